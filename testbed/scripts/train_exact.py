"""A deterministic float64 training script for the invariant tests.

No randomness in the forward pass, AdamW with a learning-rate schedule and clipping by global
norm. Writes the final parameters to ``--out/<member>.pt`` so that runs can be compared.
"""

import argparse
import atexit
import json
import os
import sys
import time

import torch

import unbroken
import unbroken.worker.devices

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--global-batch-size", type=int, default=24)
parser.add_argument("--micro-batch-size", type=int, default=4)
parser.add_argument("--step-delay", type=float, default=0.0, help="sleep per step, standing in for compute")
parser.add_argument("--micro-delay", type=float, default=0.0, help="sleep per micro-batch, standing in for a long forward/backward")
parser.add_argument("--first-step-sleep", type=float, default=0.0, help="sleep this long in this process's first step (compilation)")
parser.add_argument("--first-step-rank", type=int, default=None, help="only this local rank sleeps in its first step")
parser.add_argument("--after-loop-sleep", type=float, default=0.0, help="the leader sleeps this long after the loop")
parser.add_argument("--after-loop-file", default=None, help="then the leader writes this file (8 MB)")
parser.add_argument("--after-loop-exit", type=int, default=0, help="then the leader exits with this status")
parser.add_argument("--resources", default=None, help="append this process's fd and thread counts per generation here")
parser.add_argument("--out", default=None)
parser.add_argument("--raise-at-step", type=int, default=None, help="raise an error at this step on every member")
parser.add_argument("--bad-dataset", action="store_true", help="pass a dataset without __len__")
parser.add_argument("--batchnorm", action="store_true", help="add a BatchNorm layer (buffers that change in forward)")
parser.add_argument("--dropout", type=float, default=0.0, help="add a Dropout layer (randomness in the forward pass)")
parser.add_argument("--rng-log", default=None, help="append one torch.rand() draw per step attempt here (per-member randomness)")
parser.add_argument("--misuse", choices=["skip", "plain"], default=None, help="skip a micro-batch, or call loss.backward() directly")
parser.add_argument("--token-loss", action="store_true", help="a summed loss over a data-dependent mask, normalised by the global count")
parser.add_argument("--slow-store", action="store_true", help="register the slowfile:// checkpoint store (slowfs.py)")
parser.add_argument("--loader-workers", type=int, default=0, help="Job(num_workers=...): loader worker processes")
parser.add_argument("--prefetch", type=int, default=None, help="Job(prefetch=...): micro-batches in flight per loader worker")
parser.add_argument("--augment", action="store_true", help="a map-style dataset adding noise from the global generator to each sample; the script checks every micro-batch holds the planned samples")
parser.add_argument("--bad-index", type=int, default=None, help="with --augment: loading this dataset index raises")
parser.add_argument("--loader-pids", default=None, help="append this process's pid and its loader workers' pids here")
parser.add_argument("--scaler", action="store_true", help="Job(scaler=GradScaler('cpu')), unscale_ before clipping")
parser.add_argument("--inf-sample", type=int, default=None, help="this dataset index holds inf: the steps that hold it overflow")
parser.add_argument("--scaler-log", default=None, help="append every commit's (member, step, skipped, scale) here")
parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: this worker's GPU (cuda:LOCAL_RANK), deterministic algorithms, TF32 off")
parser.add_argument("--amp", choices=["fp16", "bf16"], default=None, help="a float32 model whose forward runs under autocast; fp16 implies --scaler")
parser.add_argument("--leader-says", action="store_true", help="the leader prints 'LEADER step N' after each commit")
parser.add_argument("--stop-at", type=int, default=None, help="the leader calls job.stop() after committing this step")
parser.add_argument("--stop-once", action="store_true", help="with --stop-at: the rule fires at that step only")
parser.add_argument("--die-after-stop", action="store_true", help="with --stop-at: the member that called job.stop() SIGKILLs itself at once")
parser.add_argument("--break-alone-at", type=int, default=None, help="the leader alone leaves the loop with break after committing this step")
parser.add_argument("--raise-after-commit", type=int, default=None, help="every member raises after committing this step")
parser.add_argument("--eval-raises", action="store_true", help="the evaluation raises (on the leader, where it runs)")
parser.add_argument("--eval-collective", action="store_true", help="the evaluation makes a torch.distributed all_reduce")
parser.add_argument("--collective-per-micro", action="store_true", help="dist.all_reduce of each micro-batch's loss after its step.backward")
parser.add_argument("--eval-at-start", action="store_true", help="job.on_leader at the top of step 0's body (nanoGPT's evaluation at iteration 0)")
parser.add_argument("--eval-before-loop", action="store_true", help="call job.on_leader before job.steps()")
parser.add_argument("--break-at", type=int, default=None, help="every member leaves the loop with break after committing this step")
parser.add_argument("--break-before", type=int, default=None, help="every member leaves the loop with break at the top of this step")
parser.add_argument("--half", choices=["float16", "bfloat16"], default=None, help="a model in this dtype, trained with SGD (with --token-loss)")
parser.add_argument("--count-scale", type=float, default=1.0, help="with --token-loss: each masked output counts this many tokens")
parser.add_argument("--eval-every", type=int, default=0, help="every N committed steps, evaluate through job.on_leader")
parser.add_argument("--eval-seconds", type=float, default=0.0, help="the evaluation sleeps this long (a long evaluation)")
parser.add_argument("--eval-log", default=None, help="append every member's (member, step, result, ran) here")
parser.add_argument("--kill-in-eval", type=int, default=None, help="the leader SIGKILLs itself inside the evaluation after this step (once)")
parser.add_argument("--metrics-log", default=None, help="a torchmetrics MSE synced over torch.distributed's default group in every step; append it and step.loss here; a rank-zero-only logger prints RZ lines")
parser.add_argument("--manual-lr", action="store_true", help="no scheduler: set every param_group's lr by hand at the top of each step, as nanoGPT does")
parser.add_argument("--clamp", type=float, default=None, help="clamp every parameter to [-C, C] after each commit (a state change outside the optimizer)")
args = parser.parse_args()
if args.device == "cuda":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: deterministic matmuls
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
device = unbroken.worker.devices.local_device() if args.device == "cuda" else torch.device("cpu")
if args.amp == "fp16":
    args.scaler = True
