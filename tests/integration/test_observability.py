"""Seeing what happened: the metrics endpoint, `unbroken status`, the progress lines and the
report of one real run with one SIGKILL and its rejoin.

One 3-worker run serves every test here (a module fixture): while it runs, the fixture scrapes
the coordinator's /metrics every few tens of milliseconds and records what it saw; the tests then
check those observations and the run's report.
"""

from __future__ import annotations

import json
import os
import statistics

import pytest

from testbed import harness
from testbed.watching import status, watched_run

pytestmark = pytest.mark.slow

STEPS = 100
KILL_STEP = 15
STEP_DELAY = 0.2


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """Run the job, scraping its metrics throughout; returns what was seen."""
    run_dir = str(tmp_path_factory.mktemp("observed") / "run")
    statuses: dict[str, str] = {}

    def observe(metrics: dict[str, float], port: int, token: str) -> None:
        members, generation = metrics["unbroken_members"], metrics["unbroken_generation"]
        if generation >= 1 and members == 3 and "healthy" not in statuses:
            statuses["healthy"] = status(port, token)
        if members == 2 and "healthy" in statuses and "degraded" not in statuses:
            statuses["degraded"] = status(port, token)

    seen = watched_run(run_dir, [
        "--nproc-per-node", "3", "--chaos", f"kill@step,rank=1,step={KILL_STEP}", "--restart-backoff", "5",
        "--progress-interval", "2", harness.EXACT, "--steps", str(STEPS), "--step-delay", str(STEP_DELAY),
    ], observe)
    assert seen["token_mode"] == "0o600"
    return {**seen, "status": statuses}


def test_the_run_finished_with_one_kill_and_its_rejoin(observed):
    run = observed["run"]
    assert run.code == 0, run.stdout[-3000:]
    assert observed["leftovers"] == []
    (fault,) = run.events("fault")
    assert (fault["fault"], fault["step"]) == ("kill", KILL_STEP)
    workers = {w["local_rank"]: w for w in run.summary()["workers"]}
    assert workers[1]["restarts"] == 1 and workers[1]["exits"][0]["how"] == "killed by SIGKILL"
    assert harness.state_received(run.events, ".w1.r1"), "the restarted worker never rejoined"


def test_the_members_metric_is_3_then_2_after_the_kill_then_3_again(observed):
    (fault,) = observed["run"].events("fault")
    series = [(t, m["unbroken_members"], m["unbroken_generation"]) for t, m in observed["scrapes"]]
    healthy = [s for s in series if s[0] < fault["t"] and s[2] >= 1]
    assert healthy and all(members == 3 for _, members, _ in healthy), healthy
    after = [s for s in series if s[0] > fault["t"]]
    two = next((i for i, s in enumerate(after) if s[1] == 2), None)
    assert two is not None, f"never saw 2 members after the kill: {after[:20]}"
    assert any(s[1] == 3 and s[2] > after[two][2] for s in after[two:]), "never saw the restarted worker back"
    last = observed["scrapes"][-1][1]
    # one failure, counted by what saw it first: its launcher, or its closed heartbeat connection
    # (a survivor's failed collective may be counted too)
    verdicts = [last.get(f'unbroken_failures_total{{detected_by="{by}"}}', 0) for by in ("launcher", "connection")]
    assert sum(verdicts) == 1, last
    assert last["unbroken_stall_seconds_count"] >= 1
    assert last["unbroken_committed_step"] >= KILL_STEP


def test_unbroken_status_lists_the_members(observed):
    healthy = observed["status"]["healthy"]
    members = observed["run"].events("generation")[0]["members"]
    assert len(members) == 3
    for member in members:
        assert any(line.strip().startswith(member) and "active" in line for line in healthy.splitlines()), healthy
    degraded = observed["status"]["degraded"]
    assert any(".w1.r0" in line and "dead" in line and "SIGKILL" in line for line in degraded.splitlines()), degraded


def test_without_a_terminal_the_console_prints_plain_progress_lines(observed):
    lines = [l for l in observed["console"].splitlines() if l.startswith("[unbroken] step ")]
    assert lines, observed["console"][-3000:]
    assert all(f"/{STEPS} (" in l and "members " in l and "samples/s" in l for l in lines), lines
    assert any("last failure" in l and ".w1.r0 killed by SIGKILL" in l for l in lines), lines


def test_the_report_counts_the_kill_its_restart_the_generations_and_the_steps(observed):
    run = observed["run"]
    report = harness.command(["report", run.run_dir, "--json"], None, 120)
    assert report.code == 0, report.stderr
    f = json.loads(report.stdout)
    assert f["failures"]["total"] == 1 and f["failures"]["by_kind"] == {"launcher": 1}
    assert f["restarts"] == 1
    assert f["generations"] == len({e["generation"] for e in run.events("generation")}) >= 3
    assert f["steps_committed"] == STEPS and f["next_step"] == STEPS and f["finished"]
    assert f["bad_lines"] == []
    assert os.path.getsize(f["timeline"]) > 0

    # The stall, bounded from outside: from the fault to the commit of the step it interrupted,
    # plus one step (step time and the script's delay) of margin.
    (fault,) = run.events("fault")
    redone = min((e for e in run.events("step") if e["t"] > fault["t"] and e["step"] >= fault["step"]), key=lambda e: e["t"])
    one_step = statistics.median(e["seconds"] for e in run.events("step")) + STEP_DELAY
    bound = redone["t"] - fault["t"] + one_step
    (incident,) = f["incidents"]
    assert incident["members"][0].endswith(".w1.r0")
    assert 0 <= incident["stall_seconds"] <= bound, (incident, bound)
    assert f["stall_seconds"]["count"] == 1 and f["stall_seconds"]["max"] == incident["stall_seconds"]
