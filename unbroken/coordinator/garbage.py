"""How the coordinator's process collects garbage: rarely, and never over what lives as long as
the job. A coordinator of thousands of members holds hundreds of thousands of objects; a
collection that walks them holds its event loop, and every member's lease ticks meanwhile."""

from __future__ import annotations

import gc

GC_THRESHOLDS = (50_000, 20, 100)
"""Python's garbage collection thresholds for a coordinator's process (Python's are 700, 10, 10)."""


def freeze_what_lives() -> None:
    """Freeze what is alive now out of garbage collections: called once, when the first generation
    of a large job has formed. Its members' records and lines were made after the start's freeze
    and live as long as the job; left to the collector, each collection of the older generations
    walked them all (a generation-1 collection held 16,384 members' coordinator for 100-130 ms,
    the worst stall of a healthy job). Garbage in reference cycles among what is frozen (a
    request in flight at that moment) is never collected: a few of them, once."""
    gc.freeze()


def collect_less_often() -> None:
    """Make this process's garbage collections rarer, and freeze what is alive now out of them.

    A coordinator of thousands of members holds some 150 objects per member (connections,
    requests, futures): with Python's thresholds, a full collection of 600,000 objects every few
    seconds held its event loop for 0.2-0.7 s on a loaded machine, every member's lease ticking
    meanwhile. With these, bench_coordinator at 4,000 members: CPU per heartbeat 128 µs (was 230-250),
    a kill re-formed in 2.0 s (was 7.4-9), worst stall 0.49 s (was 2.3). Reference cycles are
    still collected, only in larger batches."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
