"""Deterministic fault injection, shared by tests, benchmarks and demos.

A schedule is a ``;``-separated list of faults ``KIND@POINT[,key=value...]``, read from the
``UNBROKEN_CHAOS`` environment variable by every worker. Each fault fires once per job (a marker
file in the run directory decides which process gets it), the first time a process reaches its
point with all its conditions true.

Kinds: ``kill`` (SIGKILL this process), ``hang`` (SIGSTOP this process: heartbeats stop too;
``kill -CONT`` wakes it), ``spin`` (the training thread loops forever while the heartbeat thread
keeps running, like a deadlock or a stuck device).
Points: ``step`` (start of a step), ``allreduce`` (every gradient bucket of the step was sent, none
waited for yet), ``commit`` (after the allreduce, before the optimizer), ``heal`` (a healing
source, after the transfer began), ``save`` (the checkpoint writer, after the data was written and
before the manifest is published).
Every fault writes a ``fault`` event (kind, point, step, pid) to the run's event log as it fires.
Conditions: ``rank=`` local rank on its node, ``step=`` the step is at least this,
``restart=`` the process's restart count (default 0: only the first incarnation).

Example: ``kill@allreduce,rank=2,step=5;kill@heal,rank=0,step=8``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from unbroken.errors import ConfigError

KINDS = ("kill", "hang", "spin")
POINTS = ("step", "allreduce", "commit", "heal", "save")
ENV = "UNBROKEN_CHAOS"


@dataclass
class Fault:
    kind: str
    point: str
    rank: int | None = None
    step: int = 0
    restart: int = 0
    fired: bool = False


def parse(schedule: str) -> list[Fault]:
    """Parse a schedule; raises :class:`ConfigError` naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in schedule.split(";"))):
        head, _, rest = part.partition(",")
        kind, at, point = head.partition("@")
        if kind not in KINDS or not at or point not in POINTS:
            raise ConfigError(f"bad fault {part!r}: expected KIND@POINT with KIND in {KINDS} and POINT in {POINTS}")
        fault = Fault(kind, point)
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            try:
                number = int(value, 10) if value.isascii() else -1
            except ValueError:
                number = -1
            if key not in ("rank", "step", "restart") or not eq or number < 0:
                raise ConfigError(f"bad condition {item!r} in fault {part!r}: use rank=N, step=N or restart=N with N >= 0")
            setattr(fault, key, number)
        faults.append(fault)
    return faults


class Chaos:
    """The faults that apply to this process."""

    def __init__(self, faults: list[Fault], local_rank: int, restart: int, run_dir: str | None = None) -> None:
        self.faults = [(i, f) for i, f in enumerate(faults) if (f.rank is None or f.rank == local_rank) and f.restart == restart]
        self.run_dir = run_dir

    @classmethod
    def from_env(cls) -> "Chaos":
        return cls(
            parse(os.environ.get(ENV, "")),
            int(os.environ.get("LOCAL_RANK", "0")),
            int(os.environ.get("UNBROKEN_RESTART_COUNT", "0")),
            os.environ.get("UNBROKEN_RUN_DIR"),
        )

    def _claim(self, index: int) -> bool:
        """True if this process is the first in the job to reach fault ``index``."""
        if self.run_dir is None:
            return True
        folder = os.path.join(self.run_dir, "chaos")
        os.makedirs(folder, exist_ok=True)
        try:
            os.close(os.open(os.path.join(folder, f"fault-{index}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def point(self, name: str, step: int) -> None:
        for index, fault in self.faults:
            if not fault.fired and fault.point == name and step >= fault.step:
                fault.fired = True
                if not self._claim(index):
                    continue
                self._record(fault, step)
                if fault.kind == "spin":
                    while True:  # noqa: ASYNC110 - a stuck training thread is the point
                        pass
                os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)

    def _record(self, fault: Fault, step: int) -> None:
        if self.run_dir is None:
            return
        from unbroken.telemetry import EventLog

        log = EventLog.for_run_dir(self.run_dir, f"chaos:{os.environ.get('UNBROKEN_MEMBER_ID', os.getpid())}")
        log.emit("fault", fault=fault.kind, point=fault.point, step=step, pid=os.getpid(), member=os.environ.get("UNBROKEN_MEMBER_ID"))
        log.close()
