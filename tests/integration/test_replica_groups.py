"""Replica groups (issue 18): FSDP2 inside each group of processes, fault tolerance across groups.

Every run here is ``examples/train_fsdp.py`` (a float64 MLP sharded with ``fully_shard`` over the
group's mesh) under ``unbroken run --group-size 2``; its reference is the same script run as one
plain process on the whole global batch.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from testbed import harness

pytestmark = pytest.mark.slow

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_fsdp.py")
SLOW_STORE = os.path.join(harness.SCRIPTS, "train_fsdp_slow_store.py")  # the example, with the slowfile:// store
STEPS = 36
GLOBAL = 24
HEARTBEAT_TIMEOUT = 3.0  # the launcher's default: what a silent member costs before a verdict


def _reference(out, steps):
    """The final parameters of one plain process (a group of one), the whole global batch every step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    subprocess.run([sys.executable, EXAMPLE, "--steps", str(steps), "--out", out], check=True, timeout=120, env=env,
                   capture_output=True)
    return torch.load(os.path.join(out, "single.pt"))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _reference(str(tmp_path_factory.mktemp("single")), STEPS)


def _run(run_dir, *args, nproc=6, timeout=240.0):
    return harness.unbroken(
        run_dir, "--nproc-per-node", str(nproc), "--group-size", "2", "--record-samples", *args,
        EXAMPLE, "--steps", str(STEPS), "--step-delay", "0.3", "--out", f"{run_dir}/final", timeout=timeout,
    )


def _check_same_model(run_dir, single, groups):
    finals = harness.final_params(f"{run_dir}/final")
    assert len(finals) == groups, sorted(finals)
    for member, params in finals.items():
        assert harness.max_relative_difference(params, single) < 1e-8, member


def _heals(heal, suffix, generations):
    """Whether ``heal`` sent state to the member whose name ends with ``suffix``: by name (the
    group's process 0), or by its rank in the heal's generation (processes j > 0 know their peers
    only as ``rank{i}``)."""
    members = next((g["members"] for g in generations if g["generation"] == heal["generation"]), [])
    names = {f"rank{i}" for i, m in enumerate(members) if m.endswith(suffix)}
    return any(r.endswith(suffix) or r in names for r in heal["receivers"])


def _check_group_replaced(run, slot, groups):
    workers = {w["local_rank"]: w for w in run.summary()["workers"]}
    assert workers[slot]["restarts"] == 1, workers[slot]
    for other in set(range(groups)) - {slot}:
        assert workers[other]["restarts"] == 0 and [e["code"] for e in workers[other]["exits"]] == [0], workers[other]
    rejoined = [e for e in run.events("heal") if _heals(e, f".w{slot}.r1", run.events("generation"))]
    senders = {e["source"].endswith(".p1") for e in rejoined}
    assert senders == {False, True}, rejoined  # shard 0 and shard 1 each healed by a live group's process j
    assert all(0 < e["step"] < STEPS for e in rejoined), rejoined  # mid-run, from a live group's state
    return workers[slot]


def test_a_killed_process_stops_its_group_which_is_restarted_and_healed_shard_by_shard(tmp_path, single):
    # process 1 of group 1 (local rank 3 = slot 1 * 2 + 1) dies at step 5
    run = _run(str(tmp_path / "run"), "--chaos", "kill@step,rank=3,step=5")
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run.run_dir), 30, "no process left behind")
    slot = _check_group_replaced(run, 1, 3)
    assert slot["exits"][0]["how"] == "process 1 of 2: killed by SIGKILL", slot["exits"]
    fault = run.events("fault")[0]
    # the other two groups commit again at once: one re-formation, about as fast as for a plain
    # kill. Its launcher restarts the group in about 0.1 s, so it may be back in that generation
    # already (the survivors reach the step boundary 0.3 s after the kill): either way, every
    # survivor is in the first generation after the kill, and the next commit follows it.
    survivors = set(run.events("generation")[0]["members"]) - {fault["member"]}
    formed = [e for e in run.events("generation") if e["t"] > fault["t"]]
    assert formed and survivors <= set(formed[0]["members"]), formed
    after = [e for e in run.events("step") if e["t"] > fault["t"]]
    assert after and after[0]["generation"] == formed[0]["generation"], after[:1]
    stall = after[0]["t"] - fault["t"]
    before = [e["t"] for e in run.events("step") if e["t"] < fault["t"]]
    healthy = sorted(b - a for a, b in zip(before[1:], before[2:]))  # commit to commit, after the first step
    print(f"kill of one process of a group to the next commit of the other groups: {stall:.2f} s"
          f" (healthy commit to commit: {healthy[len(healthy) // 2]:.2f} s)")
    assert stall < HEARTBEAT_TIMEOUT  # its group was stopped and reported by the launcher, not timed out
    harness.check_exactly_once(run.run_dir, STEPS, GLOBAL)
    _check_same_model(run.run_dir, single, 3)


