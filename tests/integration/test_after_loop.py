"""Work after ``job.steps()`` (saving the final model, evaluating) belongs to the user's script: the
launcher does not cut it short once the job has finished, and reports it when it fails."""

import os

import pytest

from testbed import harness

pytestmark = pytest.mark.slow

FILE_BYTES = 8 << 20  # what train_exact.py writes with --after-loop-file


def test_the_leader_sleeping_after_the_loop_then_writing_a_file_is_not_killed(tmp_path):
    run_dir = str(tmp_path / "run")
    path = str(tmp_path / "final-model.bin")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "2",
        harness.EXACT, "--steps", "10", "--after-loop-sleep", "10", "--after-loop-file", path,
        timeout=150,
    )
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert os.path.getsize(path) == FILE_BYTES  # complete: written to a temporary name, then renamed
    assert not os.path.exists(path + ".tmp")
    assert "stopping worker" not in run.stdout
    assert [w["state"] for w in run.summary()["workers"]] == ["succeeded", "succeeded"]
    assert not harness.alive_workers(run_dir)


def test_a_worker_that_never_left_the_loop_is_still_stopped_after_the_grace(tmp_path):
    # worker 2 stops itself (SIGSTOP, never woken): it is declared dead, the others finish without
    # it, and it is stopped --shutdown-grace after the finish, while the leader's work goes on
    run_dir = str(tmp_path / "run")
    path = str(tmp_path / "final-model.bin")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "3", "--heartbeat-interval", "0.25", "--heartbeat-timeout", "2",
        "--shutdown-grace", "1", "--chaos", "hang@step,rank=2,step=3",
        harness.EXACT, "--steps", "12", "--step-delay", "0.1", "--after-loop-sleep", "6", "--after-loop-file", path,
        timeout=150,
    )
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "the job finished; stopping worker 2, which had not left the training loop" in run.stdout
    assert os.path.getsize(path) == FILE_BYTES
    workers = {w["local_rank"]: w for w in run.summary()["workers"]}
    assert workers[2]["state"] == "stopped" and workers[2]["exits"][-1]["how"] == "killed by SIGKILL (stopped by the launcher)"
    assert workers[0]["state"] == workers[1]["state"] == "succeeded"
    # the stopped worker went long before the leader's file was written
    finished = run.events("finished")[0]["t"]
    killed = [e for e in run.events("worker_exit") if e["local_rank"] == 2][-1]["t"]
    assert killed - finished < 5.0


def test_a_worker_failing_after_the_loop_makes_the_run_fail(tmp_path):
    run_dir = str(tmp_path / "run")
    path = str(tmp_path / "final-model.bin")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "2",
        harness.EXACT, "--steps", "6", "--after-loop-file", path, "--after-loop-exit", "3",
        timeout=150,
    )
    assert run.code == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert os.path.getsize(path) == FILE_BYTES
    workers = run.summary()["workers"]
    (leader,) = [w for w in workers if w["exits"][-1]["code"] == 3]  # the generation's index 0
    (other,) = [w for w in workers if w is not leader]
    assert f"training finished, but worker {leader['local_rank']} ({leader['exits'][-1]['member']}) failed after leaving the training loop: exit code 3" in run.stderr
    assert leader["state"] == "failed" and leader["restarts"] == 0  # not restarted
    assert other["state"] == "succeeded"
