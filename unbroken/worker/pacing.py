"""A member's side of straggler handling: measure this member's pace, exchange it with the
gradients, follow the split every member computes from the same numbers, say who is slow.

Each step, this member puts the seconds per sample it took to compute its previous share into its
own slot of a small float64 vector (the others add zeros, so the sum is exact), with the digest of
the split it used, and the vector is summed with the step's gradients
(:class:`~unbroken.worker.gradients.GradientReducer`). Afterwards every member holds every member's
measurement: the :class:`~unbroken.data.balance.Balancer` of the generation takes them and gives
the split of the next step, the same on every member. A member whose digest differs from the
others' makes the step fail before it commits (the step is redone by the next generation, whose
balancers start afresh with equal shares).

In a replica group, process ``j`` of every group exchanges with the processes ``j`` of the other
groups; the group's vote then sums the vectors over its processes, so every process of every group
ends with the same numbers. A process contributes its seconds per sample to the power 8: the sum
over a group's processes is then dominated by its slowest process (the group's pace), within
``K**(1/8)`` of it.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, NoReturn

import torch

from unbroken.data.balance import Balancer, BalanceSettings, SustainedSlowdowns
from unbroken.data.data_plan import Split

log = logging.getLogger("unbroken")

_POWER = 8  # a replica group's pace: the power mean of its processes' (close to their slowest)


class Pacing:
    """Measures this member, keeps the generation's balancer, checks the split agreed."""

    def __init__(self, settings: BalanceSettings, total: int, unit: int, group_size: int, events: Any) -> None:
        self.settings = settings
        self.total, self.unit, self.group_size = total, unit, group_size
        self._events = events
        self._balancer: Balancer | None = None
        self._generation: int | None = None
        self._last = 0.0  # this member's seconds per sample in its last measured step
        self._started: Any = None  # a CUDA event: the step's start on the device
        self._exchange_began = 0.0
        self._exchange = 0.0  # seconds this member spent in its last gradient exchange
        self._summary: dict[str, Any] | None = None
        self._sustained = SustainedSlowdowns(settings)  # the leader's: who to say is a straggler
        self.evicted: str | None = None
        """Why this member must leave as a straggler (``--stragglers evict``), once decided."""

    def leave_as_straggler(self, step: int, member_id: str) -> NoReturn:
        """``--stragglers evict`` chose this member (every member knows it at the same step):
        leave at this boundary, unfinished, with the exit status a launcher counts as a failure."""
        from unbroken.errors import EXIT_STRAGGLER

        reason = self.evicted
        self._events.emit("evicted", step=step, member=member_id, reason=reason)
        print(f"unbroken: {member_id}: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_STRAGGLER)

    @property
    def balancer(self) -> Balancer | None:
        return self._balancer

    def count(self, generation: int, members: int) -> "int | Split":
        """The member count or split of the next step of ``generation`` (a new generation starts
        with equal shares and no measurements but each member's own last one)."""
        if not self.settings.measures:
            return members
        if self._generation != generation or self._balancer is None or self._balancer.members != members:
            self._balancer = Balancer(self.settings, self.total, self.unit, members)
            self._generation = generation
        return self._balancer.count

    # -- this member's measurement ----------------------------------------------------------------

    def start(self, device: torch.device | None) -> None:
        """A step begins (on a GPU the work is queued: its end is timed on the device)."""
        self._started = None
        if device is not None and device.type == "cuda":
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()

    def measured(self, started: float, samples: int) -> None:
        """The step's share was computed (the reduce begins): keep its seconds per sample."""
        if samples <= 0:
            return
        if self._started is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            seconds = self._started.elapsed_time(end) / 1000.0
        else:
            seconds = time.monotonic() - started
        self._last = seconds / samples
        self._exchange_began = time.monotonic()

    def exchanged(self) -> None:
        """The step's gradients are reduced: keep how long this member waited in the exchange
        (for its peers' shares, and the transfer itself). A fast member waits for a slow one."""
        if self._exchange_began:
            self._exchange = time.monotonic() - self._exchange_began

    # -- the exchange -----------------------------------------------------------------------------

    def slots(self, rank: int, members: int) -> list[float] | None:
        """This member's part of the exchanged vector: its last measurement and its split's digest."""
        if not self.settings.measures or self._balancer is None:
            return None
        values = [0.0] * (2 * members)
        values[rank] = self._last ** _POWER if self.group_size > 1 else self._last
        values[members + rank] = float(self._balancer.digest())
        return values

    def width(self, members: int) -> int:
        """Length of the exchanged vector (what :meth:`slots` returns, without building it)."""
        return 2 * members if self.settings.measures and self._balancer is not None else 0

    def take(self, summed: list[float], step: int) -> str | None:
        """Every member's numbers after the exchange (and a group's vote): check the split was
        the same everywhere, then update the balancer. A reason to fail the step, or None."""
        balancer = self._balancer
        if balancer is None or not summed:
            return None
        n = balancer.members
        digests = summed[n:]
        mine = float(balancer.digest()) * self.group_size
        if any(d != mine for d in digests):
            return (f"step {step}: the members disagree on the split of the global batch (digests"
                    f" {[int(d) for d in digests]}, this member {int(mine)}); redone with equal shares")
        paces = summed[:n]
        if self.group_size > 1:
            paces = [p ** (1.0 / _POWER) if p > 0 else 0.0 for p in paces]
        balancer.observe(paces)
        return None

    def report(self, step: int, rank: int, names: list[str], leader: bool) -> None:
        """After a step's exchange: the leader says who is slow and what the split became; a
        member to evict learns it (every member knows it at the same step)."""
        balancer = self._balancer
        if balancer is None:
            return
        relative = balancer.relative_paces()
        self._summary = {"pace": None if relative[rank] is None else round(relative[rank], 4),
                         "straggler": rank in balancer.flagged(),
                         "exchange_seconds": round(self._exchange, 6)}
        if leader:
            for i in balancer.newly_flagged():
                self._events.emit("straggler", step=step, member=names[i], pace=round(relative[i], 3), window=self.settings.window)
            members = names[:balancer.members]
            for name in self._sustained.update(step, time.monotonic(), set(members), {members[i] for i in balancer.flagged()},
                                               {members[i] for i in balancer.at_pace()}):
                i = members.index(name)
                log.warning("unbroken: %s is a straggler: %.0f%% of the median member's pace, slow for %d steps or more (step %d)",
                            name, 100 * relative[i], self.settings.announce_after, step)
                self._events.emit("straggler_sustained", step=step, member=name, pace=round(relative[i], 3),
                                  steps=self.settings.announce_after)
            if balancer.changed:
                split = balancer.split
                sizes = list(split.sizes) if split is not None else None
                log.info("unbroken: step %d: shares of the global batch now %s", step,
                         "equal" if sizes is None else "/".join(map(str, sizes)))
                self._events.emit("rebalanced", step=step, shares=sizes, members=[names[i] for i in range(balancer.members)],
                                  paces=[None if r is None else round(r, 3) for r in relative])
        if rank in balancer.evicted() and self.evicted is None:
            self.evicted = (f"this member ran below {balancer.settings.evict_below:.0%} of the median member's pace for"
                            f" {balancer.settings.evict_after} steps (at {relative[rank]:.0%}, step {step});"
                            " it leaves the job as a straggler (--stragglers evict)")

    def summary(self) -> dict[str, Any] | None:
        """What this member's heartbeat tells the coordinator (read from the heartbeat thread):
        its pace as a fraction of the median member's (the median of its last ``window``
        measurements: one slow step does not move it), whether it is flagged, and its seconds in
        the last gradient exchange. None before its first measured step or when not measuring."""
        return self._summary if self.settings.measures else None
