"""A data-bound job: unbroken with loader workers against DDP with a DataLoader, side by side (issue 15).

    python benchmarks/bench_input.py [--members 2] [--trials 3] [--steps 80] [--sample-ms 2]

Each sample costs about ``--sample-ms`` of CPU to "decode and augment" (small matrix products on a
stored image, then a random crop and flip drawn from torch's global generator); the model is
small, so the step time is the time to load the global batch. Compared, in interleaved runs on
``--members`` processes with the same global batch (one micro-batch per member per step):

- plain DDP under torchrun: ``DataLoader(num_workers=2, prefetch_factor=2)`` with a
  ``DistributedSampler``;
- unbroken: ``Job(num_workers=2, prefetch=2)``;
- unbroken: ``Job(num_workers=0)`` (each micro-batch loaded in the training thread), for reference.

Prints a markdown table and writes benchmarks/results/input.json. The same file is the training
script (``--worker``).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.abspath(__file__)

import torch  # noqa: E402


class Decoded(torch.utils.data.Dataset):
    """Sample ``i``: a stored 3x32x32 "image" decoded by ``work`` rounds of 32x32 matrix products,
    then randomly cropped to 28x28 and flipped (the augmentation)."""

    def __init__(self, n: int, work: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.n, self.work = n, work
        self.images = torch.randn(64, 3, 32, 32, generator=g)
        self.mix = torch.randn(32, 32, generator=g) / 32**0.5
        self.labels = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = self.images[i % 64]
        for _ in range(self.work):
            x = torch.tanh(x @ self.mix)
        top, left = (int(v) for v in torch.randint(0, 5, (2,)))
        x = x[:, top : top + 28, left : left + 28]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x.contiguous(), self.labels[i]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 28 * 28, 10))


def worker(args: argparse.Namespace) -> None:
    """The training script, under torchrun (``--mode ddp``) or ``unbroken run``."""
    torch.set_num_threads(1)
    dataset = Decoded(args.steps * args.global_batch_size, args.work)  # one epoch: no epoch restart
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    times, last, cpu = [], None, []

    def tick(index: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if last is not None and index >= args.warmup:
            times.append(now - last)
        if index == args.warmup - 1 or (index >= args.warmup and not cpu):
            cpu.append(time.process_time())  # the training process's own CPU, every thread
        last = now

    if args.mode == "unbroken":
        import unbroken

        job = unbroken.Job(
            model, optimizer, dataset, global_batch_size=args.global_batch_size,
            micro_batch_size=-(-args.global_batch_size // args.members), seed=0,
            num_workers=args.num_workers, prefetch=2 if args.num_workers else None,
        )
        for step in job.steps(total=args.steps):
            for xb, yb in step.micro_batches():
                step.backward(loss_fn(model(xb), yb))
            step.commit()
            tick(step.index)
    else:
        import torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler

        dist.init_process_group("gloo")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        sampler = DistributedSampler(dataset, seed=0)
        loader = DataLoader(dataset, sampler=sampler, batch_size=args.global_batch_size // dist.get_world_size(),
                            num_workers=args.num_workers, prefetch_factor=2)
        for s, (xb, yb) in enumerate(loader):
            if s >= args.steps:
                break
            loss_fn(ddp(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tick(s)
        dist.destroy_process_group()
    if times:
        print(f"STEP_SECONDS {statistics.median(times):.6f}", flush=True)
        print(f"TRAINER_CPU_MS {(time.process_time() - cpu[0]) / len(times) * 1000:.3f}", flush=True)


def calibrate(sample_ms: float) -> tuple[int, float]:
    """Rounds of decoding that make one sample cost about ``sample_ms`` on one thread, and the cost."""
    torch.set_num_threads(1)

    def cost(work: int) -> float:
        data = Decoded(64, work)
        data[0]
        t = time.perf_counter()
        for i in range(32):
            data[i]
        return (time.perf_counter() - t) / 32 * 1000

    work = max(1, round(20 * sample_ms / cost(20)))
    return work, cost(work)


def main() -> int:
    sys.path.insert(0, os.path.dirname(HERE))
    from benchmarks.bench_foundation import _run, _step_seconds
    from benchmarks.common import save_results, seconds

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--sample-ms", type=float, default=2.0, help="CPU cost of one sample (decode and augment)")
    args = parser.parse_args()
    work, sample_ms = calibrate(args.sample_ms)
    common = ["--steps", str(args.steps), "--timed-from", str(args.warmup), "--global-batch-size", str(args.global_batch_size),
              "--work", str(work), "--members", str(args.members)]
    systems = {
        "ddp": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.members), SCRIPT, "--worker", "--mode", "ddp", "--num-workers", "2"],
        "unbroken": ["-m", "unbroken", "run", "--nproc-per-node", str(args.members), "--progress-interval", "0", "--run-dir", "RUN", SCRIPT, "--worker", "--mode", "unbroken", "--num-workers", "2"],
        "unbroken-0": ["-m", "unbroken", "run", "--nproc-per-node", str(args.members), "--progress-interval", "0", "--run-dir", "RUN", SCRIPT, "--worker", "--mode", "unbroken", "--num-workers", "0"],
    }
    times: dict[str, list[float]] = {name: [] for name in systems}
    trainer_cpu: dict[str, list[float]] = {name: [] for name in systems}
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            order = list(systems) if trial % 2 == 0 else list(reversed(systems))
            for name in order:
                cmd = [sys.executable, *[os.path.join(tmp, f"{name}-{trial}") if a == "RUN" else a for a in systems[name]], *common]
                out = _run(cmd, 900, tmp)
                times[name].append(_step_seconds(out))
                trainer_cpu[name].append(statistics.median(float(v) for v in re.findall(r"TRAINER_CPU_MS ([0-9.]+)", out)))
                print(f"trial {trial} {name}: {times[name][-1] * 1000:.1f} ms per step, training process {trainer_cpu[name][-1]:.2f} ms CPU per step", flush=True)
    ratio = [u / d for u, d in zip(times["unbroken"], times["ddp"])]
    ratio0 = [u / d for u, d in zip(times["unbroken-0"], times["ddp"])]
    g = args.global_batch_size
    print(f"\n{args.members} members, global batch {g} (one micro-batch of {g // args.members} per member), one sample ≈ {sample_ms:.2f} ms"
          f" of CPU, {os.cpu_count()} cores, {args.trials} interleaved trials of {args.steps} steps; median (min – max)\n")
    print("| input pipeline | step time | samples/s | / DDP | target | CPU of a training process per step |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| plain DDP: DataLoader(num_workers=2, prefetch_factor=2) + DistributedSampler | {seconds(times['ddp'], 4)} | {g / statistics.median(times['ddp']):.0f} | 1 | | {seconds(trainer_cpu['ddp'], 2, 'ms')} |")
    print(f"| unbroken: Job(num_workers=2, prefetch=2) | {seconds(times['unbroken'], 4)} | {g / statistics.median(times['unbroken']):.0f} | {seconds(ratio, 3, 'x')} | ≤ 1.05 x | {seconds(trainer_cpu['unbroken'], 2, 'ms')} |")
    print(f"| unbroken: Job(num_workers=0), loading in the training thread | {seconds(times['unbroken-0'], 4)} | {g / statistics.median(times['unbroken-0']):.0f} | {seconds(ratio0, 3, 'x')} | | {seconds(trainer_cpu['unbroken-0'], 2, 'ms')} |")
    save_results(os.path.join(HERE, "results", "input.json"), {
        "date": time.strftime("%Y-%m-%d"), "members": args.members, "global_batch_size": g, "steps": args.steps,
        "trials": args.trials, "sample_ms": sample_ms, "work": work, "cores": os.cpu_count(),
        "step_s": times, "trainer_cpu_ms_per_step": trainer_cpu, "ratio_unbroken_ddp": ratio, "ratio_unbroken0_ddp": ratio0,
    })
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--worker", action="store_true")
        p.add_argument("--mode", choices=["unbroken", "ddp"], required=True)
        p.add_argument("--steps", type=int, default=80)
        p.add_argument("--timed-from", type=int, default=10, dest="warmup", help="steps before this one are not timed")
        p.add_argument("--global-batch-size", type=int, default=32)
        p.add_argument("--work", type=int, default=10)
        p.add_argument("--members", type=int, default=2)
        p.add_argument("--num-workers", type=int, default=2)
        worker(p.parse_args())
        sys.exit(0)
    sys.exit(main())
