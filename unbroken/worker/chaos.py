"""Deterministic fault injection, shared by tests, benchmarks and demos.

A schedule is a ``;``-separated list of faults ``KIND@POINT[,key=value...]``, read from the
``UNBROKEN_CHAOS`` environment variable by every worker. Each fault fires once per job (a marker
file in the run directory decides which process gets it), the first time a process reaches its
point with all its conditions true.

Kinds: ``kill`` (SIGKILL this process), ``hang`` (SIGSTOP this process: heartbeats stop too;
``kill -CONT`` wakes it, or with ``for=SECONDS`` a helper process does after that long), ``spin``
(the training thread loops forever while the heartbeat thread keeps running, like a deadlock or a
stuck device), ``slow`` (from the moment it fires, the thread sleeps at its point each time it
reaches it: ``sleep=SECONDS`` each time, or ``by=FACTOR``, default 2, to take FACTOR times as long
as the time since the previous visit; for ``for=SECONDS``, default the rest of the process's life),
``fail`` (the member reports that a collective of its generation failed and abandons it, as after
a broken connection, without any process dying: the generation re-forms with the same members).
Points: ``step`` (start of a step), ``micro`` (each micro-batch the step hands the loop: with
``slow``, a member that computes slower, as a straggler does), ``allreduce`` (every gradient bucket of the step was sent, none
waited for yet), ``commit`` (after the allreduce, before the optimizer), ``heal`` (a healing
source, after the transfer began), ``donate`` (a donor, after it began to stream its state to a
newcomer that catches up), ``save`` (the checkpoint writer, after the data was written and
before the manifest is published); with ``--shard-optimizer``: ``barrier`` (the step's barrier
was sent, not yet waited for), ``gather`` (this member applied the step, before its gather) and
``reshard`` (a re-partition's transfers were issued, none waited for).
Every fault writes a ``fault`` event (kind, point, step, pid, member and its options) to the run's
event log as it fires.
Conditions: ``rank=`` local rank on its node, or ``rank=random``: one local rank drawn from
``seed=`` (default 0) and the fault's position in the schedule, the same in every worker of the
node, or ``rank=leader``: the member that leads its generation when the point is reached; ``step=`` the step is at least this; ``at=`` at least this many seconds have passed since the
process started its first step; ``restart=`` the process's restart count (default 0: only the first
incarnation).

Example: ``kill@allreduce,rank=2,step=5;kill@heal,rank=0,step=8;hang@step,rank=random,seed=3,at=20,for=5``.
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from unbroken.errors import ConfigError
from unbroken.worker.local_rank import local_rank

KINDS = ("kill", "hang", "spin", "slow", "fail")
POINTS = ("step", "micro", "allreduce", "commit", "heal", "donate", "save", "barrier", "gather", "reshard")
ENV = "UNBROKEN_CHAOS"
_INT_KEYS = ("rank", "step", "restart", "seed")
_SECONDS_KEYS = {"for": "duration", "at": "at", "sleep": "sleep", "by": "by"}
_HELP = (
    "use rank=N, step=N or restart=N with N >= 0; rank=random with seed=N; rank=leader; at=SECONDS;"
    " for=SECONDS (hang, slow); sleep=SECONDS or by=FACTOR (slow)"
)


@dataclass
class Fault:
    kind: str
    point: str
    rank: int | str | None = None  # a local rank, "random", "leader", or None (any)
    step: int = 0
    restart: int = 0
    fired: bool = False
    seed: int = 0
    at: float | None = None  # seconds since the process's first step
    duration: float | None = None  # for=: how long a hang or a slowdown lasts
    sleep: float | None = None  # slow: seconds slept at each visit of the point
    by: float | None = None  # slow: factor on the time between visits


def _number(text: str) -> float | None:
    try:
        value = float(text) if text.isascii() and text.strip() == text else math.nan
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _integer(text: str) -> int | None:
    try:
        value = int(text, 10) if text.isascii() else -1
    except ValueError:
        return None
    return value if value >= 0 else None


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
            parsed: int | float | str | None = None
            if eq and key == "rank" and value in ("random", "leader"):
                parsed = value
            elif eq and key in _INT_KEYS:
                parsed = _integer(value)
            elif eq and key in _SECONDS_KEYS:
                parsed = _number(value)
            if parsed is None:
                raise ConfigError(f"bad condition {item!r} in fault {part!r}: {_HELP}")
            setattr(fault, _SECONDS_KEYS.get(key, key), parsed)
        _check(fault, part)
        faults.append(fault)
    return faults


def _check(fault: Fault, part: str) -> None:
    if fault.duration is not None and fault.kind not in ("hang", "slow"):
        raise ConfigError(f"bad fault {part!r}: for=SECONDS applies to hang and slow only")
    if (fault.sleep is not None or fault.by is not None) and fault.kind != "slow":
        raise ConfigError(f"bad fault {part!r}: sleep= and by= apply to slow only")
    if fault.kind == "slow":
        if fault.sleep is not None and fault.by is not None:
            raise ConfigError(f"bad fault {part!r}: give slow either sleep=SECONDS or by=FACTOR, not both")
        if fault.by is not None and fault.by < 1:
            raise ConfigError(f"bad fault {part!r}: by=FACTOR must be at least 1")
        if fault.sleep is None and fault.by is None:
            fault.by = 2.0


def target_rank(fault: Fault, index: int, local_world_size: int) -> int | None:
    """The local rank a fault applies to (None: any); ``rank=random`` draws it from the seed and
    the fault's index, so every worker of a node draws the same one."""
    if fault.rank == "leader":
        return None  # any process: whether it leads is known only when the point is reached
    if fault.rank != "random":
        return fault.rank  # type: ignore[return-value]
    return random.Random(fault.seed * 1_000_003 + index).randrange(max(1, local_world_size))


