"""Membership: generations formed from (state, settings, now), driven with an explicit clock."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.coordinator.membership import (
    Decision,
    Generation,
    GenerationState,
    Member,
    Membership,
    MembershipSettings,
    MemberState,
    decide,
)

FAST = settings(max_examples=150, deadline=None)


def _membership(**overrides) -> Membership:
    return Membership(MembershipSettings(**{"heartbeat_timeout": 5.0, "expected_members": 2, **overrides}))


def _formed(m: Membership, *ids: str, now: float = 0.0) -> Generation:
    for i, member_id in enumerate(ids):
        m.join(member_id, "node", pid=100 + i, step=0, now=now)
    generation, decision = m.maybe_form(now)
    assert generation is not None, decision.reason
    return generation


# -- joining and the first generation --------------------------------------------------------------


def test_the_first_generation_waits_for_the_expected_members_and_then_forms_in_join_order():
    m = _membership(expected_members=3)
    m.join("b", "n1", pid=1, step=0, now=1.0)
    m.join("a", "n1", pid=2, step=0, now=2.0)
    generation, decision = m.maybe_form(2.0)
    assert generation is None
    assert not decision.form
    assert "2 of 3" in decision.reason
    m.join("c", "n2", pid=3, step=0, now=3.0)
    generation, decision = m.maybe_form(3.0)
    assert generation == Generation(1, ("b", "a", "c"), formed_at=3.0)
    assert generation.prefix == "unbroken/gen1/"
    assert decision.form and decision.members == ("b", "a", "c")
    assert all(m.members[i].state is MemberState.ACTIVE for i in "abc")
    assert m.history == [generation]
    assert not m.reconfigure_wanted()


def test_start_grace_lets_the_first_generation_start_with_fewer_than_expected_members():
    m = _membership(expected_members=3, start_grace=30.0)
    m.join("a", "n", pid=1, step=0, now=10.0)
    m.join("b", "n", pid=2, step=0, now=15.0)
    assert m.maybe_form(39.9)[0] is None  # grace counts from the first join, at 10.0
    generation, _ = m.maybe_form(40.0)
    assert generation is not None
    assert generation.members == ("a", "b")
    assert generation.number == 1


def test_start_grace_does_not_apply_once_a_generation_has_formed():
    m = _membership(expected_members=2, start_grace=1000.0)
    _formed(m, "a", "b")
    m.mark_dead("b", "exit code 1", now=1.0)
    m.join("a", "n", pid=1, step=3, now=1.0)
    generation, _ = m.maybe_form(1.0)
    assert generation is not None and generation.members == ("a",)
    assert generation.number == 2


def test_the_first_join_of_a_new_member_is_a_change_of_state():
    # Regression: a new Member starts WAITING, and join() once took that for "already waiting".
    m = _membership()
    assert m.join("a", "n", pid=1, step=0, now=1.0) is True
    assert m.members["a"].waiting_since == 1.0


def test_joining_twice_while_waiting_changes_nothing_but_the_heartbeat():
    m = _membership()
    m.join("a", "n", pid=1, step=0, now=1.0)
    assert m.members["a"].state is MemberState.WAITING
    assert m.join("a", "n", pid=1, step=0, now=4.0) is False
    assert m.members["a"].last_heartbeat == 4.0
    assert m.members["a"].joined_at == 1.0
    assert m.first_wait == 1.0


def test_no_generation_is_formed_below_min_members():
    m = _membership(expected_members=2, min_members=2)
    _formed(m, "a", "b")
    m.mark_dead("b", "exit code 1", now=1.0)
    m.join("a", "n", pid=1, step=5, now=1.0)
    generation, decision = m.maybe_form(100.0)
    assert generation is None
    assert "minimum is 2" in decision.reason
    m.join("c", "n", pid=3, step=0, now=101.0)
    generation, _ = m.maybe_form(101.0)
    assert generation is not None and generation.members == ("a", "c")


# -- failures --------------------------------------------------------------------------------------


def test_an_exit_report_breaks_the_generation_and_survivors_form_the_next_without_the_dead():
    m = _membership(expected_members=3)
    first = _formed(m, "a", "b", "c")
    assert m.mark_dead("b", "killed by SIGKILL", now=5.0) is True
    assert m.mark_dead("b", "killed by SIGKILL", now=5.1) is False  # reported twice: no change
    assert m.generation_state is GenerationState.BROKEN
    assert m.reconfigure_wanted()
    view = m.view_for("a")
    assert view == {
        "generation": 1, "broken": True, "reconfigure": True, "state": "active",
        "reason": None, "fence": False, "finished": False, "failed": None,
        "rank": 0, "size": 3, "prefix": "unbroken/gen1/",
    }
    assert m.view_for("b")["state"] == "dead"
    assert m.members["b"].death_reason == "killed by SIGKILL"
    # Nothing forms while "c" is still in the broken generation.
    m.join("c", "n", pid=3, step=7, now=5.2)
    assert m.maybe_form(5.2)[0] is None
    m.join("a", "n", pid=1, step=7, now=5.3)
    second, _ = m.maybe_form(5.3)
    assert second is not None
    assert second.number == first.number + 1
    assert second.members == ("a", "c")  # previous order, not join order
    assert m.generation_state is GenerationState.ACTIVE
    assert not m.view_for("a")["broken"]


def test_after_a_verdict_survivors_waiting_in_a_collective_are_formed_into_the_next_without_joining():
    m = _membership(expected_members=3)
    _formed(m, "a", "b", "c")
    m.heartbeat("a", 4, now=1.0, blocked_on="allreduce")
    m.heartbeat("c", 4, now=1.0, blocked_on="allreduce")
    m.mark_dead("b", "killed by SIGKILL", now=2.0)
    assert m.take_survivors(2.0)
    assert not m.take_survivors(2.0)  # once per verdict
    second, _ = m.maybe_form(2.0)
    assert second is not None and second.members == ("a", "c")
    assert m.preformed == {"a", "c"}
    assert (m.view_for("c")["generation"], m.view_for("c")["rank"], m.view_for("c")["state"]) == (2, 1, "active")


def test_survivors_are_not_taken_while_one_computes_until_it_too_waits_in_a_collective():
    m = _membership(expected_members=3)
    _formed(m, "a", "b", "c")
    m.heartbeat("a", 4, now=1.0, blocked_on="allreduce")
    m.mark_dead("b", "killed by SIGKILL", now=2.0)
    assert not m.take_survivors(2.0)  # c computes (a long step): it comes to join as usual
    assert m.maybe_form(2.0)[0] is None
    m.heartbeat("c", 4, now=2.5, blocked_on="allreduce")
    assert m.take_survivors(2.5)
    assert m.maybe_form(2.5)[0].members == ("a", "c")


def test_a_failure_report_alone_takes_nobody_and_a_member_that_joins_is_not_counted_as_taken():
    m = _membership(expected_members=3)
    first = _formed(m, "a", "b", "c")
    for member in ("a", "b", "c"):
        m.heartbeat(member, 4, now=1.0, blocked_on="allreduce")
    m.report_failure("a", first.number, now=2.0)  # nobody known dead: all three would be taken
    assert not m.take_survivors(2.0)
    m.mark_dead("b", "no heartbeat", now=2.1)
    m.join("a", "n", pid=1, step=4, now=2.1)  # a saw its collective fail and joined first
    assert m.take_survivors(2.2)
    second, _ = m.maybe_form(2.2)
    assert second.members == ("a", "c") and m.preformed == {"c"}


def test_a_dead_member_that_is_not_in_the_current_generation_does_not_break_it():
    m = _membership()
    _formed(m, "a", "b")
    m.join("late", "n", pid=9, step=0, now=1.0)
    assert m.mark_dead("late", "exit code 1", now=2.0) is True
    assert m.generation_state is GenerationState.ACTIVE
    assert not m.reconfigure_wanted()


def test_an_exit_reported_before_the_member_ever_joined_is_remembered_as_dead():
    m = _membership()
    assert m.mark_dead("ghost", "exit code 1", now=1.0) is False
    assert m.members["ghost"].state is MemberState.DEAD
    assert m.live_count() == 0


def test_heartbeat_expiry_declares_a_silent_member_dead_after_the_timeout():
    m = _membership(heartbeat_timeout=5.0)
    _formed(m, "a", "b", now=0.0)
    m.heartbeat("a", step=1, now=4.0)
    assert m.expire(5.0) == []  # b silent exactly the timeout: not yet
    assert m.expire(5.5) == ["b"]
    assert m.members["b"].state is MemberState.DEAD
    assert "no heartbeat for 5.5 s" in m.members["b"].death_reason
    assert m.members["a"].state is MemberState.ACTIVE
    assert m.generation_state is GenerationState.BROKEN
    assert m.expire(6.0) == []  # declared once
    assert m.expire(9.5) == ["a"]


def test_a_heartbeat_from_a_dead_member_does_not_revive_it_but_a_join_does():
    m = _membership()
    _formed(m, "a", "b")
    m.mark_dead("b", "no heartbeat", now=6.0)
    m.heartbeat("b", step=3, now=7.0)
    assert m.members["b"].state is MemberState.DEAD
    assert m.members["b"].step == 0
    assert m.join("b", "n", pid=2, step=3, now=8.0) is True  # a member that woke up
    assert m.members["b"].state is MemberState.WAITING
    assert m.members["b"].death_reason is None
    assert m.members["b"].step == 3


def test_heartbeats_keep_the_highest_step_and_unknown_members_get_none():
    m = _membership()
    _formed(m, "a", "b")
    m.heartbeat("a", step=4, now=1.0)
    m.heartbeat("a", step=2, now=2.0)
    m.heartbeat("a", step=None, now=3.0)
    assert m.members["a"].step == 4
    assert m.members["a"].last_heartbeat == 3.0
    assert m.committed_step() == 4
    assert m.heartbeat("nobody", step=1, now=3.0) is None


def test_a_failure_report_breaks_only_the_current_generation_once():
    m = _membership()
    _formed(m, "a", "b")
    assert m.report_failure("a", generation=0, now=1.0) is False
    assert m.report_failure("a", generation=2, now=1.0) is False
    assert m.generation_state is GenerationState.ACTIVE
    assert m.report_failure("a", generation=1, now=1.0) is True
    assert m.report_failure("b", generation=1, now=1.0) is False
    assert m.generation_state is GenerationState.BROKEN


# -- reconfiguration and leaving -------------------------------------------------------------------


def test_a_newcomer_makes_the_current_members_reconfigure_and_is_appended_to_the_order():
    m = _membership()
    m.join("b", "n", pid=2, step=0, now=0.0)
    m.join("a", "n", pid=1, step=0, now=0.5)
    assert m.maybe_form(0.5)[0] is not None  # order of the first generation: join order b, a
    assert m.current.members == ("b", "a")
    assert not m.view_for("a")["reconfigure"]
    m.join("c", "n2", pid=3, step=0, now=1.0)
    assert m.reconfigure_wanted()
    assert m.view_for("a")["reconfigure"] and m.view_for("b")["reconfigure"]
    assert m.maybe_form(1.0)[0] is None  # a and b are still training
    m.join("a", "n", pid=1, step=9, now=2.0)
    assert m.maybe_form(2.0)[0] is None
    m.join("b", "n", pid=2, step=9, now=2.0)
    generation, _ = m.maybe_form(2.0)
    assert generation is not None
    assert generation.members == ("b", "a", "c")
    assert not m.reconfigure_wanted()


def test_leave_finished_ends_the_job_and_no_generation_forms_after():
    m = _membership()
    _formed(m, "a", "b")
    assert m.leave("a", finished=True, step=10, now=1.0) is True
    assert m.finished
    assert m.generation_state is GenerationState.ACTIVE  # a finished member does not break it
    assert m.members["a"].state is MemberState.LEFT
    assert m.view_for("b")["finished"] is True
    m.join("b", "n", pid=2, step=10, now=2.0)
    m.join("late", "n", pid=3, step=0, now=2.0)
    generation, decision = m.maybe_form(2.0)
    assert generation is None
    assert decision.reason == "job finished"
    assert m.committed_step() == 10


def test_leaving_without_finishing_breaks_the_generation():
    m = _membership()
    _formed(m, "a", "b")
    assert m.leave("b", finished=False, step=3, now=1.0) is True
    assert not m.finished
    assert m.generation_state is GenerationState.BROKEN
    assert m.leave("b", finished=False, step=3, now=1.0) is False
    assert m.live_count() == 1


class _Request:
    transport = None  # no connection to watch

    def __init__(self, body: dict) -> None:
        self._body = body

    async def json(self) -> dict:
        return self._body


def _join_reply(coordinator, **body) -> dict:
    async def run() -> dict:
        coordinator._changed = asyncio.Event()
        response = await coordinator._join(_Request(body))
        return json.loads(response.text)

    return asyncio.run(run())


def test_join_replies_are_finished_after_a_member_leaves_finished():
    from unbroken.coordinator.server import Coordinator, CoordinatorSettings

    coordinator = Coordinator(CoordinatorSettings(hold=0.05), MembershipSettings(expected_members=2))
    state = coordinator.state
    _formed(state, "a", "b")
    state.leave("a", finished=True, step=10, now=1.0)
    assert _join_reply(coordinator, member="w.r1", node="n", pid=7, step=0, after=0) == {"status": "finished"}
    assert _join_reply(coordinator, member="b", node="n", pid=2, step=10, after=1) == {"status": "finished"}


def test_a_join_that_completes_the_first_generation_is_answered_with_it_at_once():
    from unbroken.coordinator.server import Coordinator, CoordinatorSettings

    coordinator = Coordinator(CoordinatorSettings(hold=0.05), MembershipSettings(expected_members=1))
    reply = _join_reply(coordinator, member="a", node="n", pid=1, step=0, after=0)
    assert reply["status"] == "formed"
    assert (reply["generation"], reply["members"], reply["rank"], reply["prefix"]) == (1, ["a"], 0, "unbroken/gen1/")


def test_joins_that_wait_for_their_generation_to_be_durable_keep_the_member_alive():
    # replicated (etcd): a member formed into a generation that is not yet durable keeps joining
    # (it has not heard of it) and its heartbeats wait meanwhile (they share its line): its joins
    # must count as heartbeats, or a slow durable write gets it declared dead for silence
    from unbroken.coordinator.server import Coordinator, CoordinatorSettings

    coordinator = Coordinator(CoordinatorSettings(hold=0.05), MembershipSettings(expected_members=1))
    state = coordinator.state
    _formed(state, "a", now=0.0)
    coordinator.leadership = object()  # replicated, and generation 1 is not durable yet
    coordinator._durable = 0
    assert _join_reply(coordinator, member="a", node="n", pid=1, step=0, after=0) == {"status": "wait"}
    assert state.members["a"].last_heartbeat > 0.0
    assert state.current.number == 1 and state.members["a"].state is MemberState.ACTIVE  # nothing else changed


def test_touch_refreshes_only_live_members():
    m = _membership()
    _formed(m, "a", "b", now=0.0)
    m.mark_dead("b", "no heartbeat", now=1.0)
    m.touch("a", now=4.0)
    m.touch("b", now=4.0)
    m.touch("nobody", now=4.0)
    assert m.members["a"].last_heartbeat == 4.0 and m.members["b"].last_heartbeat == 0.0
    assert "nobody" not in m.members and m.expire(8.5) == []


# -- decide: properties ----------------------------------------------------------------------------


@st.composite
def situations(draw):
    n = draw(st.integers(0, 8))
    ids = [f"m{i}" for i in range(n)]
    members = {}
    for member_id in ids:
        joined = draw(st.integers(0, 20)) * 0.5  # ties in join time happen
        state = draw(st.sampled_from(list(MemberState)))
        members[member_id] = Member(member_id, "node", joined_at=joined, last_heartbeat=joined, state=state)
    current = None
    if draw(st.booleans()):
        # The current generation may also name members the coordinator no longer knows.
        pool = ids + ["gone0", "gone1"]
        chosen = draw(st.lists(st.sampled_from(pool), unique=True, max_size=len(pool)))
        current = Generation(draw(st.integers(1, 50)), tuple(chosen), formed_at=0.0)
    rules = MembershipSettings(
        heartbeat_timeout=5.0,
        expected_members=draw(st.integers(1, 10)),
        start_grace=draw(st.integers(0, 60)) * 1.0,
        min_members=draw(st.integers(1, 5)),
    )
    first_wait = draw(st.none() | st.integers(0, 100).map(float))
    now = draw(st.integers(0, 200)) * 1.0
    if first_wait is not None:
        now = max(now, first_wait)
    return members, current, rules, first_wait, now


def _waiting(members) -> list[str]:
    return [m.id for m in members.values() if m.state is MemberState.WAITING]


@FAST
@given(situations())
def test_decide_never_forms_while_any_live_member_is_active(situation):
    members, current, rules, first_wait, now = situation
    decision = decide(members, current, rules, first_wait, now)
    if any(m.state is MemberState.ACTIVE for m in members.values()):
        assert not decision.form
    assert isinstance(decision, Decision) and decision.reason


@FAST
@given(situations())
def test_decide_forms_with_exactly_the_waiting_members_and_never_below_min_members(situation):
    members, current, rules, first_wait, now = situation
    decision = decide(members, current, rules, first_wait, now)
    if decision.form:
        assert sorted(decision.members) == sorted(_waiting(members))
        assert len(decision.members) >= rules.min_members
        assert all(members[i].state is MemberState.WAITING for i in decision.members)
    else:
        assert decision.members == ()


@FAST
@given(situations())
def test_decide_keeps_the_previous_order_and_appends_newcomers_by_join_time(situation):
    members, current, rules, first_wait, now = situation
    decision = decide(members, current, rules, first_wait, now)
    if not decision.form:
        return
    previous = list(current.members) if current is not None else []
    stayed = [i for i in previous if i in decision.members]
    assert list(decision.members[: len(stayed)]) == stayed
    newcomers = list(decision.members[len(stayed) :])
    assert not set(newcomers) & set(previous)
    assert newcomers == sorted(newcomers, key=lambda i: (members[i].joined_at, i))


@st.composite
def short_of_expected(draw):
    """A first formation with nothing in its way but a count below ``expected_members``: every
    known member waits, at least ``min_members`` of them, fewer than expected."""
    expected = draw(st.integers(2, 10))
    min_members = draw(st.integers(1, expected - 1))
    count = draw(st.integers(min_members, expected - 1))
    members = {}
    for i in range(count):
        joined = draw(st.integers(0, 20)) * 0.5
        members[f"m{i}"] = Member(f"m{i}", "node", joined_at=joined, last_heartbeat=joined, state=MemberState.WAITING)
    rules = MembershipSettings(heartbeat_timeout=5.0, expected_members=expected, start_grace=draw(st.integers(1, 60)) * 1.0,
                               min_members=min_members)
    return members, rules, draw(st.integers(0, 100)) * 1.0


@FAST
@given(short_of_expected(), st.floats(0.0, 0.999))
def test_decide_forms_the_first_generation_below_expected_only_after_start_grace(situation, fraction):
    members, rules, first_wait = situation
    assert not decide(members, None, rules, None, first_wait).form  # nobody has waited yet
    early = first_wait + fraction * rules.start_grace
    assert not decide(members, None, rules, first_wait, early).form, "formed below expected within the grace"
    late = decide(members, None, rules, first_wait, first_wait + rules.start_grace)
    assert late.form and sorted(late.members) == sorted(members), "did not form once the grace was over"


@FAST
@given(situations())
def test_decide_forms_whenever_nothing_stands_in_the_way(situation):
    members, current, rules, first_wait, now = situation
    waiting = _waiting(members)
    blocked = (
        not waiting
        or any(m.state is MemberState.ACTIVE for m in members.values())
        or len(waiting) < rules.min_members
        or (
            current is None
            and len(waiting) < rules.expected_members
            and (first_wait is None or now - first_wait < rules.start_grace)
        )
    )
    assert decide(members, current, rules, first_wait, now).form is (not blocked)


# -- Membership: random histories ------------------------------------------------------------------

IDS = ["a", "b", "c", "d"]
operations = st.lists(
    st.tuples(
        st.sampled_from(["join", "heartbeat", "dead", "leave", "fail", "expire"]),
        st.sampled_from(IDS),
        st.integers(0, 30),  # step
        st.integers(0, 40),  # time advance, in tenths of a second
    ),
    max_size=40,
)


@FAST
@given(ops=operations, expected=st.integers(1, 4), min_members=st.integers(1, 2))
def test_random_histories_keep_generations_numbered_and_their_members_alive(ops, expected, min_members):
    m = Membership(MembershipSettings(heartbeat_timeout=2.0, expected_members=expected, start_grace=3.0, min_members=min_members))
    now = 0.0
    for kind, member_id, step, advance in ops:
        now += advance / 10
        if kind == "join":
            m.join(member_id, "n", pid=1, step=step, now=now)
        elif kind == "heartbeat":
            m.heartbeat(member_id, step, now)
        elif kind == "dead":
            m.mark_dead(member_id, "exit", now)
        elif kind == "leave":
            m.leave(member_id, finished=step == 0, step=step, now=now)
        elif kind == "fail":
            m.report_failure(member_id, m.current.number if m.current else 0, now)
        else:
            m.expire(now)
        before = m.current
        finished_before = m.finished
        generation, decision = m.maybe_form(now)
        if generation is not None:
            assert not finished_before
            assert generation.number == (before.number + 1 if before else 1)
            assert len(generation.members) >= min_members
            assert len(set(generation.members)) == len(generation.members)
            assert m.generation_state is GenerationState.ACTIVE
        # Every active member belongs to the current generation: no one trains in an old one.
        active = {i for i, member in m.members.items() if member.state is MemberState.ACTIVE}
        assert active <= set(m.current.members if m.current else ())
    numbers = [g.number for g in m.history]
    assert numbers == list(range(1, len(numbers) + 1))


@pytest.mark.parametrize("member_state", [MemberState.DEAD, MemberState.LEFT])
def test_members_that_are_gone_count_neither_as_live_nor_as_waiting(member_state):
    members = {
        "a": Member("a", "n", joined_at=0.0, last_heartbeat=0.0, state=MemberState.WAITING),
        "b": Member("b", "n", joined_at=0.0, last_heartbeat=0.0, state=member_state),
    }
    previous = Generation(3, ("b", "a"), formed_at=0.0)
    decision = decide(members, previous, MembershipSettings(expected_members=2), first_wait=0.0, now=0.0)
    assert decision == Decision(True, ("a",), reason="1 member(s) ready")


# -- progress watchdog and quorum ------------------------------------------------------------


def _active_generation(settings, ids=("a", "b", "c")):
    m = Membership(settings)
    for i, member in enumerate(ids):
        m.join(member, "n", None, 0, now=0.0)
    generation, _ = m.maybe_form(now=0.0)
    assert generation is not None and generation.members == ids
    return m


def test_a_member_that_makes_no_progress_while_a_peer_waits_in_a_collective_is_fenced():
    m = _active_generation(MembershipSettings(expected_members=3, progress_timeout=10.0, heartbeat_timeout=100.0))
    for t in range(0, 25, 1):
        m.heartbeat("a", 5, float(t), blocked_on="g1:7:gradient allreduce")
        m.heartbeat("b", 5, float(t), blocked_on="g1:7:gradient allreduce")
        m.heartbeat("c", 5, float(t), blocked_on=None)  # alive, but stuck computing
        dead = m.expire(float(t))
        if dead:
            break
    assert dead == ["c"] and 10.0 < t <= 12.0
    assert m.members["c"].fenced and m.view_for("c")["fence"]
    assert m.members["a"].state is MemberState.ACTIVE and not m.members["a"].fenced


def test_waiting_in_a_new_collective_each_time_is_progress_not_a_hang():
    m = _active_generation(MembershipSettings(expected_members=3, progress_timeout=10.0, heartbeat_timeout=100.0))
    for t in range(0, 60):
        # "a" is fast and always waits for the slow "c", but in a different collective each time
        m.heartbeat("a", t, float(t), blocked_on=f"g1:{t}:gradient allreduce")
        m.heartbeat("b", t, float(t), blocked_on=None)
        m.heartbeat("c", t, float(t), blocked_on=None)
        assert m.expire(float(t)) == []


def test_members_that_do_not_come_to_join_after_a_break_are_declared_dead():
    m = _active_generation(MembershipSettings(expected_members=3, progress_timeout=10.0, heartbeat_timeout=100.0))
    m.report_failure("a", 1, now=1.0)
    m.join("a", "n", None, 3, now=1.0)
    m.join("b", "n", None, 3, now=1.0)
    for t in (2.0, 5.0, 10.0):
        m.heartbeat("c", 3, t)
        assert m.expire(t) == []
    m.heartbeat("c", 3, 11.5)
    assert m.expire(11.5) == ["c"]
    generation, _ = m.maybe_form(11.5)
    assert generation is not None and generation.members == ("a", "b")


def test_staying_below_the_minimum_past_the_quorum_timeout_fails_the_job():
    settings = MembershipSettings(expected_members=2, min_members=2, quorum_timeout=30.0, start_grace=5.0, heartbeat_timeout=100.0)
    m = Membership(settings)
    m.join("a", "n", None, 0, now=0.0)
    for t in (1.0, 20.0, 34.0):
        m.heartbeat("a", 0, t)
        m.expire(t)
        assert m.failed is None
        assert m.maybe_form(t)[0] is None
    m.heartbeat("a", 0, 36.0)
    m.expire(36.0)
    assert m.failed and "below the minimum of 2" in m.failed
    assert m.view_for("a")["failed"] == m.failed


def test_a_member_arriving_in_time_lets_training_start_at_the_minimum():
    settings = MembershipSettings(expected_members=3, min_members=2, quorum_timeout=30.0, start_grace=5.0, heartbeat_timeout=100.0)
    m = Membership(settings)
    m.join("a", "n", None, 0, now=0.0)
    m.expire(10.0)
    assert m.maybe_form(10.0)[0] is None
    m.join("b", "n", None, 0, now=12.0)
    generation, _ = m.maybe_form(12.0)
    assert generation is not None and generation.members == ("a", "b")
    for t in (20.0, 40.0):  # well past start_grace + quorum_timeout counted from the first wait
        m.heartbeat("a", 0, t)
        m.heartbeat("b", 0, t)
        m.expire(t)
    assert m.failed is None and m.below_quorum_since is None


def test_max_members_caps_a_generation_and_keeps_the_rest_waiting():
    m = Membership(MembershipSettings(expected_members=3, max_members=2))
    for member in ("a", "b", "c"):
        m.join(member, "n", None, 0, now=0.0)
    generation, _ = m.maybe_form(now=0.0)
    assert generation is not None and generation.members == ("a", "b")
    assert m.members["c"].state is MemberState.WAITING


def test_a_spare_waiting_beyond_max_members_does_not_make_a_full_generation_reconfigure():
    m = Membership(MembershipSettings(expected_members=3, max_members=2))
    for member in ("a", "b", "c"):
        m.join(member, "n", None, 0, now=0.0)
    m.maybe_form(now=0.0)
    assert not m.reconfigure_wanted()
    m.mark_dead("a", "killed", now=1.0)
    assert m.reconfigure_wanted()
    m.join("b", "n", None, 3, now=1.0)
    generation, _ = m.maybe_form(now=1.0)
    assert generation is not None and generation.members == ("b", "c")


# -- progress, not silence (issue 10) ----------------------------------------------------------


def _tick(m, member, t, progress, blocked_on=None, busy=None, warm=True):
    m.heartbeat(member, 0, float(t), blocked_on=blocked_on, progress=progress, busy=busy, warm=warm)


def test_a_long_step_that_keeps_making_progress_is_never_fenced_after_its_generation_broke():
    m = _active_generation(MembershipSettings(expected_members=3, progress_timeout=10.0, heartbeat_timeout=100.0))
    m.report_failure("a", 1, now=1.0)
    m.join("a", "n", None, 3, now=1.0)
    for t in range(1, 40):  # "b" and "c" are in a 40 s step, one micro-batch every 4 s
        _tick(m, "b", t, progress=t // 4)
        _tick(m, "c", t, progress=t // 4)
        assert m.expire(float(t)) == []
    # then "c" stops moving: fenced once its limit has passed since its last progress
    for t in range(40, 60):
        _tick(m, "b", t, progress=t // 4)
        _tick(m, "c", t, progress=9)
        dead = m.expire(float(t))
        if dead:
            break
    assert dead == ["c"] and 36 + 10 < t <= 36 + 12
    assert m.members["c"].fenced and m.members["b"].state is MemberState.ACTIVE


def test_a_long_step_that_keeps_making_progress_is_never_fenced_while_a_peer_waits_for_it():
    m = _active_generation(MembershipSettings(expected_members=3, progress_timeout=10.0, heartbeat_timeout=100.0))
    for t in range(0, 60):
        _tick(m, "a", t, progress=1, blocked_on="g1:1:gradient allreduce")
        _tick(m, "b", t, progress=1, blocked_on="g1:1:gradient allreduce")
        _tick(m, "c", t, progress=t // 3)  # slow, but moving
        assert m.expire(float(t)) == []


def test_a_first_step_is_judged_by_the_warmup_timeout():
    settings = MembershipSettings(expected_members=3, progress_timeout=10.0, warmup_timeout=50.0, heartbeat_timeout=100.0)
    m = _active_generation(settings)
    for t in range(0, 70):
        _tick(m, "a", t, progress=1, blocked_on="g1:1:gradient allreduce", warm=False)
        _tick(m, "b", t, progress=1, blocked_on="g1:1:gradient allreduce", warm=False)
        _tick(m, "c", t, progress=0, warm=False)  # compiling: no progress at all
        dead = m.expire(float(t))
        if dead:
            break
    assert dead == ["c"] and 50 < t <= 52


def test_a_member_busy_on_purpose_is_never_fenced_but_its_silence_still_counts():
    m = _active_generation(MembershipSettings(expected_members=3, progress_timeout=10.0, heartbeat_timeout=5.0))
    for t in range(0, 40):
        _tick(m, "a", t, progress=1, blocked_on="g1:1:final checkpoint")
        _tick(m, "b", t, progress=1, blocked_on="g1:1:final checkpoint")
        _tick(m, "c", t, progress=1, busy="final checkpoint write")
        assert m.expire(float(t)) == []
    _tick(m, "a", 46, progress=1, blocked_on="g1:1:final checkpoint")
    _tick(m, "b", 46, progress=1, blocked_on="g1:1:final checkpoint")
    assert m.expire(46.0) == ["c"]  # no heartbeat for 7 s: busy does not mean alive
    assert not m.members["c"].fenced


def test_the_progress_clock_restarts_when_a_busy_mark_ends():
    """Rank 0 is busy with a snapshot from 2.6 s to 28 s while its peers wait in the next
    allreduce; its first heartbeat after the mark must not fence it for the 26 s it was busy
    (it did, on the old code: 'made no progress for 26.1 s')."""
    m = _active_generation(MembershipSettings(expected_members=3, progress_timeout=10.0, heartbeat_timeout=100.0))
    _tick(m, "a", 2.6, progress=5, busy="checkpoint snapshot")
    for t in (2.6, 10.0, 20.0, 28.0):
        _tick(m, "b", t, progress=5, blocked_on="g1:2:gradient allreduce")
        _tick(m, "c", t, progress=5, blocked_on="g1:2:gradient allreduce")
        if t > 2.6:
            _tick(m, "a", t, progress=5, busy="checkpoint snapshot")
        assert m.expire(t) == []
    _tick(m, "a", 28.0, progress=5)  # the mark ends; the next micro-batch is seconds away
    for t in (28.1, 30.0, 37.9):
        _tick(m, "b", t, progress=5, blocked_on="g1:2:gradient allreduce")
        _tick(m, "c", t, progress=5, blocked_on="g1:2:gradient allreduce")
        _tick(m, "a", t, progress=5)
        assert m.expire(t) == [], t
    _tick(m, "a", 38.5, progress=5)
    assert m.expire(38.5) == ["a"], "still judged: stuck for progress_timeout after the mark ended"
    assert "made no progress for 10.5 s" in m.members["a"].death_reason


def test_a_busy_mark_beyond_busy_timeout_ends_the_member_naming_the_work():
    m = _active_generation(MembershipSettings(expected_members=3, progress_timeout=10.0, heartbeat_timeout=100.0, busy_timeout=60.0))
    for t in range(0, 61, 5):  # nobody waits: a write stuck on a hung mount, alone
        for member in ("a", "b"):
            _tick(m, member, t, progress=t)
        _tick(m, "c", t, progress=3, busy="checkpoint write")
        assert m.expire(float(t)) == []
    _tick(m, "c", 61, progress=3, busy="checkpoint write")
    assert m.expire(61.0) == ["c"]
    assert m.members["c"].fenced
    assert m.members["c"].death_reason == "busy with checkpoint write for 61.0 s, beyond busy_timeout=60 s"


def test_busy_timeout_below_progress_timeout_is_refused():
    with pytest.raises(ValueError, match="busy_timeout"):
        MembershipSettings(progress_timeout=20.0, busy_timeout=10.0)


def _taken_over(holder_step, now=0.0):
    """A new leader's membership, as Leading._take_over builds it from etcd: the last durable
    generation had two members and started from ``holder_step``; rejoin grace 0.5 s."""
    m = Membership(MembershipSettings(expected_members=2, start_grace=0.5, heartbeat_timeout=3.0))
    m.min_generation = 4
    m.holder_step = holder_step
    m.holder_deadline = now + 3.0
    return m


def test_a_new_leaders_first_generation_waits_for_a_member_that_holds_the_jobs_step():
    """The third leader formed generation 5 from a restarted node's fresh worker alone, 0.5 s after
    it joined, while the job's members were at step 169 and rejoined half a second later: it
    committed steps 0, 1, 2 again. Now it waits for a holder, and forms with it."""
    m = _taken_over(150)
    m.join("fresh", "n2", None, 0, now=0.0)
    for t in (0.6, 0.9):  # past the rejoin grace: on the old code it formed here, from step 0
        generation, decision = m.maybe_form(now=t)
        assert generation is None and "step 150" in decision.reason, decision
    m.join("holder", "n1", None, 169, now=1.0)
    generation, _ = m.maybe_form(now=1.0)
    assert generation is not None and set(generation.members) == {"fresh", "holder"} and generation.number == 5


def test_a_new_leader_forms_from_behind_only_once_no_holder_came_back_in_time():
    m = _taken_over(150)
    m.join("fresh", "n2", None, 0, now=0.0)
    assert m.maybe_form(now=2.9)[0] is None
    generation, _ = m.maybe_form(now=3.1)  # every holder is gone: the state comes from a checkpoint
    assert generation is not None and generation.members == ("fresh",)


def test_a_new_leader_never_forms_from_behind_while_a_holder_heartbeats_from_its_old_generation():
    """Issue 44: a leader SIGKILLed, the next SIGSTOPped within 5 s: the third formed generation 13
    from one fresh worker at step 0 while a node at step 337 was alive, blocked in a collective
    with the frozen node. Alive by this leader's view (it heartbeats), it is waited for."""
    m = _taken_over(337)
    m.holder_members = frozenset({"holder", "frozen"})
    m.join("fresh", "n2", None, 0, now=0.0)
    for t in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):  # past the deadline (3 s): the holder heartbeats meanwhile
        assert m.heartbeat("holder", 337, now=t) is None  # unknown to this leader: it has not joined yet
        generation, decision = m.maybe_form(now=t + 0.1)
        assert generation is None and "step 337" in decision.reason, (t, decision)
    m.join("holder", "n1", None, 337, now=6.5)  # its collective failed: it joins
    generation, _ = m.maybe_form(now=6.5)
    assert generation is not None and set(generation.members) == {"fresh", "holder"}


