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

    heartbeat_timeout: float = 5.0
    """Seconds without a heartbeat after which a member is declared dead."""
    expected_members: int = 1
    """Members the first generation waits for (the launcher passes nodes x processes)."""
    start_grace: float = 30.0
    """Seconds the first generation waits for ``expected_members`` before starting with fewer."""
    min_members: int = 1
    """No generation is formed with fewer members than this."""


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
        waited = now - (first_wait if first_wait is not None else now)
        if waited < settings.start_grace:
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
    return Decision(True, tuple(order), reason=f"{len(order)} member(s) ready")


@dataclass
class Membership:
    """The coordinator's state. Every mutating method returns True when the state changed."""

    settings: MembershipSettings
    members: dict[str, Member] = field(default_factory=dict)
    current: Generation | None = None
    generation_state: GenerationState = GenerationState.ACTIVE
    finished: bool = False
    first_wait: float | None = None
    history: list[Generation] = field(default_factory=list)

    # -- member requests ---------------------------------------------------------------------

    def join(self, member_id: str, node: str, pid: int | None, step: int, now: float) -> bool:
        if self.first_wait is None:
            self.first_wait = now
        member = self.members.get(member_id)
        if member is None:
            self.members[member_id] = Member(member_id, node, joined_at=now, last_heartbeat=now, pid=pid, step=step, waiting_since=now)
            return True
        if member.state is MemberState.WAITING:
            member.last_heartbeat = now
            return False
        member.state = MemberState.WAITING
        member.waiting_since = now
        member.last_heartbeat = now
        member.step = step
        member.death_reason = None
        return True

    def heartbeat(self, member_id: str, step: int | None, now: float) -> Member | None:
        member = self.members.get(member_id)
        if member is None:
            return None
        if member.state in (MemberState.WAITING, MemberState.ACTIVE):
            member.last_heartbeat = now
            if step is not None:
                member.step = max(member.step, step)
        return member

    def report_failure(self, member_id: str, generation: int, now: float) -> bool:
        """A member saw a collective of ``generation`` fail: that generation is over."""
        if self.current is None or generation != self.current.number:
            return False
        if self.generation_state is GenerationState.BROKEN:
            return False
        self.generation_state = GenerationState.BROKEN
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
            self.generation_state = GenerationState.BROKEN
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
                self.generation_state = GenerationState.BROKEN
        if finished and not self.finished:
            self.finished = True
            changed = True
        return changed

    # -- time and decisions --------------------------------------------------------------------

    def expire(self, now: float) -> list[str]:
        """Declare dead every live member silent for longer than the heartbeat timeout."""
        dead = []
        for member in self.members.values():
            if member.state in (MemberState.WAITING, MemberState.ACTIVE):
                silent = now - member.last_heartbeat
                if silent > self.settings.heartbeat_timeout:
                    self.mark_dead(member.id, f"no heartbeat for {silent:.1f} s", now)
                    dead.append(member.id)
        return dead

    def maybe_form(self, now: float) -> tuple[Generation | None, Decision]:
        if self.finished:
            return None, Decision(False, reason="job finished")
        decision = decide(self.members, self.current, self.settings, self.first_wait, now)
        if not decision.form:
            return None, decision
        number = (self.current.number + 1) if self.current is not None else 1
        generation = Generation(number, decision.members, formed_at=now)
        for member_id in decision.members:
            member = self.members[member_id]
            member.state = MemberState.ACTIVE
            member.waiting_since = None
        self.current = generation
        self.generation_state = GenerationState.ACTIVE
        self.history.append(generation)
        return generation, decision

    # -- views ---------------------------------------------------------------------------------

    def reconfigure_wanted(self) -> bool:
        """True when members of the current generation should come to join a new one."""
        if self.generation_state is GenerationState.BROKEN:
            return True
        return any(m.state is MemberState.WAITING for m in self.members.values())

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
            "finished": self.finished,
        }
