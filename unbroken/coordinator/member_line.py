"""A member's one connection to the coordinator, which its heartbeats and its joins take in turn.

A coordinator of N members holds one connection per member (and its process one descriptor per
connection): with a heartbeat connection and a join connection each, 16,000 members needed 32,000
descriptors, past a common limit of 20,000 per process. So a worker keeps *one* keep-alive
connection, its *line*: the heartbeat thread's long polls and the main thread's joins use it in
turn, and the coordinator watches it (a member whose line closes is dead: the kernel closed a dead
process's sockets). Every other request of a worker (a failure report, leaving, fetching member
names) is short and goes on a connection of its own that is closed after the reply, so it never
waits behind a held poll and never holds a descriptor for long.

Turns: a request waits until the line is free. While the member's joiner says it is joining
(:meth:`MemberLine.joining`, for its whole loop of joins), heartbeats do not take the line: a join
answered "wait" is asked again at once, and a heartbeat poll slipped in between would hold the
next join for a heartbeat interval. The coordinator counts a held join as the member's heartbeat
and holds it at most a third of the heartbeat timeout, so a member that joins stays alive.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

LINE_PATHS = ("/v1/heartbeat", "/v1/join")
"""The requests that go on a member's line; every other request gets a connection of its own."""


class MemberLine:
    """The connection that a member's heartbeats and joins share, and whose turn it is."""

    def __init__(self) -> None:
        self.conn: Any = None
        """The ``http.client.HTTPConnection`` of the line, or None until (re)opened."""
        self._changed = threading.Condition()
        self._busy = False
        self._joining = 0

    @contextlib.contextmanager
    def joining(self) -> Iterator[None]:
        """While the member joins: heartbeats wait, joins take the line back to back. Nests."""
        with self._changed:
            self._joining += 1
        try:
            yield
        finally:
            with self._changed:
                self._joining -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def paused_joining(self) -> Iterator[None]:
        """Inside :meth:`joining`: let heartbeats take the line meanwhile (a heal between joins)."""
        with self._changed:
            paused, self._joining = self._joining, 0
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._joining += paused

    @contextlib.contextmanager
    def turn(self, path: str) -> Iterator[None]:
        """Hold the line for one request to ``path`` (a heartbeat waits while the member joins)."""
        heartbeat = path == "/v1/heartbeat"
        with self._changed:
            while self._busy or (heartbeat and self._joining):
                self._changed.wait()
            self._busy = True
        try:
            yield
        finally:
            with self._changed:
                self._busy = False
                self._changed.notify_all()
