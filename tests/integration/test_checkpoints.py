"""Durable checkpoints with real jobs: the whole job killed at once resumes from the newest
complete checkpoint, with the same or another member count; a kill during a save never leaves a
visible partial checkpoint."""

import json
import os
import signal
import subprocess
import sys

import pytest

from testbed import harness
from tests.integration.conftest import GLOBAL, STEPS
from unbroken.storage.checkpoint import CheckpointStore

pytestmark = pytest.mark.slow


def start_and_kill_all(run_dir, ckpt, when, *extra):
    """Start a 4-worker job, then SIGKILL the launcher and every worker at once when ``when(run)``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken", "run", "--run-dir", run_dir, "--nproc-per-node", "4", "--record-samples",
         "--checkpoint-dir", ckpt, "--checkpoint-every", "5", *extra,
         harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    run = harness.Run(0, "", "", run_dir)
    try:
        harness.wait_for(lambda: when(run), 120, "the moment to kill the job")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        harness.kill_leftovers(run_dir)
        proc.wait()
    # SIGKILLed processes take a moment to be torn down; none may survive
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "every worker of the killed job to be gone")


@pytest.mark.parametrize("members", [4, 3], ids=["same-member-count", "fewer-members"])
def test_a_job_killed_whole_resumes_from_its_newest_checkpoint_and_ends_with_the_same_model(tmp_path, reference, members):
    ckpt = str(tmp_path / "ckpt")
    first = str(tmp_path / "first")
    start_and_kill_all(first, ckpt, lambda run: [e for e in run.events("checkpoint") if e["step"] >= 10])
    newest = CheckpointStore(ckpt).steps()[0]
    assert newest >= 10
    second = str(tmp_path / "second")
    run = harness.unbroken(second, "--nproc-per-node", str(members), "--record-samples", "--checkpoint-dir", ckpt,
                           "--checkpoint-every", "5", harness.EXACT, "--steps", str(STEPS), "--out", f"{second}/final")
    assert run.code == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"resumed from step {newest} of {ckpt}/step-{newest:08d}" in run.stdout
    harness.check_exactly_once([first, second], STEPS, GLOBAL)
    harness.check_same_model(f"{second}/final", reference["single"], members)
    assert CheckpointStore(ckpt).steps()[0] == STEPS  # the final state is saved too


def test_a_kill_during_a_save_leaves_no_visible_partial_checkpoint_and_resume_uses_the_previous(tmp_path, reference):
    ckpt = str(tmp_path / "ckpt")
    first = str(tmp_path / "first")
    start_and_kill_all(first, ckpt, lambda run: run.events("fault"), "--chaos", "kill@save,step=10")
    fault = harness.Run(0, "", "", first).events("fault")[0]
    assert fault["point"] == "save" and fault["step"] == 10
    assert os.path.isdir(os.path.join(ckpt, "step-00000010"))  # the data was written...
    assert not os.path.exists(os.path.join(ckpt, "step-00000010", "manifest.json"))  # ...but never published
    assert CheckpointStore(ckpt).steps() == [5]
    second = str(tmp_path / "second")
    run = harness.unbroken(second, "--nproc-per-node", "4", "--checkpoint-dir", ckpt, "--checkpoint-every", "5",
                           harness.EXACT, "--steps", str(STEPS), "--out", f"{second}/final")
    assert run.code == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"resumed from step 5 of {ckpt}/step-00000005" in run.stdout
    harness.check_same_model(f"{second}/final", reference["single"], 4)


def test_auto_counts_a_loss_of_every_live_copy_but_not_a_failure_peers_healed(tmp_path, reference):
    """``--checkpoint-every auto``: a member killed and healed by its peers leaves the estimated
    MTBF alone (no checkpoint was needed for it); the whole job killed and resumed from a
    checkpoint counts one loss, which the resumed job knows from the checkpoint."""
    ckpt, first, second = str(tmp_path / "ckpt"), str(tmp_path / "first"), str(tmp_path / "second")
    env = {"UNBROKEN_CHECKPOINT_MTBF": "10"}  # intervals of about a second here, so that the run saves often
    args = ["--nproc-per-node", "3", "--record-samples", "--checkpoint-dir", ckpt, "--checkpoint-every", "auto"]

    def healed_then_saved(run):
        fault = run.events("fault")
        return fault and [e for e in run.events("checkpoint") if e["t"] > fault[0]["t"] + 1.0 and e["step"] >= 8]

    proc = harness.start(["run", "--run-dir", first, *args, "--chaos", "kill@step,rank=1,step=3",
                          harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.2"], env=env)
    try:
        harness.wait_for(lambda: healed_then_saved(harness.Run(0, "", "", first)), 120, "a save after the healed kill")
    finally:
        harness.stop([proc], [first])
    harness.wait_for(lambda: not harness.alive_workers(first), 30, "every worker of the killed job to be gone")
    intervals = harness.Run(0, "", "", first).events("checkpoint_interval")
    assert intervals and all(e["losses"] == 0 and e["mtbf"] >= 10 for e in intervals), intervals

    run = harness.unbroken(second, *args, harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.05",
                           "--out", f"{second}/final", env=env)
    assert run.code == 0, run.stdout[-2000:] + run.stderr[-2000:]
    resumed = run.events("checkpoint_interval")
    assert resumed and resumed[0]["losses"] == 1, resumed
    assert "1 in " in run.stdout, run.stdout[-2000:]  # the interval's line names the loss
    harness.check_exactly_once([first, second], STEPS, GLOBAL)
    harness.check_same_model(f"{second}/final", reference["single"], 3)


def test_generation_numbers_never_repeat_across_a_full_restart_from_a_checkpoint(tmp_path):
    """The first launch forms generations after its newest checkpoint (a worker killed and back),
    then dies whole. The second numbers its generations above every one the first formed, not only
    above the one that wrote the checkpoint: two launches' events, records and metrics never share
    a generation number."""
    ckpt = str(tmp_path / "ckpt")
    first = str(tmp_path / "first")

    def after_the_newest_checkpoint(run) -> bool:
        numbers = [e["generation"] for e in run.events("generation")]
        steps = CheckpointStore(ckpt).steps()
        if len(numbers) < 3 or not steps:
            return False
        with open(os.path.join(ckpt, CheckpointStore.name(steps[0]), "manifest.json")) as f:
            behind = json.load(f)["generation"] < max(numbers)  # the newest checkpoint's writer is not the newest generation
        # and the newest generation's leader has noted it (in the background, once its group is
        # built: a generation formed in the moment before every worker dies can be numbered again)
        return behind and CheckpointStore(ckpt).newest_generation() >= max(numbers)

    start_and_kill_all(first, ckpt, after_the_newest_checkpoint, "--chaos", "kill@step,rank=1,step=11")
    seen_first = {e["generation"] for e in harness.Run(0, "", "", first).events("generation")}
    second = str(tmp_path / "second")
    run = harness.unbroken(second, "--nproc-per-node", "2", "--checkpoint-dir", ckpt, "--checkpoint-every", "5",
                           harness.EXACT, "--steps", str(STEPS))
    assert run.code == 0, run.stdout[-2000:] + run.stderr[-2000:]
    seen_second = [e["generation"] for e in run.events("generation")]
    assert seen_second and min(seen_second) > max(seen_first), (sorted(seen_first), seen_second)
    assert harness.stop([], [second]) == []