def test_a_stopped_process_is_caught_and_its_whole_group_replaced(tmp_path, single):
    # process 1 of group 1 stops itself (SIGSTOP): its heartbeat-less peer process 0 notices and ends the group
    run = _run(str(tmp_path / "run"), "--chaos", "hang@step,rank=3,step=5")
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run.run_dir), 30, "no process left behind")
    slot = _check_group_replaced(run, 1, 3)
    assert slot["exits"][0]["code"] == 75, slot["exits"]  # the group's watchdog: a peer is silent
    assert "process 0" in slot["exits"][0]["how"], slot["exits"]
    harness.check_exactly_once(run.run_dir, STEPS, GLOBAL)
    _check_same_model(run.run_dir, single, 3)


def test_every_group_killed_then_resumed_from_the_sharded_checkpoint_with_two_groups(tmp_path, single):
    checkpoints = str(tmp_path / "checkpoints")
    first = str(tmp_path / "first")
    proc = harness.start(["run", "--run-dir", first, "--nproc-per-node", "6", "--group-size", "2", "--checkpoint-dir",
                          checkpoints, "--checkpoint-every", "4", EXAMPLE, "--steps", str(STEPS), "--step-delay", "0.3"])
    try:
        saved = harness.wait_for(
            lambda: [e for e in harness.Run(0, "", "", first).events("checkpoint") if e["step"] >= 8], 150,
            "a sharded checkpoint of step 8 or later",
        )
    finally:
        harness.stop([proc], [first])  # the launcher, and every process of every group
    harness.wait_for(lambda: not harness.alive_workers(first), 30, "every process of the first run gone")
    assert not harness.Run(0, "", "", first).events("finished")
    manifest = json.load(open(os.path.join(saved[0]["location"], "manifest.json")))
    assert manifest["format"] == "dcp/1" and manifest["group"]["size"] == 2
    assert sorted(f for f in manifest["files"] if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    second = str(tmp_path / "second")
    run = _run(second, "--checkpoint-dir", checkpoints, nproc=4)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    resumed = run.events("resume")
    assert resumed and resumed[0]["step"] >= 8, resumed
    assert len(run.events("generation")[0]["members"]) == 2
    _check_same_model(second, single, 2)


def test_a_group_of_another_size_is_refused_with_both_sizes_named(tmp_path):
    run_a, run_b = str(tmp_path / "a"), str(tmp_path / "b")
    a = harness.start(["run", "--run-dir", run_a, "--node-name", "a", "--nproc-per-node", "4", "--group-size", "2",
                       EXAMPLE, "--steps", "400", "--step-delay", "0.1"])
    b = None
    try:
        started = harness.wait_for(lambda: harness.Run(0, "", "", run_a).events("coordinator_start"), 60, "node a's coordinator")
        token_file = os.path.join(run_a, "coordinator.json")
        harness.wait_for(lambda: os.path.exists(token_file), 30, "node a's token file")
        with open(token_file) as f:
            token = json.load(f)["token"]
        harness.wait_for(lambda: harness.Run(0, "", "", run_a).events("step"), 90, "node a to train")
        b = harness.start(["run", "--run-dir", run_b, "--node-name", "b", "--coordinator", f"127.0.0.1:{started[0]['port']}",
                           "--token", token, "--nproc-per-node", "3", "--group-size", "3", EXAMPLE, "--steps", "400",
                           "--step-delay", "0.1"])
        out_b, _ = b.communicate(timeout=120)
    finally:
        harness.stop([a, b], [run_a, run_b])
    assert b.returncode == 2, out_b[-3000:]
    refusals = harness.Run(0, "", "", run_a).events("refused")
    assert refusals and refusals[0]["member"].startswith("b.w0"), refusals
    assert "group size: 3 here, 2 in the job" in refusals[0]["reason"], refusals[0]["reason"]
    assert "group size: 3 here, 2 in the job" in open(os.path.join(run_b, "workers", "w0.log")).read()
    assert harness.Run(0, "", "", run_b).summary()["workers"][0]["restarts"] == 0  # stopped, not restarted


def test_steps_longer_than_every_timeout_lose_only_the_failed_group(tmp_path):
    # Real shape, scaled down: each step's work takes 1.5 s while the heartbeat timeout, and with it
    # the group's own watchdog (UNBROKEN_GROUP_TIMEOUT), is 1 s. A kill in one group must cost only
    # that group: no healthy process may be taken for silent while its training thread computes.
    steps = 12
    reference = _reference(str(tmp_path / "single"), steps)
    run_dir = str(tmp_path / "run")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "4", "--group-size", "2", "--record-samples", "--heartbeat-interval", "0.25",
        "--heartbeat-timeout", "1", "--chaos", "kill@step,rank=3,step=3",
        EXAMPLE, "--steps", str(steps), "--step-delay", "1.5", "--out", f"{run_dir}/final", timeout=240.0,
    )
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no process left behind")
    workers = {w["local_rank"]: w for w in run.summary()["workers"]}
    assert workers[0]["restarts"] == 0 and [e["code"] for e in workers[0]["exits"]] == [0], workers[0]
    assert workers[1]["restarts"] == 1 and workers[1]["exits"][0]["how"] == "process 1 of 2: killed by SIGKILL", workers[1]
    assert not [e for e in run.events("fault") if e["fault"] != "kill"]
    harness.check_exactly_once(run_dir, steps, GLOBAL)
    finals = harness.final_params(f"{run_dir}/final")
    assert finals and all(harness.max_relative_difference(p, reference) < 1e-8 for p in finals.values()), sorted(finals)


