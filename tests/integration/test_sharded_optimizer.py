"""--shard-optimizer: every member holds 2/N of the optimizer state, and the job survives the loss
of members, mid-step and mid-re-partition, with the same model as one process and every sample once."""

import os
import signal

import pytest

from testbed import harness
from tests.integration.conftest import GLOBAL

pytestmark = pytest.mark.slow

STEPS = 30
SAME = 1e-12  # float64, relative, against one process


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return {
        "plain": harness.single_process(str(tmp_path_factory.mktemp("single")), "--steps", str(STEPS)),
        "scaled": harness.single_process(str(tmp_path_factory.mktemp("scaled")), "--steps", str(STEPS), "--scaler", "--token-loss"),
    }


def sharded_run(tmp_path, chaos, *script, launcher=(), code=0):
    run_dir = str(tmp_path / "run")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "4", "--shard-optimizer", "--max-restarts", "3", "--record-samples",
        "--chaos", chaos, *launcher,
        harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.1", "--out", f"{run_dir}/final", *script,
    )
    assert run.code == code, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no worker left behind")
    return run


def check(run, reference, members=4):
    """Every sample once, every commit's invariants, the single process's model on every member,
    and every re-partition leaving each member about 2/N of the whole state."""
    harness.check_exactly_once(run.run_dir, STEPS, GLOBAL)
    harness.check_same_model(f"{run.run_dir}/final", reference, members, tolerance=SAME)
    whole = 2 * 146 * 8  # AdamW's two moments of the test model's 146 float64 parameters
    for e in run.events("reshard"):
        if e["step"] > 0:  # (no state exists before the first step)
            share = 2 / e["members"] if e["members"] > 1 else 1
            assert abs(e["state_bytes"] - share * whole) <= 0.1 * share * whole + 64, e


def reshards_after(run, step):
    return [e for e in run.events("reshard") if e["step"] >= step]


def test_a_killed_member_is_replaced_from_the_copies_and_the_restarted_one_gets_its_parts(tmp_path, single):
    run = sharded_run(tmp_path, "kill@step,rank=2,step=8")
    check(run, single["plain"])
    three = [e for e in reshards_after(run, 8) if e["members"] == 3]
    assert len(three) == 3 and sum(e["bytes_received"] for e in three) > 0  # the survivors re-partitioned
    back = [e for e in run.events("reshard") if e["source"].endswith(".w2.r1")]
    assert back and back[0]["step"] > 8 and back[0]["bytes_received"] > 0  # received its parts from holders
    assert not run.events("catch_up")  # a sharded member is healed, never replayed


def test_the_leader_killed_mid_run(tmp_path, single):
    run = sharded_run(tmp_path, "kill@step,rank=leader,step=7")
    check(run, single["plain"])
    (fault,) = run.events("fault")
    assert fault["member"].endswith(".w0.r0")


def test_a_member_killed_between_its_update_and_the_gather_is_rolled_forward(tmp_path, single):
    # it applied the step and died before sending it: the survivors applied it too and finish it
    run = sharded_run(tmp_path, "kill@gather,rank=1,step=9")
    check(run, single["plain"])
    rolled = run.events("roll_forward")
    assert len(rolled) == 3 and {e["step"] for e in rolled} == {9} and {e["pending"] for e in rolled} == {"applied"}


def test_a_member_that_missed_the_barrier_applies_its_kept_gradients_when_the_others_had_applied(tmp_path, single):
    # fail@barrier: this member sent its part of the barrier and left before it completed; the
    # others completed it and applied: the step is committed by all, this one from its kept gradients
    run = sharded_run(tmp_path, "fail@barrier,rank=1,step=5", "--scaler", "--token-loss")
    check(run, single["scaled"])
    rolled = {e["source"].split(":")[1]: e for e in run.events("roll_forward")}
    assert len(rolled) == 4 and rolled["vm.w1.r0"]["pending"] == "ready", rolled
    assert {e["step"] for e in rolled.values()} == {5} and {e["of_generation"] for e in rolled.values()} == {1}


def test_one_holder_of_each_of_two_partitions_killed_at_once(tmp_path, single):
    # members 0 and 2 hold partitions {0, 3} and {2, 1}: together one copy of each
    run = sharded_run(tmp_path, "kill@gather,rank=0,step=8;kill@gather,rank=2,step=8")
    check(run, single["plain"])
    assert sorted(e["point"] for e in run.events("fault")) == ["gather", "gather"]
    assert {e["step"] for e in run.events("roll_forward")} == {8}
    assert not run.events("sharded_state_lost")


def test_a_member_killed_while_the_state_is_re_partitioned(tmp_path, single):
    # member 1 dies; when its restart joins, member 3 dies in the middle of that re-partition
    run = sharded_run(tmp_path, "kill@step,rank=1,step=8;kill@reshard,rank=3,step=9")
    check(run, single["plain"])
    (during,) = [e for e in run.events("fault") if e["point"] == "reshard"]
    assert during["step"] >= 9
    assert not run.events("sharded_state_lost")


