"""Structured events: one JSON object per line in ``<run dir>/events.jsonl``.

Every process of a run (coordinator, launcher, workers) appends to the same file. Each event is
written with a single ``write`` on a file opened with ``O_APPEND``, so lines from concurrent
writers never interleave. ``t`` is wall-clock time (seconds since the epoch) for joining events
across processes on one host; decisions never use it.

Common fields: ``t``, ``kind``, ``source`` (who wrote it: ``coordinator``, ``launcher:<node>``,
``worker:<member>`` or ``chaos:<member>``); :meth:`EventLog.emit` refuses other fields of these
names. Kinds: ``coordinator_start``, ``worker_start``, ``worker_exit``, ``restart``, ``join``,
``generation``, ``failure``, ``verdict``, ``heal``, ``step``, ``replicas``, ``finished``,
``job_failed``, ``fault``, ``checkpoint``, ``checkpoint_interval``, ``resume``, ``quarantine``,
``quarantine_end``. The fields of each kind are in ``docs/events.md``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

RUN_DIR_ENV = "UNBROKEN_RUN_DIR"
COMMON_FIELDS = ("t", "kind", "source")
KINDS = (
    "coordinator_start", "worker_start", "worker_exit", "restart", "join", "generation", "failure", "verdict",
    "heal", "step", "replicas", "finished", "job_failed", "fault", "checkpoint", "checkpoint_interval", "resume",
    "checkpoint_skipped", "refused", "leader", "leader_lost",
    "quarantine", "quarantine_end", "shutdown", "coordinator_stall", "state_lost", "straggler", "straggler_sustained", "rebalanced", "evicted",
    "donation", "catch_up", "catch_up_off", "stop_requested", "reshard", "roll_forward", "sharded_state_lost",
)


class EventLog:
    """Appends events to one JSON-lines file; a no-op when no path is given."""

    def __init__(self, path: str | None, source: str) -> None:
        self.source = source
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    @classmethod
    def for_run_dir(cls, run_dir: str | None, source: str) -> "EventLog":
        return cls(os.path.join(run_dir, "events.jsonl") if run_dir else None, source)

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def emit(self, kind: str, **fields: Any) -> None:
        clash = [name for name in COMMON_FIELDS if name in fields]
        if clash:
            raise ValueError(f"event {kind!r}: the field(s) {clash} would replace the common fields {COMMON_FIELDS}")
        if self._fd is None:
            return
        record = {"t": time.time(), "kind": kind, "source": self.source, **fields}
        line = (json.dumps(record, default=str) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_events(path: str) -> tuple[list[dict[str, Any]], list[int]]:
    """Events of a log and the numbers of the lines that could not be parsed."""
    events, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError("not an object")
                events.append(record)
            except ValueError:
                bad.append(number)
    return events, bad
