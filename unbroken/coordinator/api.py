"""The coordinator's HTTP handlers: the requests of its API (the table in :mod:`unbroken.coordinator.server`).

Each handler reads a JSON body, applies it to the membership state (the decisions are
:mod:`unbroken.coordinator.membership`'s) and answers; ``join`` and ``heartbeat`` are long polls that answer
as soon as their answer changes, or after ``hold`` seconds. A member is refused while its slot
is quarantined, or when its preflight does not match the job's.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Coroutine

from unbroken.coordinator.job_decisions import JobDecisions
from unbroken.coordinator.line_requests import WRONG_TOKEN
from unbroken.coordinator.line_watch import CONNECTION_CLOSED, LineWatch
from unbroken.coordinator.membership import MemberState

if TYPE_CHECKING:
    from unbroken.coordinator.settings import CoordinatorSettings
    from unbroken.coordinator.membership import Membership
    from unbroken.coordinator.metrics import CoordinatorMetrics
    from unbroken.observe.events import EventLog

log = logging.getLogger("unbroken.coordinator.server")  # moved out of the coordinator; its messages keep their logger


class CoordinatorApi(JobDecisions, LineWatch):
    """The request handlers of :class:`~unbroken.coordinator.server.Coordinator`, which it is a base of,
    on the coordinator's own state."""

    settings: CoordinatorSettings
    state: Membership
    leadership: Any
    events: EventLog
    metrics: CoordinatorMetrics
    incarnation: str
    store_port: int | None
    _durable: int
    _coordinators: list[str]
    _reference: dict[str, str] | None
    _quarantined: dict[str, float]
    _heartbeat_connections: dict[str, Any]
    _idle_connections: dict[str, Any]
    _members_body: tuple[int, bytes] | None
    _bump: Callable[[], None]
    _wait_change: Callable[..., Coroutine[Any, Any, None]]

    @property
    def _authenticate(self):
        from aiohttp import web

        expected = f"Bearer {self.settings.token}".encode()

        @web.middleware
        async def authenticate(request, handler):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return web.json_response({"error": WRONG_TOKEN}, status=401)
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
        return self._reply(await self._join_body(await self._json(request), request.transport))

    async def _join_body(self, body: dict[str, Any], transport: Any) -> dict[str, Any]:
        """A join's answer (a long poll: held until the member is formed, or ``hold``), on the
        member's line ``transport``; from aiohttp's handler and from the lean line's."""
        member_id = body["member"]
        refusal = self._refusal(member_id)
        if refusal is not None:
            return {"status": "refused", "reason": refusal}
        mismatch = self._mismatch(member_id, body.get("preflight"))
        if mismatch is not None:
            return {"status": "mismatch", "reason": mismatch}
        after = int(body.get("after", 0))
        self.state.min_generation = max(self.state.min_generation, after)
        warm = bool(body.get("warm", True))
        current = self.state.current
        known = self.state.members.get(member_id)
        # Active in a generation newer than any it has heard of: its previous join's answer
        # ("wait") crossed the formation. It has not left that generation; answer it, instead of
        # taking it for a member that left, which would make every member re-form again (at
        # thousands of members, each formation would be spoilt by the next late one).
        unheard = (
            current is not None
            and current.number > after
            and member_id in current.ranks
            and known is not None
            and known.state is MemberState.ACTIVE
        )
        catch_up = body.get("catch_up") if isinstance(body.get("catch_up"), str) else None
        if not unheard and self.state.join(member_id, str(body.get("node", "")), body.get("pid"), int(body.get("step", 0)),
                                           time.monotonic(), warm, catch_up):
            self.events.emit("join", member=member_id, step=int(body.get("step", 0)))
            self._bump()
        else:
            self.state.touch(member_id, time.monotonic())  # its joins are its heartbeats meanwhile
        lean = bool(body.get("lean"))
        hold = body.get("hold")  # shorter than the coordinator's: a member catching up asks again soon
        deadline = time.monotonic() + self._join_hold(hold if isinstance(hold, (int, float)) else None)
        self._watch_line(member_id, transport)
        try:
            return await self._answer_join(member_id, after, lean, deadline)
        except asyncio.CancelledError:
            self._line_closed(member_id, transport)
            raise
        finally:
            self.state.touch(member_id, time.monotonic())  # a join held this long kept it alive
            self._line_idle(member_id, transport)

    def _join_hold(self, asked: float | None) -> float:
        """How long a join may be held: the member's heartbeats wait meanwhile (they share its
        line, :mod:`unbroken.coordinator.member_line`), so the join is its heartbeat and is held
        at most a third of the heartbeat timeout; a member catching up asks for less."""
        hold = min(self.settings.hold, self.state.settings.heartbeat_timeout / 3)
        return hold if asked is None else max(0.0, min(float(asked), hold))

    async def _answer_join(self, member_id: str, after: int, lean: bool, deadline: float) -> dict[str, Any]:
        while True:
            current = self.state.current
            member = self.state.members.get(member_id)
            durable = self.leadership is None or (current is not None and current.number <= self._durable)
            rank = current.ranks.get(member_id) if current is not None else None
            if current is not None and durable and current.number > after and rank is not None and member is not None and member.state is MemberState.ACTIVE:
                return {
                        "status": "formed",
                        "incarnation": self.incarnation,
                        "generation": current.number,
                        # O(N) bytes to each of N members is O(N^2) per formation: a lean
                        # member fetches the list (or the names it needs) from /v1/members
                        **({} if lean else {"members": list(current.members)}),
                        "size": len(current.members),
                        "rank": rank,
                        "prefix": current.prefix,
                        **({"stop": current.stop} if current.stop else {}),
                        "store_host": self.settings.advertise_host or self.settings.host,
                        "store_port": self.store_port,
                        **({"coordinators": self._coordinators} if self._coordinators else {}),
                }
            if self.state.finished:
                return {"status": "finished"}
            if self.state.failed:
                return {"status": "failed", "reason": self.state.failed}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return {"status": "wait"}
            await self._wait_change(remaining, member_id)

    async def _heartbeat(self, request):
        body = await self._json(request)
        transport = request.transport  # None once closed: the line it was is compared below
        member_id, seen, deadline = self._heartbeat_start(body, transport)
        try:
            while (view := self._heartbeat_answer(member_id, seen, deadline)) is None:
                await self._wait_change(deadline - time.monotonic(), member_id)
            return self._reply(view)
        except asyncio.CancelledError:
            self._line_closed(member_id, transport)
            raise
        finally:
            self._line_idle(member_id, transport)

    def _heartbeat_start(self, body: dict[str, Any], transport: Any) -> tuple[str, dict[str, Any], float]:
        """Take a heartbeat's report, on the member's line ``transport``; returns the member, the
        view it has seen, and until when its poll may be held."""
        member_id = body["member"]
        seen = body.get("seen") or {}
        deadline = time.monotonic() + min(float(body.get("hold", self.settings.hold)), self.settings.hold)
        self._watch_line(member_id, transport)
        progress = body.get("progress")
        self.state.heartbeat(
            member_id,
            body.get("step"),
            time.monotonic(),
            body.get("blocked_on"),
            progress=int(progress) if isinstance(progress, int) else None,
            busy=body.get("busy") or None,
            warm=body.get("warm") if isinstance(body.get("warm"), bool) else None,
            pace=body.get("pace") if isinstance(body.get("pace"), dict) else None,
        )
        if self.leadership is None and self.state.take_survivors(time.monotonic()):
            self._bump()  # the last survivor of a verdict reported waiting in a collective
        return member_id, seen, deadline

    def _heartbeat_answer(self, member_id: str, seen: dict[str, Any], deadline: float) -> dict[str, Any] | None:
        """A held heartbeat's answer now (its hold is over, or its view has news), else None."""
        view = {**self.state.view_for(member_id), "incarnation": self.incarnation}
        if deadline <= time.monotonic() or (view != seen and self._news(member_id, view, seen)):
            return view
        return None

    def _news(self, member_id: str, view: dict[str, Any], seen: dict[str, Any]) -> bool:
        """Whether ``view`` tells the member something its own join does not: a held heartbeat
        answers at once only then, and otherwise at the end of its hold.

        A member learns from its join's reply that it waits, and then the generation it was formed
        into; answering every heartbeat poll of a re-formation for that as well would double the
        coordinator's messages when it is busiest (thousands of members re-forming at once). A
        member formed into it without joining (``Membership.take_survivors``) learns of it here."""
        formed_into = (
            not view["broken"] and not view["reconfigure"]
            and self.state.current is not None and member_id in self.state.current.ranks
            and member_id not in self.state.preformed
        )
        for key, value in view.items():
            old = seen.get(key)
            if value == old:
                continue
            if key == "state" and value in ("waiting", "active") and old in ("waiting", "active"):
                continue
            if key in ("generation", "broken", "reconfigure", "rank", "size", "prefix") and formed_into:
                continue
            return True
        return False

    async def _failure(self, request):
        body = await self._json(request)
        generation = int(body.get("generation", 0))
        if self.state.report_failure(body["member"], generation, time.monotonic()):
            log.warning("generation %d broken: %s reported %s", generation, body["member"], body.get("error"))
            self.events.emit("failure", member=body["member"], generation=generation, detected_by="collective", error=body.get("error"))
            self.metrics.failure("collective")
            self._bump()
            # a peer's process or host may be gone: the kernel's closing of its connection
            # reaches this loop within milliseconds of the failure the report describes
            asyncio.get_running_loop().call_later(0.02, self._check_generation_connections)
        return self._reply({"ok": True})

    async def _exit(self, request):
        body = await self._json(request)
        member_id = body["member"]
        reason = str(body.get("reason", "exited"))
        member = self.state.members.get(member_id)
        if self.state.mark_dead(member_id, reason, time.monotonic()):
            log.warning("member %s exited: %s", member_id, reason)
            self.events.emit("verdict", member=member_id, detected_by="launcher", reason=reason)
            self.metrics.failure("launcher")
        elif member is not None and member.death_reason == CONNECTION_CLOSED:
            # already declared dead as its connection closed (milliseconds earlier): the launcher
            # says how it ended, which the status, the console and the report show instead
            member.death_reason = reason
            self.events.emit("verdict", member=member_id, detected_by="launcher", reason=reason, explains="connection")
        self._bump()
        return self._reply({"ok": True})

    async def _leave(self, request):
        body = await self._json(request)
        if self.state.leave(body["member"], bool(body.get("finished")), int(body.get("step", 0)), time.monotonic()):
            if body.get("finished"):
                reason = body.get("reason")
                self.events.emit("finished", member=body["member"], step=int(body.get("step", 0)),
                                 **({"reason": str(reason)[:500]} if reason else {}))
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

        from unbroken.coordinator.metrics import CONTENT_TYPE

        return web.Response(body=self.metrics.render(self.state), headers={"Content-Type": CONTENT_TYPE})

    async def _members(self, request):
        """The member list of a generation, serialized once per generation; or one member's id."""
        from aiohttp import web

        try:
            number = int(request.query.get("generation", "0"))
            rank = int(request.query["rank"]) if "rank" in request.query else None
        except ValueError:
            raise web.HTTPBadRequest(text="expected ?generation=N[&rank=R] with integers") from None
        generation = next((g for g in reversed(self.state.history) if g.number == number), None)
        if generation is None:
            raise web.HTTPNotFound(text=f"generation {number} is not known here (forgotten, or never formed)")
        if rank is not None:
            if not 0 <= rank < len(generation.members):
                raise web.HTTPNotFound(text=f"generation {number} has no rank {rank}")
            return self._reply({"generation": number, "member": generation.members[rank]})
        if self._members_body is None or self._members_body[0] != number:
            import json

            self._members_body = (number, json.dumps({"generation": number, "members": list(generation.members)}).encode())
        return web.Response(body=self._members_body[1], content_type="application/json")

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
                "members": [m.status(now) for m in self.state.members.values()],
            }
        )
