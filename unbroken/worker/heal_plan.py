"""Who heals whom when a generation forms: the source, the receivers, and the rounds of transfers.

Pure functions of what the members exchanged over the new group, each rank's (next step, fresh,
lineage digest) (:mod:`unbroken.worker.state_digests`): :func:`plan` picks the source and the
receivers, :func:`rounds` fans the state out from every member that holds it. Kept apart from
:mod:`unbroken.worker.healing` (which moves the state, and offers these names too): this only
decides, and moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HealPlan:
    source: int
    receivers: tuple[int, ...]
    step: int


def plan(statuses: list[tuple[int, ...]]) -> HealPlan:
    """Who sends and who receives, from each rank's (next step, fresh[, lineage digest]). Pure.

    The source is the lowest rank at the highest step, preferring real state to fresh. A member
    receives if it is behind, fresh, or at the same step by another history: a step that some
    member committed in one generation and the others redid in the next gives results equal only
    up to rounding, and replicas must be bit-identical.
    """
    rows = [(row[0], bool(row[1]), row[2] if len(row) > 2 else 0) for row in statuses]
    best = max(range(len(rows)), key=lambda r: (rows[r][0], not rows[r][1], -r))
    top_step, top_fresh, top_digest = rows[best]
    receivers = tuple(
        r
        for r, (step, fresh, digest) in enumerate(rows)
        if r != best and (step < top_step or fresh or top_fresh or digest != top_digest)
    )
    return HealPlan(best, receivers, top_step)


def rounds(plan_: HealPlan, size: int) -> list[list[tuple[int, int]]]:
    """The transfers of ``plan_`` in a group of ``size``, as rounds of (sender, receiver) pairs. Pure.

    The state fans out: every member that holds it (the source, the members at its step with its
    history, and every receiver once healed) sends it to one receiver per round, so ``R``
    receivers take about ``log2(R + 1)`` rounds, not ``R`` transfers from one source. Within a
    round every member sends or receives at most once, and a receiver sends only in rounds after
    the one that healed it, so the rounds cannot deadlock.
    """
    holders = [plan_.source] + [r for r in range(size) if r != plan_.source and r not in plan_.receivers]
    waiting = list(plan_.receivers)
    schedule = []
    while waiting:
        pairs = list(zip(holders, waiting))
        waiting = waiting[len(pairs):]
        holders += [receiver for _, receiver in pairs]
        schedule.append(pairs)
    return schedule
