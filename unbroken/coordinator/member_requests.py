"""The members' requests as state changes, for :class:`~unbroken.coordinator.membership.Membership`:
a join, a heartbeat (liveness, the collective waited in, progress, busy work, pace), a reported
failure of a collective, a verdict (:meth:`MemberRequests.mark_dead`) and a leave. A mixin: the
state it reads and changes is Membership's, through its bookkeeping (``_enter``, ``_add``,
``_note_wait``), which keeps the counts and indices in step; the decisions (forming a generation,
the views) stay in :mod:`unbroken.coordinator.membership`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from unbroken.coordinator.member_records import GenerationState, Member, MemberState, _counts_blocked

if TYPE_CHECKING:
    from unbroken.coordinator.member_records import Generation


class MemberRequests:
    """The state changes of :meth:`join`, :meth:`touch`, :meth:`heartbeat`, :meth:`report_failure`,
    :meth:`mark_dead` and :meth:`leave`; each returns True when the state changed (a heartbeat:
    the member, or None if unknown)."""

    members: dict[str, Member]
    current: Generation | None
    generation_state: GenerationState
    finished: bool
    version: int
    first_wait: float | None
    holder_members: frozenset[str]
    holder_heard: dict[str, float]
    _max_step: int
    _blocked_active: int
    _busy: dict[str, float]
    _taken: set[str]
    _verdict_pending: bool
    _add: Callable[[Member], None]
    _enter: Callable[[Member, MemberState, float], None]
    _note_wait: Callable[[float, str, str], None]
    _catch_up: Callable[[Member, str | None], bool]
    _break: Callable[[float], None]

    def join(self, member_id: str, node: str, pid: int | None, step: int, now: float, warm: bool = True,
             catch_up: str | None = None) -> bool:
        if self.first_wait is None:
            self.first_wait = now
        self._max_step = max(self._max_step, step)
        member = self.members.get(member_id)
        if member is None:
            self._add(Member(member_id, node, joined_at=now, last_heartbeat=now, pid=pid, step=step, waiting_since=now, warm=warm))
            self._note_wait(now, member_id, "waiting")
            self._catch_up(self.members[member_id], catch_up)
            return True
        member.warm = warm
        self._taken.discard(member_id)
        if member.state is MemberState.WAITING:
            member.last_heartbeat = now
            return self._catch_up(member, catch_up)
        member.fenced = False
        member.waiting_since = now
        member.last_heartbeat = now
        member.step = step
        member.death_reason = None
        self._enter(member, MemberState.WAITING, now)
        self._note_wait(now, member_id, "waiting")
        return True

    def touch(self, member_id: str, now: float) -> None:
        """The member was heard from (a join that changed nothing, a held join that ended): it
        lives. Its joins take the place of its heartbeats while it joins (they share its line)."""
        member = self.members.get(member_id)
        if member is not None and member.state in (MemberState.WAITING, MemberState.ACTIVE):
            member.last_heartbeat = max(member.last_heartbeat, now)

    def heartbeat(
        self,
        member_id: str,
        step: int | None,
        now: float,
        blocked_on: str | None = None,
        progress: int | None = None,
        busy: str | None = None,
        warm: bool | None = None,
        pace: dict[str, Any] | None = None,
    ) -> Member | None:
        member = self.members.get(member_id)
        if member is None or member.state not in (MemberState.WAITING, MemberState.ACTIVE):
            if member_id in self.holder_members:  # a holder of the job's state, alive (a new leader waits for it)
                self.holder_heard[member_id] = now
        if member is None:
            return None
        if member.state in (MemberState.WAITING, MemberState.ACTIVE):
            member.last_heartbeat = now
            if step is not None:
                member.step = max(member.step, step)
                self._max_step = max(self._max_step, step)
            if blocked_on != member.blocked_on:
                self._blocked_active -= _counts_blocked(member)
                member.blocked_on = blocked_on
                self._blocked_active += _counts_blocked(member)
                member.blocked_since = now if blocked_on else None
                if blocked_on:
                    self._note_wait(now, member_id, "blocked")
            if progress is not None and progress != member.progress:
                member.progress = progress
                member.progress_at = now
            if busy != member.busy:
                # A mark that starts or ends restarts the progress clock: the work it covered is
                # never counted as time without progress (the next micro-batch may be seconds away).
                member.progress_at = now
                member.busy_since = now if busy else None
                if busy:
                    self._busy[member_id] = now
                else:
                    self._busy.pop(member_id, None)
            member.busy = busy
            if warm is not None:
                member.warm = warm
            if pace is not None:
                _take_pace(member, pace)
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
            self._verdict_pending = True
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
                self._verdict_pending = True
        if finished and not self.finished:
            self.finished = True
            self.version += 1
            changed = True
        return changed


def _take_pace(member: Member, pace: dict[str, Any]) -> None:
    """Keep what a member's heartbeat says of its pace; values of the wrong type are ignored."""
    relative, exchange = pace.get("pace"), pace.get("exchange_seconds")
    if isinstance(relative, (int, float)) and not isinstance(relative, bool) and relative >= 0:
        member.pace = float(relative)
    if isinstance(exchange, (int, float)) and not isinstance(exchange, bool) and exchange >= 0:
        member.exchange_seconds = float(exchange)
    if isinstance(pace.get("straggler"), bool):
        member.straggler = pace["straggler"]