if args.slow_store:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import slowfs  # noqa: F401  (registers slowfile://)

torch.set_num_threads(1)
torch.manual_seed(1234)
torch.set_default_dtype(torch.float32 if args.amp or args.half else torch.float64)

n = 200
x = torch.randn(n, 6)
y = torch.sin(x @ torch.randn(6, 2))
if args.inf_sample is not None:
    x[args.inf_sample] = float("inf")  # its loss is nan, and so is every gradient of its step
dataset = torch.utils.data.TensorDataset(x, y)
if args.bad_dataset:

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    dataset = Stream()
if args.augment:

    class Augmented(torch.utils.data.Dataset):
        """The same samples plus noise drawn from the global generator (seeded per stream
        position by unbroken), and each sample's index, to check what the loader delivered."""

        def __len__(self):
            return n

        def __getitem__(self, i):
            if i == args.bad_index:
                raise ValueError(f"record {i} is corrupt")
            return x[i] + 0.05 * torch.randn(6), y[i], torch.tensor(i)

    dataset = Augmented()

layers = [torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)]
if args.dropout:
    layers.insert(2, torch.nn.Dropout(args.dropout))
if args.batchnorm:
    layers.insert(1, torch.nn.BatchNorm1d(16))
model = torch.nn.Sequential(*layers).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
if args.half:  # the gradients are divided by a count of ~count-scale tokens per output: SGD's step scales back
    model = model.to(getattr(torch, args.half))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2 * args.count_scale)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))

if args.resources:
    atexit.register(lambda: threads_at_exit())  # before the Job's exit guard, so that it runs after it
job = unbroken.Job(
    model,
    optimizer,
    dataset,
    global_batch_size=args.global_batch_size,
    micro_batch_size=args.micro_batch_size,
    seed=7,
    scheduler=None if args.manual_lr else scheduler,
    num_workers=args.loader_workers,
    prefetch=args.prefetch,
    # a small scale that grows every 4 good steps, so that 40 steps see growth and back-off
    scaler=torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=4) if args.scaler else None,
)
first_step = True


