"""The coordinator: membership, generations and failure verdicts, served over HTTP.

It also hosts the torch ``TCPStore`` on which every generation's process group rendezvous (under
the generation's prefix), so the store outlives any member. One coordinator per job: embedded in
the launcher by default, or alone as ``unbroken coordinator`` on a stable host.

The API is JSON over HTTP (aiohttp). Requests that wait (``join``, ``heartbeat``) are long polls
that return as soon as the answer changes, or after ``hold`` seconds with the current answer.

==========================  ======================================================================
``POST /v1/join``           ``{member, node, pid, step, after, warm}``: wait for a generation newer than
                            ``after`` that includes ``member``. Replies ``{status: "formed",
                            generation, members, rank, prefix, store_host, store_port}``,
                            ``{status: "wait"}`` (poll again) or ``{status: "finished"}``.
``POST /v1/heartbeat``      ``{member, step, blocked_on, progress, busy, warm, seen, hold}``:
                            records liveness, the collective the member waits in, its progress
                            counter and deliberate busy work (for the progress watchdog); replies
                            the member's view ``{generation, broken, reconfigure, state, reason,
                            fence, finished, failed}`` as soon as it differs from ``seen``.
``POST /v1/failure``        ``{member, generation, error}``: a collective of that generation failed.
``POST /v1/exit``           ``{member, exitcode, reason}``: a launcher saw a worker process exit.
``POST /v1/leave``          ``{member, finished, step}``: a member left (``finished``: job done).
``POST /v1/quarantine``     ``{prefix, seconds, reason}``: a launcher took a worker slot out of the
                            job for ``seconds`` (0 lifts it). Until then ``/v1/join`` answers
                            ``{status: "refused", reason}`` to every member id that starts with
                            ``prefix`` (a slot: ``<node>.w<local rank>.``).
``GET /v1/status``          generation, members with state, step and heartbeat age, finished,
                            failed (why the job cannot go on, or null), quarantined (prefix:
                            seconds left).
``GET /metrics``            Prometheus metrics (:mod:`unbroken.metrics`).
==========================  ======================================================================
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import uuid
import hmac
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from unbroken.errors import ConfigError
from unbroken.membership import Membership, MembershipSettings, MemberState
from unbroken.telemetry import EventLog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorSettings:
    """Where the coordinator listens and how long its long polls hold."""

    host: str = "127.0.0.1"
    """Address to bind (use 0.0.0.0 to serve other hosts)."""
    port: int = 0
    """HTTP port; 0 picks a free one."""
    store_port: int = 0
    """Port of the TCPStore for process groups; 0 picks a free one."""
    advertise_host: str | None = None
    """Host name members use to reach the store; defaults to ``host`` (or this host's name)."""
    hold: float = 2.0
    """Longest time a long poll (join, heartbeat) is held before it is answered anyway."""
    check_interval: float = 0.1
    """How often heartbeat deadlines are checked."""
    token: str | None = None
    """Shared secret every request must carry (``Authorization: Bearer TOKEN``); None: none."""
    finished_memory: float = 60.0
    """With etcd: how long the record that the job finished is kept (a leader taking over within
    it does not start the job again; a launch under the same job id after it trains anew)."""
    rejoin_grace: float = 0.5
    """A candidate that takes over the lead forms its first generation once every member of the
    last one has rejoined, or after this many seconds with those that did (a lost host's members
    never do). Live members look for the new leader every 0.1 s, so they rejoin well within it;
    one that is later joins the next generation."""


class Coordinator:
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
        self.state = Membership(membership)
        self.leadership = leadership
        """A :class:`~unbroken.replicated.Leadership` when this is one of several candidates whose
        state is replicated in etcd; None for a coordinator on its own."""
        self._durable = 0
        """The newest generation known to be durable in etcd: members hear only of those."""
        self._recorded_finished = False
        """Whether this lead has recorded in etcd that the job finished."""
        self._leading = False
        """A candidate's state is its own lead's (taken over from etcd); False until then."""
        self._coordinators: list[str] = []
        """Every candidate's address (the leader's first), sent to members so they know them all."""
        self.events = events or EventLog(None, "coordinator")
        from unbroken.metrics import CoordinatorMetrics  # prometheus_client: only the coordinator needs it

        self.metrics = CoordinatorMetrics()
        self.port: int | None = None
        self.store_port: int | None = None
        self._store = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
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
                web.post("/v1/leave", self._leave),
                web.post("/v1/quarantine", self._quarantine),
                web.get("/v1/status", self._status),
                web.get("/metrics", self._metrics),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        # reuse_address: a coordinator restarted in place binds its port at once, not after TIME_WAIT
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"coordinator port {self.settings.port} on {self.settings.host} is already in use;"
                    " choose another with --coordinator-port, or 0 for any free port"
                ) from None
            raise ConfigError(f"cannot listen on {self.settings.host}:{self.settings.port}: {exc}") from None
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        if self.leadership is not None and not self.leadership.me:
            self.leadership.me = f"{self.settings.advertise_host or self.settings.host}:{self.port}"
        self._changed = asyncio.Event()
        self._watcher = asyncio.get_running_loop().create_task(self._watch_deadlines())
        if self.leadership is not None:
            self._campaigner = asyncio.get_running_loop().create_task(self._lead())
        self.events.emit("coordinator_start", port=self.port, store_port=self.store_port, incarnation=self.incarnation)
        log.info("coordinator listening on %s:%s, store on port %s", self.settings.host, self.port, self.store_port)

    def start_in_thread(self) -> "Coordinator":
        """Start the store and the HTTP server on a daemon thread; returns once listening."""
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
            loop.run_until_complete(self._runner.cleanup())
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

    def serve_forever(self) -> None:
        """Run in the calling thread until :meth:`stop` (or Ctrl-C)."""
        self._start_store()

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            await self._start_http()
            print(f"unbroken coordinator listening on {self.settings.host}:{self.port} (store port {self.store_port})", flush=True)
            await self._wait_stopped()
            await self._runner.cleanup()

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
        generation, decision = self.state.maybe_form(time.monotonic())
        if self.leadership is not None and self.state.finished and not self._recorded_finished:
            self._recorded_finished = True
            asyncio.get_running_loop().create_task(self._record_finished())
        if generation is not None:
            if self.leadership is not None:
                asyncio.get_running_loop().create_task(self._make_durable(generation))
            if broken_at is not None:
                self.metrics.stalled(generation.formed_at - broken_at)
            log.info("generation %d formed: %s (%s)", generation.number, ", ".join(generation.members), decision.reason)
            self.events.emit(
                "generation", generation=generation.number, members=list(generation.members), reason=decision.reason
            )
        self._wake_all()

    def _wake_all(self) -> None:
        """Wake every long poll, so that each recomputes its answer."""
        assert self._changed is not None
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout: float) -> None:
        assert self._changed is not None
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _watch_deadlines(self) -> None:
        while True:
            await asyncio.sleep(self.settings.check_interval)
            now = time.monotonic()
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

    # -- leadership (replicated state in etcd) -----------------------------------------------------

    async def _lead(self) -> None:
        """Look for a free leader key every ``poll`` seconds until this candidate leads; then
        renew its lease every third of it, and step down (serving nothing) the moment it cannot.
        Each time it starts to lead it starts afresh: a new incarnation and an empty membership
        that its members' rejoins fill, with generation numbers continuing from etcd."""
        from unbroken.replicated import EtcdUnavailable

        leadership = self.leadership
        settings = leadership.settings
        registered_at = -float("inf")
        while True:
            try:
                if time.monotonic() - registered_at >= settings.registration / 3:
                    await leadership.register()
                    self._coordinators = await leadership.candidates()
                    registered_at = time.monotonic()
                if not leadership.is_leader():
                    self._leading = False  # whatever it held from an earlier lead is stale
                    if await leadership.campaign_if_free():
                        await self._take_over()
                elif not await leadership.renew():
                    self._deposed("its etcd lease could not be renewed")
            except EtcdUnavailable as exc:
                if not leadership.is_leader():
                    log.debug("campaign failed: %s", exc)
            except Exception:  # the campaign must go on whatever one round does
                log.exception("leadership round failed")
            await asyncio.sleep(settings.lease / 3 if leadership.is_leader() else settings.poll)

    async def _take_over(self) -> None:
        """Start leading from what etcd holds: generation numbers continue above the newest one,
        the first generation waits ``rejoin_grace`` at most for the last one's members, and a
        job that has just finished stays so."""
        stored = await self.leadership.read("generation") or {}
        finished = bool(await self.leadership.read("finished"))
        settings = self.membership_settings
        if stored.get("members"):
            settings = dataclasses.replace(
                settings, expected_members=len(stored["members"]), start_grace=self.settings.rejoin_grace
            )
        self.state = Membership(settings)
        self.state.min_generation = int(stored.get("number", 0))
        self.state.finished = self._recorded_finished = finished
        self._durable = self.state.min_generation
        self._coordinators = await self.leadership.candidates()
        self.incarnation = uuid.uuid4().hex[:12]
        self._leading = True
        log.warning("now leading (incarnation %s); generations continue above %d", self.incarnation, self._durable)
        self.events.emit("leader", incarnation=self.incarnation, generation=self._durable, address=self.leadership.me)
        self._bump()

    async def _record_finished(self) -> None:
        """Make "finished" durable for ``finished_memory`` seconds: a candidate that takes over
        just as the job ends tells the remaining members and launchers so, instead of starting
        it again. (A failed job is not recorded: launched again, it should train.)"""
        from unbroken.replicated import EtcdUnavailable, NotLeader

        try:
            await self.leadership.guarded_put("finished", True, ttl=self.settings.finished_memory)
        except (NotLeader, EtcdUnavailable) as exc:
            log.warning("could not record in etcd that the job finished: %s", exc)

    def _serving(self) -> bool:
        """Whether this coordinator answers: always when alone; a candidate only while it leads
        by its own clock and has rebuilt its state from etcd since it started leading."""
        return self.leadership is None or (self._leading and self.leadership.is_leader())

    def _deposed(self, why: str) -> None:
        self._leading = False
        log.error("no longer the leader: %s; serving nothing", why)
        self.leadership.step_down()
        self.events.emit("leader_lost", incarnation=self.incarnation, reason=why)
        self._wake_all()  # long polls end (with 503) instead of answering from a stale state

    async def _make_durable(self, generation: Any) -> None:
        """Write a formed generation to etcd, guarded by the leader key, before any member hears
        of it; a refused write deposes this leader."""
        from unbroken.replicated import EtcdUnavailable, NotLeader

        record = {"number": generation.number, "members": list(generation.members), "incarnation": self.incarnation}
        try:
            await self.leadership.guarded_put("generation", record)
        except (NotLeader, EtcdUnavailable) as exc:
            self._deposed(f"generation {generation.number} could not be made durable: {exc}")
            return
        self._durable = max(self._durable, generation.number)
        self._wake_all()

    @property
    def _leading_only(self):
        from aiohttp import web

        @web.middleware
        async def leading_only(request, handler):
            if not self._serving() and request.path != "/metrics":
                return self._not_leading(f"{self.leadership.me} is a candidate that does not lead")
            response = await handler(request)
            if not self._serving() and request.path != "/metrics":
                # it lost the lead while the request waited: its answer may already be stale
                return self._not_leading(f"{self.leadership.me} stopped leading")
            return response

        return leading_only

    def _not_leading(self, why: str):
        """503, with where the leader is (as far as this candidate knows): members go there."""
        from aiohttp import web

        hint = self.leadership.known_leader
        return web.json_response(
            {"error": why, "leader": hint if hint != self.leadership.me else None, "coordinators": self._coordinators},
            status=503,
        )

    # -- handlers ------------------------------------------------------------------------------

    @property
    def _authenticate(self):
        from aiohttp import web

        expected = f"Bearer {self.settings.token}".encode()

        @web.middleware
        async def authenticate(request, handler):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return web.json_response(
                    {"error": "missing or wrong token: pass --token or set UNBROKEN_TOKEN to the job's token"}, status=401
                )
            return await handler(request)

        return authenticate

    async def _json(self, request) -> dict[str, Any]:
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("member", ""), str):
            from aiohttp import web

            raise web.HTTPBadRequest(text="expected a JSON object with a string 'member'")
        return body

    def _reply(self, payload: dict[str, Any]):
        from aiohttp import web

        return web.json_response(payload)

    async def _join(self, request):
        body = await self._json(request)
        member_id = body["member"]
        refusal = self._refusal(member_id)
        if refusal is not None:
            return self._reply({"status": "refused", "reason": refusal})
        mismatch = self._mismatch(member_id, body.get("preflight"))
        if mismatch is not None:
            return self._reply({"status": "mismatch", "reason": mismatch})
        after = int(body.get("after", 0))
        self.state.min_generation = max(self.state.min_generation, after)
        warm = bool(body.get("warm", True))
        if self.state.join(member_id, str(body.get("node", "")), body.get("pid"), int(body.get("step", 0)), time.monotonic(), warm):
            self.events.emit("join", member=member_id, step=int(body.get("step", 0)))
            self._bump()
        deadline = time.monotonic() + self.settings.hold
        while True:
            current = self.state.current
            member = self.state.members[member_id]
            durable = self.leadership is None or (current is not None and current.number <= self._durable)
            if current is not None and durable and current.number > after and member_id in current.members and member.state is MemberState.ACTIVE:
                return self._reply(
                    {
                        "status": "formed",
                        "incarnation": self.incarnation,
                        "generation": current.number,
                        "members": list(current.members),
                        "rank": current.members.index(member_id),
                        "prefix": current.prefix,
                        "store_host": self.settings.advertise_host or self.settings.host,
                        "store_port": self.store_port,
                        **({"coordinators": self._coordinators} if self._coordinators else {}),
                    }
                )
            if self.state.finished:
                return self._reply({"status": "finished"})
            if self.state.failed:
                return self._reply({"status": "failed", "reason": self.state.failed})
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return self._reply({"status": "wait"})
            await self._wait_change(remaining)

    async def _heartbeat(self, request):
        body = await self._json(request)
        member_id = body["member"]
        seen = body.get("seen") or {}
        deadline = time.monotonic() + min(float(body.get("hold", self.settings.hold)), self.settings.hold)
        progress = body.get("progress")
        self.state.heartbeat(
            member_id,
            body.get("step"),
            time.monotonic(),
            body.get("blocked_on"),
            progress=int(progress) if isinstance(progress, int) else None,
            busy=body.get("busy") or None,
            warm=body.get("warm") if isinstance(body.get("warm"), bool) else None,
        )
        while True:
            view = {**self.state.view_for(member_id), "incarnation": self.incarnation}
            remaining = deadline - time.monotonic()
            if view != seen or remaining <= 0:
                return self._reply(view)
            await self._wait_change(remaining)

    async def _failure(self, request):
        body = await self._json(request)
        generation = int(body.get("generation", 0))
        if self.state.report_failure(body["member"], generation, time.monotonic()):
            log.warning("generation %d broken: %s reported %s", generation, body["member"], body.get("error"))
            self.events.emit("failure", member=body["member"], generation=generation, detected_by="collective", error=body.get("error"))
            self.metrics.failure("collective")
            self._bump()
        return self._reply({"ok": True})

    async def _exit(self, request):
        body = await self._json(request)
        member_id = body["member"]
        reason = str(body.get("reason", "exited"))
        if self.state.mark_dead(member_id, reason, time.monotonic()):
            log.warning("member %s exited: %s", member_id, reason)
            self.events.emit("verdict", member=member_id, detected_by="launcher", reason=reason)
            self.metrics.failure("launcher")
        self._bump()
        return self._reply({"ok": True})

    async def _leave(self, request):
        body = await self._json(request)
        if self.state.leave(body["member"], bool(body.get("finished")), int(body.get("step", 0)), time.monotonic()):
            if body.get("finished"):
                self.events.emit("finished", member=body["member"], step=int(body.get("step", 0)))
            self._bump()
        return self._reply({"ok": True})

    async def _quarantine(self, request):
        from aiohttp import web

        body = await self._json(request)
        prefix = body.get("prefix")
        seconds = body.get("seconds")
        if (
            not isinstance(prefix, str)
            or not prefix
            or isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not math.isfinite(seconds)
        ):
            raise web.HTTPBadRequest(text="expected {prefix: non-empty string, seconds: number, reason}")
        if seconds > 0:
            self._quarantined[prefix] = time.monotonic() + seconds
            log.warning("slot %s quarantined for %g s: %s", prefix, seconds, body.get("reason"))
        elif self._quarantined.pop(prefix, None) is not None:
            log.info("slot %s is no longer quarantined", prefix)
        return self._reply({"ok": True})

    def _mismatch(self, member_id: str, preflight: Any) -> str | None:
        """Why a joining member does not match the job (None if it does). The reference is the
        first member's preflight, kept while any member lives; it names each difference."""
        if not isinstance(preflight, dict):
            return None
        mine = {str(k): str(v) for k, v in preflight.items()}
        if self._reference is None or self.state.live_count() == 0:
            self._reference = mine
            return None
        reference = self._reference
        differences = [
            f"{key}: {mine.get(key, 'missing')} here, {reference.get(key, 'missing')} in the job"
            for key in sorted(set(reference) | set(mine))
            if reference.get(key) != mine.get(key)
        ]
        if not differences:
            return None
        reason = "; ".join(differences)
        log.error("member %s refused: it does not match the job: %s", member_id, reason)
        self.events.emit("refused", member=member_id, reason=reason)
        return reason

    def _refusal(self, member_id: str) -> str | None:
        """Why a member may not join (its slot is quarantined), or None; forgets expired entries."""
        now = time.monotonic()
        for prefix, until in list(self._quarantined.items()):
            if until <= now:
                del self._quarantined[prefix]
            elif member_id.startswith(prefix):
                return f"its slot {prefix} is quarantined for {until - now:.0f} s more"
        return None

    def _quarantine_left(self) -> dict[str, float]:
        now = time.monotonic()
        return {prefix: round(until - now, 1) for prefix, until in self._quarantined.items() if until > now}

    async def _metrics(self, request):
        from aiohttp import web

        from unbroken.metrics import CONTENT_TYPE

        return web.Response(body=self.metrics.render(self.state), headers={"Content-Type": CONTENT_TYPE})

    async def _status(self, request):
        now = time.monotonic()
        current = self.state.current
        return self._reply(
            {
                "incarnation": self.incarnation,
                "generation": current.number if current else 0,
                "generation_members": list(current.members) if current else [],
                "broken": self.state.view_for("")["broken"],
                "finished": self.state.finished,
                "failed": self.state.failed,
                "committed_step": self.state.committed_step(),
                "live": self.state.live_count(),
                "quarantined": self._quarantine_left(),
                **({"coordinators": self._coordinators} if self._coordinators else {}),
                "members": [
                    {
                        "member": m.id,
                        "node": m.node,
                        "state": m.state.value,
                        "step": m.step,
                        "heartbeat_age": round(now - m.last_heartbeat, 3),
                        "reason": m.death_reason,
                    }
                    for m in self.state.members.values()
                ],
            }
        )
