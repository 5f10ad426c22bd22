"""The console follows the job's leader (issue 27): rank-0 output (evaluation, logging) comes from
whichever worker leads the current generation, which is not the lowest local rank and changes
when the leader dies; any worker's errors reach the console too."""

import os
import re

import pytest

from testbed import harness

pytestmark = pytest.mark.slow


def test_the_console_shows_the_leaders_lines_whichever_worker_leads(tmp_path):
    steps = 24
    # every worker is killed once: whichever led first (the order of a generation is the order of
    # joining, not of local ranks) dies, and another worker leads after it
    run = harness.unbroken(str(tmp_path / "run"), "--nproc-per-node", "3",
                           "--chaos", "kill@step,rank=0,step=4;kill@step,rank=1,step=10;kill@step,rank=2,step=16",
                           harness.EXACT, "--steps", str(steps), "--step-delay", "0.15", "--leader-says")
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    shown = {int(m.group(2)): m.group(1) for m in re.finditer(r"^\[(w\d) leader\] LEADER step (\d+)$", run.stdout, re.M)}
    # the console learns of a new leader within its half-second poll: a step or two may be missed
    assert len(shown) >= steps - 8, sorted(shown)


def test_any_workers_error_reaches_the_console(tmp_path):
    run = harness.unbroken(str(tmp_path / "run"), "--nproc-per-node", "2", "--local-ranks-filter", "0", harness.EXACT, "--steps", "3",
                           "--misuse", "plain", timeout=120)
    assert run.code == 1
    assert re.search(r"^\[w1( leader)?\] .*LoopMisuse", run.stdout, re.M), run.stdout[-3000:]  # w1 is not the one followed


@pytest.mark.parametrize("tee,shown", [("3", {"LEADER step", "LEADER stderr"}), ("2", {"LEADER stderr"}), ("0", set())])
def test_tee_picks_the_shown_workers_streams_as_torchrun_and_the_log_keeps_both(tmp_path, tee, shown):
    run = harness.unbroken(str(tmp_path / "run"), "--nproc-per-node", "2", "--tee", tee, harness.EXACT, "--steps", "3",
                           "--leader-says", timeout=120)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    seen = {kind for kind in ("LEADER step", "LEADER stderr") if re.search(rf"^\[w\d leader\] {kind} \d$", run.stdout, re.M)}
    assert seen == shown, run.stdout[-3000:]
    logs = "".join(open(os.path.join(run.run_dir, "workers", name)).read() for name in ("w0.log", "w1.log"))
    assert "LEADER step 2" in logs and "LEADER stderr 2" in logs
