"""The README's showcase for real: ``unbroken run`` of the digits example with a worker SIGKILLed
through ``--chaos``, and ``unbroken demo`` on a shortened schedule. Both end with exit 0, their
report's files written, nothing left behind and the exactly-once check."""

import os

import pytest

from testbed import harness

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_digits.py")
GLOBAL = 128  # the example's default global batch


def _check_report(run_dir: str) -> None:
    report = harness.command(["report", run_dir], None, 120)
    assert report.code == 0, report.stdout[-2000:] + report.stderr[-2000:]
    assert os.path.getsize(os.path.join(run_dir, "timeline.png")) > 1000, "no timeline picture"
    for name in ("events.jsonl", "launcher.json"):
        assert os.path.getsize(os.path.join(run_dir, name)) > 0, name


def test_the_digits_example_survives_a_sigkill_and_reports_it(tmp_path):
    steps = 30
    # --min-members 2: the survivor waits for the restarted worker, so the restart and the rejoin
    # are certain (30 steps of this example take 0.1 s: without it the job could finish before the
    # launcher's backoff ran out, as it did once under CI's load).
    run = harness.unbroken(str(tmp_path / "run"), "--nproc-per-node", "2", "--min-members", "2", "--record-samples",
                           "--chaos", "kill@step,rank=1,step=5", EXAMPLE, "--steps", str(steps), "--log-every", "10")
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert [(f["fault"], f["step"]) for f in run.events("fault")] == [("kill", 5)]
    workers = {w["local_rank"]: w for w in run.summary()["workers"]}
    assert workers[1]["restarts"] == 1 and workers[0]["restarts"] == 0, workers
    healed = [h["step"] for h in run.events("heal") if "vm.w1.r1" in h["receivers"]]
    assert healed and 0 < healed[0] < steps, f"the restarted worker was not healed mid-run: {healed}"
    harness.wait_for(lambda: not harness.alive_workers(run.run_dir), 30, "no process left behind")
    harness.check_exactly_once(run.run_dir, steps, GLOBAL)
    _check_report(run.run_dir)


def test_the_demo_runs_its_faults_and_prints_the_report(tmp_path):
    steps = 60
    run_dir = str(tmp_path / "demo")
    run = harness.command(["demo", "--run-dir", run_dir, "--steps", str(steps)], run_dir, 240)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted((f["fault"], f["step"]) for f in run.events("fault") if f["fault"] != "slow") == [
        ("hang", 16), ("kill", 4), ("kill", 28)]
    assert "timeline picture:" in run.stdout and os.path.exists(os.path.join(run_dir, "timeline.png"))
    assert run.events("finished"), "the demo's job did not finish"
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no process left behind")
