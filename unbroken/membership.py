"""Membership: who is alive, which generation is current, and when to form the next one.

A generation is a numbered, ordered set of members that trains together over one process group
(built under the generation's own store prefix). The coordinator forms a new generation when the
set of members must change: a member died (its launcher reported the exit, a peer reported a
broken collective, or its heartbeats stopped) or a new member asked to join.

The rule that keeps the protocol simple: a generation is formed only when *every* live member is
waiting to join one. Members of a healthy generation learn that someone waits through the
``reconfigure`` flag of their heartbeat replies, finish the current step together and come to
join; after a failure they come at once. So every member of a new generation left its previous
one at the same step boundary, or that generation broke.

Everything here is plain state and pure decisions, driven by an explicit ``now`` (the
coordinator's ``time.monotonic()``); the coordinator does the I/O.

Member lifecycle::

    (new) --join--> WAITING --generation formed--> ACTIVE --join--> WAITING ...
    WAITING/ACTIVE --exit reported / heartbeat timeout--> DEAD
    WAITING/ACTIVE --leave--> LEFT
    DEAD --join (a member that woke up)--> WAITING   (it must be healed: it is behind)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class MemberState(enum.Enum):
    WAITING = "waiting"
    ACTIVE = "active"
    DEAD = "dead"
    LEFT = "left"


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
    write, reading a checkpoint): never taken for stuck while it lasts."""
    warm: bool = True
    """False until the member has committed a step in its process: its first step may include
    compilation and lazy imports, judged against ``warmup_timeout`` instead."""
    death_reason: str | None = None


@dataclass(frozen=True)
class Generation:
    number: int
    members: tuple[str, ...]
    formed_at: float

    @property
    def prefix(self) -> str:
        """Store prefix under which this generation's process group rendezvous."""
        return f"unbroken/gen{self.number}/"


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

    def __post_init__(self) -> None:
        if not self.heartbeat_timeout > 0:
            raise ValueError("heartbeat_timeout must be positive")
        if self.min_members < 1:
            raise ValueError(f"min_members must be at least 1, got {self.min_members}")
        if self.max_members is not None and self.max_members < self.min_members:
            raise ValueError(f"max_members ({self.max_members}) is below min_members ({self.min_members})")
        if self.progress_timeout <= 0 or self.quorum_timeout <= 0:
            raise ValueError("progress_timeout and quorum_timeout must be positive")
        if self.warmup_timeout < self.progress_timeout:
            raise ValueError(f"warmup_timeout ({self.warmup_timeout}) must be at least progress_timeout ({self.progress_timeout})")


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
    previous = list(current.members) if current is not None else []
    waiting_ids = {m.id for m in waiting}
    order = [m for m in previous if m in waiting_ids]
    newcomers = sorted((m for m in waiting if m.id not in previous), key=lambda m: (m.joined_at, m.id))
    order += [m.id for m in newcomers]
    if settings.max_members is not None:
        order = order[: settings.max_members]
    return Decision(True, tuple(order), reason=f"{len(order)} member(s) ready")


