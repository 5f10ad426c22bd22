"""``job.on_leader(fn)`` (issue 27): the leader evaluates for every member at a step boundary.

The timeouts are scaled down so that the evaluation is longer than every timeout that watches
the members (heartbeat, progress, collective): nobody is fenced, the others wait exactly as long
as the evaluation, every member gets the leader's result, and the model is the single process's.
If the leader dies inside the evaluation, the survivors re-form and the new leader runs it again.
"""

import json
import os

import pytest

from testbed import harness
from testbed.harness import GLOBAL

pytestmark = pytest.mark.slow

FAST = ["--heartbeat-interval", "0.25", "--heartbeat-timeout", "1", "--progress-timeout", "1.5", "--collective-timeout", "2"]
STEPS, EVERY, EVAL_SECONDS = 12, 4, 3.0


def _run(tmp_path, *script_args):
    run_dir = str(tmp_path / "run")
    log = str(tmp_path / "evals.jsonl")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "3", "--record-samples", *FAST,
        harness.EXACT, "--steps", str(STEPS), "--eval-every", str(EVERY), "--eval-seconds", str(EVAL_SECONDS),
        "--eval-log", log, *script_args, "--out", f"{run_dir}/final", timeout=240,
    )
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no process left behind")
    harness.check_exactly_once(run_dir, STEPS, GLOBAL)
    single = harness.single_process(str(tmp_path / "single"), "--steps", str(STEPS))
    harness.check_same_model(f"{run_dir}/final", single, harness.finished_members(run_dir))
    return run, harness.jsonl_by(log, "step")


def test_a_leader_evaluation_longer_than_every_timeout_fences_nobody_and_reaches_every_member(tmp_path):
    run, evals = _run(tmp_path)
    assert sorted(evals) == [EVERY - 1, 2 * EVERY - 1, 3 * EVERY - 1], sorted(evals)
    for step, records in evals.items():
        assert len(records) == 3, records
        assert sum(r["ran"] for r in records) == 1, f"step {step}: the evaluation ran on {records}"
        assert len({json.dumps(r["result"]) for r in records}) == 1, f"step {step}: members got {records}"
        for r in records:  # the others waited as long as the evaluation, not a timeout's worth more
            assert EVAL_SECONDS - 0.1 < r["waited"] < EVAL_SECONDS + 1.5, r
    assert not run.events("verdict"), run.events("verdict")
    assert all(w["restarts"] == 0 for w in run.summary()["workers"]), run.summary()["workers"]
    logs = "".join(open(os.path.join(run.run_dir, "workers", f"w{i}.log")).read() for i in range(3))
    assert "made no progress" not in logs and "timed out" not in logs, logs[-2000:]


def test_when_the_leader_dies_inside_the_evaluation_the_next_leader_runs_it_again(tmp_path):
    run, evals = _run(tmp_path, "--kill-in-eval", str(2 * EVERY - 1))
    assert os.path.exists(str(tmp_path / "evals.jsonl.killed")), "the leader was never killed in its evaluation"
    records = evals[2 * EVERY - 1]
    assert len(records) == 2, records  # the two survivors; the victim died inside it
    assert sum(r["ran"] for r in records) == 1, records  # one survivor ran it again, as the new leader
    assert records[0]["result"] == records[1]["result"], records
    assert {r["generation"] for r in records} != {1}, "the call was answered in a generation formed after the kill"
    assert sum(w["restarts"] for w in run.summary()["workers"]) == 1, run.summary()["workers"]
    later = evals[3 * EVERY - 1]  # the next evaluation reaches every member of its generation (the restarted one, if back)
    assert len(later) >= 2 and len({json.dumps(r["result"]) for r in later}) == 1, later
    assert sum(r["ran"] for r in later) == 1, later


def _failing(tmp_path, *script_args, max_restarts="0"):
    run_dir = str(tmp_path / "run")
    log = str(tmp_path / "evals.jsonl")
    run = harness.unbroken(run_dir, "--nproc-per-node", "3", "--max-restarts", max_restarts, *FAST, harness.EXACT,
                           "--steps", str(STEPS), "--eval-every", str(EVERY), "--eval-log", log, *script_args, timeout=180)
    assert run.code != 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no process left behind")
    return run, log


def test_an_error_in_the_leaders_function_reaches_every_member_and_it_is_never_run_again(tmp_path):
    run, log = _failing(tmp_path, "--eval-raises")
    with open(log + ".raised") as f:
        assert f.read().split() == [str(EVERY - 1)]  # ran once, on the leader
    logs = "".join(open(os.path.join(run.run_dir, "workers", f"w{i}.log")).read() for i in range(3))
    assert "ValueError: the evaluation at step 3 failed" in logs
    assert logs.count("LeaderCallFailed") >= 2 and "raised on the leader" in logs, logs[-3000:]


def test_a_collective_inside_the_leaders_function_is_refused_at_once(tmp_path):
    run, log = _failing(tmp_path, "--eval-collective")
    assert "inside job.on_leader(evaluate)" in run.stdout + run.stderr, run.stderr[-3000:]
    assert not run.events("failure"), run.events("failure")  # refused before anything was sent: no generation broke


def test_an_evaluation_at_the_top_of_step_0_reaches_every_member(tmp_path):
    run_dir = str(tmp_path / "run")
    run = harness.unbroken(run_dir, "--nproc-per-node", "3", "--record-samples", *FAST, harness.EXACT, "--steps", "6",
                           "--eval-at-start", "--out", f"{run_dir}/final", timeout=180)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no process left behind")
    logs = [open(os.path.join(run_dir, "workers", f"w{i}.log")).read() for i in range(3)]
    seen = {line for log in logs for line in log.splitlines() if line.startswith("START EVAL")}
    assert len(seen) == 1 and all("START EVAL" in log for log in logs), seen  # the same result on every member
    harness.check_exactly_once(run_dir, 6, GLOBAL)


def test_on_leader_before_the_loop_is_refused_with_a_clear_error(tmp_path):
    run, _ = _failing(tmp_path, "--eval-before-loop")
    assert "was called before job.steps()" in run.stdout + run.stderr, run.stderr[-3000:]
    assert "AttributeError" not in run.stdout + run.stderr
