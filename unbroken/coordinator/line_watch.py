"""Watching each member's line, for :class:`~unbroken.coordinator.server.Coordinator`: the one
connection a worker's heartbeats and joins share (:mod:`unbroken.coordinator.member_line`). A member
whose line closes is dead at once: the kernel closed a dead process's sockets. While a poll holds the
line, aiohttp cancels its handler when it closes (the lean line tells at once, held or not);
between polls the line is looked at every ``check_interval`` (idle ones), and every line once per
``connection_sweep``, a share of them each ``check_interval``. A mixin: the connections and the
state it reads are the coordinator's (set up in its ``__init__``).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from unbroken.coordinator.membership import MemberState

if TYPE_CHECKING:
    from unbroken.coordinator.membership import Membership
    from unbroken.coordinator.metrics import CoordinatorMetrics
    from unbroken.observe.events import EventLog

CONNECTION_CLOSED = "its heartbeat connection closed (its process or host is gone)"
"""The reason of a verdict on a closed line (the connection a member's heartbeats and joins share;
the text predates the line and is kept for those who match it). Replaced by the launcher's reason
if it reports the exit."""

log = logging.getLogger("unbroken.coordinator.server")  # moved out of the coordinator; its messages keep their logger


class LineWatch:
    """Which connection is each member's line, and the verdict when one closes."""

    state: Membership
    events: EventLog
    metrics: CoordinatorMetrics
    _stopped: threading.Event
    _heartbeat_connections: dict[str, Any]
    _idle_connections: dict[str, Any]
    _sweep_queue: collections.deque[str]
    _sweep_share: int
    _bump: Callable[[], None]

    def _watch_line(self, member_id: str, transport: Any) -> None:
        """The connection (``transport``) of a member's heartbeat or join is its line
        (:mod:`unbroken.coordinator.member_line`): watched while a poll holds it (aiohttp cancels
        the handler when it closes; the lean line tells at once), and by looking between polls;
        the newest one counts."""
        self._idle_connections.pop(member_id, None)
        if transport is not None:
            self._heartbeat_connections[member_id] = transport

    def _line_idle(self, member_id: str, transport: Any) -> None:
        if transport is not None and self._heartbeat_connections.get(member_id) is transport:
            self._idle_connections[member_id] = transport  # watched by looking until the next poll

    def _line_closed(self, member_id: str, transport: Any) -> None:
        """A held poll was cancelled: its connection closed. The member is dead if that was its line."""
        if transport is None or self._heartbeat_connections.get(member_id) is transport:
            self._connection_closed(member_id)

    def _check_connections(self, members: Any = None) -> None:
        """Every member (of ``members``; None: all) whose line has closed
        since (found between long polls, when no handler runs for it: a peer's failure report
        may have ended its poll). A full check also forgets the connections of forgotten members."""
        if members is None:
            for member_id in [m for m in self._heartbeat_connections if m not in self.state.members]:
                del self._heartbeat_connections[member_id]
                self._idle_connections.pop(member_id, None)
            members = list(self._heartbeat_connections)
        for member_id in members:
            transport = self._heartbeat_connections.get(member_id)
            member = self.state.members.get(member_id)
            if transport is None or member is None or member.state not in (MemberState.WAITING, MemberState.ACTIVE):
                # nothing to watch: a closing connection of a member that is not live changes nothing
                self._idle_connections.pop(member_id, None)
                if transport is not None and transport.is_closing():
                    self._heartbeat_connections.pop(member_id, None)
            elif transport.is_closing():
                self._connection_closed(member_id)

    def _sweep_connections(self, share: float) -> None:
        """The backstop sweep, spread out: each call looks at a ``share`` of the members' lines,
        so that a round over all of them takes ``connection_sweep`` and no turn of the loop pays
        for all (16,384 lines at once held it 22-28 ms every 2 s). A round starts by forgetting the
        lines of forgotten members."""
        queue = self._sweep_queue
        if not queue:
            for member_id in [m for m in self._heartbeat_connections if m not in self.state.members]:
                del self._heartbeat_connections[member_id]
                self._idle_connections.pop(member_id, None)
            queue.extend(self._heartbeat_connections)
            self._sweep_share = max(1, math.ceil(len(queue) * share))
        self._check_connections([queue.popleft() for _ in range(min(self._sweep_share, len(queue)))])

    def _check_generation_connections(self) -> None:
        """The current generation's connections: after a failure report, one of them may be a
        dead member's whose poll the report's wake-up just ended. O(generation), once a break."""
        current = self.state.current
        self._check_connections(current.members if current is not None else [])

    def _connection_closed(self, member_id: str) -> None:
        """A member's line closed: its process is gone (the kernel closed its
        sockets), or its host is; a live member keeps it open (its heartbeat thread reopens one
        only after a request failed, which the coordinator's own stall would cause). Dead at
        once, not after the heartbeat timeout. A stopped process or a host without power closes
        nothing: for those the heartbeat timeout still decides."""
        self._heartbeat_connections.pop(member_id, None)
        self._idle_connections.pop(member_id, None)
        member = self.state.members.get(member_id)
        if self._stopped.is_set() or member is None or member.state not in (MemberState.WAITING, MemberState.ACTIVE):
            return
        reason = CONNECTION_CLOSED
        if self.state.mark_dead(member_id, reason, time.monotonic()):
            log.warning("member %s declared dead: %s", member_id, reason)
            self.events.emit("verdict", member=member_id, detected_by="connection", reason=reason)
            self.metrics.failure("connection")
            self._bump()

