"""Reading a run's event logs for ``unbroken report``: merged, checked, and never raising on a bad line.

The figures come from ``events.jsonl`` alone (see :mod:`unbroken.observe.events`). A log that is
corrupt or truncated still gives a report: lines that are not JSON objects, and records that lack
the fields their kind needs, are counted and named by file and line number, and left out.
Several run directories (one per node of a multi-node run) are merged by time, and the same log
given twice under two names is read once.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from unbroken.errors import ConfigError
from unbroken.observe.events import read_events

EVENTS_FILE = "events.jsonl"

# Fields a record of a kind needs to be used; the value is "int" or "number".
_REQUIRED: dict[str, dict[str, str]] = {
    "step": {"step": "int", "generation": "int"},
    "generation": {"generation": "int"},
    "failure": {"generation": "int"},
    "verdict": {},
    "heal": {},
    "checkpoint": {},
}


@dataclass
class BadLine:
    file: str
    line: int
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "why": self.why}


@dataclass
class Log:
    """The merged events of one or more run directories, sorted by time."""

    files: list[str]
    events: list[dict[str, Any]]
    bad: list[BadLine] = field(default_factory=list)
    duplicates: int = 0


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def num(event: dict[str, Any], key: str) -> float | None:
    """``event[key]`` as a float if it is a finite number, else None."""
    value = event.get(key)
    return float(value) if is_number(value) else None


def _problem(record: dict[str, Any]) -> str | None:
    """Why a parsed record cannot be used, or None."""
    if not is_number(record.get("t")):
        return "no numeric 't'"
    kind = record.get("kind")
    if not isinstance(kind, str):
        return "no string 'kind'"
    for name, want in _REQUIRED.get(kind, {}).items():
        value = record.get(name)
        if not (is_int(value) if want == "int" else is_number(value)):
            return f"{kind} event without {want} {name!r}"
    return None


def events_path(run_dir: str) -> str:
    """The event log of a run directory (or the path itself, if it names a file)."""
    path = run_dir if os.path.isfile(run_dir) else os.path.join(run_dir, EVENTS_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"no event log at {path}")
    return path


def load(run_dirs: Sequence[str]) -> Log:
    """Read and merge the event logs of ``run_dirs``; bad lines are recorded, never raised."""
    files: list[str] = []
    for run_dir in run_dirs:
        path = events_path(run_dir)
        if os.path.realpath(path) not in {os.path.realpath(f) for f in files}:
            files.append(path)
    log = Log(files=files, events=[])
    seen: set[str] = set()
    for path in files:
        try:
            records, bad_numbers = read_events(path)
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
        bad_set = set(bad_numbers)
        log.bad.extend(BadLine(path, n, "not a JSON object") for n in bad_numbers)
        # read_events numbers every line; the records are the lines that are not bad, in order.
        numbers = (n for n in range(1, len(records) + len(bad_numbers) + 1) if n not in bad_set)
        for number, record in zip(numbers, records):
            why = _problem(record)
            if why is not None:
                log.bad.append(BadLine(path, number, why))
                continue
            key = json.dumps(record, sort_keys=True, default=str)
            if key in seen:  # the same log given twice under two names, say
                log.duplicates += 1
                continue
            seen.add(key)
            log.events.append(record)
    log.events.sort(key=lambda e: e["t"])
    log.bad.sort(key=lambda b: (files.index(b.file), b.line))
    return log