def test_a_holder_silent_for_a_heartbeat_timeout_is_gone_and_the_leader_forms_from_behind():
    m = _taken_over(337)
    m.holder_members = frozenset({"holder"})
    m.join("fresh", "n2", None, 0, now=0.0)
    m.heartbeat("holder", 337, now=2.0)
    assert m.maybe_form(now=4.9)[0] is None  # heard 2.9 s ago, within the heartbeat timeout (3 s)
    generation, _ = m.maybe_form(now=5.1)
    assert generation is not None and generation.members == ("fresh",)


def test_with_a_token_a_generations_store_keys_cannot_be_named_without_it():
    """The generation's TCPStore takes writes from anyone who reaches its port: with a token, its
    keys live under a tag derived from the token and the generation."""
    from unbroken.store_keys import key_tag

    def formed(token):
        m = Membership(MembershipSettings(), store_token=token)
        m.join("a", "n", None, 0, now=0.0)
        first = m.maybe_form(now=0.0)[0]
        m.mark_dead("a", "killed", now=1.0)
        m.join("b", "n", None, 0, now=1.0)
        return first, m.maybe_form(now=1.0)[0]

    assert [g.prefix for g in formed(None)] == ["unbroken/gen1/", "unbroken/gen2/"]
    first, second = formed("s3cret")
    assert first.prefix == f"unbroken/{key_tag('s3cret', 'gen1')}gen1/" and len(first.tag) == 33
    assert first.tag != second.tag  # another generation: other keys
    assert formed("other")[0].tag != first.tag  # another token: other keys


