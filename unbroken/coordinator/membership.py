"""Membership: who is alive, which generation is current, and when to form the next one.

A generation is a numbered, ordered set of members that trains together over one process group
(built under the generation's own store prefix). The coordinator forms a new generation when the
set of members must change: a member died (its launcher reported the exit, a peer reported a
broken collective, or its heartbeats stopped) or a new member asked to join.

The rule that keeps the protocol simple: a generation is formed only when *every* live member is
waiting to join one. Members of a healthy generation learn that someone waits through the
``reconfigure`` flag of their heartbeat replies, finish the current step together and come to join;
after a failure they come at once. So every member of a new generation left its previous one at the
same step boundary, or that generation broke. One exception (``Membership.take_survivors``): after
a verdict broke the current generation (a member of it declared dead, or leaving unfinished), if
every ACTIVE member reports waiting in one of its collectives, the coordinator moves them all to
WAITING itself and forms the next generation at once; they hear of it in their heartbeat reply and
need not join (not with replicated coordinators, whose members hear only of durable generations).
That generation broke too, and healing reconciles whatever some of them committed of the step.

Everything here is plain state and pure decisions, driven by an explicit ``now`` (the
coordinator's ``time.monotonic()``); the coordinator does the I/O.

The members' requests as state changes (join, heartbeat, failure, verdict, leave) are
:mod:`unbroken.coordinator.member_requests`'s, and expiry and the watchdog
:mod:`unbroken.coordinator.liveness`'s: mixins of :class:`Membership`, on its state.

Costs, for jobs of thousands of members (docs/guide/scale.md): a heartbeat, a join, a verdict and
every view are O(1): the counts of members per state are kept as states change, never recounted;
heartbeat deadlines are a heap with one entry per live member, re-armed lazily when it comes due
(O(log N) per member per ``heartbeat_timeout``); the progress watchdog scans a generation only
once someone has waited longer than ``progress_timeout``. Forming a generation is O(N). Members
that died or left, and old generations, are forgotten after ``forget_after`` seconds and beyond
``history_limit`` generations.

Member lifecycle::

    (new) --join--> WAITING --generation formed--> ACTIVE --join--> WAITING ...
    ACTIVE --taken after a verdict (every survivor waits in a collective)--> WAITING
    WAITING/ACTIVE --exit reported / heartbeat timeout--> DEAD
    WAITING/ACTIVE --leave--> LEFT
    DEAD --join (a member that woke up)--> WAITING   (it must be healed: it is behind)
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from unbroken.coordinator.liveness import Liveness
from unbroken.coordinator.catch_ups import CatchUps
from unbroken.coordinator.job_requests import JobRequests
from unbroken.coordinator.member_requests import MemberRequests
from unbroken.store_keys import key_tag
from unbroken.coordinator.member_records import (  # noqa: F401  (re-exported: the records and the rule live there)
    _LIVE,
    Decision,
    Generation,
    GenerationState,
    Member,
    MembershipSettings,
    MemberState,
    _counts_blocked,
    decide,
)


@dataclass
class Membership(Liveness, MemberRequests, JobRequests, CatchUps):
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
    store_token: str | None = None
    """The job's token: generations' store prefixes are derived from it (None: guessable ones)."""
    holder_step: int = 0
    """The job's committed step as a new leader read it from etcd (the step the last durable
    generation started from): its first generation waits, until ``holder_deadline``, for a
    member that holds at least that step, so that it never trains from behind while a member that
    holds the job's state is on its way back. 0: no such wait."""
    holder_deadline: float | None = None
    """Not before (coordinator clock) may the first generation form from behind ``holder_step``:
    a full heartbeat timeout after the leader took over (or ``rejoin_grace``, if longer)."""
    holder_members: frozenset[str] = frozenset()
    """The members of the last durable generation, as a new leader read them from etcd: its first
    generation forms from behind only once every one of them is known dead by this leader's own
    liveness view (:meth:`holders_gone`), never while one may still bring the job's state."""
    holder_heard: dict[str, float] = field(default_factory=dict)
    """When (coordinator clock) each of :attr:`holder_members` last heartbeated this leader
    before joining it (it may be blocked in a collective of its old generation meanwhile)."""
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
    stop_request: dict | None = None
    """A member's ``job.stop(reason)``, durable here once its call returned: ``{"step", "reason"}``
    (the earliest asked for). Every generation formed from then on carries it
    (:attr:`Generation.stop`), so that the stop outlives the member that asked for it."""
    catch_up_off: str | None = None
    """Why newcomers no longer catch up from a donor (a replay once failed to verify: the job's
    loop changes state outside the optimizer's and scheduler's steps); None while they may.
    From then on every newcomer waits as any joiner does, and is healed."""
    preformed: frozenset[str] = frozenset()
    """Members of the current generation that were formed into it without joining it (see
    :meth:`take_survivors`): they learn of it from their heartbeat reply, at once."""

    def __post_init__(self) -> None:
        self._counts: dict[MemberState, int] = {state: 0 for state in MemberState}
        self._deadlines: list[tuple[float, str]] = []
        """Heap of (heartbeat deadline, member): one entry per live member, re-armed when due."""
        self._armed: dict[str, float] = {}
        self._busy: dict[str, float] = {}
        """Members whose busy mark is on -> since when: the few that :meth:`expire` checks against
        ``busy_timeout``."""
        """The deadline of each member's one valid heap entry (others are stale and dropped)."""
        self._waits: list[tuple[float, str, str]] = []
        """Heap of (since, member, "blocked"|"waiting"): the longest wait of a current member."""
        self._ended: deque[tuple[float, str]] = deque()
        """(ended_at, member) of members that died or left, oldest first: pruned in order."""
        self._max_step = 0
        self._blocked_active = 0
        """How many ACTIVE members report waiting in a collective (kept as states change, O(1))."""
        self._verdict_pending = False
        """A verdict broke the current generation and its survivors have not been taken yet."""
        self._taken: set[str] = set()
        """Survivors taken as waiting by :meth:`take_survivors`, until the next formation."""
        self._catching: dict[str, str] = {}
        """Waiting members that catch up instead of being healed -> their donor ("" if none)."""
        self._donating: dict[str, str] = {}
        """Donor -> the member it streams its state to (the inverse of :attr:`_catching`)."""
        for member in self.members.values():
            self._counts[member.state] += 1
            self._blocked_active += _counts_blocked(member)
            self._max_step = max(self._max_step, member.step)
            if member.state._value_ in _LIVE:
                self._arm(member)

    # -- bookkeeping ---------------------------------------------------------------------------

    def _enter(self, member: Member, state: MemberState, now: float) -> None:
        """Move ``member`` to ``state``, keeping every count and index in step."""
        was_live = member.state._value_ in _LIVE
        self._blocked_active -= _counts_blocked(member)
        self._counts[member.state] -= 1
        self._counts[state] += 1
        member.state = state
        self._blocked_active += _counts_blocked(member)
        self.changed_members.add(member.id)
        self.version += 1
        if state._value_ in _LIVE:
            member.ended_at = None
            if not was_live:
                self._arm(member)
        else:
            member.ended_at = now
            self._ended.append((now, member.id))

    def _add(self, member: Member) -> None:
        self.members[member.id] = member
        self._counts[member.state] += 1
        self._blocked_active += _counts_blocked(member)
        self.changed_members.add(member.id)
        self.version += 1
        if member.state._value_ in _LIVE:
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

    # -- time and decisions --------------------------------------------------------------------

    def _break(self, now: float) -> None:
        if self.generation_state is not GenerationState.BROKEN:
            self.generation_state = GenerationState.BROKEN
            self.broken_at = now
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
        if self.current is None and self.holder_step > 0 and not self.holders_gone(now):
            # O(N), only before a new leader's first generation
            best = max((m.step for m in self.members.values() if m.state is MemberState.WAITING), default=0)
            if best < self.holder_step:
                return Decision(False, reason=f"first generation under a new leader: waiting for a member at step"
                                               f" {self.holder_step} or later (the waiting reach {best})")
        return None

    def take_survivors(self, now: float) -> bool:
        """Take the survivors of a generation that a verdict broke as waiting to join the next one,
        when every one of them reports waiting in one of its collectives; True if it took them.

        A data-parallel job that loses a member finds its survivors waiting for it in the step's
        allreduce: they are at no step boundary, but that collective can only fail now (or has
        completed everywhere), and whatever they commit of it, healing reconciles. Forming the next
        generation with them at once, instead of after each has abandoned the broken one and sent
        a join, halves the requests of a re-formation (thousands of members re-forming at once);
        they learn of it from their heartbeat reply. A survivor that computes (a long step) is at
        no collective: then nobody is taken, and all come to join as usual. O(1) but once per
        verdict, when it looks at the generation (O(generation))."""
        current = self.current
        if (
            not self._verdict_pending
            or current is None
            or self.generation_state is not GenerationState.BROKEN
            or self.finished
            or self.failed
        ):
            return False
        active = self._counts[MemberState.ACTIVE]
        if active == 0 or self._blocked_active < active:
            return False
        self._verdict_pending = False
        for member_id in current.members:
            member = self.members.get(member_id)
            if member is None or member.state is not MemberState.ACTIVE or member.fenced:
                continue
            member.waiting_since = now
            self._enter(member, MemberState.WAITING, now)
            self._note_wait(now, member_id, "waiting")
            self._taken.add(member_id)
        return True

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
        generation = Generation(number, decision.members, formed_at=now, tag=key_tag(self.store_token, f"gen{number}"),
                                stop=self.stop_request)
        for member_id in decision.members:
            member = self.members[member_id]
            member.waiting_since = None
            member.blocked_on = member.blocked_since = None
            member.progress_at = now
            self._enter(member, MemberState.ACTIVE, now)
        self.preformed = frozenset(self._taken.intersection(decision.members))
        self._taken = set()
        for member_id in list(self._catching):  # a formation ends every catch-up (streams end with it)
            if member_id in self.members:
                self._catch_up(self.members[member_id], None)
            else:
                self._catching.pop(member_id, None)
        self._donating.clear()
        self._verdict_pending = False
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
        return not full and self._counts[MemberState.WAITING] - (self.catching_up() if self._catching else 0) > 0

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
        current = self.current
        return {
            "generation": current.number if current else 0,
            # where this member stands in the current generation: a member formed into it
            # without joining (:meth:`take_survivors`) builds its group from these
            "rank": current.ranks.get(member_id) if current else None,
            "size": len(current.members) if current else 0,
            "prefix": current.prefix if current else None,
            **({"stop": current.stop} if current is not None and current.stop else {}),
            "broken": self.generation_state is GenerationState.BROKEN,
            "reconfigure": self.reconfigure_wanted(),
            "state": member.state.value if member else "unknown",
            "reason": member.death_reason if member else None,
            "fence": member.fenced if member else False,
            **self._donation_view(member_id),
            "finished": self.finished,
            "failed": self.failed,
        }
