"""Building blocks for replica groups (issue 18): FSDP inside a group, fault tolerance across groups.

A *replica group* is K processes that shard one replica of the model with FSDP2 (``fully_shard``
over the group's own 1-D device mesh). The coordinator's members are groups; process ``j`` of
every group holds the same shard, so the cross-group gradient allreduce, healing and checkpoints
all work per shard index ``j``. This module holds the pure pieces the runtime will need; it does
not integrate them (see ``docs/design/replica-groups.md`` for the findings and the plan):

- :func:`process_share` / :func:`process_micro_batches`: the data plan split for groups. Group
  ``g`` of ``n`` takes its contiguous share of step ``s`` exactly as a member does
  (:meth:`unbroken.data_plan.DataPlan.share`), process ``j`` of ``K`` its contiguous part of that
  share. The micro-batches of a step have the same *count* on every process of a group, because
  every FSDP backward issues a reduce-scatter that all K processes must enter.
- :class:`GroupShape`, :func:`sharding_fingerprint`, :func:`check_groups_match`: every group must
  have the same size and sharding; a group that differs is refused with :class:`GroupMismatch`.
- :func:`sharded_parameters`, :func:`local_gradient_shards`: the local gradient shards of an
  FSDP2 module, in registration order, for the cross-group allreduce.
- :func:`local_state_shards`, :func:`load_local_state_shards`: the tensors process ``j`` holds
  (parameter shards, buffers, optimizer state shards), for shard-by-shard healing.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from unbroken.data_plan import DataPlan
from unbroken.errors import ConfigError

__all__ = [
    "GroupMismatch",
    "GroupShape",
    "check_groups_match",
    "load_local_state_shards",
    "local_gradient_shards",
    "local_state_shards",
    "process_micro_batches",
    "process_share",
    "sharded_parameters",
    "sharding_fingerprint",
    "state_layout",
]


class GroupMismatch(ConfigError):
    """A replica group differs from the job's groups in size or sharding, so its process ``j``
    would not hold the same shard as process ``j`` of the others; it is refused."""


# -- the data plan split ---------------------------------------------------------------------------


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
    share = plan.share(step, group, groups)
    _check_index("process", process, group_size)
    largest = len(_part(share, 0, group_size))  # part 0 is never smaller than the others
    count = max(1, math.ceil(largest / plan.micro_batch_size))
    mine = _part(share, process, group_size)
    m = plan.micro_batch_size
    return [mine[i * m : (i + 1) * m] for i in range(count)]


# -- every group has the same size and sharding ----------------------------------------------------


def sharding_fingerprint(module: torch.nn.Module) -> str:
    """A short digest of how ``module``'s parameters are sharded: name, global shape, dtype, local
    shape and placements of every parameter, and the mesh shape. Equal fingerprints at the same
    process index mean the same local tensors, so a shard can move from one group to another."""
    digest = hashlib.sha256()
    for name, param in sharded_parameters(module):
        local = _local(param)
        placements = getattr(param, "placements", None)
        mesh = getattr(param, "device_mesh", None)
        mesh_shape = tuple(mesh.shape) if mesh is not None else ()
        digest.update(
            repr((name, tuple(param.shape), str(param.dtype), tuple(local.shape), str(placements), mesh_shape)).encode()
        )
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class GroupShape:
    """What a group reports when it joins: its number of processes and its sharding fingerprint
    (of process 0; the fingerprint of process ``j`` must match process ``j`` of other groups)."""

    size: int
    sharding: str = ""


def check_groups_match(groups: Mapping[str, GroupShape], expected: GroupShape | None = None) -> GroupShape:
    """Check that every group has the same size and sharding; return that shape.

    ``expected`` is the job's shape (the first group's, or the one a checkpoint was written with);
    without it the most common shape is taken as the job's. Raises :class:`GroupMismatch` naming
    the groups that differ and the sizes, e.g. ``group 'b' has 3 processes but the job's groups
    have 2 (every group must have --group-size processes)``.
    """
    if not groups:
        raise ValueError("no groups to check")
    if expected is None:
        counts: dict[GroupShape, int] = {}
        for shape in groups.values():
            counts[shape] = counts.get(shape, 0) + 1
        expected = max(counts, key=lambda s: counts[s])  # ties: the first seen
    problems = []
    for name, shape in groups.items():
        if shape.size != expected.size:
            problems.append(f"group {name!r} has {shape.size} processes but the job's groups have {expected.size}")
        elif shape.sharding != expected.sharding:
            problems.append(
                f"group {name!r} shards the model differently (sharding {shape.sharding} instead of "
                f"{expected.sharding}; same size {shape.size}, so the model or its fully_shard calls differ)"
            )
    if problems:
        raise GroupMismatch(
            "; ".join(problems)
            + f" (every group must have the same size, --group-size {expected.size}, and the same sharding; "
            "process j of every group must hold the same shard)"
        )
    return expected


# -- local shards of an FSDP2 module ---------------------------------------------------------------


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The process's own storage of a DTensor (the tensor itself otherwise). In-place writes to
    the result change the DTensor: this is what the cross-group allreduce and healing rely on."""
    local = getattr(tensor, "_local_tensor", None)
    return local if local is not None else tensor