def test_a_member_whose_long_wait_just_ended_is_not_fenced_for_the_wait():
    """A worker waits 30 s for the leader's evaluation (``job.on_leader``), marked blocked; when the
    result comes its mark goes, and its next heartbeat must not read as 30 s without progress
    (CI: a waiter was fenced the moment the evaluation ended). The progress counter is the one
    the worker's joiner keeps (``Joiner._blocked`` ticks on entering and on leaving a wait)."""
    from types import SimpleNamespace

    from unbroken.worker.joining import Joiner

    m = _active_generation(MembershipSettings(expected_members=3, progress_timeout=10.0, heartbeat_timeout=100.0))
    waiter = Joiner.__new__(Joiner)
    waiter.job, waiter.heartbeat = SimpleNamespace(_ticks=5), None
    waiter._blocked("g1:3:waiting for the leader's evaluate")
    for t in range(0, 31):
        m.heartbeat("a", 5, float(t), busy="running evaluate for every member", progress=1)  # the leader evaluates
        m.heartbeat("b", 5, float(t), blocked_on="g1:3:waiting for the leader's evaluate", progress=waiter.job._ticks)
        m.heartbeat("c", 5, float(t), blocked_on="g1:3:waiting for the leader's evaluate", progress=7)
        assert m.expire(float(t)) == []
    waiter._blocked(None)  # the result came
    m.heartbeat("b", 5, 31.0, blocked_on=None, progress=waiter.job._ticks)
    assert m.expire(31.0) == [] and m.members["b"].state is MemberState.ACTIVE


def test_the_first_leader_is_the_lowest_slot_of_the_first_node_and_stays_while_it_lives():
    """As rank 0 under torchrun: not whichever worker's join arrived first (local rank 1 led 7 of 9
    two-worker runs, and its rank-zero logger moved when it died)."""
    m = _membership(expected_members=4)
    for t, member in enumerate(["a.w1.r0", "b.w1.r0", "a.w0.r0", "b.w0.r0"]):
        m.join(member, member.split(".")[0], pid=t, step=0, now=1.0 + t)
    generation, _ = m.maybe_form(5.0)
    assert generation.members == ("a.w0.r0", "a.w1.r0", "b.w0.r0", "b.w1.r0")
