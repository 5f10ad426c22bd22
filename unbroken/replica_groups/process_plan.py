"""The data plan split for replica groups: which stream positions each process of a group takes.

Group ``g`` of ``n`` takes its contiguous share of step ``s`` exactly as a member does
(:meth:`unbroken.data.data_plan.DataPlan.share`), process ``j`` of ``K`` its contiguous part of that
share; every process of a group gets the same *count* of micro-batches, because every FSDP backward
is a reduce-scatter that all K processes must enter. Kept apart from
:mod:`unbroken.replica_groups.sharding` (group shapes and the local shards of an FSDP2 module):
this is the plan's arithmetic only; the design note there tells how the runtime uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from unbroken.data.data_plan import DataPlan, Split

__all__ = ["ProcessPlan", "process_micro_batches", "process_share"]


def _check_index(what: str, index: int, count: int) -> None:
    if count <= 0 or not 0 <= index < count:
        raise ValueError(f"{what} index {index} is not in 0..{count - 1} (count {count})")


def _part(share: range, index: int, count: int) -> range:
    """The contiguous part ``index`` of ``count`` of ``share``, sizes differing by at most one
    (larger parts first, as :meth:`DataPlan.share` cuts the global batch)."""
    base, extra = divmod(len(share), count)
    start = share.start + index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def process_share(plan: DataPlan, step: int, group: int, groups: int, process: int, group_size: int) -> range:
    """Stream positions of ``step`` that process ``process`` of group ``group`` processes.

    The group's share is ``plan.share(step, group, groups)``; process ``j`` of the ``group_size``
    processes takes its contiguous part. Over all ``(group, process)`` the parts are exactly
    ``[step*G, (step+1)*G)``, each position once, whatever ``groups`` and ``group_size``.
    """
    _check_index("process", process, group_size)
    return _part(plan.share(step, group, groups), process, group_size)


def process_micro_batches(plan: DataPlan, step: int, group: int, groups: int, process: int, group_size: int) -> list[range]:
    """The process's part of ``step`` cut into micro-batches, the same number on every process of
    the group (at least one, possibly empty).

    The count is ``ceil(largest part in the group / micro_batch_size)`` (at least 1); each part is
    cut as :meth:`DataPlan.micro_batches` cuts a share (pieces of the micro-batch size from the
    start, the last one shorter), then padded with empty ranges up to that count. A process with fewer samples (or none, when ``G < groups * group_size``) still
    runs the same number of forward/backward passes, some on empty batches, because each FSDP
    backward is a collective of the whole group. The loss of a micro-batch must then be written as
    a *sum* over its samples divided by ``G`` (an empty batch contributes 0, not NaN).
    """
    within = ProcessPlan(plan.dataset_len, plan.global_batch_size, plan.micro_batch_size, plan.seed, group_size, process)
    return within.micro_batches(step, group, groups)


@dataclass(frozen=True)
class ProcessPlan(DataPlan):
    """The data plan of one process of a replica group: :meth:`share` and :meth:`micro_batches`
    of *member* ``index`` of ``count`` (a group) give this process's part of the group's share,
    as :func:`process_share` and :func:`process_micro_batches` cut it. The runtime's step and
    loader use it in place of the plain plan, so they need not know about groups."""

    group_size: int = 1
    process: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_index("process", self.process, self.group_size)

    def share(self, step: int, index: int, count: "int | Split") -> range:
        return _part(DataPlan.share(self, step, index, count), self.process, self.group_size)

    def micro_batches(self, step: int, index: int, count: "int | Split") -> list[range]:
        group_share = DataPlan.share(self, step, index, count)
        largest = len(_part(group_share, 0, self.group_size))
        m = self.micro_batch_size
        mine = _part(group_share, self.process, self.group_size)
        return [mine[i * m : (i + 1) * m] for i in range(max(1, math.ceil(largest / m)))]

