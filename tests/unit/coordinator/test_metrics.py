"""The coordinator's Prometheus metrics: values from the membership state, and ``GET /metrics``."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from unbroken.coordinator.membership import Membership, MembershipSettings
from unbroken.coordinator.metrics import CoordinatorMetrics


def samples(text: bytes | str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of an exposition text."""
    if isinstance(text, bytes):
        text = text.decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def test_the_gauges_are_read_from_the_state_when_rendered():
    state = Membership(MembershipSettings(expected_members=3))
    metrics = CoordinatorMetrics()
    before = samples(metrics.render(state))
    assert before[("unbroken_members", ())] == 0
    assert before[("unbroken_generation", ())] == 0
    assert before[("unbroken_job_finished", ())] == 0
    for i, m in enumerate("abc"):
        state.join(m, "n", pid=i, step=0, now=0.0)
    assert state.maybe_form(0.0)[0] is not None
    state.heartbeat("a", 7, now=0.1)
    formed = samples(metrics.render(state))
    assert (formed[("unbroken_members", ())], formed[("unbroken_generation", ())], formed[("unbroken_committed_step", ())]) == (3, 1, 7)
    state.mark_dead("b", "killed by SIGKILL", now=0.2)
    assert samples(metrics.render(state))[("unbroken_members", ())] == 2
    state.leave("a", finished=True, step=9, now=0.3)
    assert samples(metrics.render(state))[("unbroken_job_finished", ())] == 1


def test_paces_from_heartbeats_become_per_member_gauges_for_the_current_generation_only():
    state = Membership(MembershipSettings(expected_members=3))
    metrics = CoordinatorMetrics()
    for i, m in enumerate("abc"):
        state.join(m, "n", pid=i, step=0, now=0.0)
    assert state.maybe_form(0.0)[0] is not None
    state.heartbeat("a", 3, now=0.1, pace={"pace": 1.0, "straggler": False, "exchange_seconds": 0.09})
    state.heartbeat("b", 3, now=0.1, pace={"pace": 0.5, "straggler": True, "exchange_seconds": 0.001})
    state.heartbeat("c", 3, now=0.1, pace={"pace": "fast", "straggler": 1, "exchange_seconds": -2})  # ignored
    found = samples(metrics.render(state))
    assert found[("unbroken_stragglers", ())] == 1
    assert found[("unbroken_member_pace", (("member", "a"),))] == 1.0
    assert found[("unbroken_member_pace", (("member", "b"),))] == 0.5
    assert ("unbroken_member_pace", (("member", "c"),)) not in found
    assert found[("unbroken_member_exchange_seconds", (("member", "a"),))] == 0.09
    state.mark_dead("b", "killed by SIGKILL", now=0.2)
    state.maybe_form(5.0)
    later = samples(metrics.render(state))
    assert ("unbroken_member_pace", (("member", "b"),)) not in later
    assert later[("unbroken_stragglers", ())] == 0


def test_failures_are_counted_by_how_they_were_detected_and_stalls_observed():
    metrics = CoordinatorMetrics()
    metrics.failure("launcher")
    metrics.failure("collective")
    metrics.failure("launcher")
    metrics.stalled(0.3)
    metrics.stalled(-1.0)  # clocks never make it negative, but a stall never is
    found = samples(metrics.render(Membership(MembershipSettings())))
    assert found[("unbroken_failures_total", (("detected_by", "launcher"),))] == 2
    assert found[("unbroken_failures_total", (("detected_by", "collective"),))] == 1
    assert found[("unbroken_stall_seconds_count", ())] == 2
    assert found[("unbroken_stall_seconds_sum", ())] == 0.3
    assert found[("unbroken_stall_seconds_bucket", (("le", "0.25"),))] == 1


def test_each_coordinator_has_its_own_registry():
    one, two = CoordinatorMetrics(), CoordinatorMetrics()
    one.failure("heartbeat")
    state = Membership(MembershipSettings())
    assert ("unbroken_failures_total", (("detected_by", "heartbeat"),)) not in samples(two.render(state))


def test_a_running_coordinator_serves_its_metrics_over_http():
    from unbroken.coordinator.client import CoordinatorClient
    from unbroken.coordinator.server import Coordinator, CoordinatorSettings

    coordinator = Coordinator(CoordinatorSettings(hold=0.05), MembershipSettings(expected_members=1)).start_in_thread()
    try:
        url = f"http://127.0.0.1:{coordinator.port}/metrics"
        client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", timeout=5.0)

        def scrape() -> dict:
            with urllib.request.urlopen(url, timeout=5) as response:
                assert response.headers["Content-Type"].startswith("text/plain")
                return samples(response.read())

        assert scrape()[("unbroken_members", ())] == 0
        assert client.post("/v1/join", member="a", node="n", pid=1, step=0, after=0)["status"] == "formed"
        first = scrape()
        assert (first[("unbroken_members", ())], first[("unbroken_generation", ())]) == (1, 1)
        assert first[("unbroken_stall_seconds_count", ())] == 0
        client.post("/v1/exit", member="a", exitcode=-9, reason="killed by SIGKILL")
        dead = scrape()
        assert dead[("unbroken_members", ())] == 0
        assert dead[("unbroken_failures_total", (("detected_by", "launcher"),))] == 1
        assert client.post("/v1/join", member="b", node="n", pid=2, step=0, after=1)["status"] == "formed"
        healed = scrape()
        assert (healed[("unbroken_members", ())], healed[("unbroken_generation", ())]) == (1, 2)
        assert healed[("unbroken_stall_seconds_count", ())] == 1
    finally:
        coordinator.stop()
