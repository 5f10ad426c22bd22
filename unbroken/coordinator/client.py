"""A small synchronous client of the coordinator's HTTP API, and the heartbeat thread.

Workers and launchers use plain ``http.client`` (one keep-alive connection per thread) so that the
worker's import stays light and no event loop runs inside the training process.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import random
import threading
import time
from typing import Any, Callable

from unbroken.coordinator.member_line import LINE_PATHS, MemberLine
from unbroken.errors import CoordinatorUnreachable, Unauthorized

log = logging.getLogger(__name__)


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``http://HOST:PORT``) into its parts, with a clear error."""
    text = address.removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator address must look like HOST:PORT, got {address!r}")
    return host, int(port)


class _NotLeading(Exception):
    """A coordinator candidate that does not lead answered 503."""


class CoordinatorClient:
    """JSON requests to the coordinator; retries connection failures up to ``timeout`` seconds.

    ``address`` may list several coordinator candidates (``h1:p,h2:p,h3:p``): a request that finds
    a candidate down goes to the next one, and one that finds a candidate not leading (503) goes
    to the leader that candidate names, else to the next one. Every candidate a reply lists
    (``coordinators``) is added, so workers that were told of one candidate fail over to any
    new leader without anybody telling them."""

    def __init__(self, address: str, timeout: float = 30.0, token: str | None = None, one_line: bool = False) -> None:
        self.addresses = [parse_address(a) for a in address.split(",") if a.strip()]
        if not self.addresses:
            raise ValueError(f"coordinator address must look like HOST:PORT[,HOST:PORT...], got {address!r}")
        self._current = 0
        self.host, self.port = self.addresses[0]
        self.timeout = timeout
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self.last_ok = time.monotonic()
        """When (monotonic) the newest request that the coordinator answered was *sent*: the
        member's lease counts from there. Counting from when the reply was read would let a
        member paused with a request in flight (SIGSTOP, a VM pause, a long GC) take a reply
        written before its death verdict for a fresh lease."""
        self._local = threading.local()
        self._learned = threading.Lock()
        self.line = MemberLine() if one_line else None
        """A worker's client (``one_line``): heartbeats and joins share one connection, every other
        request gets one of its own (:mod:`unbroken.coordinator.member_line`). Else each thread
        keeps a keep-alive connection of its own (a launcher, ``unbroken status``)."""

    def learn(self, addresses: list[str], leader: str | None = None) -> tuple[str, int] | None:
        """Add candidates this client did not know; go to ``leader`` next if one is named.
        Returns the leader's address, or None if none (or no valid one) was named."""
        with self._learned:
            known = None
            for text in addresses + ([leader] if leader else []):
                try:
                    known = parse_address(text)
                except ValueError:
                    known = None
                    continue
                if known not in self.addresses:
                    self.addresses = self.addresses + [known]
            if not leader or known is None:
                return None
            self._current = self.addresses.index(known)
            self.host, self.port = known
            return known

    def _connection(self, read_timeout: float, line: MemberLine | None, transient: bool) -> http.client.HTTPConnection:
        """The connection for one request: the member's line, a connection of its own that is
        closed after the reply (``transient``), or this thread's keep-alive connection."""
        conn = None if transient else line.conn if line is not None else getattr(self._local, "conn", None)
        if conn is not None and (conn.host, conn.port) != (self.host, self.port):
            self._drop(line)  # another thread moved on to another candidate
            conn = None
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=read_timeout)
            if line is not None:
                line.conn = conn
            elif not transient:
                self._local.conn = conn
        conn.timeout = read_timeout
        if conn.sock is not None:
            conn.sock.settimeout(read_timeout)
        return conn

    def _next_candidate(self, failed: tuple[str, int]) -> None:
        if len(self.addresses) > 1 and (self.host, self.port) == failed:
            self._current = (self._current + 1) % len(self.addresses)
            self.host, self.port = self.addresses[self._current]

    def _follow(self, data: bytes, target: tuple[str, int]) -> None:
        """After a 503: go to the leader the candidate names, else to the next candidate."""
        try:
            hint = json.loads(data)
        except ValueError:
            hint = {}
        if not isinstance(hint, dict):
            hint = {}
        named = hint.get("leader") if isinstance(hint.get("leader"), str) else None
        leader = self.learn([a for a in hint.get("coordinators") or [] if isinstance(a, str)], named)
        if leader is None or leader == target:
            self._next_candidate(target)

    def _drop(self, line: MemberLine | None = None) -> None:
        conn = line.conn if line is not None else getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        if line is not None:
            line.conn = None
        else:
            self._local.conn = None

    def joining(self) -> contextlib.AbstractContextManager[None]:
        """While the member joins, its heartbeats leave the line to its joins (:class:`MemberLine`)."""
        return self.line.joining() if self.line is not None else contextlib.nullcontext()

    def paused_joining(self) -> contextlib.AbstractContextManager[None]:
        """Inside :meth:`joining`, heartbeats take the line again meanwhile (a heal)."""
        return self.line.paused_joining() if self.line is not None else contextlib.nullcontext()

    def sent_at(self) -> float:
        """When (monotonic) this thread's newest request was sent (after waiting for the line)."""
        return getattr(self._local, "sent", time.monotonic())

    def _exchange(self, method: str, path: str, payload: bytes, read_timeout: float, line: MemberLine | None,
                  transient: bool) -> dict[str, Any]:
        """One attempt: send, read the reply, judge its status. The caller holds ``line``'s turn."""
        target = (self.host, self.port)
        conn = self._connection(read_timeout, line, transient)
        try:
            sent = self._local.sent = time.monotonic()
            headers = {**self._headers, "Connection": "close"} if transient else self._headers
            conn.request(method, path, body=payload if method == "POST" else None, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException):
            if transient:
                conn.close()
            else:
                self._drop(line)
            self._next_candidate(target)
            raise
        if transient:
            conn.close()
        if response.status == 401:
            raise Unauthorized(
                f"coordinator at {self.host}:{self.port} refused {path}: missing or wrong token"
                " (pass --token or set UNBROKEN_TOKEN to the job's token)"
            )
        if response.status == 503:
            if not transient:
                self._drop(line)
            self._follow(data, target)
            raise _NotLeading(data[:200].decode(errors="replace"))
        if response.status != 200:
            raise CoordinatorUnreachable(f"coordinator answered {response.status} to {path}: {data[:200]!r}")
        self.last_ok = max(self.last_ok, sent)
        reply = json.loads(data)
        if isinstance(reply, dict) and isinstance(reply.get("coordinators"), list):
            self.learn(reply["coordinators"])
        return reply

    def request(self, method: str, path: str, body: dict[str, Any] | None = None, read_timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        delay = 0.02
        last: Exception | None = None
        payload = json.dumps(body or {}).encode()
        line = self.line if self.line is not None and path in LINE_PATHS else None
        transient = self.line is not None and line is None
        while True:
            try:
                with line.turn(path) if line is not None else contextlib.nullcontext():
                    return self._exchange(method, path, payload, read_timeout, line, transient)
            except (_NotLeading, OSError, http.client.HTTPException) as exc:
                last = exc
            if time.monotonic() >= deadline:
                raise CoordinatorUnreachable(
                    f"coordinator at {self.host}:{self.port} did not answer {path} for {self.timeout:.0f} s ({last})"
                )
            time.sleep(delay)
            # with several candidates, a new leader is looked for often: the requests are cheap
            delay = min(delay * 2, 0.5 if len(self.addresses) == 1 else 0.1)

    def post(self, path: str, read_timeout: float = 10.0, **body: Any) -> dict[str, Any]:
        return self.request("POST", path, body, read_timeout)

    def status(self) -> dict[str, Any]:
        return self.request("GET", "/v1/status")


NEWS_HOLD = (0.5, 1.0)
"""The hold of the poll after a changed view, as fractions of the interval (drawn uniformly)."""


class Heartbeat:
    """Heartbeats the coordinator from a thread of its own and keeps the latest view.

    Each heartbeat is a long poll: the coordinator answers at once when the member's view changes
    (its generation broke, someone waits to join) and otherwise after ``interval`` seconds, so
    verdicts arrive in milliseconds while idle traffic stays at one request per interval.
    ``on_change`` is called (from the heartbeat thread) with every new view.
    """

    def __init__(
        self,
        client: CoordinatorClient,
        member: str,
        interval: float,
        on_change: Callable[[dict[str, Any]], None],
        max_age: float = float("inf"),
    ) -> None:
        self.client = client
        self.max_age = max_age
        """A reply that arrives longer than this after its request was sent (the member was paused
        meanwhile) describes a past that may no longer hold: it is dropped, not taken as the view."""
        self.member = member
        self.interval = interval
        self.on_change = on_change
        self.step = 0
        self.blocked_on: str | None = None
        self.busy: str | None = None
        """Deliberate work without step progress (a final checkpoint write): never taken for stuck."""
        self.warm = False
        """True once this process has committed a step (its first step is judged more leniently)."""
        self.progress: Callable[[], int] = lambda: 0
        """Reads the member's progress counter; sent with every heartbeat."""
        self.pace: Callable[[], dict[str, Any] | None] = lambda: None
        """Reads the member's pace (:meth:`unbroken.worker.pacing.Pacing.summary`); sent with every heartbeat."""
        self.view: dict[str, Any] = {}
        self.answered = time.monotonic()
        """When (monotonic) the request whose reply :attr:`view` holds was sent: the member's lease
        counts from there. It moves only after the view it vouches for is stored, so that a reader
        that sees a fresh ``answered`` (read first) also sees the view that came with it: a lease
        renewed by a reply whose news (a death verdict, a newer generation) is not yet read would
        let a member cut off for seconds commit a step the others have redone (seen in CI)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="unbroken-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        hold = 0.0  # the first poll is answered at once: the member joins next, on the same line
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                view = self.client.post(
                    "/v1/heartbeat",
                    # the coordinator holds the reply at most `interval`; a longer silence is a lost
                    # connection (a partition), which must not outlive the member's lease
                    read_timeout=self.interval + 2.0,
                    member=self.member,
                    step=self.step,
                    blocked_on=self.blocked_on,
                    progress=self.progress(),
                    busy=self.busy,
                    warm=self.warm,
                    pace=self.pace(),
                    seen=self.view,
                    hold=hold,
                )
            except Exception as exc:  # the lease check in the runtime decides what this means
                log.debug("heartbeat failed: %s", exc)
                self._stop.wait(self.interval)
                continue
            sent = self.client.sent_at()  # it may have waited for the line while the member joined
            if time.monotonic() - sent > self.max_age:
                log.info("dropped a heartbeat reply %.1f s old", time.monotonic() - sent)
                continue
            hold = self.interval
            changed = view != self.view
            if changed:
                self.view = view
                self.on_change(view)
            self.answered = max(self.answered, sent)  # after the view is taken: see `answered`
            if changed:
                # News reaches every member at once (a formation, a verdict), and each polls
                # again at once: held for equal times, their polls would come back in one burst
                # every interval ever after. A random hold for the next one spreads them out.
                hold = self.interval * random.uniform(*NEWS_HOLD)
                if view.get("broken") or view.get("reconfigure") or view.get("state") != "active":
                    # The member is about to join, and its join keeps it alive: a poll sent now
                    # would only wait at the coordinator through the re-formation and be woken by
                    # it for nothing, and hold the line that the join needs (a join waits for the
                    # poll in flight). Polling after a random pause instead halved the re-formation
                    # of 4,000 simulated members that all join (bench_coordinator --survivors
                    # computing: 1.3 -> 0.7 s). A death meanwhile still closes the connection.
                    self._stop.wait(hold)
                    hold = self.interval
