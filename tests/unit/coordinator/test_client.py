"""The coordinator client's lease: it counts from when a request was sent, never from when its
reply was read (issue 11: a stale commit after a pause)."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from unbroken.coordinator.client import CoordinatorClient, Heartbeat


class _SlowCoordinator(http.server.BaseHTTPRequestHandler):
    delay = 0.0
    replies: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(type(self).delay)
        body = json.dumps({"generation": 1, "n": len(type(self).replies)}).encode()
        type(self).replies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def coordinator():
    handler = type("Handler", (_SlowCoordinator,), {"delay": 0.0, "replies": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield handler, f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_lease_counts_from_when_the_request_was_sent_not_when_its_reply_arrived(coordinator):
    handler, address = coordinator
    handler.delay = 1.0  # a reply that takes a second, as for a member paused with it in flight
    client = CoordinatorClient(address, timeout=5)
    before = time.monotonic()
    client.post("/v1/heartbeat", member="a")
    after = time.monotonic()
    assert after - before >= 1.0
    assert before <= client.last_ok <= before + 0.5  # the send time, not the read time


def test_a_heartbeat_reply_older_than_the_lease_is_dropped_not_taken_as_the_view(coordinator):
    handler, address = coordinator
    handler.delay = 0.6
    views = []
    beat = Heartbeat(CoordinatorClient(address, timeout=5), "a", interval=0.05, on_change=views.append, max_age=0.3)
    beat.start()
    try:
        deadline = time.monotonic() + 10
        while len(handler.replies) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(handler.replies) >= 3
        assert views == [] and beat.view == {}
        handler.delay = 0.0
        while not views and time.monotonic() < deadline:
            time.sleep(0.05)
        assert views and views[0]["generation"] == 1
    finally:
        beat.stop()


def test_a_503_sends_the_client_to_the_leader_it_names_and_teaches_it_every_candidate():
    from unbroken.coordinator.client import CoordinatorClient

    client = CoordinatorClient("a:1")
    client._follow(b'{"leader": "b:2", "coordinators": ["b:2", "c:3"]}', ("a", 1))
    assert client.addresses == [("a", 1), ("b", 2), ("c", 3)] and (client.host, client.port) == ("b", 2)
    client._follow(b'{"leader": null, "coordinators": ["not an address"]}', ("b", 2))  # no leader known: the next one
    assert (client.host, client.port) == ("c", 3) and len(client.addresses) == 3
    client._follow(b"not json", ("c", 3))
    assert (client.host, client.port) == ("a", 1)


class _ScriptedCoordinator(http.server.BaseHTTPRequestHandler):
    """Answers each heartbeat at once with the next view of ``script`` (the last one repeated),
    recording when each request arrived and the hold it asked for."""

    script: list[dict] = []
    requests: list[tuple[float, float]] = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        cls = type(self)
        cls.requests.append((time.monotonic(), body["hold"]))
        reply = json.dumps(cls.script[min(len(cls.requests) - 1, len(cls.script) - 1)]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def _polls(script: list[dict], interval: float, count: int) -> list[tuple[float, float]]:
    """The first ``count`` heartbeat polls (when, hold) a Heartbeat sends to a coordinator that
    answers ``script`` in order (its last entry ever after)."""
    handler = type("Handler", (_ScriptedCoordinator,), {"script": script, "requests": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    beat = Heartbeat(CoordinatorClient(f"127.0.0.1:{server.server_address[1]}", timeout=5), "a", interval=interval, on_change=lambda view: None)
    beat.start()
    try:
        deadline = time.monotonic() + 10
        while len(handler.requests) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return handler.requests[:count]
    finally:
        beat.stop()
        server.shutdown()
        server.server_close()


def test_after_news_the_next_poll_holds_a_random_part_and_while_broken_polls_come_back_at_once_after_pauses():
    from unbroken.coordinator.client import NEWS_HOLD

    interval = 0.4
    formed = {"generation": 1, "broken": False, "reconfigure": False, "state": "active"}
    broken = {"generation": 1, "broken": True, "reconfigure": True, "state": "active"}
    polls = _polls([formed, formed, broken, broken, broken, formed], interval, 7)
    (t0, hold0), (t1, hold1), (t2, hold2), (t3, hold3), (t4, hold4), (t5, hold5), (t6, hold6) = polls
    low, high = (interval * f for f in NEWS_HOLD)
    assert hold0 == 0  # the first poll comes back at once: the member's join needs the line next
    # news (the first view): the next poll goes at once, held a random part of the interval
    assert t1 - t0 < low and low <= hold1 <= high
    # no news: a full hold
    assert hold2 == interval
    # its generation broke (it is about to join): while the view stays broken, each poll waits a
    # random part of the interval first and asks for no hold, so that a join never waits behind one
    # (a held poll kept a rejoin after a failed heal waiting for a whole hold)
    for (sent, hold), (after, _) in ((polls[2], polls[3]), (polls[3], polls[4]), (polls[4], polls[5])):
        assert low <= after - sent <= high + 0.2
    assert hold3 == hold4 == hold5 == 0
    # active again (news): the next poll at once, held a random part
    assert t6 - t5 < low and low <= hold6 <= high


def test_a_view_that_is_not_active_makes_the_next_poll_wait_first_leaving_the_line_to_the_join():
    # declared dead (it was stopped past its heartbeat timeout), the member rejoins next: a poll
    # held meanwhile would hold the line its join needs (seen in CI: the rejoin came too late)
    from unbroken.coordinator.client import NEWS_HOLD

    interval = 0.4
    active = {"generation": 1, "broken": False, "reconfigure": False, "state": "active"}
    dead = {"generation": 1, "broken": False, "reconfigure": False, "state": "dead"}
    (t0, _), (t1, _), (t2, _) = _polls([active, dead, dead], interval, 3)
    low = interval * NEWS_HOLD[0]
    assert t1 - t0 < low  # active: the next poll at once
    assert t2 - t1 >= low  # dead: a pause first


def test_the_heartbeat_renews_the_lease_only_after_the_view_that_came_with_it_is_taken():
    """``answered`` (the lease) moves after ``view``: a reader that sees the renewed lease sees
    the news that came with it; a renewed lease with the old view let a cut-off member commit."""
    first = {"generation": 1, "state": "active"}
    news = {"generation": 2, "state": "dead"}
    handler = type("Handler", (_ScriptedCoordinator,), {"script": [first, news], "requests": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    seen = []
    beat = Heartbeat(CoordinatorClient(f"127.0.0.1:{server.server_address[1]}", timeout=5), "a", interval=0.05,
                     on_change=lambda view: seen.append((view, beat.answered)))
    started = beat.answered
    beat.start()
    try:
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        beat.stop()
        server.shutdown()
        server.server_close()
    assert [view for view, _ in seen] == [first, news]
    # when each view was taken, the lease had not yet moved to its request
    (_, before_first), (_, before_news) = seen
    assert before_first == started and before_first < before_news
    assert beat.answered > before_news
