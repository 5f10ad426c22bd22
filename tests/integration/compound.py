"""Seeded schedules of two or three overlapping faults (issue 26): a kill during the heal that the
first fault started, a hang during a heal, a kill inside an allreduce or between the allreduce
and the optimizer, a failed collective, all within a few steps of each other. Used by the
compound-fault tests (a few seeds) and by ``tests/soak/compound.py`` (many)."""

from __future__ import annotations

import random

KINDS = (
    "kill@step",
    "kill@allreduce",
    "kill@commit",
    "kill@heal",
    "hang@heal,for={hang}",
    "hang@step,for={hang}",
    "fail@allreduce",
)


def schedule(seed: int, workers: int, steps: int, hang: float = 2.5) -> str:
    """Two or three faults on random workers, the first at a step in the first third of the run
    and the others within three steps of it, so that each lands while the job is still
    recovering from the one before (a heal, a re-formation)."""
    rng = random.Random(seed)
    first = rng.randint(3, max(3, steps // 3))
    faults = []
    for i in range(rng.choice((2, 3))):
        kind = rng.choice(KINDS).format(hang=hang)
        # a heal comes right after the first fault: a fault at a heal waits for no later step
        step = first if i == 0 or "@heal" in kind else first + rng.randint(0, 3)
        faults.append(f"{kind},rank={rng.randrange(workers)},step={step}")
    return ";".join(faults)
