"""``torch.distributed`` inside the loop answers with the generation.

Libraries read the world from ``torch.distributed`` and the environment: wandb's and Lightning's
rank-zero helpers, torchmetrics' sync, Hugging Face's ``is_main_process``. Under ``unbroken run``
each generation installs itself as torch.distributed's default group, so ``dist.is_initialized()``
is True and ``get_rank()``/``get_world_size()`` give the member's index and the generation's size,
and sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` to match (``LOCAL_RANK``
and ``LOCAL_WORLD_SIZE`` come from the launcher). Both change when a generation forms.

The default group is a :class:`GenerationProcessGroup`: a ``torch.distributed.ProcessGroup``
whose collectives run on the generation's own group and are waited on as the gradient reduce is,
watching the coordinator's verdicts instead of only a timeout. When one fails (a member was lost)
inside a step, before its commit, the collective returns (its output is undefined) and the step
is redone in the next generation, like a failed gradient reduce; the script's own collective is
redone with it. Inside a step's body they go over a group of their own and meet every member
first (:mod:`unbroken.worker.script_collectives`): members that make different collectives fail
the job with :class:`~unbroken.errors.LoopMisuse` instead of aborting the process in Gloo. Outside a step (after the commit) the failure is raised as
:class:`~unbroken.errors.GenerationFailed` with a message that says to move the collective
into the step. Replica groups keep torch.distributed's default group for their own mesh
(:func:`unbroken.group_mesh`), so this is only installed for plain members.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from unbroken.errors import GenerationFailed

if TYPE_CHECKING:
    from unbroken.worker.group import GenerationGroup

WATCHED = {
    "allreduce": "allreduce",
    "allreduce_coalesced": "allreduce_coalesced",
    "allgather": "allgather",
    "_allgather_base": "_allgather_base",
    "all_gather_single": "_allgather_base",
    "allgather_into_tensor_coalesced": "allgather_into_tensor_coalesced",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "_reduce_scatter_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "alltoall_base": "alltoall_base",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
}
"""The collectives of the default group that run on the generation's group and are watched (the
name torch.distributed calls -> the backend's method); point-to-point ones go to the backend."""

_Work: Any = getattr(dist, "_Work", None) or torch._C._distributed_c10d.Work


class _Done(_Work):
    """A work that is already complete: the collective was waited on (watched) before returning."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class GenerationProcessGroup(dist.ProcessGroup):
    """torch.distributed's default group for one generation: its collectives run on the
    generation's group and are watched; a failure is handed to ``failed``, which either lets the
    collective return (the step will be redone) or raises."""

    def __init__(self, group: "GenerationGroup", failed: Callable[[GenerationFailed], None],
                 check: Callable[[str], None] = lambda op: None,
                 route: Callable[[str, tuple], Any] = lambda op, args: None) -> None:
        super().__init__(group.rank, group.size)
        self._generation = group
        self._failed = failed
        self._check = check
        self._route = route
        backend_type = dist.ProcessGroup.BackendType.NCCL if group.backend == "nccl" else dist.ProcessGroup.BackendType.GLOO
        self._set_default_backend(backend_type)
        self._register_backend(torch.device(group.device.type), backend_type, group.pg)
        if group.device.type == "cuda":  # CPU tensors (all_gather_object's sizes stay on the GPU; others may not)
            self._register_backend(torch.device("cpu"), backend_type, group.pg)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return self._generation.backend

    def name(self) -> str:
        return self._generation.backend

    def _watched(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        group = self._generation
        what = f"the script's {op}"
        self._check(op)  # refused before any byte is sent (a collective inside job.on_leader)
        try:
            pg = self._route(op, args) or group.pg  # inside a step: a group of their own, met in the store first
            try:
                work = getattr(pg, WATCHED[op])(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - whatever the backend raises, the generation failed
                raise GenerationFailed(f"generation {group.number}: {what} failed to start: {exc}") from None
            group.wait(group._issued(work), what)
        except GenerationFailed as exc:
            self._failed(exc)
        return _Done(args[0] if args else [])


def _add_watched_methods() -> None:
    for op in WATCHED:
        def method(self: GenerationProcessGroup, *args: Any, _op: str = op, **kwargs: Any) -> Any:
            return self._watched(_op, args, kwargs)

        method.__name__ = op
        setattr(GenerationProcessGroup, op, method)


_add_watched_methods()


RANK_ZERO_HELPERS = (
    "lightning_utilities.core.rank_zero",
    "lightning_fabric.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "pytorch_lightning.utilities.rank_zero",
    "lightning.pytorch.utilities.rank_zero",
)
"""Modules whose ``rank_zero_only.rank`` was read from ``RANK``/``LOCAL_RANK`` when they were
imported (before the first generation formed): told the member's rank at every formation."""