def sharded_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that take gradients, by name, in registration order (the same on every
    process of every group for the same model code)."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def local_gradient_shards(module: torch.nn.Module) -> list[torch.Tensor | None]:
    """The local gradient shard of every parameter of :func:`sharded_parameters`, in that order.

    After FSDP's reduce-scatter inside the group, ``param.grad`` is a DTensor whose local tensor
    is process ``j``'s shard of the group's gradient; the entry is that local tensor (not a copy),
    so an in-place allreduce across groups updates the gradient the optimizer will use. ``None``
    where the parameter has no gradient (the runtime carries presence as ``gradients.py`` does, so
    that a gradient no group produced stays ``None``).
    """
    return [None if p.grad is None else _local(p.grad) for _, p in sharded_parameters(module)]


def _optimizer_names(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.nn.Parameter]]:
    names = {id(p): name for name, p in module.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that is not the module's")
            out.append((names[id(p)], p))
    return out


def local_state_shards(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """The tensors this process holds, by name, in a deterministic order (not copies).

    Keys are ``model/<name>`` for every entry of ``module.state_dict()`` (under FSDP2 a parameter
    is a DTensor there and its entry is the local shard; buffers are replicated plain tensors) and
    ``optim/<parameter name>/<state key>`` for the optimizer's tensor state (AdamW's ``exp_avg``
    and ``exp_avg_sq`` are sharded like their parameter; ``step`` is a scalar). Process ``j`` of a
    live group sends these; process ``j`` of a healed group receives into the same keys with
    :func:`load_local_state_shards`. Non-tensor state (param_groups' hyperparameters, the
    scheduler, the step counter) is small and travels as the runtime sends it today.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        out[f"model/{name}"] = _local(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor)
    if optimizer is not None:
        for name, p in _optimizer_names(module, optimizer):
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    out[f"optim/{name}/{key}"] = _local(value)
    return out


def _init_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily created state (a fresh process has none to receive into)."""
    if all(optimizer.state.get(p) for group in optimizer.param_groups for p in group["params"]):
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state  # private; see the design note

    _init_optim_state(optimizer)


def load_local_state_shards(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, shards: Mapping[str, torch.Tensor]
) -> None:
    """Copy ``shards`` (as :func:`local_state_shards` of process ``j`` of a live group returned
    them) into this process's own tensors, in place.

    The keys and shapes must be exactly this process's: a difference means the groups shard the
    model differently, and is refused with :class:`GroupMismatch` before anything is written. A
    fresh optimizer's state is created first (with torch's own initializer, which steps with zero
    gradients and restores the learning rate).
    """
    if optimizer is not None:
        _init_optimizer_state(module, optimizer)
    mine = local_state_shards(module, optimizer)
    missing = sorted(set(mine) - set(shards))
    extra = sorted(set(shards) - set(mine))
    if missing or extra:
        raise GroupMismatch(f"the received state does not match this process's: missing {missing[:5]}, unexpected {extra[:5]}")
    wrong = [
        f"{k}: {tuple(shards[k].shape)} {shards[k].dtype} for {tuple(v.shape)} {v.dtype}"
        for k, v in mine.items()
        if shards[k].shape != v.shape or shards[k].dtype != v.dtype
    ]
    if wrong:
        raise GroupMismatch("the received shards do not match this process's: " + "; ".join(wrong[:5]))
    with torch.no_grad():
        for key, tensor in mine.items():
            tensor.copy_(shards[key])


def state_layout(shards: Mapping[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], str]]:
    """Name, shape and dtype of each shard: what a receiver allocates before the transfers."""
    return [(k, tuple(v.shape), str(v.dtype)) for k, v in shards.items()]