def wake_later(pid: int, seconds: float) -> subprocess.Popen:
    """Start a helper that sends SIGCONT to ``pid`` after ``seconds``. It stays in this process's
    group, so a launcher that kills the worker's group kills it too."""
    deadline = time.time() + seconds
    code = (
        "import os, signal, time\n"
        f"time.sleep(max(0.0, {deadline!r} - time.time()))\n"
        "try:\n"
        f"    os.kill({pid}, signal.SIGCONT)\n"
        "except ProcessLookupError:\n"
        "    pass\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True
    )


class Chaos:
    """The faults that apply to this process."""

    def __init__(self, faults: list[Fault], local_rank: int, restart: int, run_dir: str | None = None, local_world_size: int = 1) -> None:
        self.faults = [
            (i, f)
            for i, f in enumerate(faults)
            if target_rank(f, i, local_world_size) in (None, local_rank) and f.restart == restart
        ]
        self.run_dir = run_dir
        self.first_step: float | None = None  # monotonic time of the first step point
        self._slow: list[tuple[Fault, float]] = []  # active slowdowns and when they end
        self._left: dict[str, float] = {}  # when each point was last left
        self._lock = threading.Lock()
        self._helpers: list[subprocess.Popen] = []
        self.leading: Callable[[], bool] = lambda: False
        """Whether this process leads its generation now (the Job sets it): for ``rank=leader``."""

    @classmethod
    def from_env(cls) -> "Chaos":
        return cls(
            parse(os.environ.get(ENV, "")),
            local_rank() or 0,
            int(os.environ.get("UNBROKEN_RESTART_COUNT", "0")),
            os.environ.get("UNBROKEN_RUN_DIR"),
            int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
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

    def _due(self, fault: Fault, name: str, step: int, now: float) -> bool:
        if fault.fired or fault.point != name or step < fault.step:
            return False
        if fault.rank == "leader" and not self.leading():
            return False
        if fault.at is not None and (self.first_step is None or now - self.first_step < fault.at):
            return False
        return True

    def point(self, name: str, step: int) -> None:
        if not self.faults:
            return
        now = time.monotonic()
        if name == "step" and self.first_step is None:
            self.first_step = now
        for index, fault in self.faults:
            if not self._due(fault, name, step, now):
                continue
            fault.fired = True
            if not self._claim(index):
                continue
            self._record(fault, step)
            if fault.kind == "spin":
                while True:  # noqa: ASYNC110 - a stuck training thread is the point
                    pass
            if fault.kind == "slow":
                with self._lock:
                    self._slow.append((fault, now + fault.duration if fault.duration is not None else math.inf))
                continue
            if fault.kind == "fail":
                from unbroken.errors import GenerationFailed

                raise GenerationFailed(f"chaos: injected collective failure at {name} of step {step}")
            if fault.kind == "hang" and fault.duration is not None:
                self._helpers.append(wake_later(os.getpid(), fault.duration))
            os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
        self._slow_down(name, now)

    def _slow_down(self, name: str, now: float) -> None:
        with self._lock:
            self._slow = [(f, end) for f, end in self._slow if now < end]
            active = [f for f, _ in self._slow if f.point == name]
        left = self._left.get(name)
        delay = 0.0
        for fault in active:
            if fault.sleep is not None:
                delay += fault.sleep
            elif left is not None and fault.by is not None:
                delay += (fault.by - 1.0) * (now - left)
        if delay > 0:
            time.sleep(delay)
        self._left[name] = time.monotonic()

    def _record(self, fault: Fault, step: int) -> None:
        if self.run_dir is None:
            return
        from unbroken.observe.events import EventLog

        options = {key: getattr(fault, attr) for key, attr in _SECONDS_KEYS.items() if getattr(fault, attr) is not None}
        if fault.rank in ("random", "leader"):
            options["rank"] = local_rank() or 0
        log = EventLog.for_run_dir(self.run_dir, f"chaos:{os.environ.get('UNBROKEN_MEMBER_ID', os.getpid())}")
        log.emit("fault", fault=fault.kind, point=fault.point, step=step, pid=os.getpid(), member=os.environ.get("UNBROKEN_MEMBER_ID"), **options)
        log.close()


def check_reachable(faults: list[Fault], local_ranks: int) -> None:
    """Refuse a fault aimed at a local rank this node does not run: it could never fire, and a test
    or a demo that counts on it would pass for the wrong reason."""
    for fault in faults:
        if isinstance(fault.rank, int) and fault.rank >= local_ranks:
            raise ConfigError(f"fault {fault.kind}@{fault.point},rank={fault.rank} can never fire: this node runs local ranks"
                              f" 0..{local_ranks - 1} (use rank=random or rank=leader to target one of them)")
