"""The coordinator's lean line server (:mod:`unbroken.coordinator.line_server`): heartbeats and
joins answered without aiohttp, with the same answers (token, 400s, 503 of a candidate that does
not lead), every other request handed over to aiohttp on the same connection, and a held poll's
line that closes making its member dead at once. Spoken to over raw sockets, as any HTTP/1.1
client (``http.client``, ``curl``) speaks."""

from __future__ import annotations

import json
import socket
import time

import pytest

from testbed.harness import wait_for
from unbroken.coordinator.membership import MembershipSettings, MemberState
from unbroken.coordinator.server import Coordinator, CoordinatorSettings


def _request(method: str, path: str, body: dict | bytes | None = None, token: str | None = None, extra: str = "") -> bytes:
    payload = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else b"")
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"{method} {path} HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\n{auth}{extra}"
            f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


class _Line:
    """One keep-alive connection; reads one response at a time (Content-Length framed)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def response(self) -> tuple[int, dict]:
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        status = int(lines[0].split(" ")[1])
        length = next(int(v) for k, _, v in (line.partition(":") for line in lines[1:]) if k.lower() == "content-length")
        while len(rest) < length:
            self.buffer = head + b"\r\n\r\n" + rest
            self._read()
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
        self.buffer = rest[length:]
        return status, json.loads(rest[:length])

    def _read(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("the coordinator closed the connection")
        self.buffer += chunk

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def coordinator():
    started = Coordinator(CoordinatorSettings(hold=0.3, token="s3cret"), MembershipSettings(expected_members=2, heartbeat_timeout=30.0))
    started.start_in_thread()
    yield started
    started.stop()


def _join(line: _Line, member: str) -> tuple[int, dict]:
    line.send(_request("POST", "/v1/join", {"member": member, "node": "n", "pid": 1, "step": 0, "lean": True}, token="s3cret"))
    return line.response()


def test_the_lean_line_answers_as_aiohttp_would_a_wrong_token_bad_json_and_a_body_without_a_member(coordinator):
    line = _Line(coordinator.port)
    try:
        line.send(_request("POST", "/v1/heartbeat", {"member": "a"}, token="wrong"))
        status, body = line.response()
        assert status == 401 and "token" in body["error"]
        line.send(_request("POST", "/v1/heartbeat", {"member": "a"}))  # no token at all
        assert line.response()[0] == 401
        line.send(_request("POST", "/v1/heartbeat", b"{not json", token="s3cret"))
        status, body = line.response()
        assert status == 400 and "member" in body["error"]
        line.send(_request("POST", "/v1/join", {"node": "n"}, token="s3cret"))
        assert line.response()[0] == 400
        line.send(_request("POST", "/v1/join", {"member": "a", "step": "not a step"}, token="s3cret"))
        status, body = line.response()
        assert status == 400 and "/v1/join" in body["error"]
        assert "a" not in coordinator.state.members  # nothing of it was taken
    finally:
        line.close()


def test_requests_sent_back_to_back_are_answered_in_order_and_other_paths_are_handed_to_aiohttp(coordinator):
    line = _Line(coordinator.port)
    try:
        # two requests in one write (pipelined): the second is served once the first is answered
        line.send(_request("POST", "/v1/heartbeat", {"member": "x", "hold": 0.0}, token="s3cret") * 2)
        first, second = line.response(), line.response()
        assert first[0] == second[0] == 200 and first[1]["state"] == "unknown"
        assert len(coordinator._lines) == 1  # served by the lean line, not aiohttp
        # then a path the lean line does not serve, on the same connection: aiohttp answers it
        line.send(b"GET /v1/status HTTP/1.1\r\nHost: c\r\nAuthorization: Bearer s3cret\r\n\r\n")
        status, body = line.response()
        assert status == 200 and "members" in body
        assert not coordinator._lines  # handed over
        # and the connection stays aiohttp's, heartbeats included, with the same answers
        line.send(_request("POST", "/v1/heartbeat", {"member": "x", "hold": 0.0}, token="s3cret"))
        status, body = line.response()
        assert status == 200 and body["state"] == "unknown"
    finally:
        line.close()


def test_a_held_heartbeat_answers_at_the_end_of_its_hold_or_at_once_with_news(coordinator):
    a, b = _Line(coordinator.port), _Line(coordinator.port)
    try:
        a.send(_request("POST", "/v1/join", {"member": "a", "node": "n", "pid": 1, "step": 0, "lean": True}, token="s3cret"))
        wait_for(lambda: "a" in coordinator.state.members, 5, "a's join")
        status, formed_b = _join(b, "b")
        status_a, formed_a = a.response()
        assert status == status_a == 200 and formed_a["status"] == formed_b["status"] == "formed"
        seen = {}
        a.send(_request("POST", "/v1/heartbeat", {"member": "a", "seen": seen, "hold": 5.0}, token="s3cret"))
        status, view = a.response()  # news (it has seen nothing): at once
        assert status == 200 and view["generation"] == formed_a["generation"] and view["state"] == "active"
        sent = time.monotonic()
        a.send(_request("POST", "/v1/heartbeat", {"member": "a", "seen": view, "hold": 5.0}, token="s3cret"))
        status, again = a.response()  # no news: held for the coordinator's hold (0.3 s), not 5 s
        assert status == 200 and again == view and 0.25 <= time.monotonic() - sent < 3.0
        # a held heartbeat whose line closes: its member is dead at once (its process is gone)
        b.send(_request("POST", "/v1/heartbeat", {"member": "b", "seen": {}, "hold": 0.0}, token="s3cret"))
        status, view_b = b.response()
        b.send(_request("POST", "/v1/heartbeat", {"member": "b", "seen": view_b, "hold": 30.0}, token="s3cret"))
        a.send(_request("POST", "/v1/heartbeat", {"member": "a", "seen": view, "hold": 30.0}, token="s3cret"))
        held = lambda m: any(p.member_id == m for group in coordinator._waiters.values() for p in group)  # noqa: E731
        wait_for(lambda: held("a") and held("b"), 5, "a's and b's held polls")
        b.close()
        wait_for(lambda: coordinator.state.members["b"].state is MemberState.DEAD, 5, "b declared dead")
        assert coordinator.state.members["b"].death_reason and "connection" in coordinator.state.members["b"].death_reason
        status, woken = a.response()  # a's held poll, woken by the break (and its line deferred meanwhile)
        assert status == 200 and woken["broken"] or woken["generation"] > view["generation"]
        a.send(_request("POST", "/v1/heartbeat", {"member": "a", "seen": {}, "hold": 0.0}, token="s3cret"))
        assert a.response()[0] == 200  # served again once the wake-up was over
    finally:
        a.close()
        b.close()


def test_a_candidate_that_does_not_lead_answers_503_on_the_lean_line(coordinator, monkeypatch):
    class NotLeading:
        me = "127.0.0.1:1"
        known_leader = "127.0.0.1:2"

    monkeypatch.setattr(coordinator, "leadership", NotLeading())
    monkeypatch.setattr(coordinator, "_serving", lambda: False)
    line = _Line(coordinator.port)
    try:
        line.send(_request("POST", "/v1/heartbeat", {"member": "a"}, token="s3cret"))
        status, body = line.response()
        assert status == 503 and body["leader"] == "127.0.0.1:2" and "does not lead" in body["error"]
    finally:
        line.close()


def test_a_line_answered_by_a_wake_up_is_served_again_only_once_every_poll_of_it_is_answered():
    """The next heartbeat of a member answered early in a wake-up would only be held: serving it
    between slices made the last survivors wait behind thousands of them."""
    import asyncio

    coordinator = Coordinator(CoordinatorSettings(wake_slice=0.0), MembershipSettings(expected_members=2))
    served: list[tuple[int, int]] = []  # (line, polls still to wake when it was served again)

    class Line:
        def __init__(self, index: int) -> None:
            self.index = index

        def defer_serving(self) -> None:
            pass

        def serve_again(self) -> None:
            served.append((self.index, len(coordinator._to_wake)))

    class Poll:  # a held poll: answered when woken, its line deferred as LineRequests does
        def __init__(self, index: int) -> None:
            self.line, self.over = Line(index), False

        def done(self) -> bool:
            return self.over

        def set_result(self, _) -> None:
            self.over = True
            coordinator._defer_serving(self.line)

    async def run():
        polls = [Poll(i) for i in range(300)]
        coordinator._to_wake.extend(polls)
        coordinator._schedule_wakes()
        turns = 0
        while len(served) < 300 and turns < 100:
            await asyncio.sleep(0)
            turns += 1
        return polls, turns

    polls, turns = asyncio.run(run())
    assert all(p.over for p in polls) and turns >= 5  # a chunk of 64 a turn: several turns
    assert [i for i, _ in served] == list(range(300))  # oldest first, each once
    assert all(left == 0 for _, left in served)  # none before the last poll was answered