def test_both_holders_of_a_partition_lost_goes_on_from_the_newest_checkpoint(tmp_path, single):
    # members 1 and 2 both hold partition 1: it is gone; the job goes on from step 10's checkpoint
    checkpoints = str(tmp_path / "checkpoints")
    run = sharded_run(tmp_path, "kill@gather,rank=1,step=12;kill@gather,rank=2,step=12",
                      launcher=("--checkpoint-dir", checkpoints, "--checkpoint-every", "5"))
    check(run, single["plain"])
    lost = run.events("sharded_state_lost")
    assert lost and "both holders of a partition died" in lost[0]["reason"]
    assert [e["step"] for e in run.events("resume")] == [10]
    assert "the job goes on from its newest checkpoint" in run.stdout


def test_both_holders_lost_without_a_checkpoint_ends_the_job_saying_why(tmp_path):
    run = sharded_run(tmp_path, "kill@gather,rank=1,step=6;kill@gather,rank=2,step=6", code=1)
    console = run.stdout + run.stderr
    assert "the job cannot go on: the sharded optimizer state is lost" in console
    assert "use --checkpoint-dir" in console
    assert "Traceback" not in console
    assert not harness.finished_members(run.run_dir)


def test_a_member_stopped_between_its_update_and_the_gather_wakes_behind_and_is_healed_whole(tmp_path, single):
    # SIGSTOPped after applying step 8 (its barrier completed): declared dead by its heartbeat, the
    # others roll step 8 forward without it; when it wakes, its half-applied step is of a generation
    # gone by: it forgets its state (never a source) and is healed like a new process
    run = sharded_run(tmp_path, "hang@gather,rank=2,step=8,for=5", "--step-delay", "0.25",
                      launcher=("--heartbeat-interval", "0.25", "--heartbeat-timeout", "2"))
    check(run, single["plain"])
    (fault,) = run.events("fault")
    victim = fault["member"]
    verdict = next(e for e in run.events("verdict") if e["member"] == victim)
    rolled = run.events("roll_forward")
    assert {e["source"].split(":")[1] for e in rolled} == {"vm.w0.r0", "vm.w1.r0", "vm.w3.r0"}, rolled
    assert any(victim in e["receivers"] and e["t"] > verdict["t"] for e in run.events("heal"))
    assert {w["local_rank"]: w for w in run.summary()["workers"]}[2]["restarts"] == 0


