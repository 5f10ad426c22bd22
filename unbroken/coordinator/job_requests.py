"""The membership's part of the decisions one member takes for the whole job (DESIGN: Fast
paths): a stop request every later generation carries, and when a new leader may form its first
generation from behind the job (every holder of its state gone).
A base of :class:`~unbroken.coordinator.membership.Membership`, whose fields these read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unbroken.coordinator.member_records import MemberState

if TYPE_CHECKING:
    from unbroken.coordinator.member_records import Member
    from unbroken.coordinator.member_records import MembershipSettings


class JobRequests:
    """:meth:`request_stop` and :meth:`holders_gone`."""

    settings: MembershipSettings
    members: dict[str, Member]
    version: int
    stop_request: dict | None
    holder_step: int
    holder_deadline: float | None
    holder_members: frozenset[str]
    holder_heard: dict[str, float]

    def request_stop(self, step: int, reason: str) -> bool:
        """Record a member's stop request: no step at or after ``step`` is trained (the earliest
        request wins). True if it changed the request."""
        if self.stop_request is not None and self.stop_request["step"] <= step:
            return False
        self.stop_request = {"step": int(step), "reason": str(reason)[:500]}
        self.version += 1
        return True

    def holders_gone(self, now: float) -> bool:
        """Whether a new leader's first generation may form from behind :attr:`holder_step`: its
        wait (:attr:`holder_deadline`) is over and no member of the last durable generation is
        alive by this leader's view: none heartbeated within a heartbeat timeout (a member
        blocked in its old generation's collective heartbeats while it waits), none waits with
        the job's step. O(members of that generation)."""
        if self.holder_deadline is not None and now < self.holder_deadline:
            return False
        timeout = self.settings.heartbeat_timeout
        for member_id in self.holder_members:
            if now - self.holder_heard.get(member_id, float("-inf")) < timeout:
                return False
            member = self.members.get(member_id)
            if member is not None and member.state in (MemberState.WAITING, MemberState.ACTIVE) and member.step >= self.holder_step:
                return False
        return True
