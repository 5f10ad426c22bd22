"""unbroken.coordinator.state_loss: a generation that forms behind the job is named, whether the
lost step was reported or not; one that keeps any member of the generation before is not."""

from __future__ import annotations

from unbroken.coordinator.membership import Membership, MembershipSettings
from unbroken.coordinator.state_loss import state_loss


def _running(*ids: str, step: int = 0) -> Membership:
    m = Membership(MembershipSettings(heartbeat_timeout=5.0, expected_members=len(ids)))
    for i, member_id in enumerate(ids):
        m.join(member_id, "node", pid=i, step=step, now=0.0)
    generation, decision = m.maybe_form(0.0)
    assert generation is not None and state_loss(m, generation) is None, decision.reason
    return m


def _re_formed(m: Membership, dead: tuple[str, ...], joining: dict[str, int], now: float):
    for member_id in dead:
        m.mark_dead(member_id, "killed by SIGKILL", now=now)
    for member_id, step in joining.items():
        m.join(member_id, "node", pid=None, step=step, now=now)
    generation, decision = m.maybe_form(now + 10.0)
    assert generation is not None, decision.reason
    return generation


def test_a_generation_behind_the_highest_reported_step_is_named_with_both_steps():
    m = _running("a", "b", "c")
    m.heartbeat("a", 40, now=1.0)
    m.heartbeat("b", 40, now=1.0)
    generation = _re_formed(m, ("a", "b"), {"c": 12}, now=2.0)
    loss = state_loss(m, generation)
    assert loss is not None and (loss.step, loss.lost) == (12, 40) and "step 40" in loss.reason


def test_every_member_of_the_generation_before_gone_before_reporting_its_newest_step_is_named():
    # a, b trained on (their last reports said step 30) while c and d caught up from them; both are
    # killed at once, and c and d (replayed to step 30) form the next generation: whatever a and b
    # committed after step 30 is gone, though no member ever reported it
    m = _running("a", "b")
    m.heartbeat("a", 30, now=1.0)
    m.heartbeat("b", 30, now=1.0)
    m.join("c", "node2", pid=3, step=30, now=1.5, catch_up="x:1")
    m.join("d", "node2", pid=4, step=30, now=1.5, catch_up="x:2")
    generation = _re_formed(m, ("a", "b"), {"c": 30, "d": 30}, now=2.0)
    assert set(generation.members) == {"c", "d"}
    loss = state_loss(m, generation)
    assert loss is not None and loss.step == 30 and "generation 1" in loss.reason


def test_a_generation_that_keeps_one_member_of_the_one_before_has_lost_nothing():
    m = _running("a", "b", "c")
    m.heartbeat("a", 30, now=1.0)
    m.heartbeat("c", 31, now=1.0)
    generation = _re_formed(m, ("a", "b"), {"c": 31, "n": 0}, now=2.0)
    assert set(generation.members) == {"c", "n"} and state_loss(m, generation) is None
