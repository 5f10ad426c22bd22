"""The live console of ``unbroken run``: state from events, the tail of a growing log, the views."""

from __future__ import annotations

import io
import json
import time

import pytest

from unbroken.observe.console import EventTail, ProgressView, RunState, _duration
from unbroken.observe.events import EventLog

T0 = 1_700_000_000.0


def step(t: float, index: int, members: int = 4, total: int = 100, loss: float = 0.5, samples: int = 128, seconds: float = 0.1) -> dict:
    return {"t": t, "kind": "step", "source": "worker:a", "step": index, "generation": 1, "members": members,
            "seconds": seconds, "loss": loss, "samples": samples, "total": total}


def test_nothing_seen_yet_says_so():
    assert RunState().describe(T0) == "waiting for the first step  no failures"


def test_step_of_total_members_rate_loss_and_time_left():
    s = RunState()
    for i in range(11):
        s.feed(step(T0 + 0.5 * i, i, loss=1.0 / (i + 1)))
    # 10 steps of 128 samples in 5 s after the first one
    assert s.rates(T0 + 5.0) == (pytest.approx(2.0), pytest.approx(256.0))
    line = s.describe(T0 + 5.0)
    assert line == "step 11/100 (11%)  members 4  256 samples/s  loss 0.0909  ETA 0:45  no failures"


def test_the_rate_falls_while_no_step_commits():
    s = RunState()
    for i in range(3):
        s.feed(step(T0 + i, i))
    assert s.rates(T0 + 2)[0] == pytest.approx(1.0)
    assert s.rates(T0 + 8)[0] == pytest.approx(0.25)


def test_one_step_event_gives_the_rate_of_its_own_step_time():
    s = RunState()
    s.feed(step(T0, 0, seconds=0.5, samples=100))
    assert s.rates(T0) == (pytest.approx(2.0), pytest.approx(200.0))


def test_step_events_without_samples_or_total_still_show_progress():
    s = RunState()
    for i in range(3):
        s.feed({"t": T0 + i, "kind": "step", "step": i, "generation": 1, "members": 2, "seconds": 0.1, "loss": 2.0})
    assert s.describe(T0 + 2) == "step 3  members 2  1.0 steps/s  loss 2.0000  no failures"


def test_the_last_failure_prefers_the_verdict_that_explains_a_broken_collective():
    s = RunState()
    s.feed(step(T0, 0))
    s.feed({"t": T0 + 1.0, "kind": "failure", "member": "n.w0.r0", "generation": 1, "detected_by": "collective"})
    assert "generation 1 broke (n.w0.r0: a collective failed)" in s.describe(T0 + 1)
    s.feed({"t": T0 + 1.01, "kind": "verdict", "member": "n.w1.r0", "detected_by": "launcher", "reason": "killed by SIGKILL"})
    s.feed({"t": T0 + 1.02, "kind": "failure", "member": "n.w2.r0", "generation": 1, "detected_by": "collective"})
    s.feed({"t": T0 + 1.03, "kind": "generation", "generation": 2, "members": ["a", "b", "c"]})
    line = s.describe(T0 + 13.0)
    assert "members 3" in line
    assert line.endswith("last failure 0:12 ago: n.w1.r0 killed by SIGKILL (detected by launcher)")


def test_the_end_of_the_job_replaces_the_time_left():
    s = RunState()
    s.feed(step(T0, 98))
    s.feed(step(T0 + 1, 99))
    assert "ETA" in s.describe(T0 + 1)
    s.feed({"t": T0 + 1.1, "kind": "finished", "member": "a", "step": 100})
    assert "finished" in s.describe(T0 + 2) and "ETA" not in s.describe(T0 + 2)
    assert s.rates(T0 + 60)[0] == pytest.approx(1.0)  # the rate of the run, not of the time since
    s.feed({"t": T0 + 2, "kind": "job_failed", "reason": "quorum lost"})
    assert "job failed: quorum lost" in s.describe(T0 + 2)


def test_malformed_events_are_ignored():
    s = RunState()
    for bad in ({}, {"kind": "step"}, {"t": "x", "kind": "step", "step": 1}, {"t": T0, "kind": "step", "step": "1"}):
        s.feed(bad)
    assert s.step is None


@pytest.mark.parametrize("seconds, text", [(0, "0:00"), (59.6, "1:00"), (125, "2:05"), (3725, "1:02:05"), (-3, "0:00")])
def test_durations(seconds, text):
    assert _duration(seconds) == text


def test_the_tail_returns_only_complete_new_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"t": 1, "kind": "old"}\n')
    tail = EventTail(str(path))
    assert tail.read() == []
    with open(path, "a") as f:
        f.write('{"t": 2, "kind": "a"}\nnot json\n{"t": 3, "ki')
    assert tail.read() == [{"t": 2, "kind": "a"}]
    with open(path, "a") as f:
        f.write('nd": "b"}\n[1, 2]\n')
    assert tail.read() == [{"t": 3, "kind": "b"}]
    assert EventTail(str(path), from_end=False).read()[0] == {"t": 1, "kind": "old"}
    assert EventTail(str(tmp_path / "missing.jsonl")).read() == []


def test_without_a_terminal_a_plain_line_comes_every_interval(tmp_path):
    path = str(tmp_path / "events.jsonl")
    events = EventLog(path, "worker:a")
    lines: list[str] = []
    view = ProgressView(path, 0.2, lines.append, tty=False, poll=0.02).start()
    try:
        time.sleep(0.5)
        assert lines == []  # nothing before the first step
        events.emit("step", step=0, generation=1, members=2, seconds=0.1, loss=1.5, samples=64, total=10)
        deadline = time.monotonic() + 10
        while not lines and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        view.stop()
        events.close()
    assert lines and lines[0].startswith("step 1/10 (10%)  members 2  640 samples/s  loss 1.5000  ETA ")


def test_an_interval_of_zero_shows_nothing(tmp_path):
    path = str(tmp_path / "events.jsonl")
    view = ProgressView(path, 0, lambda line: pytest.fail("printed"), tty=True).start()
    assert view._thread is None and view._progress is None
    view.stop()


def test_on_a_terminal_rich_draws_the_progress(tmp_path):
    from rich.console import Console

    path = str(tmp_path / "events.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps(step(T0, 49, total=100)) + "\n")
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    view = ProgressView(path, 10, lambda line: pytest.fail("plain line on a terminal"), tty=True, console=console, poll=0.02)
    view.tail.offset = 0
    view.start()
    try:
        view.update()
    finally:
        view.stop()
    text = out.getvalue()
    assert "unbroken" in text and "step 50/100 (50%)" in text and "members 4" in text


def test_a_crash_the_coordinator_never_saw_and_a_quarantine_are_failures_a_stop_is_not():
    """A script that fails before it joins, restarted until its slot is quarantined, showed "no failures"."""
    s = RunState()
    s.feed({"t": T0, "kind": "worker_exit", "member": "n.w1.r3", "local_rank": 1, "code": -15,
            "how": "killed by SIGTERM (stopped by the launcher)"})
    assert s.describe(T0).endswith("no failures")
    s.feed({"t": T0 + 1, "kind": "worker_exit", "member": "n.w1.r0", "local_rank": 1, "code": 1, "how": "exit code 1"})
    assert s.describe(T0 + 2).endswith("last failure 0:01 ago: n.w1.r0 exit code 1")
    s.feed({"t": T0 + 3, "kind": "quarantine", "member": "n.w1.r2", "local_rank": 1})
    assert "slot 1 quarantined after repeated crashes (n.w1.r2)" in s.describe(T0 + 4)