def resources():
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def threads_at_exit():
    """Registered before the Job's exit guard, so it runs after it: the threads left for the
    interpreter's teardown (a Gloo worker thread still running then can abort the process)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile: not left behind
            continue
    with open(args.resources, "a") as f:
        f.write(json.dumps({"member": os.environ.get("UNBROKEN_MEMBER_ID"), "threads_at_exit": sorted(names)}) + "\n")


local_rank = int(os.environ.get("LOCAL_RANK", "0"))
if args.metrics_log:
    import torch.distributed as dist
    import torchmetrics
    from lightning_utilities.core.rank_zero import rank_zero_only

    mse = torchmetrics.MeanSquaredError()
    rank_zero_only.rank = int(os.environ.get("RANK", "0"))  # as Lightning sets it at import (unbroken updates it per generation)

    @rank_zero_only
    def log_on_rank_zero(step, synced):
        print(f"RZ step {step.index} mse {synced:.6f} rank {os.environ.get('RANK', '0')}", flush=True)
my_loaders = []
if args.eval_before_loop:
    job.on_leader(print, "evaluating before training")
for step in job.steps(total=args.steps):
    if args.resources:
        with open(args.resources, "a") as f:
            fds, threads = resources()
            f.write(f'{{"member": "{os.environ.get("UNBROKEN_MEMBER_ID")}", "generation": {step.generation}, "step": {step.index}, "fds": {fds}, "threads": {threads}, "parked": {len(job._graveyard)}, "released": {job._graveyard.released}}}\n')
    if args.rng_log:
        with open(args.rng_log, "a") as f:
            f.write(f'{{"member": "{os.environ.get("UNBROKEN_MEMBER_ID")}", "generation": {step.generation}, "step": {step.index}, "draw": {torch.rand(()).item()!r}}}\n')
    if first_step and args.first_step_sleep and args.first_step_rank in (None, local_rank):
        time.sleep(args.first_step_sleep)
    first_step = False
    if args.break_before is not None and step.index == args.break_before:
        break
    if args.raise_at_step is not None and step.index == args.raise_at_step:
        raise RuntimeError(f"deliberate failure at step {step.index}")
    if args.eval_at_start and step.index == 0:
        at_start = job.on_leader(lambda: {"loss": torch.nn.functional.mse_loss(model(x[:32].to(device)), y[:32].to(device)).item()})
        print(f"START EVAL {at_start['loss']:.6f}", flush=True)
    if args.manual_lr:
        for group in optimizer.param_groups:
            group["lr"] = 0.05 / (1.0 + 0.1 * step.index)
    seen = []
    if args.metrics_log:
        mse.reset()
    for i, (xb, yb, *index) in enumerate(step.micro_batches()):
        if args.loader_pids and job._loader.pids():
            my_loaders = job._loader.pids()
            with open(args.loader_pids, "a") as f:
                f.write(f'{{"member": "{os.environ.get("UNBROKEN_MEMBER_ID")}", "pid": {os.getpid()}, "loaders": {job._loader.pids()}}}\n')
            args.loader_pids = None  # once per process
        if index:
            seen.extend(index[0].tolist())
            planned = job.plan.indices(step.positions).tolist()
            assert seen == planned[: len(seen)], f"step {step.index}: the loader delivered {seen}, the plan says {planned}"
        if args.misuse == "skip" and i == 0:
            continue
        if args.misuse == "plain":
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            continue
        if args.token_loss and args.half:
            # a half-precision model; the loss summed in float32 over "tokens" of count-scale each
            mask = (xb[:, :2] > -0.3).float()
            err = (model(xb.to(device, getattr(torch, args.half))).float() - yb.float()) ** 2 * mask
            step.backward(err.sum(), count=mask.sum() * args.count_scale)
            continue
        if args.token_loss:
            # like padded tokens: each sample counts a different number of its outputs
            mask = (xb[:, :2] > -0.3).to(xb.dtype)
            step.backward(((model(xb) - yb) ** 2 * mask).sum(), count=mask.sum())
            continue
        xb, yb = xb.to(device), yb.to(device)
        if args.collective_per_micro:  # as a DDP script logs its loss: a collective per micro-batch
            import torch.distributed as dist

            loss = torch.nn.functional.mse_loss(model(xb), yb)
            step.backward(loss)
            if dist.is_initialized():
                dist.all_reduce(loss.detach().clone())
            continue
        if args.metrics_log:
            out = model(xb)
            mse.update(out.detach(), yb)
            step.backward(torch.nn.functional.mse_loss(out, yb))
            continue
        if args.amp:
            with torch.autocast(device.type, dtype=torch.float16 if args.amp == "fp16" else torch.bfloat16):
                out = model(xb)
            step.backward(torch.nn.functional.mse_loss(out.float(), yb))
        else:
            step.backward(torch.nn.functional.mse_loss(model(xb), yb))
        if args.micro_delay:
            time.sleep(args.micro_delay)
    if args.metrics_log:
        if dist.is_initialized():  # torch.distributed answers with the generation
            assert (dist.get_rank(), dist.get_world_size()) == (step.rank, step.members), (dist.get_rank(), dist.get_world_size(), step.rank, step.members)
            assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == (str(step.rank), str(step.members)), os.environ["RANK"]
        synced = float(mse.compute())  # all_gathers the metric's state over the default group (undefined if a peer died)
    if not step.reduce():
        continue
    if args.metrics_log:
        with open(args.metrics_log, "a") as f:
            f.write(json.dumps({"member": os.environ.get("UNBROKEN_MEMBER_ID", "single"), "step": step.index,
                                "synced": synced, "loss": step.loss, "members": step.members}) + "\n")
    if job.scaler is not None:
        job.scaler.unscale_(job.optimizer)  # clip the true gradients, as under DDP
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    step.commit()
    if args.clamp is not None and step.committed:
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-args.clamp, args.clamp)
    if args.scaler_log and step.committed and job.scaler is not None:
        with open(args.scaler_log, "a") as f:
            f.write(f'{{"member": "{os.environ.get("UNBROKEN_MEMBER_ID", "single")}", "step": {step.index}, "skipped": {str(step.skipped).lower()}, "scale": {job.scaler.get_scale()!r}}}\n')
    print(f"step {step.index} loss {step.loss:.6f} members {step.members}", flush=True)
    if args.metrics_log and step.committed:
        log_on_rank_zero(step, synced)
    if args.leader_says and step.committed and job.is_leader:
        print(f"LEADER step {step.index}", flush=True)
        print(f"LEADER stderr {step.index}", file=sys.stderr, flush=True)
    if args.stop_at is not None and step.committed and (step.index == args.stop_at if args.stop_once else step.index >= args.stop_at) and job.is_leader:
        job.stop(f"early stop after step {step.index}")
        if args.die_after_stop and os.environ.get("UNBROKEN_MEMBER_ID"):
            os.kill(os.getpid(), 9)  # the stop must outlive the member that asked for it
    if args.break_at is not None and step.committed and step.index == args.break_at:
        break
    if args.break_alone_at is not None and step.committed and step.index == args.break_alone_at and job.is_leader:
        break
    if args.raise_after_commit is not None and step.committed and step.index == args.raise_after_commit:
        raise RuntimeError(f"deliberate failure after step {step.index}'s commit")
    if args.eval_every and step.committed and (step.index + 1) % args.eval_every == 0:
        ran = []

        def evaluate(at):
            """The loss on the first 32 samples, computed by the leader (long: --eval-seconds)."""
            ran.append(True)
            print(f"EVAL step {at} on the leader", flush=True)
            if at == args.kill_in_eval and not os.path.exists(args.eval_log + ".killed"):
                open(args.eval_log + ".killed", "w").close()
                time.sleep(args.eval_seconds / 2)
                os.kill(os.getpid(), 9)  # dies inside the evaluation: the next leader runs it again
            time.sleep(args.eval_seconds)
            if args.eval_raises:
                with open(args.eval_log + ".raised", "a") as f:
                    f.write(f"{at}\n")
                raise ValueError(f"the evaluation at step {at} failed")
            if args.eval_collective:
                import torch.distributed as dist

                dist.all_reduce(torch.zeros(1))
            with torch.no_grad():
                return {"step": at, "loss": torch.nn.functional.mse_loss(model(x[:32].to(device)), y[:32].to(device)).item()}

        entered = time.monotonic()
        result = job.on_leader(evaluate, step.index)
        with open(args.eval_log, "a") as f:
            f.write(json.dumps({"member": os.environ.get("UNBROKEN_MEMBER_ID", "single"), "step": step.index,
                                "result": result, "ran": bool(ran), "generation": job.generation,
                                "waited": time.monotonic() - entered}) + "\n")
    if args.step_delay:
        time.sleep(args.step_delay)

# the loop's end stopped the loader workers (joined: not even zombies)
assert not [p for p in my_loaders if os.path.exists(f"/proc/{p}")], f"loader workers {my_loaders} outlived job.steps()"

if args.after_loop_file and job.is_leader:
    time.sleep(args.after_loop_sleep)
    with open(args.after_loop_file + ".tmp", "wb") as f:
        for _ in range(8):
            f.write(b"x" * (1 << 20))
    os.rename(args.after_loop_file + ".tmp", args.after_loop_file)
    if args.after_loop_exit:
        sys.exit(args.after_loop_exit)
if args.out:
    os.makedirs(args.out, exist_ok=True)
    name = os.environ.get("UNBROKEN_MEMBER_ID", "single")
    final = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if job.scaler is not None:  # compared with the parameters: the scale must match too
        final["scaler.scale"] = torch.tensor(job.scaler.get_scale())
        final["scaler.growth_tracker"] = torch.tensor(float(job.scaler.state_dict()["_growth_tracker"]))
    torch.save(final, os.path.join(args.out, f"{name}.pt"))
print("done", file=sys.stderr)