def kill_whole_sharded_job(run_dir, ckpt, when, *extra):
    """A 4-member sharded job saving every 5 steps, SIGKILLed whole (launcher and workers) when ``when(run)``."""
    proc = harness.start(["run", "--run-dir", run_dir, "--nproc-per-node", "4", "--shard-optimizer", "--record-samples",
                          "--checkpoint-dir", ckpt, "--checkpoint-every", "5", *extra,
                          harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.15"])
    try:
        harness.wait_for(lambda: when(harness.Run(0, "", "", run_dir)), 120, "the moment to kill the job")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        harness.kill_leftovers(run_dir)
        proc.communicate()
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "every worker of the killed job to be gone")


@pytest.mark.parametrize("members, shard", [(3, True), (2, False)], ids=["three-sharded", "two-not-sharded"])
def test_the_owners_checkpoint_resumes_at_another_member_count_sharded_or_not(tmp_path, single, members, shard):
    import torch

    from unbroken.storage.checkpoint import CheckpointStore
    from unbroken.storage.optimizer_parts import PARTS_DIR

    ckpt, first, second = str(tmp_path / "ckpt"), str(tmp_path / "first"), str(tmp_path / "second")
    kill_whole_sharded_job(first, ckpt, lambda run: [e for e in run.events("checkpoint") if e["step"] >= 10])
    store = CheckpointStore(ckpt)
    newest = store.steps()[0]
    manifest, payload = store.read(newest)
    # written by its owners: four parts of about a quarter of the state each, none in rank 0's file
    assert manifest["optimizer_parts"]["members"] == 4
    parts = [manifest["files"][f"{PARTS_DIR}/m{k}/__0_0.distcp"]["bytes"] for k in range(4)]
    assert max(parts) < 0.4 * sum(parts), parts
    assert torch.load(f"{ckpt}/step-{newest:08d}/state.pt", weights_only=False)["optimizer"]["state"] == {}
    run = harness.unbroken(second, "--nproc-per-node", str(members), "--record-samples", "--checkpoint-dir", ckpt,
                           "--checkpoint-every", "5", *(["--shard-optimizer"] if shard else []),
                           harness.EXACT, "--steps", str(STEPS), "--out", f"{second}/final")
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"resumed from step {newest} of {ckpt}/step-{newest:08d}" in run.stdout
    if shard:  # every member read its own spans of the new plan from the parts
        read = [e for e in run.events("reshard") if e["step"] == newest]
        assert len(read) == members and all(e["from_checkpoint"] for e in read), read
    harness.check_exactly_once([first, second], STEPS, GLOBAL)
    harness.check_same_model(f"{second}/final", single["plain"], members, tolerance=SAME)
    harness.wait_for(lambda: not harness.alive_workers(second), 30, "no worker left behind")


def test_a_member_killed_while_it_writes_its_part_leaves_that_checkpoint_unpublished_and_the_job_goes_on(tmp_path, single):
    checkpoints = str(tmp_path / "checkpoints")
    run = sharded_run(tmp_path, "kill@save,rank=2,step=10", launcher=("--checkpoint-dir", checkpoints, "--checkpoint-every", "5"))
    check(run, single["plain"])
    assert [e["point"] for e in run.events("fault")] == ["save"]
    saved = [e["step"] for e in run.events("checkpoint")]
    assert 10 not in saved and 15 in saved, saved  # rank 0 gave its write up when the member left, not after a timeout
    assert "checkpoint of step 10 failed" in run.stdout + run.stderr
    assert not os.path.exists(os.path.join(checkpoints, "step-00000010", "manifest.json"))


def test_a_slow_store_skips_the_saves_due_while_a_write_runs_and_says_so(tmp_path, single):
    """Every file takes a second more to write (a checkpoint's parts: several seconds, longer than the
    collective timeout): saves due meanwhile are skipped, reported, never waited for; the final one is whole."""
    from unbroken.storage.checkpoint import CheckpointStore

    run_dir, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "3", "--shard-optimizer", "--record-samples", "--heartbeat-interval", "0.25",
        "--heartbeat-timeout", "1", "--progress-timeout", "1.5", "--collective-timeout", "3",
        "--checkpoint-dir", f"slowfile://{ckpt}", "--checkpoint-every", "4",
        harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.1", "--slow-store", "--out", f"{run_dir}/final",
        env={"UNBROKEN_TEST_WRITE_SECONDS": "1"},
    )
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.events("failure") == [] and all(w["restarts"] == 0 for w in run.summary()["workers"])
    skipped = run.events("checkpoint_skipped")
    assert skipped and "skipped: the write of step" in run.stdout, run.stdout[-2000:]
    published = CheckpointStore(ckpt).steps()
    assert published[0] == STEPS and not {e["step"] for e in skipped} & set(published), (published, skipped)
    for step in published:
        manifest, _ = CheckpointStore(ckpt).read(step)  # every part verified
        assert manifest["optimizer_parts"]["members"] == 3
    harness.check_exactly_once(run.run_dir, STEPS, GLOBAL)
    harness.check_same_model(f"{run_dir}/final", single["plain"], 3, tolerance=SAME)
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no worker left behind")


def test_a_member_lost_while_it_writes_its_part_of_the_final_checkpoint_has_it_redone_whole(tmp_path, single):
    """Rank 0 waits for the final checkpoint's parts watching the generation: the member's loss breaks
    it, and the next generation (the restarted member healed in) writes the final checkpoint again."""
    from unbroken.storage.checkpoint import CheckpointStore

    checkpoints = str(tmp_path / "checkpoints")
    run = sharded_run(tmp_path, f"kill@save,rank=2,step={STEPS}", launcher=("--checkpoint-dir", checkpoints, "--checkpoint-every", "10"))
    # the survivors finish in a generation of their own, or with the restarted member if it is back in time
    finished = harness.finished_members(run.run_dir)
    assert len(finished) in (3, 4) and "vm.w0.r0" in finished, finished
    check(run, single["plain"], members=len(finished))
    assert [(e["point"], e["step"]) for e in run.events("fault")] == [("save", STEPS)]
    final = [e for e in run.events("checkpoint") if e["step"] == STEPS]
    assert len(final) == 1 and final[0]["parts"] == len(finished), final  # written once, by the last generation
    assert max(e["generation"] for e in run.events("generation")) > 1  # the one that lost the member was broken
    store = CheckpointStore(checkpoints)
    assert store.steps()[0] == STEPS
    manifest, _ = store.read(STEPS)  # every part verified
    assert manifest["final"] and manifest["optimizer_parts"]["members"] == len(finished)


def test_the_leader_killed_while_it_publishes_a_checkpoint_leaves_it_unpublished_and_the_job_goes_on(tmp_path, single):
    # rank 0 dies with every part written and merged, before its manifest: the new leader saves the next ones
    checkpoints = str(tmp_path / "checkpoints")
    run = sharded_run(tmp_path, "kill@save,rank=0,step=10", launcher=("--checkpoint-dir", checkpoints, "--checkpoint-every", "5"))
    check(run, single["plain"])
    (fault,) = run.events("fault")
    assert (fault["point"], fault["member"]) == ("save", "vm.w0.r0")
    saved = [e["step"] for e in run.events("checkpoint")]
    assert 10 not in saved and 15 in saved, saved
    assert not os.path.exists(os.path.join(checkpoints, "step-00000010", "manifest.json"))
