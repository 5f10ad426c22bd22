"""The coordinator's answers to requests on the lean line (:mod:`unbroken.coordinator.line_server`),
for :class:`~unbroken.coordinator.server.Coordinator`. A mixin: the state is the coordinator's.

The answers are those of the aiohttp handlers (:mod:`unbroken.coordinator.api`), from the same
code (``_heartbeat_start``, ``_heartbeat_answer``, ``_join_body``), with what aiohttp's
middlewares did done here: the token, and a candidate that does not lead answering 503. What
differs is how a heartbeat is held: not by a task awaiting a future, but by a :class:`HeldPoll`
that :class:`~unbroken.coordinator.long_polls.LongPolls` wakes in place of a future (it answers at
once if its view has news, else waits again) and that one timer answers at the end of its hold.
Joins, rare, run the handlers' coroutine as a task; a line that closes cancels it, as aiohttp does.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import orjson

if TYPE_CHECKING:
    from unbroken.coordinator.line_server import LineConnection
    from unbroken.coordinator.settings import CoordinatorSettings

log = logging.getLogger("unbroken.coordinator.server")

WRONG_TOKEN = ("missing or wrong token: pass --token or set UNBROKEN_TOKEN to the job's token (an `unbroken run` with an"
               " embedded coordinator writes it to RUN_DIR/coordinator.json; `unbroken status RUN_DIR` reads it there)")
"""The error of a request without the job's token (the same on both servers of the port)."""


class HeldPoll:
    """A heartbeat held on a lean line: in a member's long-poll waiters like a future (``done``,
    ``set_result``), but woken by a call, with no task behind it."""

    __slots__ = ("owner", "connection", "transport", "member_id", "seen", "deadline", "timer", "over")

    def __init__(self, owner: "LineRequests", connection: "LineConnection", member_id: str, seen: dict[str, Any],
                 deadline: float) -> None:
        self.owner = owner
        self.connection = connection
        self.transport = connection.transport
        self.member_id = member_id
        self.seen = seen
        self.deadline = deadline
        self.timer: asyncio.TimerHandle | None = None
        self.over = False

    def done(self) -> bool:
        return self.over

    def set_result(self, _: Any) -> None:
        """Woken: a change may concern its member."""
        if not self.over:
            self.owner._poll_woken(self)

    def wait(self) -> None:
        """Wait (again) for a change that concerns its member."""
        self.owner._waiters.setdefault(self.member_id, set()).add(self)  # type: ignore[arg-type]

    def end(self) -> None:
        """No longer held: out of the waiters, its timer cancelled."""
        self.over = True
        if self.timer is not None:
            self.timer.cancel()
        group = self.owner._waiters.get(self.member_id)
        if group is not None:
            group.discard(self)  # type: ignore[arg-type]
            if not group:
                del self.owner._waiters[self.member_id]


class LineRequests:
    """Serving the lean line's requests on the coordinator's own state and handlers."""

    settings: CoordinatorSettings
    leadership: Any
    _waiters: dict[str, set[Any]]
    _coordinators: list[str]
    _serving: Callable[[], bool]
    _join_body: Callable[..., Any]
    _heartbeat_start: Callable[..., tuple[str, dict[str, Any], float]]
    _heartbeat_answer: Callable[..., dict[str, Any] | None]
    _line_idle: Callable[[str, Any], None]
    _line_closed: Callable[[str, Any], None]
    _waking: bool
    _defer_serving: Callable[[Any], None]

    def _line_request(self, connection: LineConnection, path: str, authorization: bytes, raw: bytes) -> None:
        if self.settings.token and not hmac.compare_digest(authorization, f"Bearer {self.settings.token}".encode()):
            connection.answer(401, {"error": WRONG_TOKEN})
            return
        if self._refuse_not_leading(connection, "is a candidate that does not lead"):
            return
        try:
            body = orjson.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("member", ""), str) or "member" not in body:
            connection.answer(400, {"error": "expected a JSON object with a string 'member'"})
            return
        connection.member = body["member"]
        try:
            if path == "/v1/heartbeat":
                self._line_heartbeat(connection, body)
            else:
                task = asyncio.get_running_loop().create_task(self._join_body(body, connection.transport))
                connection.pending = task
                task.add_done_callback(lambda done: self._join_done(connection, done))
        except (TypeError, ValueError) as exc:  # a field of the wrong type, as aiohttp's handler would fail
            connection.answer(400, {"error": f"bad {path} request: {exc}"})

    def _refuse_not_leading(self, connection: LineConnection, why: str) -> bool:
        """A candidate answers only while it leads: else 503, naming the leader it knows."""
        if self.leadership is None or self._serving():
            return False
        hint = self.leadership.known_leader
        connection.answer(503, {"error": f"{self.leadership.me} {why}", "leader": hint if hint != self.leadership.me else None,
                                "coordinators": self._coordinators})
        return True

    def _line_heartbeat(self, connection: LineConnection, body: dict[str, Any]) -> None:
        member_id, seen, deadline = self._heartbeat_start(body, connection.transport)
        poll = HeldPoll(self, connection, member_id, seen, deadline)
        view = self._heartbeat_answer(member_id, seen, deadline)
        if view is not None:
            self._poll_answer(poll, view)
            return
        connection.pending = poll
        poll.wait()
        poll.timer = asyncio.get_running_loop().call_later(deadline - time.monotonic(), self._poll_expired, poll)

    def _poll_woken(self, poll: HeldPoll) -> None:
        view = self._heartbeat_answer(poll.member_id, poll.seen, poll.deadline)
        if view is None:
            poll.wait()
        else:
            self._poll_answer(poll, view)
            if self._waking and poll.connection.transport is not None:
                self._defer_serving(poll.connection)

    def _poll_expired(self, poll: HeldPoll) -> None:
        if not poll.over:  # its hold is over (a timer may fire a hair early: no view compared)
            self._poll_answer(poll, self._heartbeat_answer(poll.member_id, poll.seen, -1.0))

    def _poll_answer(self, poll: HeldPoll, view: dict[str, Any] | None) -> None:
        poll.end()
        self._line_idle(poll.member_id, poll.transport)
        if not self._refuse_not_leading(poll.connection, "stopped leading"):  # its view may be stale
            poll.connection.answer(200, view or {})

    def _join_done(self, connection: LineConnection, task: asyncio.Task) -> None:
        if task.cancelled() or connection.transport is None:
            return
        exc = task.exception()
        if exc is not None:
            if isinstance(exc, (TypeError, ValueError)):
                connection.answer(400, {"error": f"bad /v1/join request: {exc}"})
            else:
                log.error("a join failed", exc_info=exc)
                connection.answer(500, {"error": f"the coordinator failed: {exc}"})
        elif not self._refuse_not_leading(connection, "stopped leading"):
            connection.answer(200, task.result())

    def _line_lost(self, connection: LineConnection) -> None:
        """A lean line closed: a held poll ends and its member is dead (its line closed, as when
        aiohttp cancels a held handler); a join's task is cancelled (its handler says so); an
        idle line of a live member is its death too, told at once rather than found by looking."""
        pending = connection.pending
        connection.pending = None
        if isinstance(pending, HeldPoll):
            if not pending.over:
                pending.end()
                self._line_closed(pending.member_id, pending.transport)
        elif pending is not None:
            pending.cancel()
        elif connection.member is not None:
            self._line_closed(connection.member, connection.transport)
