"""What a :class:`~unbroken.worker.runtime.Job` builds from its arguments and settings as it is made.

The data plan this process follows, its name as a member of the job, its side of straggler
handling and the default group that follows each generation: each a function of what it needs,
passed explicitly (no job, so nothing here imports the runtime). Moved out of the Job's
``__init__`` so that the runtime stays short; the Job calls them in the order it always built them.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any, Callable

from unbroken.data.data_plan import DataPlan
from unbroken.data.loader import check_dataset

if TYPE_CHECKING:
    from unbroken.errors import GenerationFailed
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


def default_group(settings: RuntimeSettings, distributed: bool, group: GroupMember | None,
                  script_collective_failed: Callable[[GenerationFailed], None],
                  release: Callable[[Any], None],
                  check: Callable[[str], None] = lambda op: None,
                  route: Callable[[str, tuple], Any] = lambda op, args: None) -> DefaultGroup | None:
    """The default group that follows each generation (:mod:`unbroken.worker.default_group`), for a
    plain member of a distributed job that wants one; None alone or in a replica group. A past
    generation's default group goes to ``release`` (the graveyard's bury); ``check(op)`` may refuse
    a collective of the script's before it starts (one inside ``job.on_leader``); ``route(op, args)``
    gives the group a collective inside a step goes over (:mod:`unbroken.worker.script_collectives`)."""
    if distributed and group is None and settings.default_group:
        from unbroken.worker.default_group import DefaultGroup

        return DefaultGroup(script_collective_failed, release, check, route)
    return None
