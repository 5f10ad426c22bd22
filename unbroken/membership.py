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

Costs, for jobs of thousands of members (docs/guide/scale.md): a heartbeat, a join, a verdict and
every view are O(1): the counts of members per state are kept as states change, never recounted;
heartbeat deadlines are a heap with one entry per live member, re-armed lazily when it comes due
(O(log N) per member per ``heartbeat_timeout``); the progress watchdog scans a generation only
once someone has waited longer than ``progress_timeout``. Forming a generation is O(N). Members
that died or left, and old generations, are forgotten after ``forget_after`` seconds and beyond
``history_limit`` generations.

Member lifecycle::

    (new) --join--> WAITING --generation formed--> ACTIVE --join--> WAITING ...
    WAITING/ACTIVE --exit reported / heartbeat timeout--> DEAD
    WAITING/ACTIVE --leave--> LEFT
    DEAD --join (a member that woke up)--> WAITING   (it must be healed: it is behind)
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

_LIVE = frozenset(("waiting", "active"))


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
    ended_at: float | None = None
    """When (coordinator clock) it died or left: it is forgotten ``forget_after`` seconds later."""


@dataclass(frozen=True)
class Generation:
    number: int
    members: tuple[str, ...]
    formed_at: float

    @cached_property
    def ranks(self) -> dict[str, int]:
        """Member id -> rank, built once: membership tests and ranks in O(1), not O(N)."""
        return {member: rank for rank, member in enumerate(self.members)}

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
    newcomers = sorted((m for m in waiting if m.id not in before), key=lambda m: (m.joined_at, m.id))
    order += [m.id for m in newcomers]
    if settings.max_members is not None:
        order = order[: settings.max_members]
    return Decision(True, tuple(order), reason=f"{len(order)} member(s) ready")


