"""The coordinator's quarantine of a worker slot: joins from the slot are refused until it ends."""

from __future__ import annotations

import time

import pytest

from unbroken.coordinator.client import CoordinatorClient
from unbroken.coordinator.server import Coordinator, CoordinatorSettings
from unbroken.errors import CoordinatorUnreachable
from unbroken.coordinator.membership import MembershipSettings


@pytest.fixture
def coordinator():
    c = Coordinator(CoordinatorSettings(hold=0.05), MembershipSettings(expected_members=1)).start_in_thread()
    try:
        yield c, CoordinatorClient(f"127.0.0.1:{c.port}", timeout=5.0)
    finally:
        c.stop()


def join(client, member, after=0):
    return client.post("/v1/join", member=member, node="n", pid=1, step=0, after=after)


def test_a_quarantined_slot_is_refused_and_other_slots_are_not(coordinator):
    c, client = coordinator
    assert client.post("/v1/quarantine", prefix="n.w1.", seconds=60, reason="failed 6 times within 300 s") == {"ok": True}
    reply = join(client, "n.w1.r6")
    assert reply["status"] == "refused" and "n.w1." in reply["reason"]
    assert "n.w1.r6" not in c.state.members  # refused before it is recorded at all
    assert join(client, "n.w10.r0")["status"] == "formed"  # the prefix ends with the dot
    assert 59 < client.status()["quarantined"]["n.w1."] <= 60


def test_a_quarantine_ends_by_itself_or_when_lifted(coordinator):
    c, client = coordinator
    client.post("/v1/quarantine", prefix="n.w0.", seconds=0.3, reason="x")
    assert join(client, "n.w0.r1")["status"] == "refused"
    time.sleep(0.4)
    assert join(client, "n.w0.r1")["status"] == "formed"
    assert client.status()["quarantined"] == {}
    client.post("/v1/quarantine", prefix="n.w2.", seconds=600, reason="x")
    client.post("/v1/quarantine", prefix="n.w2.", seconds=0, reason="cool-off over")
    assert client.status()["quarantined"] == {}
    assert join(client, "n.w2.r3", after=1)["status"] != "refused"


@pytest.mark.parametrize(
    "body",
    [{"seconds": 5}, {"prefix": "", "seconds": 5}, {"prefix": "n.w0.", "seconds": "5"}, {"prefix": "n.w0.", "seconds": True}, {"prefix": 3, "seconds": 1}],
)
def test_a_malformed_quarantine_request_is_refused(coordinator, body):
    c, client = coordinator
    with pytest.raises(CoordinatorUnreachable, match="answered 400"):
        client.post("/v1/quarantine", **body)
    assert client.status()["quarantined"] == {}
