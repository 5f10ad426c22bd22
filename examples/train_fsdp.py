"""A model sharded with FSDP2 inside each replica group, fault tolerant across groups; on the CPU.

    unbroken run --nproc-per-node 4 --group-size 2 examples/train_fsdp.py   # 2 groups of 2
    python examples/train_fsdp.py                                          # the reference: 1 process

The loop is the plain data-parallel one with three differences:

1. ``unbroken.group_mesh()`` before the model is built: the device mesh of this process's group.
2. The model is sharded over that mesh with ``fully_shard`` (layers first, then the root), and
   ``unbroken.replica_groups.sharding.sum_gradients(model)`` turns FSDP's gradient averaging into a sum:
   unbroken weights each micro-batch by its share of the global batch, so the global-batch
   gradient is a plain sum over the processes and the groups.
3. Each micro-batch's loss is passed as a *sum* with ``count=``, so that a process whose part of
   the step is empty (more processes than samples) adds 0, not NaN.

Process j of every group holds the same shard; unbroken allreduces it across the groups, heals a
restarted group shard by shard from a live one and writes sharded (DCP) checkpoints.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.distributed.fsdp import fully_shard

import unbroken
from unbroken.replica_groups.sharding import sum_gradients

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--layers", type=int, default=3)
parser.add_argument("--global-batch-size", type=int, default=24)
parser.add_argument("--micro-batch-size", type=int, default=4)
parser.add_argument("--step-delay", type=float, default=0.0, help="sleep per step, standing in for compute")
parser.add_argument("--out", default=None, help="write the full final parameters to OUT/<member>.pt (process 0 of each group)")
args = parser.parse_args()

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
torch.manual_seed(1234)
x = torch.randn(240, 8)
y = torch.sin(x @ torch.randn(8, 2))
dataset = torch.utils.data.TensorDataset(x, y)

mesh = unbroken.group_mesh()  # before the model: FSDP shards over this process's replica group
torch.manual_seed(0)  # every process of every group builds the same initial model
dims = [8] + [args.hidden] * args.layers + [2]
model = torch.nn.Sequential(*[m for a, b in zip(dims[:-1], dims[1:]) for m in (torch.nn.Linear(a, b), torch.nn.Tanh())][:-1])
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
sum_gradients(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)

job = unbroken.Job(model, optimizer, dataset, global_batch_size=args.global_batch_size,
                   micro_batch_size=args.micro_batch_size, seed=7)
for step in job.steps(total=args.steps):
    for xb, yb in step.micro_batches():
        step.backward((model(xb) - yb).pow(2).mean(dim=1).sum(), count=len(xb))
    step.commit()
    if args.step_delay:
        import time

        time.sleep(args.step_delay)

if args.out:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # a collective of the group
    if int(os.environ.get("UNBROKEN_RANK_IN_GROUP", "0")) == 0:
        os.makedirs(args.out, exist_ok=True)
        member = os.environ.get("UNBROKEN_MEMBER_ID", "single")
        torch.save({k: v.detach().clone() for k, v in full.items()}, os.path.join(args.out, f"{member}.pt"))
