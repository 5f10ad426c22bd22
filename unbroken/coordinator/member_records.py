"""The records of membership and its one rule, pure: a member and its state, a generation, the
settings, and :func:`decide`, whether a new generation is formed now and with whom.
:mod:`unbroken.coordinator.membership` keeps the state that changes (see its docstring for the lifecycle).
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable


_LIVE = frozenset(("waiting", "active"))


class MemberState(enum.Enum):
    WAITING = "waiting"
    ACTIVE = "active"
    DEAD = "dead"
    LEFT = "left"

    __hash__ = object.__hash__  # members are singletons: Enum's own hash is Python code, and the
    # coordinator counts states in a dict at every change of 16,000 members' states


class GenerationState(enum.Enum):
    ACTIVE = "active"
    BROKEN = "broken"


@dataclass
class Member:
    id: str
    node: str
    joined_at: float
    last_heartbeat: float
    state: MemberState = MemberState.WAITING
    step: int = 0
    pid: int | None = None
    waiting_since: float | None = None
    blocked_on: str | None = None
    """The collective the member last reported waiting in (None: not waiting in one)."""
    blocked_since: float | None = None
    """Since when (coordinator clock) it has waited in that same collective."""
    fenced: bool = False
    """Declared dead for making no progress: it must end itself so that its launcher restarts it."""
    progress: int | None = None
    """The member's progress counter (micro-batches, gradient hooks, collectives entered, state
    sent), as last reported; it only ever moves while the member works."""
    progress_at: float = 0.0
    """When (coordinator clock) the counter last moved, or the member last became active."""
    busy: str | None = None
    """Work the member reported doing on purpose that makes no step progress (a final checkpoint
    write, reading a checkpoint): never taken for stuck while it lasts, up to ``busy_timeout``."""
    busy_since: float | None = None
    """When (coordinator clock) the current busy mark began."""
    warm: bool = True
    """False until the member has committed a step in its process: its first step may include
    compilation and lazy imports, judged against ``warmup_timeout`` instead."""
    catch_up: str | None = None
    """While it catches up from a donor instead of waiting to be healed (:mod:`unbroken.worker.catch_up`):
    the address its donor streams to. It waits without making anyone re-form."""
    pace: float | None = None
    """Its pace as a fraction of the median member's, as the members measured it in-band (the median
    of a window of steps, :mod:`unbroken.data.balance`); None until reported."""
    straggler: bool = False
    """The members flag it as a straggler (slower than the threshold for a window of steps)."""
    exchange_seconds: float | None = None
    """Seconds it spent in its last gradient exchange: waiting for slower peers, and the transfer."""
    death_reason: str | None = None
    ended_at: float | None = None
    """When (coordinator clock) it died or left: it is forgotten ``forget_after`` seconds later."""

    def status(self, now: float) -> dict[str, Any]:
        """Its row in ``GET /v1/status`` (``unbroken status``)."""
        return {"member": self.id, "node": self.node, "state": self.state.value, "step": self.step,
                "heartbeat_age": round(now - self.last_heartbeat, 3), "pace": self.pace, "straggler": self.straggler,
                "reason": self.death_reason}


@dataclass(frozen=True)
class Generation:
    number: int
    members: tuple[str, ...]
    formed_at: float
    tag: str = ""
    """A part of the store prefix derived from the job's token (:func:`unbroken.store_keys.key_tag`):
    without the token, nobody can name this generation's keys."""
    stop: dict | None = None
    """The job's stop request when this generation formed (``{"step", "reason"}``: no step at or
    after ``step`` is trained), or None: every member of the generation learns the same one from
    its join reply, so all end at the same boundary (:meth:`Membership.request_stop`)."""

    @cached_property
    def ranks(self) -> dict[str, int]:
        """Member id -> rank, built once: membership tests and ranks in O(1), not O(N)."""
        return {member: rank for rank, member in enumerate(self.members)}

    @property
    def prefix(self) -> str:
        """Store prefix under which this generation's process group rendezvous."""
        return f"unbroken/{self.tag}gen{self.number}/"


