"""The straggler benchmark's training script: the same model, samples and micro-batches under
unbroken or DDP, with the compute of a micro-batch stood in by a sleep (``--compute`` seconds), so
that three members on two cores still have speeds of their own; ``--slow-rank R --slow-from S``
makes local rank R take twice as long per micro-batch from step S on. Prints
``STEP_SECONDS <median step from --measure-from on>``; with ``--out``, the leader (or the single
process) saves the final parameters there (float64 model)."""

import argparse
import os
import statistics
import time

import torch

from unbroken.data.data_plan import DataPlan

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["unbroken", "ddp", "single"], required=True)
parser.add_argument("--steps", type=int, default=80)
parser.add_argument("--global-batch-size", type=int, default=48)
parser.add_argument("--micro-batch-size", type=int, default=2)
parser.add_argument("--compute", type=float, default=0.02, help="seconds of stand-in compute per micro-batch")
parser.add_argument("--slow-rank", type=int, default=None)
parser.add_argument("--slow-from", type=int, default=20)
parser.add_argument("--measure-from", type=int, default=40)
parser.add_argument("--out", default=None)
args = parser.parse_args()

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
n = 2048
x, y = torch.randn(n, 32), torch.randn(n, 1)
dataset = torch.utils.data.TensorDataset(x, y)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
local_rank = int(os.environ.get("LOCAL_RANK", "0"))
G, M = args.global_batch_size, args.micro_batch_size


def compute(step: int) -> None:
    slow = args.slow_rank == local_rank and step >= args.slow_from
    time.sleep(args.compute * (2 if slow else 1))


times, last = [], None


def tick(step: int) -> None:
    global last
    now = time.perf_counter()
    if last is not None and step >= args.measure_from:
        times.append(now - last)
    last = now


if args.mode == "unbroken":
    import unbroken

    job = unbroken.Job(model, optimizer, dataset, global_batch_size=G, micro_batch_size=M, seed=0)
    for step in job.steps(total=args.steps):
        for xb, yb in step.micro_batches():
            compute(step.index)
            step.backward(torch.nn.functional.mse_loss(model(xb), yb))
        if step.commit():
            tick(step.index)
    leader = job.is_leader
else:
    plan = DataPlan(n, G, M, seed=0)
    net, rank, world = model, 0, 1
    if args.mode == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        net = torch.nn.parallel.DistributedDataParallel(model)
    for s in range(args.steps):
        micro = plan.micro_batches(s, rank, world)
        for k, part in enumerate(micro):
            idx = plan.indices(part)
            compute(s)
            loss = torch.nn.functional.mse_loss(net(x[idx]), y[idx]) * (len(part) / G) * world
            if args.mode == "ddp" and k < len(micro) - 1:
                with net.no_sync():
                    loss.backward()
            else:
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tick(s)
    leader = rank == 0
    if args.mode == "ddp":
        dist.destroy_process_group()

if args.out and leader:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)
if times:
    print(f"STEP_SECONDS {statistics.median(times):.6f}", flush=True)
