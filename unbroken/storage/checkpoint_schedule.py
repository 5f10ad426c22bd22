"""When ``--checkpoint-every auto`` saves: the Young/Daly interval from the measured cost of a save
and the mean time between the failures a checkpoint is for (those no live peer can heal).
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_MAX_INTERVAL = 1800.0
"""The longest ``auto`` interval, in seconds: see :class:`Schedule`."""


def young_daly_interval(save_cost: float, mtbf: float) -> float:
    """Seconds between checkpoints that minimise expected lost time: sqrt(2 * C * MTBF)."""
    return math.sqrt(2.0 * max(save_cost, 1e-6) * mtbf)


class Schedule:
    """When to save: every ``every`` steps, or (``auto``) every Young/Daly interval
    ``sqrt(2 x cost x MTBF)``, capped at ``max_interval``.

    ``cost`` is what a save costs training, measured: its stall plus the slowdown of the steps that
    ran while it was written. ``MTBF`` is the mean time between the failures that a checkpoint is
    for: those that live peers cannot heal, because every holder of the state was lost at once
    (the whole job killed, preempted or out of time, every member on hosts that failed together).
    A failure that some member survives costs no checkpoint anything: a live peer heals the
    others, so counting it would only make saves more frequent for nothing.

    Those losses are seen only by the job's next start, which resumes from a checkpoint (the
    processes that could have counted them are gone): so the count and the job's training
    seconds travel in every checkpoint and every healed state (:meth:`record`, :meth:`adopt`), and
    a resume from a checkpoint that was not the job's final one counts one loss. The estimate
    ``(prior + seconds) / (losses + 1)`` starts at ``prior`` (``mtbf``, the assumed MTBF) and
    grows while the job runs without one, like a mean with the prior counted as one observation.

    The cap bounds what a loss the job cannot foresee (a cluster outage, a scheduler's kill) costs:
    at most ``max_interval`` of training redone, whatever the estimate says.
    """

    def __init__(self, every: int | str, mtbf: float, now: float, max_interval: float = DEFAULT_MAX_INTERVAL) -> None:
        self.every = every
        self.prior = mtbf
        self.max_interval = max_interval
        self.started = now
        self.losses = 0
        """Times every live copy of the state was lost in this job (resumes from a checkpoint)."""
        self.before = 0.0
        """Seconds the job had trained before this process took its state."""
        self.last_save: float | None = None
        self.interval: float | None = None

    def seconds(self, now: float) -> float:
        """The job's seconds of training so far, as far as this process knows."""
        return self.before + (now - self.started)

    def mtbf(self, now: float) -> float:
        """The estimated mean time between losses of every live copy of the state."""
        return (self.prior + self.seconds(now)) / (self.losses + 1)

    def due(self, next_step: int, now: float) -> bool:
        if self.every != "auto":
            return next_step % int(self.every) == 0
        if self.last_save is None:
            return True  # the first save measures what a save costs
        return self.interval is not None and now - self.last_save >= self.interval

    def began(self, now: float) -> None:
        """A save began now."""
        self.last_save = now

    def cost(self, seconds: float, now: float) -> str | None:
        """Record what the last save cost training; returns a message when the auto interval
        changed noticeably."""
        if self.every != "auto":
            return None
        mtbf = self.mtbf(now)
        ideal = young_daly_interval(seconds, mtbf)
        interval = min(ideal, self.max_interval)
        changed = self.interval is None or abs(interval - self.interval) > 0.1 * self.interval
        if changed:
            self.interval = interval
            capped = f", capped at {self.max_interval:.0f} s" if ideal > self.max_interval else ""
            return (f"checkpoint interval {interval:.1f} s (Young/Daly: a save costs {seconds * 1000:.0f} ms, MTBF {mtbf:.0f} s"
                    f" of losses of every live copy: {self.losses} in {self.seconds(now):.0f} s of training{capped})")
        return None

    def saved(self, cost: float, now: float) -> str | None:
        """A save that began ``now`` and cost ``cost`` seconds (both at once, for simple callers)."""
        self.began(now)
        return self.cost(cost, now)

    def record(self, now: float) -> dict[str, float]:
        """What travels with the state (in a checkpoint's manifest, in a heal)."""
        return {"losses": self.losses, "seconds": round(self.seconds(now), 3)}

    def adopt(self, record: Any, now: float, lost: bool = False) -> None:
        """Take the job's history from a state this process loaded (a checkpoint's, or a peer's in
        a heal); ``lost``: it was resumed from a checkpoint that was not the job's final one, so
        every live copy of the state had been lost. A missing or malformed record is ignored."""
        if isinstance(record, dict):
            losses, seconds = record.get("losses"), record.get("seconds")
            if isinstance(losses, int) and not isinstance(losses, bool) and losses >= 0:
                self.losses = max(self.losses, losses)
            if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds >= 0:
                self.before = max(self.before, float(seconds) - (now - self.started))
        if lost:
            self.losses += 1