@dataclass
class Membership:
    """The coordinator's state. Every mutating method returns True when the state changed.

    Member states change only through this class (:meth:`_enter`), which keeps the counts per
    state, the heartbeat deadline heap and :attr:`changed_members` in step with them."""

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
    """The newest generations (at most ``settings.history_limit``), oldest first."""
    changed_members: set[str] = field(default_factory=set)
    """Members whose own view (state, reason, fence) changed since the coordinator last took this
    set: only their long polls need waking, unless the view shared by all changed."""
    version: int = 0
    """Counts changes of the state; a view computed at one version holds until it moves."""

    def __post_init__(self) -> None:
        self._counts: dict[MemberState, int] = {state: 0 for state in MemberState}
        self._deadlines: list[tuple[float, str]] = []
        """Heap of (heartbeat deadline, member): one entry per live member, re-armed when due."""
        self._armed: dict[str, float] = {}
        """The deadline of each member's one valid heap entry (others are stale and dropped)."""
        self._waits: list[tuple[float, str, str]] = []
        """Heap of (since, member, "blocked"|"waiting"): the longest wait of a current member."""
        self._ended: deque[tuple[float, str]] = deque()
        """(ended_at, member) of members that died or left, oldest first: pruned in order."""
        self._max_step = 0
        for member in self.members.values():
            self._counts[member.state] += 1
            self._max_step = max(self._max_step, member.step)
            if member.state.value in _LIVE:
                self._arm(member)

    # -- bookkeeping ---------------------------------------------------------------------------

    def _enter(self, member: Member, state: MemberState, now: float) -> None:
        """Move ``member`` to ``state``, keeping every count and index in step."""
        was_live = member.state.value in _LIVE
        self._counts[member.state] -= 1
        self._counts[state] += 1
        member.state = state
        self.changed_members.add(member.id)
        self.version += 1
        if state.value in _LIVE:
            member.ended_at = None
            if not was_live:
                self._arm(member)
        else:
            member.ended_at = now
            self._ended.append((now, member.id))

    def _add(self, member: Member) -> None:
        self.members[member.id] = member
        self._counts[member.state] += 1
        self.changed_members.add(member.id)
        self.version += 1
        if member.state.value in _LIVE:
            self._arm(member)
        else:
            self._ended.append((member.ended_at or 0.0, member.id))

    def _arm(self, member: Member, floor: float = float("-inf")) -> None:
        # floor: never re-arm at or before the time just checked (rounding could loop forever)
        deadline = max(member.last_heartbeat + self.settings.heartbeat_timeout, floor)
        self._armed[member.id] = deadline
        heapq.heappush(self._deadlines, (deadline, member.id))

    def _note_wait(self, since: float, member_id: str, kind: str) -> None:
        heapq.heappush(self._waits, (since, member_id, kind))
        if len(self._waits) > 4 * len(self.members) + 64:
            # stale entries under a long-lived valid one: rebuild from the valid ones (amortized O(1))
            self._waits = [w for w in self._waits if self._wait_valid(*w)]
            heapq.heapify(self._waits)

    def _wait_valid(self, since: float, member_id: str, kind: str) -> bool:
        if self.current is None or member_id not in self.current.ranks:
            return False
        member = self.members.get(member_id)
        if member is None:
            return False
        if kind == "blocked":
            return member.state is MemberState.ACTIVE and member.blocked_since == since
        return member.state is MemberState.WAITING and member.waiting_since == since

    def _longest_wait_since(self) -> float | None:
        """Since when the longest-waiting member of the current generation waits (in a collective,
        or to join the next one), or None if none waits. Amortized O(log N)."""
        while self._waits and not self._wait_valid(*self._waits[0]):
            heapq.heappop(self._waits)
        return self._waits[0][0] if self._waits else None

    def count(self, state: MemberState) -> int:
        """How many members are in ``state``. O(1)."""
        return self._counts[state]

    # -- member requests ---------------------------------------------------------------------

    def join(self, member_id: str, node: str, pid: int | None, step: int, now: float, warm: bool = True) -> bool:
        if self.first_wait is None:
            self.first_wait = now
        self._max_step = max(self._max_step, step)
        member = self.members.get(member_id)
        if member is None:
            self._add(Member(member_id, node, joined_at=now, last_heartbeat=now, pid=pid, step=step, waiting_since=now, warm=warm))
            self._note_wait(now, member_id, "waiting")
            return True
        member.warm = warm
        if member.state is MemberState.WAITING:
            member.last_heartbeat = now
            return False
        member.fenced = False
        member.waiting_since = now
        member.last_heartbeat = now
        member.step = step
        member.death_reason = None
        self._enter(member, MemberState.WAITING, now)
        self._note_wait(now, member_id, "waiting")
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
                self._max_step = max(self._max_step, step)
            if blocked_on != member.blocked_on:
                member.blocked_on = blocked_on
                member.blocked_since = now if blocked_on else None
                if blocked_on:
                    self._note_wait(now, member_id, "blocked")
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
            self._add(
                Member(
                    member_id, "", joined_at=now, last_heartbeat=now, state=MemberState.DEAD, death_reason=reason, ended_at=now
                )
            )
            return False
        if member.state in (MemberState.DEAD, MemberState.LEFT):
            return False
        member.death_reason = reason
        self._enter(member, MemberState.DEAD, now)
        if self.current is not None and member_id in self.current.ranks:
            self._break(now)
        return True

    def leave(self, member_id: str, finished: bool, step: int, now: float) -> bool:
        member = self.members.get(member_id)
        changed = False
        if member is not None and member.state is not MemberState.LEFT:
            was_live = member.state in (MemberState.WAITING, MemberState.ACTIVE)
            member.step = max(member.step, step)
            self._max_step = max(self._max_step, step)
            self._enter(member, MemberState.LEFT, now)
            changed = True
            in_current = self.current is not None and member_id in self.current.ranks
            if was_live and in_current and not finished:
                self._break(now)
        if finished and not self.finished:
            self.finished = True
            self.version += 1
            changed = True
        return changed

    # -- time and decisions --------------------------------------------------------------------

    def _break(self, now: float) -> None:
        if self.generation_state is not GenerationState.BROKEN:
            self.generation_state = GenerationState.BROKEN
            self.broken_at = now
            self.version += 1

    def expire(self, now: float) -> list[str]:
        """Declare dead every live member that is silent or makes no progress; check the quorum;
        forget members gone for longer than ``forget_after``.

        Silent: no heartbeat for ``heartbeat_timeout``. No progress: its progress counter has not
        moved for ``progress_timeout`` (``warmup_timeout`` before its first commit) while a peer of
        the current generation waited for it inside a collective (and it was not in one itself),
        or since its generation broke and it has still not come to join.

        Cost: O(log N) per deadline that came due, not O(N) per call.
        """
        dead = []
        timeout = self.settings.heartbeat_timeout
        heap = self._deadlines
        while heap and heap[0][0] < now:
            deadline, member_id = heapq.heappop(heap)
            if self._armed.get(member_id) != deadline:
                continue  # a stale entry: the member's valid one is elsewhere in the heap
            member = self.members.get(member_id)
            if member is None or member.state.value not in _LIVE:
                del self._armed[member_id]
                continue
            silent = now - member.last_heartbeat
            if silent > timeout:
                del self._armed[member_id]
                self.mark_dead(member.id, f"no heartbeat for {silent:.1f} s", now)
                dead.append(member.id)
            else:
                self._arm(member, floor=now)  # it heartbeat since: due a timeout after its newest one
        dead += self._expire_stragglers(now)
        self._check_quorum(now)
        self._forget(now)
        return dead

    def _forget(self, now: float) -> None:
        """Forget members that died or left more than ``forget_after`` ago (oldest first), unless
        the current generation names them."""
        ended = self._ended
        horizon = now - self.settings.forget_after
        while ended and ended[0][0] < horizon:
            at, member_id = ended.popleft()
            member = self.members.get(member_id)
            if member is None or member.state.value in _LIVE or member.ended_at != at:
                continue  # it came back (or was forgotten) since
            if self.current is not None and member_id in self.current.ranks:
                member.ended_at = now  # still named by the generation: look again later
                ended.append((now, member_id))
                continue
            del self.members[member_id]
            self._counts[member.state] -= 1
            self._armed.pop(member_id, None)
            self.changed_members.discard(member_id)

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
        a long step, never stuck, whatever the state of its generation.

        O(1) (amortized) unless someone has waited longer than ``progress_timeout``: nobody can be
        stuck for longer than the wait that makes them a straggler."""
        if self.current is None:
            return []
        limit = self.settings.progress_timeout
        if self.generation_state is GenerationState.BROKEN:
            since = self.broken_at if self.broken_at is not None else now
            if now - since <= limit:
                return []
            candidates = [self.members[m] for m in self.current.members if self.members[m].state is MemberState.ACTIVE]
            why = "made no progress for {idle:.1f} s after its generation broke"
        else:
            # Members that left this generation to join the next wait for the rest just the same.
            longest = self._longest_wait_since()
            if longest is None or now - longest <= limit or now - self.current.formed_at <= limit:
                return []
            since = self.current.formed_at
            candidates = [
                m
                for m in (self.members[i] for i in self.current.members)
                if m.state is MemberState.ACTIVE and m.blocked_since is None
            ]
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
            self.version += 1

    def _cannot_form(self, now: float) -> Decision | None:
        """The reason :func:`decide` would give for not forming, from the counts alone (O(1));
        None when it might form (then :func:`decide` runs, O(N), once per formation)."""
        waiting = self._counts[MemberState.WAITING]
        if not waiting:
            return Decision(False, reason="nobody waits to join")
        busy = self._counts[MemberState.ACTIVE]
        if busy:
            return Decision(False, reason=f"waiting for {busy} active member(s) to reach a step boundary")
        if self.current is None and waiting < self.settings.expected_members:
            if self.first_wait is None or now - self.first_wait < self.settings.start_grace:
                return Decision(False, reason=f"first generation: {waiting} of {self.settings.expected_members} expected members")
        if waiting < self.settings.min_members:
            return Decision(False, reason=f"{waiting} member(s) waiting, minimum is {self.settings.min_members}")
        return None

    def maybe_form(self, now: float) -> tuple[Generation | None, Decision]:
        if self.finished:
            return None, Decision(False, reason="job finished")
        if self.failed:
            return None, Decision(False, reason=self.failed)
        early = self._cannot_form(now)
        if early is not None:
            return None, early
        decision = decide(self.members, self.current, self.settings, self.first_wait, now)
        if not decision.form:
            return None, decision
        number = max((self.current.number + 1) if self.current is not None else 1, self.min_generation + 1)
        generation = Generation(number, decision.members, formed_at=now)
        for member_id in decision.members:
            member = self.members[member_id]
            member.waiting_since = None
            member.blocked_on = member.blocked_since = None
            member.progress_at = now
            self._enter(member, MemberState.ACTIVE, now)
        self.current = generation
        self.generation_state = GenerationState.ACTIVE
        self.broken_at = None
        self._waits = []
        self.history.append(generation)
        if len(self.history) > self.settings.history_limit:
            del self.history[: -self.settings.history_limit]
        self.version += 1
        return generation, decision

    # -- views ---------------------------------------------------------------------------------

    def reconfigure_wanted(self) -> bool:
        """True when members of the current generation should come to join a new one. O(1)."""
        if self.generation_state is GenerationState.BROKEN:
            return True
        full = (
            self.current is not None
            and self.settings.max_members is not None
            and len(self.current.members) >= self.settings.max_members
        )
        return not full and self._counts[MemberState.WAITING] > 0

    def live_count(self) -> int:
        return self._counts[MemberState.WAITING] + self._counts[MemberState.ACTIVE]

    def committed_step(self) -> int:
        """The highest step any member has reported (kept as reports arrive, O(1))."""
        return self._max_step

    def shared_view(self) -> tuple[Any, ...]:
        """The part of every member's view that is the same for all of them: when it changes,
        every long poll must answer; otherwise only those of :attr:`changed_members`."""
        return (
            self.current.number if self.current else 0,
            self.generation_state is GenerationState.BROKEN,
            self.reconfigure_wanted(),
            self.finished,
            self.failed,
        )

    def view_for(self, member_id: str) -> dict[str, Any]:
        """What a member learns from a heartbeat reply. O(1)."""
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
