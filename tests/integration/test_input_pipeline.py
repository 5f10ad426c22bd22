"""Loader worker processes and prefetching (issue 15): still exactly once and the same model with
kills at every protocol point, a sample that cannot be loaded stops the job with its name, and no
loader process outlives its worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from testbed import harness
from unbroken.data.data_plan import DataPlan

pytestmark = pytest.mark.slow

STEPS, GLOBAL = 30, 24
LOADER = ["--augment", "--loader-workers", "2", "--prefetch", "2"]


@pytest.fixture(scope="module")
def augmented_reference(tmp_path_factory):
    """A single process loading in its training thread: every augmentation drawn there."""
    return harness.single_process(str(tmp_path_factory.mktemp("single")), "--steps", str(STEPS), "--augment")


def _loader_pids(path: str) -> dict[str, list[int]]:
    """Member -> its loader workers' pids, as each worker process wrote them (once)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {r["member"]: r["loaders"] for r in map(json.loads, f)}


def _shm_of(pids) -> list[str]:
    """Shared-memory files torch named after one of ``pids`` (``torch_<pid>_...``)."""
    names = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    return sorted(n for n in names for p in pids if n.startswith(f"torch_{p}_"))


def _assert_no_loader_survives(run_dir: str) -> None:
    members = _loader_pids(f"{run_dir}/loaders.jsonl")
    assert members and all(len(pids) == 2 for pids in members.values()), members
    pids = [p for ps in members.values() for p in ps]
    harness.wait_for(lambda: not any(harness._running(p) for p in pids), 10, f"loader workers {pids} to end")
    assert not _shm_of(pids)


@pytest.mark.parametrize(
    "chaos, delay",
    [
        # a member SIGKILLed inside the allreduce; later a generation broken with the same members,
        # so the step is redone with the very share whose batches were prefetched and consumed
        ("kill@allreduce,rank=1,step=5;fail@allreduce,rank=2,step=14", "0.1"),
        # the leader SIGKILLed between the allreduce and the optimizer
        ("kill@commit,rank=0,step=8", "0.1"),
        # killed at the start of a step, then the healing source killed while it sends the state
        ("kill@step,rank=2,step=3;kill@heal,step=4", "0.4"),
    ],
    ids=["inside-allreduce-and-same-share-redo", "after-allreduce-before-optimizer", "step-start-and-healing-transfer"],
)
def test_loader_workers_and_prefetching_keep_exactly_once_and_the_same_model_whatever_the_kill_point(tmp_path, augmented_reference, chaos, delay):
    run_dir = str(tmp_path / "run")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "3", "--max-restarts", "3", "--record-samples", "--chaos", chaos,
        harness.EXACT, "--steps", str(STEPS), "--step-delay", delay, *LOADER,
        "--out", f"{run_dir}/final", "--loader-pids", f"{run_dir}/loaders.jsonl",
        # the restarted worker waits to be healed (instead of catching up), so that the heal runs
        env={"UNBROKEN_REJOIN": "heal"} if "@heal" in chaos else None,
    )
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    exits = [e for w in run.summary()["workers"] for e in w["exits"]]
    # the script checks that every micro-batch holds exactly the planned samples: it never failed
    assert all(e["code"] == 0 or e["how"] == "killed by SIGKILL" for e in exits), exits
    assert sum(e["how"] == "killed by SIGKILL" for e in exits) == chaos.count("kill@")
    assert len(run.events("fault")) == chaos.count("@")
    stats = harness.check_exactly_once(run_dir, STEPS, GLOBAL)
    assert stats["redone_attempts"] >= 1 or "commit" in chaos
    finals = harness.final_params(f"{run_dir}/final")
    assert finals
    for member, params in finals.items():
        # augmentations drawn in loader workers, per stream position: the same as in one process
        assert harness.max_relative_difference(params, augmented_reference) < 1e-8, member
    by_step = {}
    for e in run.events("replicas"):
        by_step.setdefault(e["step"], set()).add(e["hash"])
    assert by_step and all(len(hashes) == 1 for hashes in by_step.values()), by_step
    if "heal" in chaos:
        assert run.events("heal")
    _assert_no_loader_survives(run_dir)


def test_a_sample_that_cannot_be_loaded_stops_the_job_naming_its_index_position_and_step(tmp_path):
    plan = DataPlan(200, GLOBAL, 4, seed=7)
    position = 3 * GLOBAL + 8  # in step 3
    bad = plan.indices(range(position, position + 1)).item()
    assert bad not in plan.indices(range(0, 3 * GLOBAL)).tolist()  # met first in step 3
    run_dir = str(tmp_path / "run")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "2", "--max-restarts", "5",
        harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.1", *LOADER, "--bad-index", str(bad),
        "--loader-pids", f"{run_dir}/loaders.jsonl", timeout=120,
    )
    assert run.code == 1
    assert "not retrying a bug in the script" in run.stderr
    named = f"SampleError: loading dataset[{bad}] (stream position {position}) for step 3"
    assert named in run.stderr and f"ValueError: record {bad} is corrupt" in run.stderr
    logs = [open(os.path.join(run_dir, "workers", name)).read() for name in os.listdir(os.path.join(run_dir, "workers"))]
    assert any(named in log for log in logs)
    assert len(run.events("worker_start")) < 2 * 2  # each worker at most restarted once, never more
    assert not any(e["kind"] == "step" and e["step"] >= 3 for e in run.events())
    _assert_no_loader_survives(run_dir)


def test_loader_workers_end_with_a_training_process_that_is_killed(tmp_path):
    """No launcher to kill the process group: the loader workers die with their parent."""
    pids_file = tmp_path / "loaders.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    proc = subprocess.Popen(
        [sys.executable, harness.EXACT, "--steps", "100000", "--step-delay", "0.05", *LOADER, "--loader-pids", str(pids_file)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        members = harness.wait_for(lambda: _loader_pids(str(pids_file)), 60, "the loader workers to start")
        pids = members["None"]
        assert len(pids) == 2 and all(harness._running(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        harness.wait_for(lambda: not any(harness._running(p) for p in pids), 5, f"loader workers {pids} to die with their parent")
        assert not _shm_of(pids + [proc.pid])
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the session, had anything survived
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def test_loader_workers_end_when_the_launcher_is_stopped_by_sigterm(tmp_path):
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken", "run", "--run-dir", run_dir, "--nproc-per-node", "2",
         harness.EXACT, "--steps", "100000", "--step-delay", "0.05", *LOADER, "--loader-pids", f"{run_dir}/loaders.jsonl"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        harness.wait_for(lambda: len(_loader_pids(f"{run_dir}/loaders.jsonl")) == 2, 90, "both workers' loader workers to start")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        _assert_no_loader_survives(run_dir)
        harness.wait_for(lambda: not harness.alive_workers(run_dir), 10, "no worker left behind")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        harness.kill_leftovers(run_dir)
