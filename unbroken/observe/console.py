"""The live console of ``unbroken run``: progress read from the run's event log.

A thread tails ``<run dir>/events.jsonl`` (the launcher owns the run directory) and keeps a
:class:`RunState`: step of total, members, samples per second, loss, time left and the last
failure. On a terminal, rich draws it as a progress bar below the scrolling worker output; when
the output is not a terminal, one plain ``[unbroken] step ...`` line is printed every
``interval`` seconds instead (none before the first step). ``interval`` 0 turns both off.

The step events come from the worker at index 0 of the running generation; a node whose run
directory holds none of them (another node hosts index 0) shows failures only.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger(__name__)

RATE_WINDOW = 50  # step events the rate is measured over
SAME_INCIDENT = 1.0  # seconds: a verdict this close to a collective failure explains it


def _duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds) + 0.5)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@dataclass
class RunState:
    """What the console shows, built from events; :meth:`describe` renders it as one line."""

    step: int | None = None  # steps committed (last step index + 1)
    total: int | None = None
    members: int | None = None
    loss: float | None = None
    finished: bool = False
    failed: str | None = None
    failure: tuple[float, str, bool] | None = None  # (t, text, from a verdict)
    window: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RATE_WINDOW))
    last_seconds: float | None = None

    def feed(self, event: dict[str, Any]) -> None:
        kind, t = event.get("kind"), event.get("t")
        if not isinstance(t, (int, float)):
            return
        if kind == "step" and isinstance(event.get("step"), int):
            self.step = event["step"] + 1
            self.total = event.get("total") if isinstance(event.get("total"), int) else self.total
            self.members = event.get("members") if isinstance(event.get("members"), int) else self.members
            self.loss = event.get("loss") if isinstance(event.get("loss"), (int, float)) else self.loss
            samples = event.get("samples")
            self.window.append((t, samples if isinstance(samples, int) else None))
            seconds = event.get("seconds")
            self.last_seconds = seconds if isinstance(seconds, (int, float)) and seconds > 0 else self.last_seconds
        elif kind == "generation" and isinstance(event.get("members"), list):
            self.members = len(event["members"])
        elif kind == "verdict":
            text = f"{event.get('member')} {event.get('reason') or 'declared dead'} (detected by {event.get('detected_by')})"
            self.failure = (t, text, True)
        elif kind == "failure":
            if self.failure is None or not self.failure[2] or t - self.failure[0] > SAME_INCIDENT:
                self.failure = (t, f"generation {event.get('generation')} broke ({event.get('member')}: a collective failed)", False)
        elif kind == "worker_exit" and event.get("code") not in (0, None) and not str(event.get("how", "")).endswith("(stopped by the launcher)"):
            if self.failure is None or t - self.failure[0] > SAME_INCIDENT:  # a crash the coordinator may never see
                self.failure = (t, f"{event.get('member')} {event.get('how')}", False)
        elif kind == "quarantine":
            self.failure = (t, f"slot {event.get('local_rank')} quarantined after repeated crashes ({event.get('member')})", True)
        elif kind == "finished":
            self.finished = True
        elif kind == "job_failed":
            self.failed = str(event.get("reason"))

    def rates(self, now: float) -> tuple[float | None, float | None]:
        """(steps per second, samples per second) over the recent step events, up to ``now``."""
        if len(self.window) >= 2:
            end = self.window[-1][0] if self.finished else max(now, self.window[-1][0])  # stalls lower the rate
            span = end - self.window[0][0]
            if span > 0:
                recent = list(self.window)[1:]
                samples = [s for _, s in recent]
                per_sample = sum(samples) / span if all(s is not None for s in samples) else None  # type: ignore[arg-type]
                return len(recent) / span, per_sample
        if self.window and self.last_seconds:
            samples = self.window[-1][1]
            return 1.0 / self.last_seconds, (samples / self.last_seconds if samples is not None else None)
        return None, None

    def describe(self, now: float) -> str:
        parts = []
        if self.step is None:
            parts.append("waiting for the first step")
        elif self.total:
            parts.append(f"step {self.step}/{self.total} ({self.step / self.total:.0%})")
        else:
            parts.append(f"step {self.step}")
        if self.members is not None:
            parts.append(f"members {self.members}")
        steps_per_s, samples_per_s = self.rates(now)
        if samples_per_s is not None:
            parts.append(f"{samples_per_s:.0f} samples/s")
        elif steps_per_s is not None:
            parts.append(f"{steps_per_s:.1f} steps/s")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.failed:
            parts.append(f"job failed: {self.failed}")
        elif self.finished:
            parts.append("finished")
        elif steps_per_s and self.total and self.step is not None:
            parts.append(f"ETA {_duration((self.total - self.step) / steps_per_s)}")
        if self.failure is not None:
            parts.append(f"last failure {_duration(now - self.failure[0])} ago: {self.failure[1]}")
        else:
            parts.append("no failures")
        return "  ".join(parts)


def _notice(event: dict[str, Any]) -> str | None:
    """A console line for an event that the progress line does not show: whichever worker wrote
    it, the user sees it (the console otherwise shows one worker's output)."""
    kind = event.get("kind")
    if kind == "resume":
        return f"{event.get('source', '').removeprefix('worker:')}: resumed from step {event.get('step')} of {event.get('location')}"
    if kind == "checkpoint_skipped":
        return f"checkpoint of step {event.get('step')} skipped: the write of step {event.get('writing')} is still running"
    if kind == "state_lost":
        from unbroken.observe.incidents import state_loss_text

        return state_loss_text(event)
    if kind == "catch_up_off":
        return (f"{event.get('member')}'s catch-up did not match its donor ({event.get('reason')}); rejoining members"
                " are healed from a peer from now on")
    if kind == "refused":
        return f"{event.get('member')} refused: it does not match the job: {event.get('reason')}"
    return None


class EventTail:
    """The complete lines appended to a JSON-lines file since the last read, as events."""

    def __init__(self, path: str, from_end: bool = True) -> None:
        self.path = path
        self.offset = os.path.getsize(path) if from_end and os.path.exists(path) else 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # an unfinished last line waits for the rest
        events = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                events.append(record)
        return events


class ProgressView:
    """Feeds a :class:`RunState` from the event log on a thread and shows it (rich or plain)."""

    def __init__(
        self,
        events_path: str,
        interval: float,
        say: Callable[[str], None],
        tty: bool | None = None,
        console: Any = None,
        poll: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state = RunState()
        self.tail = EventTail(events_path)
        self.interval = interval
        self.say = say
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.console = console
        self.poll = poll
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress: Any = None
        self._task: Any = None

    def start(self) -> "ProgressView":
        if self.interval <= 0:
            return self
        if self.tty:
            self._start_rich()
        self._thread = threading.Thread(target=self._run, name="unbroken-console", daemon=True)
        self._thread.start()
        return self

    def _start_rich(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        self._progress = Progress(
            TextColumn("[bold]unbroken[/]"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console or Console(),
            refresh_per_second=2,
            redirect_stdout=True,
            redirect_stderr=True,
        )
        self._task = self._progress.add_task("train", total=None, status=self.state.describe(self.clock()))
        self._progress.start()

    def update(self) -> None:
        """Read what the log gained, print the events worth a line of their own, and refresh the
        display."""
        for event in self.tail.read():
            self.state.feed(event)
            notice = _notice(event)
            if notice:
                self.say(notice)
        if self._progress is not None:
            s = self.state
            self._progress.update(self._task, completed=s.step or 0, total=s.total, status=self.state.describe(self.clock()))

    def _run(self) -> None:
        next_line = self.clock() + self.interval
        while not self._stop.wait(self.poll):
            try:
                self.update()
                now = self.clock()
                if self._progress is None and now >= next_line:
                    next_line = now + self.interval
                    if self.state.step is not None:
                        self.say(self.state.describe(now))
            except Exception:  # the display must never take the launcher down
                log.exception("console progress view failed")
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._progress is None:
                try:
                    self.update()  # the last notices
                except Exception:
                    log.exception("console progress view failed")
        if self._progress is not None:
            try:
                self.update()
            except Exception:
                log.exception("console progress view failed")
            self._progress.stop()
            self._progress = None