@dataclass(frozen=True)
class MembershipSettings:
    """Rules for forming generations."""

    heartbeat_timeout: float = 3.0
    """Seconds without a heartbeat after which a member is declared dead."""
    expected_members: int = 1
    """Members the first generation waits for (the launcher passes nodes x processes)."""
    start_grace: float = 30.0
    """Seconds the first generation waits for ``expected_members`` before starting with fewer."""
    min_members: int = 1
    """No generation is formed with fewer members than this."""
    max_members: int | None = None
    """A generation takes at most this many members; the others wait as spares."""
    quorum_timeout: float = 300.0
    """Seconds live members may stay below ``min_members`` (after the first generation, or after
    ``start_grace`` before it) before the job is failed."""
    progress_timeout: float = 20.0
    """A member whose progress (micro-batches, gradient hooks, collectives entered) has not moved
    for this long, while a peer waits for it inside a collective or after its generation broke,
    is declared dead. A long step that keeps moving is never stuck, however long it lasts."""
    warmup_timeout: float = 600.0
    """The same limit for a member that has not yet committed a step in its process (its first
    step compiles, imports and allocates)."""
    busy_timeout: float = 3600.0
    """Longest deliberate work a member may mark busy (a checkpoint, an on_leader call, warming memory for a heal, leaving) before it
    is declared dead and ends itself, with a reason naming the work: a write stuck on a hung
    mount must not hold the job forever. Generous: a whole state written to slow storage."""
    forget_after: float = 600.0
    """Seconds after which a member that died or left (and is in no current generation) is
    forgotten: the coordinator's memory stays bounded however often members restart. A member
    heard of again after that is simply new."""
    history_limit: int = 64
    """How many of the newest generations :attr:`Membership.history` keeps."""

    def __post_init__(self) -> None:
        if not self.heartbeat_timeout > 0:
            raise ValueError("heartbeat_timeout must be positive")
        if self.min_members < 1:
            raise ValueError(f"min_members must be at least 1, got {self.min_members}")
        if self.max_members is not None and self.max_members < self.min_members:
            raise ValueError(f"max_members ({self.max_members}) is below min_members ({self.min_members})")
        if self.progress_timeout <= 0 or self.quorum_timeout <= 0:
            raise ValueError("progress_timeout and quorum_timeout must be positive")
        if self.forget_after <= 0 or self.history_limit < 1:
            raise ValueError("forget_after must be positive and history_limit at least 1")
        if self.warmup_timeout < self.progress_timeout:
            raise ValueError(f"warmup_timeout ({self.warmup_timeout}) must be at least progress_timeout ({self.progress_timeout})")
        if self.busy_timeout < self.progress_timeout:
            raise ValueError(f"busy_timeout ({self.busy_timeout}) must be at least progress_timeout ({self.progress_timeout})")


@dataclass(frozen=True)
class Decision:
    """Whether to form a generation now, with whom, and why (for the log)."""

    form: bool
    members: tuple[str, ...] = ()
    reason: str = ""


def decide(
    members: dict[str, Member],
    current: Generation | None,
    settings: MembershipSettings,
    first_wait: float | None,
    now: float,
) -> Decision:
    """Decide whether a new generation should be formed now. Pure."""
    live = [m for m in members.values() if m.state in (MemberState.WAITING, MemberState.ACTIVE)]
    waiting = [m for m in live if m.state is MemberState.WAITING]
    if not waiting:
        return Decision(False, reason="nobody waits to join")
    busy = [m.id for m in live if m.state is MemberState.ACTIVE]
    if busy:
        return Decision(False, reason=f"waiting for {len(busy)} active member(s) to reach a step boundary")
    if current is None and len(waiting) < settings.expected_members:
        if first_wait is None or now - first_wait < settings.start_grace:
            return Decision(
                False,
                reason=f"first generation: {len(waiting)} of {settings.expected_members} expected members",
            )
    if len(waiting) < settings.min_members:
        return Decision(False, reason=f"{len(waiting)} member(s) waiting, minimum is {settings.min_members}")
    previous = current.members if current is not None else ()
    before = current.ranks if current is not None else {}
    waiting_ids = {m.id for m in waiting}
    order = [m for m in previous if m in waiting_ids]
    newcomers = [m for m in waiting if m.id not in before]
    order += [m.id for m in sorted(newcomers, key=_seat(newcomers))]
    if settings.max_members is not None:
        order = order[: settings.max_members]
    return Decision(True, tuple(order), reason=f"{len(order)} member(s) ready")


def _counts_blocked(member: Member) -> int:
    """1 if ``member`` counts in :attr:`Membership._blocked_active` (ACTIVE, waiting in a
    collective), else 0: every change of its state or wait adds the difference."""
    return int(member.state is MemberState.ACTIVE and bool(member.blocked_on))


_SLOT = re.compile(r"\.w(\d+)\.r\d+$")
"""A launcher's member id, ``NODE.wSLOT.rRESTART`` (unbroken.launch.workers)."""


def _seat(newcomers: list[Member]) -> Callable[[Member], tuple[float, float, float, str]]:
    """The order newcomers take in a generation, after the members it keeps: node by node, in the
    order the nodes' first members joined, and slot by slot within a node. The first generation's
    leader (index 0) is then the lowest slot of the first node, as rank 0 is under torchrun,
    whichever of its workers happened to join first; it stays the leader for as long as it lives
    (kept members come first). Ids of another form keep the order they joined in."""
    first_join: dict[str, float] = {}
    for m in newcomers:
        first_join[m.node] = min(first_join.get(m.node, m.joined_at), m.joined_at)

    def seat(m: Member) -> tuple[float, float, float, str]:
        slot = _SLOT.search(m.id)
        return first_join[m.node], int(slot.group(1)) if slot else math.inf, m.joined_at, m.id

    return seat
