"""Decisions one member takes for all outlive it (DESIGN: Fast paths): a ``job.stop()`` the
coordinator holds is carried into every generation formed after it; a divergence fails the job."""

from __future__ import annotations

from tests.unit.coordinator.test_catch_up import _running
from unbroken.coordinator.membership import MembershipSettings
from unbroken.worker.join_request import formed_from_view


def test_a_stop_request_is_carried_by_every_generation_formed_after_it_and_the_earliest_wins():
    m = _running("a", "b", "c")
    assert m.current.stop is None and "stop" not in m.view_for("a")
    assert m.request_stop(13, "early stop after step 12")
    assert not m.request_stop(20, "later")  # the earliest request wins
    assert m.current.stop is None  # a generation's stop is the one it formed with: its members agree on it
    m.mark_dead("a", "killed by SIGKILL", now=1.0)  # the leader that asked died
    for member_id in ("b", "c"):
        m.join(member_id, "node", pid=0, step=13, now=1.5)
    generation, decision = m.maybe_form(1.5)
    assert generation is not None, decision.reason
    assert generation.stop == {"step": 13, "reason": "early stop after step 12"}
    view = m.view_for("b")
    assert view["stop"] == generation.stop
    # a member formed without joining builds the same reply from its view, stop included
    view["incarnation"] = "i1"
    reply = formed_from_view(view, ("127.0.0.1", 1), "i1", after=1)
    assert reply is not None and reply["stop"] == generation.stop
    assert m.request_stop(11, "an earlier one")
    assert m.stop_request == {"step": 11, "reason": "an earlier one"}


def test_a_stop_and_a_divergence_posted_to_the_coordinator():
    from unbroken.coordinator.client import CoordinatorClient
    from unbroken.coordinator.server import Coordinator, CoordinatorSettings

    c = Coordinator(CoordinatorSettings(), MembershipSettings(heartbeat_timeout=60.0, expected_members=1)).start_in_thread()
    try:
        client = CoordinatorClient(f"127.0.0.1:{c.port}", timeout=5.0)
        client.post("/v1/stop", member="a", step=7, reason="enough")
        assert c.state.stop_request == {"step": 7, "reason": "enough"}
        client.post("/v1/fail_job", member="a", reason="replicas diverged: members hold different parameters after step 9")
        assert c.state.failed and "replicas diverged" in c.state.failed
        reply = client.post("/v1/join", read_timeout=5.0, member="b", node="n", pid=2, step=0, after=0, hold=0.2)
        assert reply["status"] == "failed" and "diverged" in reply["reason"], reply
    finally:
        c.stop()
