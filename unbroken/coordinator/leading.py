"""A coordinator candidate's leadership, when the coordinator is replicated over etcd.

Each launcher under ``--etcd`` runs a candidate (see :mod:`unbroken.coordinator.replicated` for the election
and the guarded writes). A candidate polls the leader key until it leads; then it rebuilds its
state from etcd (:meth:`Leading._take_over`), serves, renews its lease, and makes every generation
it forms durable in etcd before any member hears of it. The moment it cannot, it is deposed and
serves nothing (a 503 that names the leader, as far as it knows).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from unbroken.coordinator.membership import Membership

if TYPE_CHECKING:
    from unbroken.coordinator.settings import CoordinatorSettings
    from unbroken.coordinator.membership import MembershipSettings
    from unbroken.observe.events import EventLog

log = logging.getLogger("unbroken.coordinator.server")  # moved out of the coordinator; its messages keep their logger


class Leading:
    """The leadership side of :class:`~unbroken.coordinator.server.Coordinator`, which it is a base of:
    the rounds of a candidate, on the coordinator's own state."""

    settings: CoordinatorSettings
    membership_settings: MembershipSettings
    state: Membership
    leadership: Any
    events: EventLog
    incarnation: str
    _durable: int
    _recorded_outcome: bool
    _leading: bool
    _coordinators: list[str]
    _bump: Callable[[], None]
    _wake_all: Callable[[], None]

    async def _lead(self) -> None:
        """Look for a free leader key every ``poll`` seconds until this candidate leads; then
        renew its lease every third of it, and step down (serving nothing) the moment it cannot.
        Each time it starts to lead it starts afresh: a new incarnation and an empty membership
        that its members' rejoins fill, with generation numbers continuing from etcd."""
        from unbroken.coordinator.replicated import EtcdUnavailable

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
        job that ended (finished, or failed) stays so."""
        stored = await self.leadership.read("generation") or {}
        outcome = await self.leadership.read("outcome") or {}
        settings = self.membership_settings
        if stored.get("members"):
            settings = dataclasses.replace(
                settings, expected_members=len(stored["members"]), start_grace=self.settings.rejoin_grace
            )
        self.state = Membership(settings, store_token=self.settings.token)
        self.state.min_generation = int(stored.get("number", 0))
        # Its first generation must not train from behind the job: it waits for a member that
        # holds the step the last durable generation started from, at least a heartbeat timeout,
        # and for as long as any member of that generation heartbeats (Membership.holders_gone).
        self.state.holder_step = int(stored.get("step", 0))
        self.state.holder_deadline = time.monotonic() + max(settings.heartbeat_timeout, self.settings.rejoin_grace)
        self.state.holder_members = frozenset(stored.get("members") or ())
        self.state.finished = bool(outcome.get("finished"))
        self.state.failed = outcome.get("failed") or None
        self._recorded_outcome = bool(outcome)
        self._durable = self.state.min_generation
        self._coordinators = await self.leadership.candidates()
        self.incarnation = uuid.uuid4().hex[:12]
        self._leading = True
        log.warning("now leading (incarnation %s); generations continue above %d", self.incarnation, self._durable)
        self.events.emit("leader", incarnation=self.incarnation, generation=self._durable, address=self.leadership.me)
        self._bump()

    def _record_outcome_once(self) -> None:
        """With etcd: once the job finished or failed, record it (once per lead)."""
        if self.leadership is None or self._recorded_outcome or not (self.state.finished or self.state.failed):
            return
        self._recorded_outcome = True
        outcome = {"finished": True} if self.state.finished else {"failed": self.state.failed}
        asyncio.get_running_loop().create_task(self._record_outcome(outcome))

    async def _record_outcome(self, outcome: dict[str, Any]) -> None:
        """Make the job's outcome durable, with no expiry: a candidate that takes over after the
        job ended tells the remaining members and launchers so, instead of starting it again
        (launchers would restart the workers of a failed job). It stays until the job id is
        deliberately reused: ``etcdctl del --prefix /unbroken/<job id>/``, or a new job id."""
        from unbroken.coordinator.replicated import EtcdUnavailable, NotLeader

        try:
            await self.leadership.guarded_put("outcome", outcome)
        except (NotLeader, EtcdUnavailable) as exc:
            self._recorded_outcome = False  # the next leader, or the next round, tries again
            log.warning("could not record in etcd how the job ended (%s): %s", outcome, exc)

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
        from unbroken.coordinator.replicated import EtcdUnavailable, NotLeader

        # the step this generation starts from: the best its members hold (healing brings all there)
        step = max((self.state.members[m].step for m in generation.members if m in self.state.members), default=0)
        record = {"number": generation.number, "members": list(generation.members), "incarnation": self.incarnation, "step": step}
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
