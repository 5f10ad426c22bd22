"""Building blocks for replica groups: FSDP inside a group, fault tolerance across groups.

A *replica group* is K processes that shard one replica of the model with FSDP2 (``fully_shard``
over the group's own 1-D device mesh). The coordinator's members are groups; process ``j`` of
every group holds the same shard, so the cross-group gradient allreduce, healing and checkpoints
all work per shard index ``j``. This module holds the pure pieces the runtime uses (the design
note at the end of this docstring has the findings and how the runtime uses them):

- :func:`process_share` / :func:`process_micro_batches` (in :mod:`unbroken.replica_groups.process_plan`,
  offered here too): the data plan split for groups. Group
  ``g`` of ``n`` takes its contiguous share of step ``s`` exactly as a member does
  (:meth:`unbroken.data.data_plan.DataPlan.share`), process ``j`` of ``K`` its contiguous part of that
  share. The micro-batches of a step have the same *count* on every process of a group, because
  every FSDP backward issues a reduce-scatter that all K processes must enter.
- :class:`GroupShape`, :func:`sharding_fingerprint`, :func:`check_groups_match`: every group must
  have the same size and sharding; a group that differs is refused with :class:`GroupMismatch`.
- :func:`sharded_parameters`, :func:`local_gradient_shards`: the local gradient shards of an
  FSDP2 module, in registration order, for the cross-group allreduce.
- :func:`local_state_shards`, :func:`load_local_state_shards`: the tensors process ``j`` holds
  (parameter shards, buffers, optimizer state shards), for shard-by-shard healing.

## Design note (from the first spike)

(Kept here rather than in ``docs/``: the site is built with ``mkdocs build --strict``, which
refuses a page that is not in the navigation.)

Status: used by the runtime (how, at the end of this note; the user guide is
`docs/guide/replica-groups.md`). Besides this module (unit tests in
`tests/unit/replica_groups/test_replica_groups.py`): :mod:`unbroken.worker.group_member` (the group's own process group,
relay and watchdog, its votes), :mod:`unbroken.replica_groups.group_relay`, :mod:`unbroken.storage.sharded_checkpoint`,
and `tests/integration/test_replica_groups.py` (the issue's four must-shows). The findings below
come from the spike (`examples/hsdp_reference.py`). All figures: torch 2.13.0+cpu, Gloo, a shared
2-core machine.

### What was found

**FSDP2 inside a group, nothing across.** `fully_shard(module, mesh=group_mesh)` over a 1-D mesh
of the group's K processes only reduce-scatters inside the group. The example takes that mesh as
the `shard` row of `init_device_mesh("cpu", (n, K), mesh_dim_names=("replicate", "shard"))`
(`mesh2d["shard"]`); the runtime will instead make the group its own world (or
`DeviceMesh.from_group(group_pg, "cpu")`) since a group's lifetime is not the job's. With a 1-D
mesh FSDP has no replicate dimension, so its cross-replica allreduce is simply absent (with a 2-D
mesh, `set_requires_all_reduce(False)` does *not* help, from reading `foreach_reduce`: FSDP then keeps the reduce-scatter output
as a pending partial sum and never writes `param.grad` until a backward with the allreduce on).

**Gradient division off.** `FSDPModule.set_gradient_divide_factor(1.0)` (the old
`set_reduce_scatter_divide_factor` is a deprecated alias). It is per FSDP module, not recursive:
call it on every `FSDPModule` in `model.modules()`. In `_fsdp_collectives._get_gradient_divide_factors`
a factor of 1 gives `ReduceOp.SUM` and no pre/post division for float64/float16; for float32 and
bfloat16 it chooses `ReduceOp.PREMUL_SUM(1/factor)`, which Gloo refuses (checked: "Cannot use ReduceOp.PREMUL_SUM
with Gloo"), so also call
`set_force_sum_reduction_for_comms(True)` (SUM plus a division by 1, skipped). With the
share-weighted loss (the step protocol's loss weighting), written as *sum over samples / G* so that an empty
micro-batch gives 0 rather than NaN, the sum over the group and then over the groups is exactly
the gradient of the mean loss.

**Local gradient shards.** After backward `param.grad` is a DTensor (`Shard(0)` on the group
mesh); `grad._local_tensor` is process j's shard, and writing it in place changes the gradient the
optimizer uses (`local_gradient_shards`). Shards may be uneven (dim 0 of 5 over 2 processes: 3 and
2 rows) or empty, but process j has the same shapes in every group. The example flattens them,
allreduces (sum) over a `ProcessGroupGloo` built over `PrefixStore("gen0/shard{j}", store)` with
one rank per group (as `group.py` builds a generation), and copies back. Alternative not tried:
`set_all_reduce_hook(hook)` runs the hook on each FSDP unit's flat reduce-scatter output, which
would let the cross-group allreduce start during backward, like today's buckets.

**Same number of backward passes in a group.** Every FSDP backward is a reduce-scatter of the
whole group, so all K processes must run the same number of micro-batches even when their parts
differ by one sample or are empty (`G < n*K`). `process_micro_batches` cuts each part as
`DataPlan.micro_batches` does and pads with empty ranges to the group's count. Across groups the
count may differ (the cross-group allreduce is once per step). Plain HSDP needs equal counts over
*all* processes, which the example's defaults (G=30, micro-batch 4: 8/7/8/7 samples) satisfy.

**`state_dict()` of an FSDP2 module** returns DTensors for parameters (global shape, placements
`(Shard(dim=0),)`, local shape the process's rows) and plain tensors for buffers (BatchNorm
statistics are not sharded). `optimizer.state_dict()` is keyed by parameter index, `step` a plain
tensor, `exp_avg`/`exp_avg_sq` DTensors sharded like their parameter;
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, opt)` keys it by
parameter name and returns the optimizer's own tensors (checked: the same objects).

**Shard-by-shard healing.** `local_state_shards(model, opt)` gives name -> local tensor (no copies)
for `model/<name>` and `optim/<param>/<key>`; process j of a live group sends them in this order
(the receiver knows the layout: same code, same sharding) and process j of the healed group calls
`load_local_state_shards`, which first creates a fresh optimizer's lazy state (torch's private
`_init_optim_state`: a step with zero gradients at lr 0), refuses a different key set or shape
with `GroupMismatch` before writing anything, then copies in place. Unit test: a fresh model and
optimizer loaded this way step bit-identically to the live one. The K transfers of a heal are
independent (one per shard index), so they run in parallel over K pairs.

**Same size and sharding.** `GroupShape(size, sharding_fingerprint(model))` per group;
`check_groups_match` refuses a differing group with `GroupMismatch` (a `ConfigError`), e.g.
"group 'b' has 3 processes but the job's groups have 2 (every group must have the same size,
--group-size 2, ...)". The fingerprint hashes name, global and local shape, dtype, placements and
mesh shape of every parameter; process j of every group must agree with process j of the others.

**DCP checkpoints** (a throwaway probe script with 1-2 processes, not kept in the repository): `dcp.save({"model":
get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=dir)` from
the 2 processes of one group wrote `.metadata`, `__0_0.distcp`, `__1_0.distcp` (one file per
process). `dcp.load` into `get_model_state_dict`/`get_optimizer_state_dict` of a fresh model, then
`set_model_state_dict`/`set_optimizer_state_dict`, restored it bit for bit (0.0 difference, and
0.0 after 2 more steps) with 2 processes, with 1 FSDP process, and with a plain unsharded model
without a process group. So a resume may change the number of groups (every group loads the same
replica) and even the group size (DCP reshards on load). Only one group needs to write a
checkpoint (all hold the same replica); `dcp.save(..., process_group=group_pg)` keeps DCP's
planning collectives inside the writing group, and `dcp.async_save` exists for the background
writer. Atomic publish: DCP writes into a fresh directory and unbroken's manifest names it only
once every process of the group reported its file written and checksummed.

### Measured

`python examples/hsdp_reference.py` (defaults: MLP 32-512-512-512-8, 546,312 float64 parameters,
2 groups x 2 processes, G=30, micro-batch 4, AdamW, 20 steps; then 30 healthy steps of each
variant, interleaved, after 3 warm-up, the slowest process's time per step):

| | relative difference to one process (20 steps) | shard j identical in both groups | healthy step, median (p10-p90) |
| --- | --- | --- | --- |
| replica groups (FSDP2 per group, own cross-group allreduce) | 1.36e-15 | yes | 165.2 ms (135.6-197.9) |
| plain HSDP (FSDP2 2-D mesh, its own replicate allreduce once per step) | 1.36e-15 | yes | 167.0 ms (132.6-191.2) |

Ratio 0.99 (the issue's target is <= 1.05x). With plain HSDP allreducing after every micro-batch
(the default; `set_requires_all_reduce(False)` on all but the last avoids it) it took 164 ms vs
145 ms for replica groups in an earlier run. The machine is shared and the spread is wide; the
benchmark of record must be interleaved and repeated. `--steps 5 --hidden 64 --global-batch 29
--micro-batch 3` (uneven shares 8/7/7/7) gave 5.9e-17.

### How the runtime uses them

- **Launcher** (`--group-size K`, :mod:`unbroken.launch.workers`): a slot is a group of K processes in
  one process group; the first process to fail takes the others down and the slot restarts as
  one. It hosts a store for its groups; each incarnation of a group gets a prefix of its own.
- **The member is the group** (:mod:`unbroken.worker.joining`, :mod:`unbroken.worker.group_member`): process 0
  joins and heartbeats, sending the group's size and sharding fingerprint in its preflight (a
  group that differs is refused by the coordinator, naming both values), and relays every
  generation and view to processes 1..K-1; its heartbeat's progress is the relay's group progress.
- **Process j works on shard j**: its generation group has the prefix `<generation>/shard<j>`,
  its plan is :class:`ProcessPlan`, its gradient buckets hold local shards (`gradients._local`),
  its healing state is :func:`local_state_shards` (healed over the shard-j group with the usual
  fan-out, so the K shards move in parallel) and its replica check hashes its shard.
- **Votes**: every decision that the processes of a group must take alike (use a generation, go
  on at a step boundary, commit, write a checkpoint, finish) is an allreduce over the group's own
  process group (:meth:`GroupMember.vote`); a process that disagrees makes the whole group redo.
- **Checkpoints**: the group at index 0 writes with :func:`unbroken.storage.sharded_checkpoint.save_sharded`
  (in the foreground); a resume loads with `load_sharded` in the group at index 0, which heals the
  others as a plain resume does.

The cross-group reduction overlaps the backward without `set_all_reduce_hook`: FSDP2 calls a
sharded parameter's post-accumulate-grad hooks once its reduce-scatter has landed, and the
reducer's buckets start as their shards become final, as for plain members. Not done: groups
spanning nodes, anything on a GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from unbroken.errors import ConfigError
from unbroken.replica_groups.process_plan import ProcessPlan, process_micro_batches, process_share  # offered here as before

__all__ = [
    "GroupMismatch",
    "GroupShape",
    "ProcessPlan",
    "check_groups_match",
    "load_local_state_shards",
    "local_gradient_shards",
    "local_state_shards",
    "process_micro_batches",
    "process_share",
    "sharded_parameters",
    "sharding_fingerprint",
    "state_layout",
    "sum_gradients",
]


class GroupMismatch(ConfigError):
    """A replica group differs from the job's groups in size or sharding, so its process ``j``
    would not hold the same shard as process ``j`` of the others; it is refused."""


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


def sum_gradients(module: torch.nn.Module) -> torch.nn.Module:
    """Make every FSDP2 unit of ``module`` sum its gradients over the group, never average them.

    The loss is weighted by each micro-batch's share of the global batch, so the
    gradient of the mean loss is the plain *sum* over processes and groups: FSDP's division by the
    group size must be off (``set_gradient_divide_factor(1.0)``, per unit, not recursive), and its
    reduce-scatter must be a plain SUM (``set_force_sum_reduction_for_comms``: otherwise float32
    and bfloat16 use PREMUL_SUM, which Gloo refuses). Call after ``fully_shard``; returns ``module``."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    return module


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
