"""The coordinator: membership, generations and failure verdicts, served over HTTP.

It also hosts the torch ``TCPStore`` on which every generation's process group rendezvous (under
the generation's prefix), so the store outlives any member. One coordinator per job: embedded in
the launcher by default, or alone as ``unbroken coordinator`` on a stable host.

The API is JSON over HTTP (aiohttp). Requests that wait (``join``, ``heartbeat``) are long polls
that return as soon as the answer changes, or after ``hold`` seconds with the current answer.

==========================  ======================================================================
``POST /v1/join``           ``{member, node, pid, step, after, warm, lean, catch_up, hold}``: wait (at most
                            ``hold`` s, never more than the coordinator's hold nor a third of the
                            heartbeat timeout) for a generation newer
                            than ``after`` that includes ``member``. Replies ``{status: "formed",
                            generation, members, size, rank, prefix, store_host, store_port}``
                            (with ``lean``: no ``members``; fetch them from ``/v1/members``),
                            ``{status: "wait"}`` (poll again) or ``{status: "finished"}``.
``GET /v1/members``         ``?generation=N[&rank=R]``: the members of generation N, in rank
                            order (``{generation, members}``), or the one at rank R
                            (``{generation, member}``); 404 once it is forgotten.
``POST /v1/heartbeat``      ``{member, step, blocked_on, progress, busy, warm, seen, hold}``:
                            records liveness, the collective the member waits in, its progress
                            counter and deliberate busy work (for the progress watchdog); replies
                            the member's view ``{generation, broken, reconfigure, state, reason,
                            fence, finished, failed}`` as soon as it differs from ``seen``.
``POST /v1/failure``        ``{member, generation, error}``: a collective of that generation failed.
``POST /v1/exit``           ``{member, exitcode, reason}``: a launcher saw a worker process exit.
``POST /v1/stop``           ``{member, step, reason}``: ``job.stop(reason)``, durable before it returns: no
                            step at or after ``step`` is trained; every generation formed from then on
                            carries it in its join replies (``stop``).
``POST /v1/fail_job``       ``{member, reason}``: what no restart mends (replicas that differ, members whose script
                            makes different collectives): the job fails with the reason.
``POST /v1/catch_up_off``   ``{member, reason}``: a catch-up's replay differed from its donor's state;
                            newcomers are healed from now on.
``POST /v1/leave``          ``{member, finished, step}``: a member left (``finished``: job done).
``POST /v1/quarantine``     ``{prefix, seconds, reason}``: a launcher took a worker slot out of the
                            job for ``seconds`` (0 lifts it). Until then ``/v1/join`` answers
                            ``{status: "refused", reason}`` to every member id that starts with
                            ``prefix`` (a slot: ``<node>.w<local rank>.``).
``GET /v1/status``          generation, members with state, step and heartbeat age, finished,
                            failed (why the job cannot go on, or null), quarantined (prefix:
                            seconds left).
``GET /metrics``            Prometheus metrics (:mod:`unbroken.coordinator.metrics`).
==========================  ======================================================================

This module holds :class:`Coordinator`'s lifecycle (the store, the HTTP server, the thread it
runs on) and its state changes (forming generations, the deadlines). The request handlers are
:mod:`unbroken.coordinator.api`; waiting for a change and waking the long polls it concerns,
:mod:`unbroken.coordinator.long_polls`; a replicated candidate's leadership rounds are
:mod:`unbroken.coordinator.leading`.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import uuid
import logging
import threading
import time
from typing import Any

from unbroken.coordinator.api import CoordinatorApi
from unbroken.coordinator.settings import CoordinatorSettings  # noqa: F401  (the coordinator's settings, named here too)
from unbroken.errors import ConfigError
from unbroken.coordinator.leading import Leading
from unbroken.coordinator.line_requests import LineRequests
from unbroken.coordinator import garbage
from unbroken.coordinator.line_server import LineConnection
from unbroken.coordinator.long_polls import LongPolls
from unbroken.coordinator.membership import Membership, MembershipSettings
from unbroken.coordinator.state_loss import state_loss
from unbroken.open_files import raise_limit
from unbroken.observe.events import EventLog

log = logging.getLogger(__name__)


LARGE_JOB = 256
"""From this many expected (or allowed) members on, an embedded coordinator also makes its process
:func:`~unbroken.coordinator.garbage.collect_less_often`; a standalone one always does."""


class Coordinator(CoordinatorApi, LineRequests, Leading, LongPolls):
    """Serves the membership API and hosts the TCPStore. Start with :meth:`start_in_thread`
    (embedded) or :meth:`serve_forever` (standalone)."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        membership: MembershipSettings,
        events: EventLog | None = None,
        leadership: Any = None,
    ) -> None:
        self.settings = settings
        self.membership_settings = membership
        self.state = Membership(membership, store_token=settings.token)
        self.leadership = leadership
        """A :class:`~unbroken.coordinator.replicated.Leadership` when this is one of several candidates whose
        state is replicated in etcd; None for a coordinator on its own."""
        self._durable = 0
        """The newest generation known to be durable in etcd: members hear only of those."""
        self._recorded_outcome = False
        """Whether this lead has recorded in etcd how the job ended (finished, or failed)."""
        self._heartbeat_connections: dict[str, Any] = {}
        """Each member's newest heartbeat connection (its transport), checked for closing."""
        self._idle_connections: dict[str, Any] = {}
        """The heartbeat connections that no held poll watches right now (between a reply and the
        member's next heartbeat): a closing one is noticed only by looking, so they are looked at
        every ``check_interval``; a held poll learns of its closing from aiohttp's cancellation."""
        self._sweep_queue: collections.deque[str] = collections.deque()
        """Members whose lines the current round of the backstop sweep has yet to look at."""
        self._sweep_share = 1
        """How many of them each ``check_interval`` looks at, in this round."""
        self._waiters: dict[str, set[asyncio.Future]] = {}
        """Long polls waiting for a change, by member: a change of one member's view wakes only
        its own; a change of the view shared by all wakes all of them, once."""
        self._to_wake: collections.deque[asyncio.Future] = collections.deque()
        """Polls to wake, ``wake_slice`` seconds of them per turn of the event loop."""
        self._waking = False
        self._heap_frozen = False
        """Whether the first large generation's objects were frozen (:func:`~unbroken.coordinator.garbage.freeze_what_lives`)."""
        self._deferred_lines: collections.deque[Any] = collections.deque()
        """Lean lines not served until the current wake-up ends (:meth:`_defer_serving`)."""
        self._shared: tuple[Any, ...] | None = None
        """The view shared by every member at the last wake-up (see :meth:`_wake_changed`)."""
        self._lines: set[LineConnection] = set()
        """The connections the lean line server serves (:mod:`unbroken.coordinator.line_server`)."""
        self._server: asyncio.AbstractServer | None = None
        self._members_body: tuple[int, bytes] | None = None
        """The newest generation's member list as a JSON body, serialized once per generation."""
        self._leading = False
        """A candidate's state is its own lead's (taken over from etcd); False until then."""
        self._coordinators: list[str] = []
        """Every candidate's address (the leader's first), sent to members so they know them all."""
        self.events = events or EventLog(None, "coordinator")
        from unbroken.coordinator.metrics import CoordinatorMetrics  # prometheus_client: only the coordinator needs it

        self.metrics = CoordinatorMetrics()
        self.port: int | None = None
        self.store_port: int | None = None
        self._store = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.incarnation = uuid.uuid4().hex[:12]
        """Names this coordinator process: a member whose generation was formed by another
        incarnation (the coordinator restarted and lost its memory) stops committing and rejoins."""
        self._reference: dict[str, str] | None = None
        """The preflight every joining member must match (see :meth:`_mismatch`)."""
        self._quarantined: dict[str, float] = {}
        """Quarantined slots: member id prefix -> until when (``time.monotonic()``)."""

    # -- lifecycle -------------------------------------------------------------------------------

    def _start_store(self) -> None:
        import datetime

        import torch.distributed as dist

        try:
            self._store = dist.TCPStore(
                self.settings.host,
                self.settings.store_port,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=30),
            )
        except Exception as exc:  # torch raises a bare RuntimeError/DistNetworkError
            raise ConfigError(
                f"cannot start the process-group store on {self.settings.host}:{self.settings.store_port}"
                f" ({exc}); choose another --store-port, or 0 for any free port"
            ) from None
        self.store_port = self._store.port

    async def _start_http(self) -> None:
        from aiohttp import web

        middlewares = [self._authenticate] if self.settings.token else []
        if self.leadership is not None:
            middlewares.append(self._leading_only)
        app = web.Application(middlewares=middlewares)
        app.add_routes(
            [
                web.post("/v1/join", self._join),
                web.post("/v1/heartbeat", self._heartbeat),
                web.post("/v1/failure", self._failure),
                web.post("/v1/exit", self._exit),
                web.post("/v1/catch_up_off", self._catch_up_off),
                web.post("/v1/stop", self._stop),
                web.post("/v1/fail_job", self._fail_job),
                web.post("/v1/leave", self._leave),
                web.post("/v1/quarantine", self._quarantine),
                web.get("/v1/status", self._status),
                web.get("/v1/members", self._members),
                web.get("/metrics", self._metrics),
            ]
        )
        # handler_cancellation: a held heartbeat learns at once that its member's connection closed
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        # every connection starts on the lean line server, which hands the other requests to
        # aiohttp's (:mod:`unbroken.coordinator.line_server`)
        fallback = self._runner.server
        assert fallback is not None
        # reuse_address: a coordinator restarted in place binds its port at once, not after TIME_WAIT
        # backlog: thousands of members connect at once when a job starts (the kernel caps it at
        # net.core.somaxconn)
        try:
            self._server = await asyncio.get_running_loop().create_server(
                lambda: LineConnection(self, fallback, self._lines), self.settings.host, self.settings.port,
                reuse_address=True, backlog=4096,
            )
        except OSError as exc:
            await self._runner.cleanup()
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"coordinator port {self.settings.port} on {self.settings.host} is already in use;"
                    " choose another with --coordinator-port, or 0 for any free port"
                ) from None
            raise ConfigError(f"cannot listen on {self.settings.host}:{self.settings.port}: {exc}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        if self.leadership is not None and not self.leadership.me:
            self.leadership.me = f"{self.settings.advertise_host or self.settings.host}:{self.port}"
        self._watcher = asyncio.get_running_loop().create_task(self._watch_deadlines())
        if self.leadership is not None:
            self._campaigner = asyncio.get_running_loop().create_task(self._lead())
        self.events.emit("coordinator_start", port=self.port, store_port=self.store_port, incarnation=self.incarnation)
        log.info("coordinator listening on %s:%s, store on port %s", self.settings.host, self.port, self.store_port)

    def _expected_members(self) -> int:
        return max(self.membership_settings.expected_members, self.membership_settings.max_members or 0)

    def start_in_thread(self) -> "Coordinator":
        """Start the store and the HTTP server on a daemon thread; returns once listening."""
        raise_limit(2 * self._expected_members(), f"a coordinator of {self._expected_members()} members")
        if self._expected_members() >= LARGE_JOB:
            garbage.collect_less_often()
        self._start_store()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._start_http())
            except BaseException as exc:  # reported to the starting thread
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_until_complete(self._wait_stopped())
            loop.run_until_complete(self._close_servers())
            loop.close()

        self._thread = threading.Thread(target=run, name="unbroken-coordinator", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self

    async def _wait_stopped(self) -> None:
        while not self._stopped.is_set():
            await asyncio.sleep(0.05)
        self._watcher.cancel()
        if self.leadership is not None:
            self._campaigner.cancel()
            await self.leadership.resign()  # hand over at once instead of after the lease
            await self.leadership.gateway.close()

    async def _close_servers(self) -> None:
        """Stop listening, close the lean lines, and let aiohttp close the connections it serves."""
        self._server.close()
        self._resume_collection()
        self._deferred_lines.clear()
        for line in list(self._lines):
            line.close()
        await self._runner.cleanup()

    def serve_forever(self) -> None:
        """Run in the calling thread until :meth:`stop` (or Ctrl-C)."""
        garbage.collect_less_often()  # a process of its own: nothing else in it minds
        raise_limit(2 * self._expected_members(), f"a coordinator of {self._expected_members()} members")
        self._start_store()

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            await self._start_http()
            print(f"unbroken coordinator listening on {self.settings.host}:{self.port} (store port {self.store_port})", flush=True)
            await self._wait_stopped()
            await self._close_servers()

        asyncio.run(main())

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    # -- state changes -------------------------------------------------------------------------

    def _bump(self) -> None:
        """Form a generation if the rules allow, then wake every long poll."""
        broken_at = self.state.broken_at
        if not self._serving():
            return
        if self.leadership is None:  # replicated: members hear only of durable generations, by joining
            self.state.take_survivors(time.monotonic())
        generation, decision = self.state.maybe_form(time.monotonic())
        self._record_outcome_once()
        if generation is not None:
            if len(generation.members) >= LARGE_JOB and not self._heap_frozen:
                garbage.freeze_what_lives()
                self._heap_frozen = True
            if self.leadership is not None:
                asyncio.get_running_loop().create_task(self._make_durable(generation))
            if broken_at is not None:
                self.metrics.stalled(generation.formed_at - broken_at)
            log.info("generation %d formed: %s (%s)", generation.number, ", ".join(generation.members), decision.reason)
            taken = {"without_joining": len(self.state.preformed)} if self.state.preformed else {}
            self.events.emit(
                "generation", generation=generation.number, members=list(generation.members), reason=decision.reason, **taken
            )
            self._note_state_lost(generation)
        self._wake_changed()

    def _note_state_lost(self, generation: Any) -> None:
        """Say so when a generation forms behind the job (:mod:`unbroken.coordinator.state_loss`):
        it trains from the best state left (a checkpoint's, or the initial one, or a newcomer's
        whose catch-up was verified part way) and commits the steps after it a second time; the
        `state_lost` event names them, and the console, the report and the launcher's last line say so."""
        loss = state_loss(self.state, generation)
        if loss is None:
            return
        message = (f"generation {generation.number} forms at step {loss.step}: {loss.reason};"
                   " it goes on from a checkpoint if there is one, else from the best state left")
        log.info("%s", message)  # the console says it in the launcher's voice, from the event (observe.state_loss_text)
        self.events.emit("state_lost", generation=generation.number, step=loss.step, lost=loss.lost, reason=loss.reason)

    async def _watch_deadlines(self) -> None:
        previous = time.monotonic()
        excused_until = 0.0
        while True:
            await asyncio.sleep(self.settings.check_interval)
            now = time.monotonic()
            stalled = now - previous - self.settings.check_interval
            previous = now
            if stalled > self.settings.stall_excuse and now - excused_until > self.state.settings.heartbeat_timeout:
                # This process did not run (a long collection, a paused VM, a loaded host): its
                # members' heartbeats and progress wait unread in its sockets. Their silence is
                # the coordinator's, not theirs: no verdict for silence or for lack of progress
                # until as long again has passed. Closed connections and launchers' reports
                # still count at once. One excuse per heartbeat timeout at most, so that a
                # coordinator late on every check (overloaded) still declares the dead.
                excused_until = now + stalled
                log.warning("the coordinator did not run for %.2f s: verdicts for silence wait %.2f s", stalled, stalled)
                self.events.emit("coordinator_stall", seconds=round(stalled, 3))
            self._sweep_connections(self.settings.check_interval / self.settings.connection_sweep)
            self._check_connections(list(self._idle_connections))
            now = time.monotonic()
            if now < excused_until:
                continue
            failed_before = self.state.failed
            dead = self.state.expire(now)
            for member_id in dead:
                reason = self.state.members[member_id].death_reason
                log.warning("member %s declared dead: %s", member_id, reason)
                how = "heartbeat" if reason and reason.startswith("no heartbeat") else "progress watchdog"
                self.events.emit("verdict", member=member_id, detected_by=how, reason=reason)
                self.metrics.failure(how)
            if dead or (self.state.current is None and self.state.first_wait is not None) or self.state.failed != failed_before:
                self._bump()
            if self.state.failed and not failed_before:
                log.error("job failed: %s", self.state.failed)
                self.events.emit("job_failed", reason=self.state.failed)
                self._record_outcome_once()
