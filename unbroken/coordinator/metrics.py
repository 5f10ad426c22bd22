"""The coordinator's Prometheus metrics, served as ``GET /metrics``.

Each :class:`CoordinatorMetrics` owns its own registry (not prometheus_client's global one), so
several coordinators in one process (tests) do not clash. The gauges are read from the
membership state when the endpoint is scraped; the counters and the histogram are updated as
things happen.

==================================  =====================================================================
``unbroken_members``                live members (waiting or active)
``unbroken_generation``             number of the current generation (0 before the first)
``unbroken_committed_step``         steps committed (the highest count any member reported)
``unbroken_job_finished``           1 once the job has finished, else 0
``unbroken_failures_total``         failure reports by ``detected_by``: ``launcher``, ``connection``, ``heartbeat``,
                                    ``progress watchdog`` (verdicts) and ``collective`` (a member's
                                    broken collective); one crash can count under several labels
``unbroken_stall_seconds``          histogram: from a generation breaking to the next one forming
``unbroken_stragglers``             active members the members flag as stragglers now (:mod:`unbroken.data.balance`)
``unbroken_member_pace``            per active member (label ``member``): its pace as a fraction of the median
                                    member's, measured in-band over a window of steps (1: typical)
``unbroken_member_exchange_seconds`` per active member: seconds in its last gradient exchange (waiting for
                                    slower peers, and the transfer); high on the members a straggler holds up
==================================  =====================================================================

This module imports prometheus_client; only the coordinator imports it, so a worker's import
stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from unbroken.coordinator.member_records import MemberState

if TYPE_CHECKING:
    from unbroken.coordinator.membership import Membership

STALL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, float("inf"))
CONTENT_TYPE = CONTENT_TYPE_LATEST


class CoordinatorMetrics:
    """The metrics of one coordinator, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.members = Gauge("unbroken_members", "Live members (waiting or active).", registry=r)
        self.generation = Gauge("unbroken_generation", "Number of the current generation (0 before the first).", registry=r)
        self.committed_step = Gauge("unbroken_committed_step", "Steps committed (highest count any member reported).", registry=r)
        self.finished = Gauge("unbroken_job_finished", "1 once the job has finished, else 0.", registry=r)
        self.failures = Counter(
            "unbroken_failures", "Failure reports, by how they were detected.", ["detected_by"], registry=r
        )
        self.stragglers = Gauge("unbroken_stragglers", "Active members flagged as stragglers now.", registry=r)
        self.pace = Gauge("unbroken_member_pace", "Pace as a fraction of the median member's (1: typical).", ["member"], registry=r)
        self.exchange = Gauge(
            "unbroken_member_exchange_seconds", "Seconds in the last gradient exchange (waiting for peers, and the transfer).",
            ["member"], registry=r,
        )
        self.stall = Histogram(
            "unbroken_stall_seconds", "Seconds from a generation breaking to the next generation forming.", buckets=STALL_BUCKETS, registry=r
        )

    def failure(self, detected_by: str) -> None:
        self.failures.labels(detected_by=detected_by).inc()

    def stalled(self, seconds: float) -> None:
        self.stall.observe(max(0.0, seconds))

    def render(self, state: "Membership") -> bytes:
        """The exposition text, with the gauges taken from ``state`` now."""
        self.members.set(state.live_count())
        self.generation.set(state.current.number if state.current else 0)
        self.committed_step.set(state.committed_step())
        self.finished.set(1 if state.finished else 0)
        self._paces(state)
        return generate_latest(self.registry)

    def _paces(self, state: "Membership") -> None:
        """The straggler gauges, for the live members of the current generation only (a member
        that left or died drops out of the exposition)."""
        self.pace.clear()
        self.exchange.clear()
        flagged = 0
        for member_id in state.current.members if state.current else ():
            member = state.members.get(member_id)
            if member is None or member.state is not MemberState.ACTIVE:
                continue
            flagged += member.straggler
            if member.pace is not None:
                self.pace.labels(member=member_id).set(member.pace)
            if member.exchange_seconds is not None:
                self.exchange.labels(member=member_id).set(member.exchange_seconds)
        self.stragglers.set(flagged)
