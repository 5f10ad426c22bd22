"""The benchmark's training script: the same model, data and global batch under unbroken or DDP.

``--mode unbroken`` runs under ``unbroken run``; ``--mode ddp`` under ``torchrun`` with plain
``DistributedDataParallel`` on Gloo. Both take the same samples per member per step (the data
plan), so only the machinery differs. Prints ``STEP_SECONDS <median of steps after warm-up>``.
"""

import time

SCRIPT_START = time.time()
_t0 = time.perf_counter()
import torch  # noqa: E402

IMPORT_SECONDS = time.perf_counter() - _t0

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402

from unbroken.data.data_plan import DataPlan  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["unbroken", "ddp", "zero", "deepspeed"], required=True,
                    help="zero: DDP with torch's ZeroRedundancyOptimizer; deepspeed: DeepSpeed's ZeRO stage 1 (torchrun, Gloo)")
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--global-batch-size", type=int, default=96)
parser.add_argument("--width", type=int, default=512)
parser.add_argument("--warmup", type=int, default=20)
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
n = 4096
x = torch.randn(n, 256)
y = torch.randint(0, 10, (n,))
dataset = torch.utils.data.TensorDataset(x, y)
model = torch.nn.Sequential(
    torch.nn.Linear(256, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 10)
)
_t1 = time.perf_counter()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the first optimizer imports torch._dynamo
OPTIMIZER_SECONDS = time.perf_counter() - _t1
loss_fn = torch.nn.CrossEntropyLoss()
times = []


def optimizer_bytes() -> int:
    """Bytes of optimizer state this process holds (its shard's, where the state is sharded)."""
    sharded = getattr(globals().get("job"), "_sharded", None)
    if sharded is not None:
        return sharded.state_bytes()
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own shard
    if args.mode == "deepspeed":
        local = engine.optimizer
        flat = getattr(local, "single_partition_of_fp32_groups", None)
        if flat is not None:  # ZeRO: the moments of this rank's partition
            local = local.optimizer
    return sum(v.numel() * v.element_size() for s in local.state.values() for v in s.values() if isinstance(v, torch.Tensor))

if os.environ.get("UNBROKEN_RUN_DIR"):
    with open(os.path.join(os.environ["UNBROKEN_RUN_DIR"], "imports.jsonl"), "a") as f:
        f.write(json.dumps({"member": os.environ.get("UNBROKEN_MEMBER_ID"), "import_torch": IMPORT_SECONDS, "script_start": SCRIPT_START, "first_optimizer": OPTIMIZER_SECONDS, "t": time.time()}) + "\n")

if args.mode == "unbroken":
    import unbroken

    job = unbroken.Job(model, optimizer, dataset, global_batch_size=args.global_batch_size, seed=0)
    last = None
    for step in job.steps(total=args.steps):
        for xb, yb in step.micro_batches():
            step.backward(loss_fn(model(xb), yb))
        step.commit()
        if step.index == 0:
            print(f"FIRST_STEP_AT {time.time():.6f}", flush=True)
        now = time.perf_counter()
        if last is not None and step.index >= args.warmup and step.members == job.member_count:
            times.append(now - last)
        last = now
else:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.mode == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    if args.mode == "deepspeed":
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": args.global_batch_size // world, "zero_optimization": {"stage": 1},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10**9}
        engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters(),
                                                       dist_init_required=False)
    ddp = engine if args.mode == "deepspeed" else torch.nn.parallel.DistributedDataParallel(model)
    plan = DataPlan(n, args.global_batch_size, args.global_batch_size, seed=0)
    last = None
    for s in range(args.steps):
        idx = plan.indices(plan.share(s, rank, world))
        loss = loss_fn(ddp(x[idx]), y[idx])
        if args.mode == "deepspeed":
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if s == 0:
            print(f"FIRST_STEP_AT {time.time():.6f}", flush=True)
        now = time.perf_counter()
        if last is not None and s >= args.warmup:
            times.append(now - last)
        last = now
    dist.destroy_process_group()

if times:
    print(f"STEP_SECONDS {statistics.median(times):.6f}", flush=True)
print(f"OPTIMIZER_BYTES {optimizer_bytes()}", flush=True)
