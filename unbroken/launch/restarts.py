"""When to restart a crashed worker slot, and when to give a bad slot a rest (quarantine).

A *slot* is one local rank of one launcher. Its successive processes are the members
``<node>.w<local rank>.r0``, ``.r1``, ... The launcher keeps one :class:`SlotBudget` per slot and
asks it at each crash whether to start the slot again, and when. Pure: no I/O; the time is passed
in as ``now`` (the launcher's ``time.monotonic()``), so tests drive the clock.

The rules, with K = ``max_restarts`` and W = ``window``:

- At a failure at time t, n is the number of the slot's failures in (t - W, t], this one included.
- n <= K: the slot is restarted after ``backoff * 2**(n - 1)`` seconds, at most ``max_backoff``.
  So a slot may be restarted K times within any W seconds. Failures older than W no longer
  count: after W quiet seconds both the budget and the backoff are back to their start.
- n > K: the slot is quarantined for ``cooloff`` seconds: not started meanwhile. Then it starts
  again with a fresh budget: its earlier failures are forgotten.

Why these defaults (K = 5 restarts within W = 300 s, a cool-off of 600 s):

- A slot in a crash loop (a bad device, a node short of memory, a broken local disk, a job
  config that only this host gets wrong) fails again within seconds to a minute of each start:
  start, import, join, heal, crash. Six such failures fall within 300 s, so such a slot is taken
  out after a few minutes, having cost its peers no more than six re-formations.
- The failures of a healthy long job (preemptions, an occasional hardware error, a rare
  out-of-memory) come minutes to hours apart. A 300 s window seldom holds two of them, so they
  never add up: a job that runs for days survives any number of failures spread over time. The
  old rule (3 restarts over the job's whole life) ended such jobs.
- Five restarts within 300 s still ride out a burst that hits a healthy slot several times
  in a row (a minute of network trouble, a storage outage).
- 600 s of cool-off gives a passing cause time to clear (a GPU reset, memory freed by another
  process, a disk cleaned up) and limits what a slot that stays broken costs its peers to one
  crash loop per 15 minutes or so, while a slot that recovered is back within about 10 minutes.
- The backoff starts at 0.1 s, because a lone crash should cost as little as possible, and doubles
  up to 10 s within a burst, so that a crash loop does not spin.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from unbroken.errors import ConfigError


@dataclass(frozen=True)
class RestartPolicy:
    """How a launcher restarts its crashed workers. The CLI flag of each field is in its message."""

    max_restarts: int = 5
    """Restarts allowed per slot within ``window`` (``--max-restarts``); one failure more
    quarantines the slot. 0: quarantine at the first crash."""
    window: float = 300.0
    """Seconds over which failures are counted (``--restart-window``)."""
    backoff: float = 0.1
    """Delay before restarting after a slot's first failure within the window
    (``--restart-backoff``); doubles with each further failure within the window."""
    max_backoff: float = 10.0
    """Upper bound of the delay (``--max-restart-backoff``)."""
    cooloff: float = 600.0
    """Seconds a quarantined slot is not started (``--quarantine-cooloff``)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        for flag, value, allow_zero in (
            ("--restart-window", self.window, False),
            ("--restart-backoff", self.backoff, True),
            ("--max-restart-backoff", self.max_backoff, True),
            ("--quarantine-cooloff", self.cooloff, False),
        ):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
                raise ConfigError(f"{flag} must be {'0 or more' if allow_zero else 'positive'} seconds, got {value}")


@dataclass(frozen=True)
class Verdict:
    """What to do with a slot that just failed."""

    restart: bool
    """True: start it again after ``delay``; False: it is quarantined for ``delay``."""
    delay: float
    """Seconds until the slot is started again (the backoff, or the cool-off)."""
    failures: int
    """The slot's failures within the window, this one included."""


class SlotBudget:
    """The failures of one slot and whether it is quarantined."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._failures: collections.deque[float] = collections.deque()
        self.quarantined_until: float | None = None
        self.quarantines = 0
        """How many times this slot has been quarantined."""

    def failures_within_window(self, now: float) -> int:
        self._forget(now)
        return len(self._failures)

    def failed(self, now: float) -> Verdict:
        """Record a failure at ``now`` and decide: restart after a backoff, or quarantine."""
        self._failures.append(now)
        n = self.failures_within_window(now)
        if n <= self.policy.max_restarts:
            delay = min(self.policy.backoff * 2 ** (n - 1), self.policy.max_backoff)
            return Verdict(True, delay, n)
        self.quarantined_until = now + self.policy.cooloff
        self.quarantines += 1
        return Verdict(False, self.policy.cooloff, n)

    def quarantined(self, now: float) -> bool:
        return self.quarantined_until is not None and now < self.quarantined_until

    def release(self) -> None:
        """The cool-off is over: the slot starts again with a fresh budget."""
        self.quarantined_until = None
        self._failures.clear()

    def _forget(self, now: float) -> None:
        while self._failures and self._failures[0] <= now - self.policy.window:
            self._failures.popleft()
