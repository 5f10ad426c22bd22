"""What a :class:`~unbroken.worker.runtime.Job` builds from its arguments and settings as it is made.

The data plan this process follows, its name as a member of the job, its side of straggler
handling and the default group that follows each generation: each a function of what it needs,
passed explicitly (no job, so nothing here imports the runtime). Moved out of the Job's
``__init__`` so that the runtime stays short; the Job calls them in the order it always built them.
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any

from unbroken.data.data_plan import DataPlan
from unbroken.data.loader import check_dataset
from unbroken.worker.step_loop import OPEN_ENDED
from unbroken.errors import ConfigError

if TYPE_CHECKING:
    from unbroken.observe.events import EventLog
    from unbroken.worker.default_group import DefaultGroup
    from unbroken.worker.group_member import GroupMember
    from unbroken.worker.pacing import Pacing
    from unbroken.worker.runtime_settings import RuntimeSettings


def data_plan(dataset: Any, global_batch_size: int, micro_batch_size: int | None, seed: int,
              group: GroupMember | None) -> DataPlan:
    """The plan of the job's steps over ``dataset`` (a ConfigError if it is not map-style), as
    this process follows it: its replica group's process's part when in a group of several."""
    plan_args = (
        check_dataset(dataset),
        global_batch_size,
        global_batch_size if micro_batch_size is None else micro_batch_size,
        seed,
    )
    if group is not None and group.grouped:
        from unbroken.replica_groups.process_plan import ProcessPlan

        return ProcessPlan(*plan_args, group.size, group.rank)
    return DataPlan(*plan_args)


def member_id(settings: RuntimeSettings, group: GroupMember | None) -> str:
    """This process's name in the job: the launcher's, or host and pid; a replica group's
    processes after the first add their rank (the group's member is process 0)."""
    member_id = settings.member_id or f"{socket.gethostname()}-{os.getpid()}"
    if group is not None and group.rank > 0:
        member_id = f"{member_id}.p{group.rank}"  # the group's member is process 0
    return member_id


def pacing(settings: RuntimeSettings, distributed: bool, plan: DataPlan, group: GroupMember | None,
           events: EventLog) -> Pacing:
    """This member's side of straggler handling (``--stragglers``; off in a single process), in
    units of the micro-batches its whole replica group takes at once."""
    from unbroken.data.balance import BalanceSettings
    from unbroken.worker.pacing import Pacing

    grouped = group is not None and group.grouped
    return Pacing(
        BalanceSettings(mode=settings.stragglers if distributed else "off"), plan.global_batch_size,
        plan.micro_batch_size * (group.size if grouped else 1), group.size if grouped else 1, events,
    )


def default_group(settings: RuntimeSettings, distributed: bool, group: GroupMember | None, loop_guard: Any,
                  joiner: Any) -> DefaultGroup | None:
    """The default group that follows each generation (:mod:`unbroken.worker.default_group`), for a
    plain member of a distributed job that wants one; None alone or in a replica group. The loop
    guard decides what happens to a script's collective that fails, refuses one inside
    ``job.on_leader`` and routes one inside a step (:mod:`unbroken.worker.script_collectives`); a
    past generation's default group goes to the joiner's graveyard."""
    if distributed and group is None and settings.default_group:
        from unbroken.worker.default_group import DefaultGroup
        from unbroken.worker.script_collectives import script_route

        route = script_route(loop_guard, lambda: joiner.group, lambda reason: joiner.report_job_failure(reason))
        return DefaultGroup(loop_guard.script_collective_failed, joiner.graveyard.bury, loop_guard.check_script_collective,
                            route)
    return None


def emit_step(events: Any, step: Any, samples: int, total: int | None) -> None:
    """The ``step`` event of a commit (the leader's): what the console and the report show."""
    events.emit("step", step=step.index, generation=step.generation, members=step.members,
                seconds=time.monotonic() - step.started, loss=step.loss, samples=samples,
                total=total if total is not None and total < OPEN_ENDED else None)


def sharded_optimizer(settings: RuntimeSettings, distributed: bool, group: GroupMember | None, optimizer: Any,
                      loop_guard: Any) -> Any:
    """The optimizer's sharded state (``shard_optimizer``, :mod:`unbroken.worker.sharded_optimizer`), or
    None: not asked for, or a single process (which holds the whole state, the reference)."""
    if not settings.shard_optimizer or not distributed:
        return None
    if group is not None:
        raise ConfigError("shard_optimizer cannot be combined with replica groups (--group-size > 1): a replica"
                          " group already shards its state with FSDP; use one or the other")
    from unbroken.worker.sharded_optimizer import ShardedOptimizer

    return ShardedOptimizer(optimizer, lambda: loop_guard.check_optimizer_step(optimizer, (), {}))
