"""A worker's one connection to the coordinator (issue 31: 16,000 members within a 20,000-file limit):
its heartbeats and joins take one keep-alive line in turn, every other request gets a connection
of its own, and the coordinator watches the line whether a heartbeat or a join holds it."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest

from unbroken.coordinator.client import CoordinatorClient, Heartbeat
from unbroken.coordinator.member_line import MemberLine
from unbroken.coordinator.membership import MembershipSettings, MemberState
from unbroken.coordinator.server import Coordinator, CoordinatorSettings
from unbroken.errors import CoordinatorUnreachable


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_heartbeats_wait_while_the_member_joins_and_joins_go_back_to_back():
    line = MemberLine()
    order: list[str] = []

    def heartbeat() -> None:
        with line.turn("/v1/heartbeat"):
            order.append("heartbeat")

    with line.joining():
        beat = threading.Thread(target=heartbeat)
        beat.start()
        for _ in range(3):
            with line.turn("/v1/join"):
                order.append("join")
            time.sleep(0.05)  # between two joins: a heartbeat slipped in would hold the next one
        assert order == ["join"] * 3
        with line.paused_joining():  # a heal between joins: heartbeats go on meanwhile
            beat.join(5)
            assert order == ["join"] * 3 + ["heartbeat"]
    assert not beat.is_alive()


def test_one_request_at_a_time_holds_the_line():
    line = MemberLine()
    inside = threading.Event()
    release = threading.Event()
    took: list[float] = []

    def first() -> None:
        with line.turn("/v1/heartbeat"):
            inside.set()
            release.wait(5)

    def second() -> None:
        with line.turn("/v1/join"):
            took.append(time.monotonic())

    a = threading.Thread(target=first)
    a.start()
    inside.wait(5)
    b = threading.Thread(target=second)
    b.start()
    time.sleep(0.1)
    assert took == []  # the join waits for the poll in flight
    release.set()
    a.join(5)
    b.join(5)
    assert len(took) == 1


@pytest.fixture
def coordinator(request):
    timeout = getattr(request, "param", 0.6)
    c = Coordinator(CoordinatorSettings(hold=2.0), MembershipSettings(heartbeat_timeout=timeout, expected_members=2)).start_in_thread()
    try:
        yield c
    finally:
        c.stop()


def _join(client: CoordinatorClient, member: str, after: int = 0) -> dict:
    return client.post("/v1/join", read_timeout=5.0, member=member, node="n", pid=1, step=0, after=after, lean=True)


def test_a_members_heartbeats_and_joins_share_one_connection_and_other_requests_close_theirs(coordinator):
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", timeout=5.0, one_line=True)
    beat = Heartbeat(client, "a", 0.2, lambda view: None).start()
    try:
        seen: set[int] = set()

        def note() -> bool:
            transport = coordinator._heartbeat_connections.get("a")
            if transport is not None:
                seen.add(id(transport))
            return transport is not None

        _wait(note, 5, "a heartbeat")
        with client.joining():
            reply = _join(client, "a")  # waits for the member b; held at most timeout/3
        assert reply["status"] == "wait", reply
        note()
        time.sleep(0.5)  # heartbeats again
        note()
        assert len(seen) == 1, "the heartbeat and the join came over different connections"
        line = client.line.conn.sock.getsockname()
        client.post("/v1/failure", member="a", generation=0, error="test")  # a connection of its own
        assert client.line.conn.sock.getsockname() == line
        _wait(lambda: _connections_from(coordinator.port) == 1, 5, "the failure report's connection to close")
    finally:
        beat.stop()


def _connections_from(port: int) -> int:
    """Established client connections of this process to ``port`` (from /proc)."""
    count = 0
    with open("/proc/net/tcp") as f:
        for row in f.readlines()[1:]:
            fields = row.split()
            remote, state = fields[2], fields[3]
            if state == "01" and int(remote.split(":")[1], 16) == port:
                count += 1
    return count


def test_a_held_join_keeps_its_member_alive_without_heartbeats(coordinator):
    # heartbeats wait while the member joins: its joins, back to back, are its heartbeats. Held
    # the coordinator's whole hold (2 s here) against a 0.6 s heartbeat timeout, the waiting member
    # would be declared dead for silence between two joins.
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", timeout=5.0, one_line=True)
    start = time.monotonic()
    with client.joining():
        while time.monotonic() - start < 2.0:
            asked = time.monotonic()
            assert _join(client, "a")["status"] == "wait"
            assert time.monotonic() - asked < 0.5  # held a third of the heartbeat timeout
    assert coordinator.state.members["a"].state is MemberState.WAITING, coordinator.state.members["a"].death_reason


@pytest.mark.parametrize("coordinator", [30.0], indirect=True)  # no verdict for silence within the test
def test_a_member_whose_line_closes_while_its_join_is_held_is_dead_at_once(coordinator):
    sock = socket.create_connection(("127.0.0.1", coordinator.port))
    body = b'{"member": "a", "node": "n", "pid": 1, "step": 0, "after": 0, "lean": true}'
    sock.sendall(b"POST /v1/join HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    _wait(lambda: "a" in coordinator.state.members, 5, "the join to arrive")
    sock.close()  # as the kernel does for a dead process, while its join is held
    _wait(lambda: coordinator.state.members["a"].state is MemberState.DEAD, 1.0, "the verdict")
    assert coordinator.state.members["a"].death_reason.startswith("its heartbeat connection closed")


class _Leader(http.server.BaseHTTPRequestHandler):
    """Answers every request with an active view (``/v1/failure`` slower than its read timeout),
    keeping the connection alive and recording each request's path and body."""

    protocol_version = "HTTP/1.1"
    requests: list[tuple[str, dict]] = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        type(self).requests.append((self.path, body))
        if self.path == "/v1/failure":
            time.sleep(1.0)
        reply = json.dumps({"generation": 1, "state": "active"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def leader():
    handler = type("Handler", (_Leader,), {"requests": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_a_transient_request_that_fails_leaves_the_line_on_its_candidate(leader):
    # HA: a short request (a report) that timed out used to move the client's current candidate,
    # and the line followed, closing its connection: the leader took that for the member's death
    spare = socket.socket()
    spare.bind(("127.0.0.1", 0))  # a second candidate that is down (bound, not listening)
    address = ("127.0.0.1", leader.server_address[1])
    try:
        client = CoordinatorClient(f"{address[0]}:{address[1]},127.0.0.1:{spare.getsockname()[1]}", timeout=0.1, one_line=True)
        client.post("/v1/heartbeat", member="a", hold=0)
        line = client.line.conn
        with pytest.raises(CoordinatorUnreachable):
            client.post("/v1/failure", read_timeout=0.2, member="a", generation=1, error="test")  # one try
        assert (client.host, client.port) == address
        client.post("/v1/heartbeat", member="a", hold=0)
        assert client.line.conn is line and line.sock is not None  # the same connection, still open
    finally:
        spare.close()


def test_a_heartbeat_that_waited_for_the_line_reports_what_holds_when_it_is_sent(leader):
    # a heartbeat waits while its member joins; what it reports (the step, the collective waited
    # in) is read when it takes the line, not when it began to wait
    client = CoordinatorClient(f"127.0.0.1:{leader.server_address[1]}", timeout=5.0, one_line=True)
    beat = Heartbeat(client, "a", 0.2, lambda view: None)
    with client.joining():
        beat.start()
        time.sleep(0.3)  # the first poll waits for the line
        assert leader.RequestHandlerClass.requests == []
        beat.step = 7
    try:
        _wait(lambda: leader.RequestHandlerClass.requests, 5, "the first heartbeat")
        path, body = leader.RequestHandlerClass.requests[0]
        assert path == "/v1/heartbeat" and body["step"] == 7
    finally:
        beat.stop()