def test_a_store_slower_than_the_collective_timeout_holds_up_no_group(tmp_path):
    # Real shape, scaled down: every file a sharded checkpoint writes takes 3 s longer to close,
    # and the collective timeout is 3 s; process 0 of the writing group writes its shard, DCP's
    # metadata and the manifest, 9 s or more. Written in the foreground, the other group waited
    # for it in its next allreduce until that timed out and the generation broke.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from unbroken.storage.checkpoint import CheckpointStore

    steps = 16
    reference = _reference(str(tmp_path / "single"), steps)
    run_dir, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "4", "--group-size", "2", "--heartbeat-interval", "0.25", "--heartbeat-timeout", "1",
        "--progress-timeout", "1.5", "--collective-timeout", "3", "--checkpoint-dir", f"slowfile://{ckpt}",
        "--checkpoint-every", "4", SLOW_STORE, "--steps", str(steps), "--step-delay", "0.2", "--out", f"{run_dir}/final",
        env={"UNBROKEN_TEST_WRITE_SECONDS": "3"}, timeout=240.0,
    )
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no process left behind")
    assert run.events("failure") == [] and [e for e in run.events("verdict") if "explains" not in e] == []
    assert len(run.events("generation")) == 1
    assert all(w["restarts"] == 0 for w in run.summary()["workers"])
    assert run.events("checkpoint_skipped"), "the saves due while a write ran should have been skipped"
    written = run.events("checkpoint")
    assert [e["step"] for e in written][-1] == steps and all(e["processes"] == 2 for e in written), written
    assert max(e["write_seconds"] for e in written) > 3 * 2  # slower than the collective timeout, twice
    # the final checkpoint is the final model, as users' tools read it
    store = CheckpointStore(ckpt)
    assert store.steps()[0] == steps
    dcp_to_torch_save(f"{ckpt}/{store.name(steps)}", str(tmp_path / "final.pt"))
    saved = torch.load(str(tmp_path / "final.pt"))["train"]["model"]
    finals = harness.final_params(f"{run_dir}/final")
    assert len(finals) == 2
    for params in finals.values():
        assert saved.keys() == params.keys() and all(torch.equal(saved[k], params[k]) for k in saved)
        assert harness.max_relative_difference(params, reference) < 1e-8


def test_a_heal_that_hangs_part_way_leaves_every_process_of_a_group_at_one_step(tmp_path, single):
    """Issue 26's compound fault, with the state kept: process 0 of group 0 killed at step 3, then
    process 1 of group 1 stopped for 2 s while it sends its shard in the heal, so group 0's heal
    fails part-way. Group 1 keeps the state; group 0 is healed again from it, and every
    invariant holds (this one passed before the fix too: it guards the path a fresh group takes)."""
    run = _run(str(tmp_path / "run"), "--chaos", "kill@step,rank=0,step=3;hang@heal,rank=3,for=2", nproc=4)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run.run_dir), 30, "no process left behind")
    harness.check_exactly_once(run.run_dir, STEPS, GLOBAL)  # with check_commits: a group's processes at one step
    _check_same_model(run.run_dir, single, 2)


def test_a_group_whose_state_cannot_be_mended_restarts_fresh_and_never_trains_split(tmp_path, single):
    """The same, but process 1 of group 1 stays stopped: group 1 ends, and with it the only whole
    copy of the state. Group 0 holds half a state that nobody can complete (there is no
    checkpoint): it ends itself and restarts fresh, and the job starts over from step 0, instead
    of training its processes from different steps (steps are committed twice: every holder was
    lost)."""
    run = _run(str(tmp_path / "run"), "--chaos", "kill@step,rank=0,step=3;hang@heal,rank=3", nproc=4)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run.run_dir), 30, "no process left behind")
    harness.check_commits(run.run_dir, every_holder_lost=True)
    _check_same_model(run.run_dir, single, 2)
