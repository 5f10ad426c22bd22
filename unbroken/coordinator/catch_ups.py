"""Newcomers that catch up from a donor instead of waiting to be healed
(:mod:`unbroken.worker.catch_up`), as the coordinator keeps them: who donates to whom, who waits
without making anyone re-form, and catch-ups turned off for good once a replay failed to verify.
A base of :class:`~unbroken.coordinator.membership.Membership`, whose fields these read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unbroken.coordinator.member_records import MemberState

if TYPE_CHECKING:
    from unbroken.coordinator.member_records import Generation, Member


class CatchUps:
    """:meth:`_catch_up`, :meth:`catching_up`, :meth:`stop_catch_ups` and the donor's view."""

    members: dict[str, Member]
    current: Generation | None
    version: int
    catch_up_off: str | None
    changed_members: set[str]
    _catching: dict[str, str]
    _donating: dict[str, str]

    def _catch_up(self, member: Member, address: str | None) -> bool:
        """Start or end ``member``'s catching up (``address``: where its donor streams to). A
        donor is the highest-ranked active member of the current generation that donates to
        nobody else; without one, the member waits as an ordinary joiner (and is healed). Returns
        True if anything changed."""
        donor = None
        if address is not None and self.current is not None and self.catch_up_off is None:
            for candidate in reversed(self.current.members):
                m = self.members.get(candidate)
                if m is not None and m.state is MemberState.ACTIVE and self._donating.get(candidate, member.id) == member.id:
                    donor = candidate
                    break
        if donor is None:
            address = None  # nobody can donate now: it waits as any joiner does, and is healed
        if member.catch_up == address and self._catching.get(member.id) == donor:
            return False
        previous = self._catching.pop(member.id, None)
        if previous:
            self._donating.pop(previous, None)
            self.changed_members.add(previous)
        member.catch_up = address
        if donor is not None:
            self._catching[member.id] = donor
            self._donating[donor] = member.id
            self.changed_members.add(donor)
        self.version += 1
        return True

    def catching_up(self) -> int:
        """Waiting members that catch up: they make nobody re-form. O(members catching up)."""
        return sum(1 for m in self._catching if (member := self.members.get(m)) is not None and member.state is MemberState.WAITING)

    def stop_catch_ups(self, reason: str) -> bool:
        """No newcomer catches up from now on (:attr:`catch_up_off`); those catching up are
        healed instead. True the first time."""
        if self.catch_up_off is not None:
            return False
        self.catch_up_off = reason
        for member_id in list(self._catching):
            if member_id in self.members:
                self._catch_up(self.members[member_id], None)
            else:
                self._catching.pop(member_id, None)
        self.version += 1
        return True

    def _donation_view(self, member_id: str) -> dict[str, Any]:
        """For a donor: ``donate``, the member to stream its state to and where. O(1)."""
        newcomer = self._donating.get(member_id)
        if newcomer is None or newcomer not in self.members:
            return {}
        return {"donate": {"member": newcomer, "address": self.members[newcomer].catch_up}}