def tell_rank_zero_helpers(rank: int) -> None:
    """Set ``rank_zero_only.rank`` in the rank-zero helpers already imported (Lightning's,
    torchmetrics' lightning_utilities), so that rank-zero-only logging follows the leader."""
    for name in RANK_ZERO_HELPERS:
        helper = getattr(sys.modules.get(name), "rank_zero_only", None)
        if helper is not None:
            helper.rank = rank


class DefaultGroup:
    """Keeps torch.distributed's default group and the rank variables in step with the
    generation this member is in (see the module's docstring)."""

    def __init__(self, failed: Callable[[GenerationFailed], None], release: Callable[[Any], None] = lambda pg: None,
                 check: Callable[[str], None] = lambda op: None,
                 route: Callable[[str, tuple], Any] = lambda op, args: None) -> None:
        self._failed = failed
        self._check = check
        self._route = route
        self._release = release
        """Takes a past generation's default group when the next one forms, to drop it where a
        slow destructor holds up nothing (:meth:`unbroken.worker.graveyard.Graveyard.bury`)."""
        self._pg: GenerationProcessGroup | None = None
        self._saved_env: dict[str, str | None] | None = None

    def enter(self, group: "GenerationGroup", store_host: str, store_port: int) -> None:
        """Make ``group`` the default group and set the rank variables to match."""
        from torch.distributed import distributed_c10d as c10d

        if dist.is_initialized() and c10d._world.default_pg is not self._pg:
            return  # the script (or a replica group's mesh) made a default group of its own: leave it
        past = self._forget()
        if past is not None:
            self._release(past)
        pg = GenerationProcessGroup(group, self._failed, self._check, self._route)
        c10d._update_default_pg(pg)
        c10d._world.pg_map[pg] = (group.backend, group.store)
        c10d._world.pg_names[pg] = "default_pg"
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(group.size)}
        c10d._world.pg_backend_config[pg] = f"{group.device.type}:{group.backend}"
        self._pg = pg
        values = {"RANK": str(group.rank), "WORLD_SIZE": str(group.size), "MASTER_ADDR": store_host,
                  "MASTER_PORT": str(store_port), "GROUP_RANK": str(group.rank), "ROLE_RANK": str(group.rank),
                  "ROLE_WORLD_SIZE": str(group.size)}
        if self._saved_env is None:
            self._saved_env = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        tell_rank_zero_helpers(group.rank)

    def _forget(self) -> GenerationProcessGroup | None:
        """Stop being torch.distributed's default group; returns the group let go. Dropping it
        can destroy the generation's backend (it references it), which for a broken generation can
        wait on Gloo's threads: :meth:`enter` hands it to ``release`` instead."""
        from torch.distributed import distributed_c10d as c10d

        pg, self._pg = self._pg, None
        if pg is None:
            return None
        for table in (c10d._world.pg_map, c10d._world.pg_names, c10d._world.pg_group_ranks, c10d._world.pg_backend_config):
            table.pop(pg, None)
        if c10d._world.default_pg is pg:
            c10d._update_default_pg(None)
        return pg

    def leave(self) -> None:
        """After the loop: no default group, and the rank variables as they were. The last
        generation's group is dropped here, so that its threads are joined before the interpreter's
        teardown."""
        self._forget()
        for key, value in (self._saved_env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = None
