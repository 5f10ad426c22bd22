"""Stragglers: each member's measured pace, the split of the global batch that follows it, and
the members to flag or evict.

A synchronous step runs at the pace of its slowest member, but the model does not depend on who
computes which micro-batch (each is weighted by its share of the global batch). So a slow member
is given fewer whole micro-batches and the others more: the global batch, the order of its
samples and exactly-once do not change (:class:`~unbroken.data.data_plan.Split`).

Every member feeds a :class:`Balancer` the same numbers: the seconds per sample each member took
to compute its share of the step before, exchanged with the gradients (one slot per member, the
others adding zeros, so the sums are exact). The same numbers and the same code give the same
split on every member, without a message of its own; the members still compare a digest of the
split they used before anything commits. The estimate of a member's pace is the median of its
last ``window`` measurements (one slow step, a page fault or a collection, moves nothing), and a
new split is taken only when it shortens the predicted step by ``gain`` and ``window`` steps after
the last change, so noisy paces do not make the split oscillate.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from unbroken.data.data_plan import Split
from unbroken.errors import ConfigError

MODES = ("balance", "report", "evict", "off")
"""``balance``: rebalance and flag (default); ``report``: flag only; ``evict``: rebalance, flag and
end a member that stays below the floor; ``off``: no measurement at all."""


@dataclass(frozen=True)
class BalanceSettings:
    """How stragglers are measured, rebalanced, flagged and evicted."""

    mode: str = "balance"
    window: int = 5
    """Steps of measurements a pace estimate is the median of; also the least number of steps
    between two changes of the split."""
    gain: float = 0.2
    """A new split is taken only if it shortens the predicted step by at least this fraction (20 %:
    a 25 % noise on every pace never moves the split, a member at half pace does within a window)."""
    flag_below: float = 0.8
    """A member whose pace estimate is below this fraction of the median member's for ``window``
    steps in a row is flagged as a straggler (once: it stays flagged until it is back above
    halfway to the median's pace for ``window`` steps)."""
    announce_after: int = 20
    """A flagged member is said on the console (once per job, by the leader) only when it has been
    flagged this many steps in a row ..."""
    announce_after_s: float = 5.0
    """... and for at least this many seconds, while no other member was flagged: members that are
    slow in turn (an oversubscribed host) or for a moment are kept in the events and the report,
    not announced."""
    evict_below: float = 0.5
    """With ``mode="evict"``: a member below this fraction of the median pace ..."""
    evict_after: int = 20
    """... for this many steps in a row is ended (and counted as a failure)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"stragglers must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"straggler window must be a positive number of steps, got {self.window!r}")
        for name in ("gain", "flag_below", "evict_below"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ConfigError(f"straggler {name} must be between 0 and 1, got {value!r}")
        if not isinstance(self.announce_after, int) or self.announce_after < 1:
            raise ConfigError(f"straggler announce_after must be a positive number of steps, got {self.announce_after!r}")
        if not self.announce_after_s >= 0:
            raise ConfigError(f"straggler announce_after_s must be seconds (0 or more), got {self.announce_after_s!r}")
        if not isinstance(self.evict_after, int) or self.evict_after < 1:
            raise ConfigError(f"straggler evict_after must be a positive number of steps, got {self.evict_after!r}")

    @property
    def measures(self) -> bool:
        return self.mode != "off"

    @property
    def rebalances(self) -> bool:
        return self.mode in ("balance", "evict")


def proportional_split(total: int, unit: int, paces: list[float]) -> Split | None:
    """Sizes in whole ``unit``s (a micro-batch) proportional to ``paces`` (samples per second),
    at least one unit each, summing to ``total`` (what is left over a whole unit goes to the
    fastest member). None when there are fewer units than members."""
    n = len(paces)
    units, rest = divmod(total, unit)
    if n == 0 or units < n or min(paces) <= 0:
        return None
    whole = sum(paces)
    quotas = [units * p / whole for p in paces]
    counts = [max(1, math.floor(q)) for q in quotas]
    while sum(counts) > units:  # the floors of one can overshoot: take from the most over-served
        i = max((i for i in range(n) if counts[i] > 1), key=lambda i: (counts[i] - quotas[i], -i))
        counts[i] -= 1
    while sum(counts) < units:
        i = max(range(n), key=lambda i: (quotas[i] - counts[i], -i))
        counts[i] += 1
    sizes = [c * unit for c in counts]
    sizes[max(range(n), key=lambda i: (paces[i], -i))] += rest
    return Split(tuple(sizes))


def equal_sizes(total: int, members: int) -> tuple[int, ...]:
    """The plain plan's shares (:meth:`~unbroken.data.data_plan.DataPlan.share`): sizes that differ by at most one."""
    base, extra = divmod(total, members)
    return tuple(base + (1 if i < extra else 0) for i in range(members))


class Balancer:
    """One generation's estimate of its members' paces and the split it gives. Reset with every
    generation: every member of a generation has seen the same measurements since it formed."""

    def __init__(self, settings: BalanceSettings, total: int, unit: int, members: int) -> None:
        self.settings = settings
        self.total, self.unit, self.members = total, unit, members
        self._seen: list[deque[float]] = [deque(maxlen=settings.window) for _ in range(members)]
        self.split: Split | None = None
        """The split in force: None for the plan's equal shares."""
        self._since_change = 0
        self._slow_for = [0] * members  # steps in a row below flag_below
        self._fast_for = [0] * members  # steps in a row back above the flag's release (flagged members)
        self._flagged: set[int] = set()
        self._newly: list[int] = []
        self._flagged_ever: set[int] = set()
        self.in_turn = False
        """True once a second member was flagged in this generation: members are slow in turn (an
        oversubscribed host, or more than one slow member)."""
        self._floor_for = [0] * members  # steps in a row below evict_below
        self._relative: list[float | None] = [None] * members
        self.changed = False
        """True if the last :meth:`observe` changed the split."""

    @property
    def count(self) -> "int | Split":
        """What the plan takes for the member count: the split, or the number of members."""
        return self.split if self.split is not None else self.members

    def digest(self) -> int:
        """Names the split in force (0 for equal shares): members compare it before they commit."""
        return self.split.digest() if self.split is not None else 0

    def estimates(self) -> list[float | None]:
        """Each member's seconds per sample (the median of its last measurements), None if unknown."""
        return [statistics.median(seen) if seen else None for seen in self._seen]

    def relative_paces(self) -> list[float | None]:
        """Each member's pace as a fraction of the median member's (1.0: typical, 0.5: half as fast),
        as of the last :meth:`observe` (computed there once: the leader reads it several times a step)."""
        return list(self._relative)

    def _measure_relative(self) -> list[float | None]:
        found = self.estimates()
        known = [s for s in found if s is not None]
        if not known:
            return [None] * self.members
        middle = statistics.median(known)
        return [None if s is None else middle / s for s in found]

    def observe(self, seconds_per_sample: list[float]) -> None:
        """Take one step's measurements (the same list on every member; 0 for a member that did not
        measure, as in its first step) and update the split, the flags and the evictions."""
        if len(seconds_per_sample) != self.members:
            raise ValueError(f"{len(seconds_per_sample)} measurements for {self.members} members")
        for seen, value in zip(self._seen, seconds_per_sample):
            if value > 0 and math.isfinite(value):
                seen.append(value)
        self._since_change += 1
        self.changed = False
        relative = self._relative = self._measure_relative()
        window = self.settings.window
        release = (1.0 + self.settings.flag_below) / 2  # hysteresis: a flagged member must get clearly back
        self._newly = []
        for i, r in enumerate(relative):
            full = len(self._seen[i]) >= window
            self._slow_for[i] = self._slow_for[i] + 1 if full and r is not None and r < self.settings.flag_below else 0
            self._floor_for[i] = self._floor_for[i] + 1 if full and r is not None and r < self.settings.evict_below else 0
            if i not in self._flagged:
                if self._slow_for[i] >= window:
                    self._flagged.add(i)
                    self._newly.append(i)
                    self._fast_for[i] = 0
            else:
                self._fast_for[i] = self._fast_for[i] + 1 if r is None or r >= release else 0
                if self._fast_for[i] >= window:
                    self._flagged.discard(i)
        if self._newly:
            self._flagged_ever.update(self._newly)
            self.in_turn = len(self._flagged_ever) >= 2
        if self.settings.rebalances:
            self._rebalance()

    def _rebalance(self) -> None:
        window = self.settings.window
        if self._since_change < window or any(len(seen) < window for seen in self._seen):
            return
        seconds = [s for s in self.estimates() if s is not None]
        proposal = proportional_split(self.total, self.unit, [1.0 / s for s in seconds])
        if proposal is None:
            return
        current = self.split.sizes if self.split is not None else equal_sizes(self.total, self.members)
        if proposal.sizes == current:
            return
        if _predicted(proposal.sizes, seconds) <= (1 - self.settings.gain) * _predicted(current, seconds):
            self.split = None if proposal.sizes == equal_sizes(self.total, self.members) else proposal
            self._since_change = 0
            self.changed = True

    def flagged(self) -> list[int]:
        """Members flagged as stragglers: a pace estimate below ``flag_below`` of the median's for
        ``window`` steps in a row (a member that is slow for a few steps, as every member of an
        oversubscribed host is in turn, is not). A flagged member stays flagged until its pace is
        back above halfway between ``flag_below`` and the median's for ``window`` steps in a row,
        so a member whose pace hovers at the threshold is flagged once, not at every dip."""
        return sorted(self._flagged)

    def newly_flagged(self) -> list[int]:
        """Members flagged by the last :meth:`observe` (not flagged before it)."""
        return list(self._newly)

    def at_pace(self) -> list[int]:
        """Members measured for a full window in this generation, not flagged, and at or above
        ``flag_below`` of the median pace now: those known not to be slow."""
        relative = self.relative_paces()
        return [i for i, (seen, r) in enumerate(zip(self._seen, relative))
                if len(seen) >= self.settings.window and i not in self._flagged and r is not None
                and r >= self.settings.flag_below]

    def flagged_in_generation(self) -> list[int]:
        """Every member flagged at some step of this generation."""
        return sorted(self._flagged_ever)

    def evicted(self) -> list[int]:
        """With ``mode="evict"``: members below ``evict_below`` for ``evict_after`` steps in a row."""
        if self.settings.mode != "evict":
            return []
        return [i for i, n in enumerate(self._floor_for) if n >= self.settings.evict_after]


def _predicted(sizes: tuple[int, ...] | list[int], seconds: list[float]) -> float:
    """The step's compute time with these shares: its slowest member's."""
    return max(size * s for size, s in zip(sizes, seconds))


class SustainedSlowdowns:
    """The leader's view of which members are slow for long enough to say so on the console, by
    member name and across generations (a balancer starts afresh with each generation; a slow
    member stays slow). Console only: the split and the flags do not depend on it.

    A member counts as slow from the step it was first flagged until a balancer finds it unflagged
    and at pace (:meth:`Balancer.at_pace`), in this generation or a later one. It is sustained once it has been slow for
    ``announce_after`` steps and ``announce_after_s`` seconds since it, or any other member, was
    last flagged: members that are slow in turn restart each other's count and are never
    sustained. Each member is announced once."""

    def __init__(self, settings: BalanceSettings) -> None:
        self.settings = settings
        self._since: dict[str, tuple[int, float]] = {}  # slow member -> (step, time) it was first flagged
        self._last: dict[str, tuple[int, float]] = {}  # member -> the last (step, time) it was flagged
        self._announced: set[str] = set()

    def update(self, step: int, now: float, members: set[str], flagged: set[str], at_pace: set[str]) -> list[str]:
        """After a step: the generation's members, those flagged now and those known to be at
        pace; the members to announce (each once per job, and only while a member: one that left
        is slow no more, and under a new name when it comes back)."""
        for name in [name for name in self._since if name not in members]:
            del self._since[name]
        for name in flagged:
            self._since.setdefault(name, (step, now))
            self._last[name] = (step, now)
        for name in at_pace - flagged:
            self._since.pop(name, None)
        found = []
        for name, since in self._since.items():
            at, t = max([since] + [last for other, last in self._last.items() if other != name])
            if (name not in self._announced and step - at >= self.settings.announce_after
                    and now - t >= self.settings.announce_after_s):
                found.append(name)
        self._announced.update(found)
        return sorted(found)
