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


class _Failed(Exception):
    """One attempt found its candidate down or not leading (503); ``after`` is where to go next."""

    def __init__(self, reason: str, after: tuple[str, int]) -> None:
        super().__init__(reason)
        self.after = after


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

    def _connection(self, read_timeout: float, line: MemberLine | None, target: tuple[str, int] | None) -> http.client.HTTPConnection:
        """The connection for one request: a connection of its own to ``target`` that is closed
        after the reply (a transient request), else the member's line or this thread's keep-alive
        connection, both to the current candidate."""
        conn = None if target else line.conn if line is not None else getattr(self._local, "conn", None)
        if conn is not None and (conn.host, conn.port) != (self.host, self.port):
            self._drop(line)  # another thread moved on to another candidate
            conn = None
        if conn is None:
            host, port = target or (self.host, self.port)
            conn = http.client.HTTPConnection(host, port, timeout=read_timeout)
            if line is not None:
                line.conn = conn
            elif not target:
                self._local.conn = conn
        conn.timeout = read_timeout
        if conn.sock is not None:
            conn.sock.settimeout(read_timeout)
        return conn

    def _after(self, failed: tuple[str, int]) -> tuple[str, int]:
        """The candidate to try after ``failed``: the next one in order (the first if unknown)."""
        addresses = self.addresses
        return addresses[(addresses.index(failed) + 1) % len(addresses)] if failed in addresses else addresses[0]

    def _next_candidate(self, failed: tuple[str, int]) -> None:
        """Move the client's current candidate on, unless another request moved it already."""
        if len(self.addresses) > 1 and (self.host, self.port) == failed:
            self.host, self.port = self._after(failed)
            self._current = self.addresses.index((self.host, self.port))

    def _follow(self, data: bytes, target: tuple[str, int], move: bool = True) -> tuple[str, int]:
        """After a 503: the leader the candidate names, else the next candidate; returned, and made
        the current candidate (a named leader always is: that is news for every request)."""
        try:
            hint = json.loads(data)
        except ValueError:
            hint = {}
        if not isinstance(hint, dict):
            hint = {}
        named = hint.get("leader") if isinstance(hint.get("leader"), str) else None
        leader = self.learn([a for a in hint.get("coordinators") or [] if isinstance(a, str)], named)
        if leader is not None and leader != target:
            return leader
        if move:
            self._next_candidate(target)
        return self._after(target)

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
                  own: tuple[str, int] | None) -> dict[str, Any]:
        """One attempt: send, read the reply, judge its status. The caller holds ``line``'s turn.

        ``own``: a transient request's candidate. Its failure moves only that request on
        (:class:`_Failed`'s ``after``): moving the client's current candidate would drop the
        member's line, which the leader takes for the member's death."""
        target = own or (self.host, self.port)
        conn = self._connection(read_timeout, line, own)
        try:
            sent = self._local.sent = time.monotonic()
            headers = {**self._headers, "Connection": "close"} if own else self._headers
            conn.request(method, path, body=payload if method == "POST" else None, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            if own:
                conn.close()
            else:
                self._drop(line)
                self._next_candidate(target)
            # a transient request tries the current candidate next if another request moved on
            current = (self.host, self.port)
            after = current if own and current != target else self._after(target)
            raise _Failed(str(exc) or type(exc).__name__, after) from exc
        if own:
            conn.close()
        if response.status == 401:
            raise Unauthorized(
                f"coordinator at {target[0]}:{target[1]} refused {path}: missing or wrong token (pass --token or set"
                " UNBROKEN_TOKEN to the job's token; an `unbroken run` with an embedded coordinator writes it to"
                " RUN_DIR/coordinator.json, and `unbroken status RUN_DIR` reads it there)"
            )
        if response.status == 503:
            if not own:
                self._drop(line)
            raise _Failed(data[:200].decode(errors="replace"), self._follow(data, target, move=not own))
        if response.status != 200:
            raise CoordinatorUnreachable(f"coordinator answered {response.status} to {path}: {data[:200]!r}")
        self.last_ok = max(self.last_ok, sent)
        reply = json.loads(data)
        if isinstance(reply, dict) and isinstance(reply.get("coordinators"), list):
            self.learn(reply["coordinators"])
        return reply

    def request(self, method: str, path: str, body: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
                read_timeout: float = 10.0) -> dict[str, Any]:
        """One request, retried until :attr:`timeout`. A callable ``body`` is called for every
        attempt once the request holds the line, so what it reports is read as late as possible."""
        deadline = time.monotonic() + self.timeout
        delay = 0.02
        last: Exception | None = None
        line = self.line if self.line is not None and path in LINE_PATHS else None
        own = (self.host, self.port) if self.line is not None and line is None else None
        while True:
            try:
                with line.turn(path) if line is not None else contextlib.nullcontext():
                    payload = json.dumps((body() if callable(body) else body) or {}).encode()
                    return self._exchange(method, path, payload, read_timeout, line, own)
            except _Failed as exc:
                last = exc
                own = exc.after if own else None
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

    def _body(self, hold: float) -> Callable[[], dict[str, Any]]:
        """The poll's body, read when the poll takes the line (it may wait while the member joins):
        read earlier, it would report a step, a blocking collective or a view already past."""
        return lambda: dict(
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

    def _run(self) -> None:
        hold = 0.0  # the first poll is answered at once: the member joins next, on the same line
        while not self._stop.is_set():
            try:
                # the coordinator holds the reply at most `interval`; a longer silence is a lost
                # connection (a partition), which must not outlive the member's lease
                view = self.client.request("POST", "/v1/heartbeat", self._body(hold), read_timeout=self.interval + 2.0)
            except Exception as exc:  # the lease check in the runtime decides what this means
                log.debug("heartbeat failed: %s", exc)
                self._stop.wait(self.interval)
                continue
            sent = self.client.sent_at()  # it may have waited for the line while the member joined
            if time.monotonic() - sent > self.max_age:
                log.info("dropped a heartbeat reply %.1f s old", time.monotonic() - sent)
                continue
            changed = view != self.view
            if changed:
                self.view = view
                self.on_change(view)
            self.answered = max(self.answered, sent)  # after the view is taken: see `answered`
            if view.get("broken") or view.get("reconfigure") or view.get("state") != "active":
                # The member is about to join (or joins), and its joins keep it alive. A held
                # poll would only wait at the coordinator through the re-formation, be woken by it
                # for nothing, and hold the line that the next join needs (a join waits for the
                # poll in flight, up to a whole hold: seen in CI as a rejoin that came too late).
                # So until the view is active again the polls come back at once, spaced by a
                # random pause. Polling after a pause halved the re-formation of 4,000 simulated
                # members that all join (bench_coordinator --survivors computing: 1.3 -> 0.7 s).
                # A death meanwhile still closes the connection.
                hold = 0.0
                self._stop.wait(self.interval * random.uniform(*NEWS_HOLD))
            elif changed:
                # News reaches every member at once (a formation, a verdict), and each polls
                # again at once: held for equal times, their polls would come back in one burst
                # every interval ever after. A random hold for the next one spreads them out.
                hold = self.interval * random.uniform(*NEWS_HOLD)
            else:
                hold = self.interval
