"""The console follows the job's leader (issue 27): rank-0 output (evaluation, logging) comes from
whichever worker leads the current generation, which is not the lowest local rank and changes
when the leader dies; any worker's errors reach the console too."""

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
    run = harness.unbroken(str(tmp_path / "run"), "--nproc-per-node", "2", "--tee", "0", harness.EXACT, "--steps", "3",
                           "--misuse", "plain", timeout=120)
    assert run.code == 1
    assert re.search(r"^\[w1( leader)?\] .*LoopMisuse", run.stdout, re.M), run.stdout[-3000:]  # w1 is not the one followed
