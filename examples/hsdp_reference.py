"""Replica groups by hand: FSDP2 inside each group, our own allreduce across groups (issue 18 spike).

Two groups of two processes (four processes, Gloo on the CPU, a FileStore in a temporary
directory). Each group shards a float64 MLP with FSDP2 ``fully_shard`` over its own 1-D mesh (the
``shard`` row of a 2-D ``("replicate", "shard")`` mesh), with FSDP's gradient division turned off
(``set_gradient_divide_factor(1.0)`` on every FSDP module) and no replicate dimension, so FSDP only
reduce-scatters inside the group. Each micro-batch's loss is a sum over its samples divided by the
global batch size G (DESIGN step 4). After backward, process j's local gradient shards
(:func:`unbroken.replica_groups.sharding.local_gradient_shards`) are flattened and allreduced (sum) across
the groups over a Gloo group of their own, one per shard index j, built over a ``PrefixStore`` as
the runtime builds its generation groups. Then AdamW steps.

It checks that after ``--steps`` steps the model equals a single process trained on the whole
global batch (relative difference printed; the target is below 1e-8) and that process j holds
bit-identical shards in both groups, then does the same for plain HSDP (``fully_shard`` over the
2-D mesh, FSDP's own replicate allreduce, same loss weighting) and times healthy steps of both,
interleaved, printing the medians.

    python examples/hsdp_reference.py [--steps 20] [--timed-steps 30] [--hidden 512]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from unbroken.data.data_plan import DataPlan  # noqa: E402
from unbroken.replica_groups.sharding import local_gradient_shards, local_state_shards, process_micro_batches, sum_gradients  # noqa: E402

GROUPS, GROUP_SIZE = 2, 2
WORLD = GROUPS * GROUP_SIZE
IN, OUT, DATASET = 32, 8, 512


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(DATASET, IN, generator=g, dtype=torch.float64)
    w = torch.randn(IN, OUT, generator=g, dtype=torch.float64)
    return x, torch.tanh(x @ w) + 0.1 * torch.randn(DATASET, OUT, generator=g, dtype=torch.float64)


def make_model(hidden: int, layers: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    dims = [IN] + [hidden] * layers + [OUT]
    mods: list[torch.nn.Module] = []
    for a, b in zip(dims[:-1], dims[1:]):
        mods += [torch.nn.Linear(a, b, dtype=torch.float64), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods[:-1])


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, g: int) -> torch.Tensor:
    # a sum over samples / G: the share-weighted loss, and 0 (not NaN) for an empty micro-batch
    return (model(x) - y).pow(2).mean(dim=1).sum() / g


def reference(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """One process, the whole global batch every step."""
    x, y = make_data()
    plan = DataPlan(DATASET, args.global_batch, args.micro_batch)
    model = make_model(args.hidden, args.layers)
    opt = make_optimizer(model)
    for step in range(args.steps):
        for mb in plan.micro_batches(step, 0, 1):
            idx = plan.indices(mb)
            loss_of(model, x[idx], y[idx], args.global_batch).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_gradients(model)  # we weight the loss by len/G: a plain sum, no division anywhere
    return model


class Variant:
    """One way to train: ``groups`` (ours) or ``hsdp`` (FSDP2's own replicate allreduce)."""

    def __init__(self, kind: str, args: argparse.Namespace, mesh2d, cross: dist.ProcessGroup, group: int, process: int):
        self.kind, self.args, self.cross, self.group, self.process = kind, args, cross, group, process
        mesh = mesh2d["shard"] if kind == "groups" else mesh2d
        self.model = shard(make_model(args.hidden, args.layers), mesh)
        self.opt = make_optimizer(self.model)
        self.plan = DataPlan(DATASET, args.global_batch, args.micro_batch)

    def step(self, step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        mbs = process_micro_batches(self.plan, step, self.group, GROUPS, self.process, GROUP_SIZE)
        for i, mb in enumerate(mbs):
            if self.kind == "hsdp":  # FSDP's replicate allreduce once per step, not per micro-batch
                self.model.set_requires_all_reduce(i == len(mbs) - 1)
            idx = self.plan.indices(mb)
            loss_of(self.model, x[idx], y[idx], self.args.global_batch).backward()
        if self.kind == "groups":
            shards = local_gradient_shards(self.model)
            assert all(s is not None for s in shards)
            flat = torch.cat([s.reshape(-1) for s in shards])
            self.cross.allreduce([flat]).wait()  # sum over the groups, shard index j only
            offset = 0
            for s in shards:
                s.copy_(flat[offset : offset + s.numel()].view_as(s))
                offset += s.numel()
        self.opt.step()
        self.opt.zero_grad()

    def full_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in self.model.state_dict().items():
            out[k] = v.full_tensor() if hasattr(v, "full_tensor") else v
        return out


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    va = torch.cat([a[k].reshape(-1) for k in sorted(b)])
    vb = torch.cat([b[k].reshape(-1) for k in sorted(b)])
    return ((va - vb).norm() / vb.norm()).item()


def worker(rank: int, args: argparse.Namespace, store_path: str, ref: dict[str, torch.Tensor], results) -> None:
    torch.set_num_threads(1)
    group, process = divmod(rank, GROUP_SIZE)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=WORLD)
    try:
        # the shard row of this mesh is the group's own 1-D mesh (FSDP inside the group)
        mesh2d = init_device_mesh("cpu", (GROUPS, GROUP_SIZE), mesh_dim_names=("replicate", "shard"))
        # across groups: one Gloo group per shard index j, as the runtime would build per generation
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=60)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        cross = dist.ProcessGroupGloo(dist.PrefixStore(f"gen0/shard{process}", store), group, GROUPS, options)
        x, y = make_data()

        report: dict[str, object] = {"rank": rank}
        for kind in ("groups", "hsdp"):
            v = Variant(kind, args, mesh2d, cross, group, process)
            for step in range(args.steps):
                v.step(step, x, y)
            full = v.full_state()
            report[f"{kind}_rel_diff"] = rel_diff(full, ref)
            # process j of both groups holds bit-identical shards (parameters and optimizer state)
            local = torch.cat([t.reshape(-1) for t in local_state_shards(v.model, v.opt).values()])
            both = [torch.empty_like(local) for _ in range(GROUPS)]
            cross.allgather([both], [local]).wait()
            report[f"{kind}_replicas_identical"] = bool(torch.equal(both[0], both[1]))

        # healthy steps, interleaved, fresh models; time = slowest process of the step
        variants = {kind: Variant(kind, args, mesh2d, cross, group, process) for kind in ("groups", "hsdp")}
        times: dict[str, list[float]] = {kind: [] for kind in variants}
        for t in range(args.timed_steps + args.warmup):
            for kind in (("groups", "hsdp") if t % 2 == 0 else ("hsdp", "groups")):
                dist.barrier()
                start = time.perf_counter()
                variants[kind].step(t, x, y)
                took = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if t >= args.warmup:
                    times[kind].append(took.item())
        for kind, ts in times.items():
            report[f"{kind}_step_ms"] = 1000 * statistics.median(ts)
            report[f"{kind}_step_ms_p10_p90"] = [1000 * q for q in _quantiles(ts)]
        results.put(report)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _quantiles(ts: list[float]) -> list[float]:
    qs = statistics.quantiles(ts, n=10)
    return [qs[0], qs[-1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timed-steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = sum(p.numel() for p in make_model(args.hidden, args.layers).parameters())
    print(f"model: {args.layers} hidden layers of {args.hidden}, {params} float64 parameters "
          f"({params * 8 / 1e6:.1f} MB); {GROUPS} groups x {GROUP_SIZE} processes; G={args.global_batch}, "
          f"micro-batch {args.micro_batch}; {args.steps} AdamW steps", flush=True)
    ref = reference(args)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, os.path.join(tmp, "store"), ref, results), nprocs=WORLD, join=True)
    reports = sorted((results.get() for _ in range(WORLD)), key=lambda r: r["rank"])
    ok = True
    for kind, name in (("groups", "replica groups (own cross-group allreduce)"), ("hsdp", "plain HSDP (FSDP2 replicate allreduce)")):
        diff = max(r[f"{kind}_rel_diff"] for r in reports)
        same = all(r[f"{kind}_replicas_identical"] for r in reports)
        ok = ok and diff < 1e-8 and same
        print(f"{name}: max relative difference to one process {diff:.2e}; shard j identical in both groups: {same}")
    g, h = reports[0]["groups_step_ms"], reports[0]["hsdp_step_ms"]
    print(f"healthy step, median of {args.timed_steps} interleaved (slowest process): replica groups {g:.2f} ms "
          f"(p10-p90 {reports[0]['groups_step_ms_p10_p90'][0]:.2f}-{reports[0]['groups_step_ms_p10_p90'][1]:.2f}), "
          f"plain HSDP {h:.2f} ms (p10-p90 {reports[0]['hsdp_step_ms_p10_p90'][0]:.2f}-"
          f"{reports[0]['hsdp_step_ms_p10_p90'][1]:.2f}); ratio {g / h:.3f}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
