"""Who is still alive, for :class:`~unbroken.coordinator.membership.Membership`: heartbeat deadlines (a heap
with one entry per live member), the progress watchdog, the quorum check, and forgetting members
that died or left long ago. A mixin: the state it reads and changes is Membership's.
"""

from __future__ import annotations

import heapq
from typing import Any

from unbroken.coordinator.member_records import _LIVE, GenerationState, Member, MemberState


class Liveness:
    """Expiry and the watchdog; see :meth:`expire`."""

    members: dict[str, Any]
    settings: Any

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
        dead += self._expire_busy(now)
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

    def _expire_busy(self, now: float) -> list[str]:
        """Fence the members whose busy mark has lasted longer than ``busy_timeout`` (stuck
        work, such as a write to a hung mount), naming the work. O(members marked busy)."""
        dead = []
        limit = self.settings.busy_timeout
        for member_id, since in list(self._busy.items()):
            member = self.members.get(member_id)
            if member is None or member.state.value not in _LIVE or member.busy is None:
                self._busy.pop(member_id, None)
                continue
            if now - since <= limit:
                continue
            self._busy.pop(member_id, None)
            self.mark_dead(member_id, f"busy with {member.busy} for {now - since:.1f} s, beyond busy_timeout={limit:.0f} s", now)
            member.fenced = True
            dead.append(member_id)
        return dead

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