@dataclass
class Membership:
    """The coordinator's state. Every mutating method returns True when the state changed."""

    settings: MembershipSettings
    members: dict[str, Member] = field(default_factory=dict)
    current: Generation | None = None
    generation_state: GenerationState = GenerationState.ACTIVE
    finished: bool = False
    failed: str | None = None
    """Why the job cannot go on (quorum lost for too long); None while it can."""
    first_wait: float | None = None
    broken_at: float | None = None
    below_quorum_since: float | None = None
    min_generation: int = 0
    """The highest generation any member has seen (it may come from a checkpoint written under an
    earlier coordinator): new generations are numbered above it, so numbers never repeat."""
    history: list[Generation] = field(default_factory=list)

    # -- member requests ---------------------------------------------------------------------

    def join(self, member_id: str, node: str, pid: int | None, step: int, now: float, warm: bool = True) -> bool:
        if self.first_wait is None:
            self.first_wait = now
        member = self.members.get(member_id)
        if member is None:
            self.members[member_id] = Member(
                member_id, node, joined_at=now, last_heartbeat=now, pid=pid, step=step, waiting_since=now, warm=warm
            )
            return True
        member.warm = warm
        if member.state is MemberState.WAITING:
            member.last_heartbeat = now
            return False
        member.state = MemberState.WAITING
        member.fenced = False
        member.waiting_since = now
        member.last_heartbeat = now
        member.step = step
        member.death_reason = None
        return True

    def heartbeat(
        self,
        member_id: str,
        step: int | None,
        now: float,
        blocked_on: str | None = None,
        progress: int | None = None,
        busy: str | None = None,
        warm: bool | None = None,
    ) -> Member | None:
        member = self.members.get(member_id)
        if member is None:
            return None
        if member.state in (MemberState.WAITING, MemberState.ACTIVE):
            member.last_heartbeat = now
            if step is not None:
                member.step = max(member.step, step)
            if blocked_on != member.blocked_on:
                member.blocked_on = blocked_on
                member.blocked_since = now if blocked_on else None
            if progress is not None and progress != member.progress:
                member.progress = progress
                member.progress_at = now
            member.busy = busy
            if warm is not None:
                member.warm = warm
        return member

    def report_failure(self, member_id: str, generation: int, now: float) -> bool:
        """A member saw a collective of ``generation`` fail: that generation is over."""
        if self.current is None or generation != self.current.number:
            return False
        if self.generation_state is GenerationState.BROKEN:
            return False
        self._break(now)
        return True

    def mark_dead(self, member_id: str, reason: str, now: float) -> bool:
        member = self.members.get(member_id)
        if member is None:
            # Died before it ever joined: remember it so that a late join is not mistaken for life.
            self.members[member_id] = Member(
                member_id, "", joined_at=now, last_heartbeat=now, state=MemberState.DEAD, death_reason=reason
            )
            return False
        if member.state in (MemberState.DEAD, MemberState.LEFT):
            return False
        member.state = MemberState.DEAD
        member.death_reason = reason
        if self.current is not None and member_id in self.current.members:
            self._break(now)
        return True

    def leave(self, member_id: str, finished: bool, step: int, now: float) -> bool:
        member = self.members.get(member_id)
        changed = False
        if member is not None and member.state is not MemberState.LEFT:
            was_live = member.state in (MemberState.WAITING, MemberState.ACTIVE)
            member.state = MemberState.LEFT
            member.step = max(member.step, step)
            changed = True
            in_current = self.current is not None and member_id in self.current.members
            if was_live and in_current and not finished:
                self._break(now)
        if finished and not self.finished:
            self.finished = True
            changed = True
        return changed

    # -- time and decisions --------------------------------------------------------------------

    def _break(self, now: float) -> None:
        if self.generation_state is not GenerationState.BROKEN:
            self.generation_state = GenerationState.BROKEN
            self.broken_at = now

    def expire(self, now: float) -> list[str]:
        """Declare dead every live member that is silent or makes no progress; check the quorum.

        Silent: no heartbeat for ``heartbeat_timeout``. No progress: its progress counter has not
        moved for ``progress_timeout`` (``warmup_timeout`` before its first commit) while a peer of
        the current generation waited for it inside a collective (and it was not in one itself),
        or since its generation broke and it has still not come to join.
        """
        dead = []
        for member in self.members.values():
            if member.state in (MemberState.WAITING, MemberState.ACTIVE):
                silent = now - member.last_heartbeat
                if silent > self.settings.heartbeat_timeout:
                    self.mark_dead(member.id, f"no heartbeat for {silent:.1f} s", now)
                    dead.append(member.id)
        dead += self._expire_stragglers(now)
        self._check_quorum(now)
        return dead

    def _stuck_for(self, member: Member, since: float, now: float) -> float | None:
        """Seconds that ``member`` has made no progress since ``since``, if that is beyond its
        limit; None if it is within its limit or busy on purpose."""
        if member.busy:
            return None
        limit = self.settings.progress_timeout if member.warm else self.settings.warmup_timeout
        idle = now - max(member.progress_at, since)
        return idle if idle > limit else None

    def _expire_stragglers(self, now: float) -> list[str]:
        """Fence the active members of the current generation that make no progress while others
        wait for them: inside a collective, to join the next generation, or after it broke.

        Progress, not silence, decides: a member whose counter moved within its limit is busy in
        a long step, never stuck, whatever the state of its generation."""
        if self.current is None:
            return []
        limit = self.settings.progress_timeout
        active = [self.members[m] for m in self.current.members if self.members[m].state is MemberState.ACTIVE]
        if self.generation_state is GenerationState.BROKEN:
            since = self.broken_at if self.broken_at is not None else now
            candidates = active
            why = "made no progress for {idle:.1f} s after its generation broke"
        else:
            members = [self.members[m] for m in self.current.members]
            waited = [now - m.blocked_since for m in active if m.blocked_since is not None]
            # Members that left this generation to join the next wait for the rest just the same.
            waited += [now - m.waiting_since for m in members if m.state is MemberState.WAITING and m.waiting_since is not None]
            if not waited or max(waited) <= limit:
                return []
            since = self.current.formed_at
            candidates = [m for m in active if m.blocked_since is None]
            why = "made no progress for {idle:.1f} s while a peer waited for it"
        dead = []
        for member in candidates:
            idle = self._stuck_for(member, since, now)
            if idle is None:
                continue
            self.mark_dead(member.id, why.format(idle=idle), now)
            member.fenced = True
            dead.append(member.id)
        return dead

    def _check_quorum(self, now: float) -> None:
        if self.finished or self.failed or self.first_wait is None:
            return
        live = self.live_count()
        if live >= self.settings.min_members:
            self.below_quorum_since = None
            return
        if self.below_quorum_since is None:
            # Before the first generation the members get start_grace to arrive first.
            self.below_quorum_since = now if self.current is not None else self.first_wait + self.settings.start_grace
        if now - self.below_quorum_since > self.settings.quorum_timeout:
            self.failed = (
                f"only {live} live member(s), below the minimum of {self.settings.min_members},"
                f" for more than quorum_timeout={self.settings.quorum_timeout:.0f} s"
            )

    def maybe_form(self, now: float) -> tuple[Generation | None, Decision]:
        if self.finished:
            return None, Decision(False, reason="job finished")
        if self.failed:
            return None, Decision(False, reason=self.failed)
        decision = decide(self.members, self.current, self.settings, self.first_wait, now)
        if not decision.form:
            return None, decision
        number = max((self.current.number + 1) if self.current is not None else 1, self.min_generation + 1)
        generation = Generation(number, decision.members, formed_at=now)
        for member_id in decision.members:
            member = self.members[member_id]
            member.state = MemberState.ACTIVE
            member.waiting_since = None
            member.blocked_on = member.blocked_since = None
            member.progress_at = now
        self.current = generation
        self.generation_state = GenerationState.ACTIVE
        self.broken_at = None
        self.history.append(generation)
        return generation, decision

    # -- views ---------------------------------------------------------------------------------

    def reconfigure_wanted(self) -> bool:
        """True when members of the current generation should come to join a new one."""
        if self.generation_state is GenerationState.BROKEN:
            return True
        full = (
            self.current is not None
            and self.settings.max_members is not None
            and len(self.current.members) >= self.settings.max_members
        )
        return not full and any(m.state is MemberState.WAITING for m in self.members.values())

    def live_count(self) -> int:
        return sum(m.state in (MemberState.WAITING, MemberState.ACTIVE) for m in self.members.values())

    def committed_step(self) -> int:
        return max((m.step for m in self.members.values()), default=0)

    def view_for(self, member_id: str) -> dict[str, Any]:
        """What a member learns from a heartbeat reply."""
        member = self.members.get(member_id)
        return {
            "generation": self.current.number if self.current else 0,
            "broken": self.generation_state is GenerationState.BROKEN,
            "reconfigure": self.reconfigure_wanted(),
            "state": member.state.value if member else "unknown",
            "reason": member.death_reason if member else None,
            "fence": member.fenced if member else False,
            "finished": self.finished,
            "failed": self.failed,
        }
