"""The replica-groups benchmark's training script: one FSDP2 model, two ways to replicate it.

    unbroken run --nproc-per-node 4 --group-size 2 benchmarks/fsdp_step.py --mode unbroken --times T.json
    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/fsdp_step.py --mode hsdp --times T.json

Both modes build the same float32 MLP (``--in-features`` -> ``--hidden`` x ``--layers`` ->
``--out-features``, Tanh between, AdamW; seed 0 on every process), shard it with FSDP2
``fully_shard`` (each Linear, then the root) with gradient division off
(:func:`unbroken.replica_groups.sharding.sum_gradients`), and train on the same synthetic data with the same
global batch, cut into the same per-process micro-batches
(:func:`unbroken.replica_groups.sharding.process_micro_batches` of one :class:`~unbroken.data.data_plan.DataPlan`,
seed 7). The loss of a micro-batch is the sum of its per-sample mean squared errors over the global
batch size (``count=`` under unbroken, which divides by the global count after the allreduce).

- ``--mode unbroken`` (under ``unbroken run --group-size K``): the mesh is ``unbroken.group_mesh()``
  (FSDP inside the group only); unbroken allreduces shard j across the groups and commits.
- ``--mode hsdp`` (under torchrun, ``WORLD_SIZE`` = groups x K): plain HSDP, ``fully_shard`` over
  ``init_device_mesh("cpu", (groups, K), mesh_dim_names=("replicate", "shard"))`` so FSDP itself
  allreduces across the replicas; ``set_requires_all_reduce(i == last micro-batch)`` makes that
  allreduce run once per step, as unbroken's does.

With ``--times PATH``, one process (rank 0 under hsdp; process 0 of the member at index 0 under
unbroken) writes ``{"mode", "steps", "times", ...}`` to PATH at the end: ``times[i]`` is the wall
time from the end of step ``steps[i] - 1`` to the end of step ``steps[i]`` (``time.perf_counter()``
right after the optimizer has stepped: ``step.commit()`` / ``optimizer.step(); zero_grad()``), so
the first step has no time. ``backward[i]``: the part of that step spent in the micro-batch loop
(forward and backward passes, FSDP's collectives inside the group, and under hsdp FSDP's replicate
allreduce, which runs in the last backward); the rest of ``times[i]`` is the commit (unbroken: the
cross-group allreduce, the group's vote, the optimizer) or the optimizer step (hsdp), and the
loop's own bookkeeping. The benchmark drops the warm-up. One torch thread per process.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

IN_FEATURES, OUT_FEATURES, DATASET, SEED = 64, 16, 4096, 7


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("unbroken", "hsdp"), required=True)
    parser.add_argument("--steps", type=int, default=45)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3, help="hidden layers (Linear(hidden, hidden) after the first)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=2, help="hsdp only: the shard dimension (unbroken: --group-size of unbroken run)")
    parser.add_argument("--times", default=None, help="write the step times here (JSON)")
    args = parser.parse_args(argv)
    for name in ("steps", "hidden", "layers", "global_batch_size", "micro_batch_size", "group_size"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def make_model(hidden: int, layers: int, dtype: torch.dtype) -> torch.nn.Sequential:
    """The MLP, the same on every process (seed 0), not yet sharded."""
    torch.manual_seed(0)
    dims = [IN_FEATURES] + [hidden] * layers + [OUT_FEATURES]
    mods: list[torch.nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        mods += [torch.nn.Linear(a, b, dtype=dtype), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods[:-1])


def parameter_count(hidden: int, layers: int) -> int:
    dims = [IN_FEATURES] + [hidden] * layers + [OUT_FEATURES]
    return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))


def make_data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(DATASET, IN_FEATURES, generator=g, dtype=dtype)
    w = torch.randn(IN_FEATURES, OUT_FEATURES, generator=g, dtype=dtype)
    return x, torch.tanh(x @ w)


def shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    from unbroken.replica_groups.sharding import sum_gradients

    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return sum_gradients(model)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def squared_error_sum(model: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    return (model(xb) - yb).pow(2).mean(dim=1).sum()


def write_times(path: str, args: argparse.Namespace, steps: list[int], times: list[float], **extra) -> None:
    doc = {"mode": args.mode, "steps": steps, "times": times, "hidden": args.hidden, "layers": args.layers,
           "dtype": args.dtype, "parameters": parameter_count(args.hidden, args.layers),
           "global_batch_size": args.global_batch_size, "micro_batch_size": args.micro_batch_size, **extra}
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


def run_unbroken(args: argparse.Namespace) -> None:
    import unbroken

    dtype = getattr(torch, args.dtype)
    x, y = make_data(dtype)
    mesh = unbroken.group_mesh()  # before the model: FSDP shards over this process's group
    model = shard(make_model(args.hidden, args.layers, dtype), mesh)
    optimizer = make_optimizer(model)
    job = unbroken.Job(model, optimizer, torch.utils.data.TensorDataset(x, y), global_batch_size=args.global_batch_size,
                       micro_batch_size=args.micro_batch_size, seed=SEED)
    steps, times, members, backward, last = [], [], [], [], None
    for step in job.steps(total=args.steps):
        started = time.perf_counter()
        for xb, yb in step.micro_batches():
            step.backward(squared_error_sum(model, xb, yb), count=len(xb))
        passes = time.perf_counter() - started
        step.commit()
        now = time.perf_counter()
        if last is not None:
            steps.append(step.index)
            times.append(now - last)
            members.append(step.members)
            backward.append(passes)
        last = now
    if args.times and os.environ.get("UNBROKEN_RANK_IN_GROUP", "0") == "0" and job.member_index == 0:
        write_times(args.times, args, steps, times, members=members, backward=backward,
                    group_size=int(os.environ.get("UNBROKEN_GROUP_SIZE", "1")))


def run_hsdp(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from unbroken.data.data_plan import DataPlan
    from unbroken.replica_groups.sharding import process_micro_batches

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    k = args.group_size
    if world % k:
        raise SystemExit(f"WORLD_SIZE {world} is not a multiple of --group-size {k}")
    groups = world // k
    group, process = divmod(rank, k)
    dtype = getattr(torch, args.dtype)
    x, y = make_data(dtype)
    mesh = init_device_mesh("cpu", (groups, k), mesh_dim_names=("replicate", "shard"))
    model = shard(make_model(args.hidden, args.layers, dtype), mesh)
    optimizer = make_optimizer(model)
    plan = DataPlan(DATASET, args.global_batch_size, args.micro_batch_size, SEED)
    g = args.global_batch_size
    steps, times, backward, last = [], [], [], None
    for s in range(args.steps):
        started = time.perf_counter()
        micro = process_micro_batches(plan, s, group, groups, process, k)
        for i, positions in enumerate(micro):
            model.set_requires_all_reduce(i == len(micro) - 1)  # FSDP's replicate allreduce once per step
            idx = plan.indices(positions)
            (squared_error_sum(model, x[idx], y[idx]) / g).backward()
        passes = time.perf_counter() - started
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        now = time.perf_counter()
        if last is not None:
            steps.append(s)
            times.append(now - last)
            backward.append(passes)
        last = now
    if args.times and rank == 0:
        write_times(args.times, args, steps, times, members=[groups] * len(times), backward=backward, group_size=k)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(getattr(torch, args.dtype))
    (run_unbroken if args.mode == "unbroken" else run_hsdp)(args)


if __name__ == "__main__":
    main()
