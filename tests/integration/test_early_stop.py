"""Ending early (issue 27): ``job.stop(reason)`` on one member, or a ``break`` taken by every
member after the same step, ends the job at one step boundary for every member: exit 0, recorded
as finished with its reason, the final checkpoint written, the model of a single process that ran
that many steps."""

import os

import pytest
import torch

from testbed import harness
from testbed.harness import GLOBAL
from unbroken.storage.checkpoint import CheckpointStore

pytestmark = pytest.mark.slow


def _run(tmp_path, *script_args, extra=()):
    run_dir = str(tmp_path / "run")
    ckpt = str(tmp_path / "ckpt")
    run = harness.unbroken(run_dir, "--nproc-per-node", "3", "--record-samples", "--checkpoint-dir", ckpt,
                           "--checkpoint-every", "100", *extra, harness.EXACT, "--steps", "40", "--step-delay", "0.1",
                           *script_args, "--out", f"{run_dir}/final")
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no process left behind")
    return run, ckpt


def test_job_stop_on_the_leader_ends_every_member_at_one_boundary_even_after_a_kill(tmp_path):
    run, ckpt = _run(tmp_path, "--stop-at", "14", extra=("--chaos", "kill@step,rank=1,step=5"))
    reasons = {e.get("reason") for e in run.events("finished")}
    assert "early stop after step 14" in reasons, run.events("finished")
    assert "workers exited before the job finished" not in run.stdout + run.stderr
    harness.check_exactly_once(run.run_dir, 15, GLOBAL)  # steps 0..14 committed, step 15 not
    single = harness.single_process(str(tmp_path / "single"), "--steps", "15")
    stopped_alone = harness.single_process(str(tmp_path / "alone"), "--steps", "40", "--stop-at", "14")
    assert all(torch.equal(stopped_alone[k], single[k]) for k in single)  # alone, stop() ends at the next boundary
    harness.check_same_model(f"{run.run_dir}/final", single, harness.finished_members(run.run_dir))
    assert CheckpointStore(ckpt).steps()[0] == 15, "the final checkpoint is written as at a normal end"


def test_a_stop_outlives_the_leader_that_asked_for_it(tmp_path):
    # the rule fires at step 12 only, on the leader, which dies at once: the survivors learn of
    # the stop from the coordinator (it was durable when job.stop() returned), commit nothing
    # after step 12, and the job ends as the single process's does
    run, ckpt = _run(tmp_path, "--stop-at", "12", "--stop-once", "--die-after-stop")
    assert [e for e in run.events("stop_requested") if e["step"] == 13], run.events("stop_requested")
    reasons = {e.get("reason") for e in run.events("finished")}
    assert "early stop after step 12" in reasons, run.events("finished")
    harness.check_exactly_once(run.run_dir, 13, GLOBAL)  # steps 0..12 committed, step 13 not
    single = harness.single_process(str(tmp_path / "single"), "--steps", "13")
    harness.check_same_model(f"{run.run_dir}/final", single, harness.finished_members(run.run_dir))
    assert CheckpointStore(ckpt).steps()[0] == 13


def test_a_break_by_every_member_after_the_same_step_ends_the_job_with_exit_0(tmp_path):
    run, ckpt = _run(tmp_path, "--break-at", "9")
    assert any("left the loop after step 9" in (e.get("reason") or "") for e in run.events("finished")), run.events("finished")
    harness.check_exactly_once(run.run_dir, 10, GLOBAL)
    single = harness.single_process(str(tmp_path / "single"), "--steps", "10")
    harness.check_same_model(f"{run.run_dir}/final", single, 3)
    assert CheckpointStore(ckpt).steps()[0] == 10
    logs = "".join(open(os.path.join(run.run_dir, "workers", f"w{i}.log")).read() for i in range(3))
    assert "Traceback" not in logs, logs[-2000:]


def test_a_break_on_the_leader_alone_stops_the_job_for_every_member_after_that_step(tmp_path):
    run, ckpt = _run(tmp_path, "--break-alone-at", "9")
    assert any("alone" in (e.get("reason") or "") for e in run.events("finished")), run.events("finished")
    assert "a break on one member stops the job for every member" in run.stdout + run.stderr
    harness.check_exactly_once(run.run_dir, 10, GLOBAL)  # steps 0..9 committed, and no other
    single = harness.single_process(str(tmp_path / "single"), "--steps", "10")
    harness.check_same_model(f"{run.run_dir}/final", single, 3)
    assert CheckpointStore(ckpt).steps()[0] == 10


def test_an_exception_after_a_commit_on_every_member_is_a_failed_job_never_finished(tmp_path):
    run_dir = str(tmp_path / "run")
    run = harness.unbroken(run_dir, "--nproc-per-node", "2", "--max-restarts", "1", harness.EXACT, "--steps", "20",
                           "--raise-after-commit", "5", timeout=150)
    assert run.code != 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "deliberate failure after step 5's commit" in run.stderr
    assert not run.events("finished"), run.events("finished")
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no process left behind")


def test_a_break_at_the_top_of_a_step_by_every_member_ends_the_job_at_the_boundary_before_it(tmp_path):
    run, ckpt = _run(tmp_path, "--break-before", "12", extra=("--chaos", "kill@step,rank=2,step=4"))
    assert any("left the loop after step 11" in (e.get("reason") or "") for e in run.events("finished")), run.events("finished")
    harness.check_exactly_once(run.run_dir, 12, GLOBAL)
    single = harness.single_process(str(tmp_path / "single"), "--steps", "12")
    harness.check_same_model(f"{run.run_dir}/final", single, harness.finished_members(run.run_dir))
    assert CheckpointStore(ckpt).steps()[0] == 12
