"""What unbroken costs a healthy job: step time and start-up against plain DDP under torchrun,
side by side (issue 17).

    python benchmarks/bench_overhead.py [--workers 2] [--trials 3] [--widths 100,1870,4870] [--torchrun-malloc default|tuned]

For each model size (an MLP of about 35 k, 4 M and 25 M parameters at the default widths), the
two systems run the same script (``benchmarks/train_bench.py``: same model, samples and global
batch) in interleaved pairs, so that the machine's noise falls on both. Reported per size: the
median step time of each and the median of the per-pair ratios; and, from the smallest size's
runs, the start-up: from launching the command to the first committed step. Prints a markdown
table and writes benchmarks/results/overhead.json. unbroken's workers fix glibc's malloc
thresholds (``tune_malloc``); ``--torchrun-malloc tuned`` gives DDP's workers the same ones
through glibc's variables, to tell that part of a difference from the rest.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.bench_foundation import SCRIPT, _run, _step_seconds  # noqa: E402
from benchmarks.common import save_results, seconds, torchrun_malloc_env  # noqa: E402


def _params(width: int) -> int:
    return 256 * width + width + width * width + width + width * 10 + 10


def _one(system: str, workers: int, width: int, steps: int, tmp: str, index: int,
         malloc: dict[str, str] | None = None) -> tuple[float, float]:
    """(median step seconds, seconds from launch to the first committed step)."""
    args = [SCRIPT, "--mode", system, "--steps", str(steps), "--width", str(width), "--warmup", str(min(20, steps // 4))]
    if system == "ddp":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers), *args]
    else:
        cmd = [sys.executable, "-m", "unbroken", "run", "--nproc-per-node", str(workers), "--progress-interval", "0",
               "--run-dir", os.path.join(tmp, f"u{index}"), *args]
    launched = time.time()
    out = _run(cmd, 1200, tmp, malloc if system == "ddp" else None)
    first = min(float(v) for v in re.findall(r"FIRST_STEP_AT ([0-9.]+)", out))
    return _step_seconds(out), first - launched


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--widths", default="100,1870,4870", help="MLP widths (default: about 35 k, 4 M and 25 M parameters)")
    parser.add_argument("--steps", default="300,60,30", help="steps per run for each width")
    parser.add_argument("--torchrun-malloc", choices=["default", "tuned"], default="default",
                        help="tuned: run DDP's workers with glibc's thresholds fixed as unbroken's workers fix them"
                             " (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_; tune_malloc in docs/guide/settings.md)")
    args = parser.parse_args()
    malloc = torchrun_malloc_env(args.torchrun_malloc)
    widths = [int(w) for w in args.widths.split(",")]
    steps = [int(s) for s in args.steps.split(",")]
    rows = []
    startup: dict[str, list[float]] = {"ddp": [], "unbroken": []}
    with tempfile.TemporaryDirectory() as tmp:
        for width, count in zip(widths, steps):
            times: dict[str, list[float]] = {"ddp": [], "unbroken": []}
            for trial in range(args.trials):
                order = ("ddp", "unbroken") if trial % 2 == 0 else ("unbroken", "ddp")
                for system in order:
                    step, first = _one(system, args.workers, width, count, tmp, len(times[system]) + 100 * width, malloc)
                    times[system].append(step)
                    if width == widths[0]:
                        startup[system].append(first)
            ratios = [u / d for u, d in zip(times["unbroken"], times["ddp"])]
            rows.append({"width": width, "params": _params(width), **times, "ratio": ratios})
            print(f"width {width}: ddp {seconds(times['ddp'], 4)}  unbroken {seconds(times['unbroken'], 4)}  ratio {seconds(ratios, 3, 'x')}", flush=True)
    start_ratio = [u / d for u, d in zip(startup["unbroken"], startup["ddp"])]
    print(f"\n{args.workers} workers, {args.trials} interleaved pairs per size; median (min – max)\n")
    print("| model | plain DDP step | unbroken step | unbroken / DDP | target |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['params'] / 1e6:.3g} M parameters | {seconds(row['ddp'], 4)} | {seconds(row['unbroken'], 4)} | {seconds(row['ratio'], 3, 'x')} | ≤ 1.02 x |")
    print(f"| start-up to the first committed step | {seconds(startup['ddp'])} | {seconds(startup['unbroken'])} | {seconds(start_ratio, 3, 'x')} | ≤ 1.0 x |")
    save_results(os.path.join(HERE, "results", "overhead.json" if malloc is None else "overhead_tuned_torchrun.json"), {"workers": args.workers, "sizes": rows, "startup": startup, "startup_ratio": start_ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
