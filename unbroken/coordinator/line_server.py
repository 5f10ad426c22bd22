"""The coordinator's port: members' lines answered by a lean HTTP/1.1 server, the rest by aiohttp.

A coordinator of N members answers N/hold heartbeats a second and, when a member dies, N - 1 held
polls at once. Through aiohttp's full request pipeline (routing, middlewares, a task, a request and
a response object, several futures) a heartbeat cost 190-220 µs of the coordinator's CPU here, and
16,384 members took 3-4 s to hear of a re-formation. Yet a member's line
(:mod:`unbroken.coordinator.member_line`) only ever carries two requests of one shape: a
``POST /v1/heartbeat`` or ``POST /v1/join`` with a JSON body and a ``Content-Length``, sent by
``http.client``. So every connection of the port starts here, in :class:`LineConnection`: such a
request is parsed here in a few lines and handed to the coordinator
(:class:`~unbroken.coordinator.line_requests.LineRequests`), which answers it through
:meth:`LineConnection.answer`; at the first request of any other shape (another path or method,
chunked bodies, ``Expect``, HTTP/1.0) the connection is handed over to aiohttp, with what it has
read, for the rest of its life. The wire stays plain HTTP/1.1: workers, launchers, ``curl`` and
the benchmark's simulated members need no change.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol

import orjson

from unbroken.coordinator.member_line import LINE_PATHS

MAX_HEAD = 16_384
"""Bytes of a request's head (request line and headers) at most; more is handed to aiohttp, which
answers it as it answers any request too large."""

REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 500: b"Internal Server Error", 503: b"Service Unavailable"}

_LEAN_PATHS = frozenset(path.encode() for path in LINE_PATHS)


class LineHost(Protocol):
    """What a :class:`LineConnection` needs of the coordinator."""

    def _line_request(self, connection: "LineConnection", path: str, authorization: bytes, body: bytes) -> None:
        """Answer one line request (now, or later through ``connection.answer``)."""

    def _line_lost(self, connection: "LineConnection") -> None:
        """The connection closed (whatever it was waiting for is over)."""


class LineConnection(asyncio.Protocol):
    """One connection accepted on the coordinator's port, answered here while it carries line
    requests (one at a time, in order, as HTTP/1.1 requires) and handed to aiohttp otherwise."""

    def __init__(self, host: LineHost, fallback: Callable[[], asyncio.Protocol], lines: set["LineConnection"]) -> None:
        self.host = host
        self._fallback = fallback
        self._lines = lines
        self.transport: asyncio.Transport | None = None
        self.member: str | None = None
        """The member whose line this is (named by its newest request), if any."""
        self.pending: Any = None
        """What answers the request being served, if it is held: a held poll or a join's task."""
        self._buffer = bytearray()
        self._busy = False
        self._parsing = False
        self._close_after = False
        self._deferred = False
        """Read, but not served until :meth:`serve_again` (see ``LongPolls._defer_serving``)."""

    # -- asyncio's protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._lines.add(self)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self._busy and not self._parsing and not self._deferred:
            self._parse()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lines.discard(self)
        if self.transport is not None:
            self.host._line_lost(self)
        self.transport = None

    # -- requests ------------------------------------------------------------------------------

    def _parse(self) -> None:
        """Serve the requests read so far, one at a time: the next waits until this one is answered."""
        self._parsing = True
        try:
            while not self._busy and self.transport is not None and self._buffer:
                request = self._next_request()
                if request is None:
                    return
                self._busy = True
                self.host._line_request(self, *request)
        finally:
            self._parsing = False

    def _next_request(self) -> tuple[str, bytes, bytes] | None:
        """The next complete line request (path, ``Authorization`` header, body); None if it is
        incomplete, or if the connection was handed over."""
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD:
                self._hand_over()
            return None
        lines = bytes(self._buffer[:end]).split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or parts[0] != b"POST" or parts[1] not in _LEAN_PATHS or parts[2] != b"HTTP/1.1":
            self._hand_over()
            return None
        length, authorization, close = -1, b"", False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length" and length < 0 and value.strip().isdigit():
                length = int(value)
            elif name == b"authorization":
                authorization = value.strip()
            elif name == b"connection":
                close = value.strip().lower() == b"close"
            elif name in (b"content-length", b"transfer-encoding", b"expect"):
                length = -2  # repeated lengths, chunked bodies, 100-continue: aiohttp's to answer
        if length < 0:
            self._hand_over()
            return None
        start = end + 4
        if len(self._buffer) < start + length:
            return None
        body = bytes(self._buffer[start : start + length])
        del self._buffer[: start + length]
        self._close_after = close
        return parts[1].decode(), authorization, body

    def answer(self, status: int, payload: dict[str, Any]) -> None:
        """Answer the request being served with ``payload`` as JSON; then serve the next one."""
        self.pending = None
        self._busy = False
        if self.transport is None:
            return
        body = orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
        self.transport.write(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n%s\r\n%s"
            % (status, REASONS[status], len(body), b"Connection: close\r\n" if self._close_after else b"", body)
        )
        if self._close_after:
            self.transport.close()
        elif self._buffer and not self._parsing:
            self._parse()

    def _hand_over(self) -> None:
        """From now on aiohttp serves this connection, starting with what was read and not served."""
        transport, data = self.transport, bytes(self._buffer)
        assert transport is not None
        self.transport = None
        self._buffer = bytearray()
        self._lines.discard(self)
        handler = self._fallback()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if data:
            handler.data_received(data)

    def defer_serving(self) -> None:
        """Keep reading, but serve no request until :meth:`serve_again` (a closing line is still
        noticed at once: no system call, unlike pausing the transport's reading)."""
        self._deferred = True

    def serve_again(self) -> None:
        self._deferred = False
        if self._buffer and not self._busy and not self._parsing and self.transport is not None:
            self._parse()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
