"""The record of which stream positions this member trained on (``record_samples``).

With ``UNBROKEN_RECORD_SAMPLES`` set, a member writes one JSON line per step attempt (its
generation, step, rank, member count and the positions of its share) and one per commit to
``<run dir>/samples/<member>.jsonl``, and at a finished end its lineage and replica hash to
``<member>.lineage.json``. The integration tests read them to check that every position of the
stream was applied in exactly one committed step and that no stale member committed. Off by
default: nothing is opened or written then.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Protocol


class Attempt(Protocol):
    """What the record reads of a step: where it stands and the stream positions of its share."""

    generation: int
    index: int
    rank: int
    members: int
    positions: range


class SampleRecord:
    """This member's sample files; every method does nothing when recording is off."""

    def __init__(self, enabled: bool, run_dir: str | None, member_id: str) -> None:
        self.enabled = enabled
        self.run_dir = run_dir
        self.member_id = member_id
        self._fd: int | None = None

    def open(self) -> None:
        """Open the attempts file (appending: a restarted member continues it)."""
        if not self.enabled:
            return
        path = os.path.join(self.run_dir, "samples", f"{self.member_id}.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def attempt(self, step: Attempt, group: Any) -> None:
        """The positions ``step`` is about to send into its generation's allreduce (``group``: this
        process's replica group, or None)."""
        if self._fd is None:
            return
        # in a replica group, "k" processes each log their part of the group's share
        k = f',"k":{group.size}' if group is not None and group.grouped else ""
        line = f'{{"g":{step.generation},"s":{step.index},"r":{step.rank},"n":{step.members}{k},"a":{step.positions.start},"b":{step.positions.stop}}}\n'
        os.write(self._fd, line.encode())

    def commit(self, step: Attempt, digest: int, group: Any) -> None:
        """What this member committed, for the invariant checks: the generation, the step, the
        process of its replica group ("p", 0 alone) and the lineage digest after the commit ("d"),
        which every process of the generation must share."""
        if self._fd is not None:
            process = group.rank if group is not None and group.grouped else 0
            line = f'{{"commit":1,"g":{step.generation},"s":{step.index},"p":{process},"d":{digest},"t":{time.time()!r}}}\n'
            os.write(self._fd, line.encode())

    def write_lineage(self, lineage: list[int], replica_hash: str | None, next_step: int) -> None:
        """At a finished end: the generation of every committed step, and the final replica hash."""
        if not self.enabled:
            return
        path = os.path.join(self.run_dir, "samples", f"{self.member_id}.lineage.json")
        with open(path, "w") as f:
            json.dump({"lineage": lineage, "hash": replica_hash, "next_step": next_step}, f)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
