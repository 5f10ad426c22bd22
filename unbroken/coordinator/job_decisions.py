"""Requests that decide for the whole job, made by one member: a durable ``job.stop()``
(``/v1/stop``), a job that no restart can mend (``/v1/fail_job``: replicas that differ, members
whose script makes different collectives), catch-ups turned off for good (``/v1/catch_up_off``).
Each is held by the coordinator's state, so that it outlives the member that asked (DESIGN: Fast
paths), and each is said in the event log.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from unbroken.coordinator.membership import Membership
    from unbroken.observe.events import EventLog

log = logging.getLogger("unbroken.coordinator.server")  # the coordinator's messages keep their logger


class JobDecisions:
    """The handlers of the job-wide decisions; a base of :class:`~unbroken.coordinator.api.CoordinatorApi`."""

    state: Membership
    events: EventLog
    _bump: Callable[[], None]
    _json: Callable[..., Any]
    _reply: Callable[..., Any]
    _record_outcome_once: Callable[[], None]

    async def _stop(self, request):
        from aiohttp import web

        body = await self._json(request)
        step = body.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise web.HTTPBadRequest(text="expected {member, step: a non-negative integer, reason}")
        reason = str(body.get("reason") or "stopped by the script")
        if self.state.request_stop(step, reason):
            self.events.emit("stop_requested", member=body["member"], step=step, reason=reason[:500])
            self._bump()
        return self._reply({"ok": True})

    async def _fail_job(self, request):
        """A member found what no restart mends: replicas that differ
        (:class:`~unbroken.errors.ReplicaDivergence`: no member's model can be vouched for), or
        members whose script makes different collectives. The job fails with the reason
        (recorded in etcd too): nobody re-forms, restarts or finishes from it."""
        body = await self._json(request)
        reason = str(body.get("reason") or "a member failed the job")[:1000]
        if not self.state.failed:
            self.state.failed = reason
            self.state.version += 1
            log.error("job failed: %s", reason)
            self.events.emit("job_failed", reason=reason, member=body["member"])
            self._record_outcome_once()
            self._bump()
        return self._reply({"ok": True})

    async def _catch_up_off(self, request):
        body = await self._json(request)
        reason = str(body.get("reason", "a catch-up failed to verify"))[:500]
        if self.state.stop_catch_ups(reason):
            self.events.emit("catch_up_off", member=body["member"], reason=reason)
            self._bump()
        return self._reply({"ok": True})
