"""The coordinator's side of catching up (unbroken.worker.catch_up): a newcomer that catches up
waits without making anyone re-form, and one member of the running generation is named its donor."""

from __future__ import annotations

from unbroken.coordinator.membership import Membership, MembershipSettings, MemberState


def _running(*ids: str) -> Membership:
    m = Membership(MembershipSettings(heartbeat_timeout=5.0, expected_members=len(ids)))
    for i, member_id in enumerate(ids):
        m.join(member_id, "node", pid=i, step=0, now=0.0)
    generation, decision = m.maybe_form(0.0)
    assert generation is not None, decision.reason
    return m


def test_a_newcomer_that_catches_up_makes_nobody_re_form_and_gets_the_last_ranked_member_as_donor():
    m = _running("a", "b", "c")
    assert m.join("new", "node", pid=9, step=0, now=1.0, catch_up="10.0.0.9:4000")
    assert not m.reconfigure_wanted() and not m.view_for("a")["reconfigure"]
    assert m.view_for("c")["donate"] == {"member": "new", "address": "10.0.0.9:4000"}
    assert "donate" not in m.view_for("a") and "donate" not in m.view_for("new")
    assert "c" in m.changed_members  # its held heartbeat must answer at once
    # a second newcomer gets another donor
    m.join("new2", "node", pid=10, step=0, now=1.0, catch_up="10.0.0.10:4000")
    assert m.view_for("b")["donate"]["member"] == "new2" and not m.reconfigure_wanted()


def test_when_it_has_caught_up_it_joins_as_usual_and_the_others_re_form_for_it():
    m = _running("a", "b", "c")
    m.join("new", "node", pid=9, step=0, now=1.0, catch_up="10.0.0.9:4000")
    m.changed_members.clear()
    assert m.join("new", "node", pid=9, step=17, now=2.0)  # no catch_up: caught up (or given up)
    assert m.reconfigure_wanted() and "donate" not in m.view_for("c") and "c" in m.changed_members
    assert not m.join("new", "node", pid=9, step=17, now=2.5)  # the same again changes nothing
    for member_id in ("a", "b", "c"):
        m.join(member_id, "node", pid=0, step=17, now=3.0)
    generation, decision = m.maybe_form(3.0)
    assert generation is not None and "new" in generation.members, decision.reason


def test_a_formation_ends_every_catch_up_and_a_dead_newcomer_no_longer_counts():
    m = _running("a", "b", "c")
    m.join("new", "node", pid=9, step=0, now=1.0, catch_up="10.0.0.9:4000")
    m.mark_dead("b", "killed by SIGKILL", now=2.0)  # another failure: the generation re-forms, the newcomer in it
    for member_id in ("a", "c"):
        m.join(member_id, "node", pid=0, step=5, now=2.5)
    generation, _ = m.maybe_form(2.5)
    assert generation is not None and "new" in generation.members
    assert m.members["new"].catch_up is None and "donate" not in m.view_for("c")
    m2 = _running("a", "b")
    m2.join("new", "node", pid=9, step=0, now=1.0, catch_up="x:1")
    m2.mark_dead("new", "killed by SIGKILL", now=2.0)
    assert m2.members["new"].state is MemberState.DEAD and m2.catching_up() == 0 and not m2.reconfigure_wanted()


def test_without_a_running_generation_or_a_free_donor_it_waits_as_any_joiner_and_is_healed():
    m = Membership(MembershipSettings(heartbeat_timeout=5.0, expected_members=3))
    m.join("new", "node", pid=9, step=0, now=0.0, catch_up="x:1")
    assert m.catching_up() == 0 and m.members["new"].catch_up is None
    m = _running("a", "b")
    m.join("n1", "node", pid=1, step=0, now=1.0, catch_up="x:1")
    m.join("n2", "node", pid=2, step=0, now=1.0, catch_up="x:2")
    assert {m.view_for("b")["donate"]["member"], m.view_for("a")["donate"]["member"]} == {"n1", "n2"}
    assert not m.reconfigure_wanted()
    m.join("n3", "node", pid=3, step=0, now=1.0, catch_up="x:3")  # every member donates already
    assert m.members["n3"].catch_up is None and m.reconfigure_wanted()
    assert not m.join("n1", "node", pid=1, step=0, now=1.5, catch_up="x:1")  # polling again keeps its donor


def test_a_join_asks_for_a_shorter_hold_than_the_coordinators_and_gets_its_answer_within_it():
    # a newcomer catching up polls again soon (it must say when it has caught up): a join held the
    # coordinator's whole hold (30 s here) would outlast the client's 5 s and fail the test
    from unbroken.coordinator.client import CoordinatorClient
    from unbroken.coordinator.server import Coordinator, CoordinatorSettings

    c = Coordinator(CoordinatorSettings(hold=30.0), MembershipSettings(heartbeat_timeout=60.0, expected_members=1)).start_in_thread()
    try:
        client = CoordinatorClient(f"127.0.0.1:{c.port}", timeout=5.0)
        first = client.post("/v1/join", read_timeout=5.0, member="a", node="n", pid=1, step=0, after=0, hold=0.2)
        assert first["status"] == "formed", first
        reply = client.post("/v1/join", read_timeout=5.0, member="new", node="n", pid=2, step=0, after=0,
                            catch_up="127.0.0.1:9", hold=0.2)
        assert reply["status"] == "wait", reply
        assert c.state.members["new"].catch_up == "127.0.0.1:9"
    finally:
        c.stop()


def test_once_a_replay_failed_to_verify_no_newcomer_is_named_a_donor_and_those_waiting_are_healed():
    m = _running("a", "b", "c")
    m.join("new", "node", pid=9, step=0, now=1.0, catch_up="10.0.0.9:4000")
    assert m.view_for("c")["donate"]["member"] == "new" and m.catching_up() == 1
    assert m.stop_catch_ups("the state replayed to step 7 differs from its donor's")
    assert not m.stop_catch_ups("again")  # once
    assert "donate" not in m.view_for("c") and m.catching_up() == 0 and m.reconfigure_wanted()
    m.join("later", "node", pid=10, step=0, now=2.0, catch_up="10.0.0.10:4000")
    assert m.members["later"].catch_up is None and not any("donate" in m.view_for(x) for x in ("a", "b", "c"))


def test_the_coordinator_turns_catch_ups_off_on_a_members_report_and_says_so():
    from unbroken.coordinator.client import CoordinatorClient
    from unbroken.coordinator.server import Coordinator, CoordinatorSettings

    c = Coordinator(CoordinatorSettings(), MembershipSettings(heartbeat_timeout=60.0, expected_members=1)).start_in_thread()
    try:
        client = CoordinatorClient(f"127.0.0.1:{c.port}", timeout=5.0)
        client.post("/v1/catch_up_off", member="a", reason="differs")
        assert c.state.catch_up_off == "differs"
    finally:
        c.stop()
