"""Whether a newly formed generation goes on from behind the job: every copy of the newest state
is gone, so the steps after the best state left are committed a second time.

Two ways to know it. Reported steps: a member of the new generation is behind the highest step
any member reported (or the step a new leader found in etcd). But a member reports its step with
its heartbeat, so the members that committed the newest steps may die before reporting them (a
whole node killed while the others were away, or catching up from one of them). Hence the second:
no member of the generation before is in the new one, so whatever they committed after their last
report went with them. A decision from the membership's state alone (DESIGN: Copies of the truth).
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.coordinator.member_records import Generation
from unbroken.coordinator.membership import Membership


@dataclass(frozen=True)
class StateLoss:
    """``step``: where the new generation starts; ``lost``: the newest step reported held (it may
    be higher, unreported); ``reason``: which of the two ways told."""

    step: int
    lost: int
    reason: str


def state_loss(state: Membership, generation: Generation) -> StateLoss | None:
    """The loss ``generation`` (just formed, the newest in ``state.history``) starts behind, or
    None if some member of it holds the newest state."""
    best = max((state.members[m].step for m in generation.members if m in state.members), default=0)
    known = max(state.committed_step(), state.holder_step)
    if best < known:
        return StateLoss(best, known, f"every member that held step {known} is gone")
    before = state.history[-2] if len(state.history) >= 2 and state.history[-1] is generation else None
    if before is not None and not set(before.members) & set(generation.members):
        return StateLoss(best, known, f"no member of generation {before.number} is in it: what they committed after"
                                      " their last report is gone with them")
    return None
