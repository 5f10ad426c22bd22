"""A member slowed to half speed: unbroken's throughput against the ideal, next to plain DDP under
torchrun with the same slowdown (issue 30).

    python benchmarks/bench_stragglers.py [--trials 3] [--json]

Three members train the same float64 model on the same micro-batches
(``benchmarks/straggler_step.py``; 48 samples a step in micro-batches of 2, each micro-batch's
compute stood in by a 20 ms sleep so that three members on two cores keep speeds of their own, a
step of about 0.2 s, of which 160 ms compute). From step 20 local rank 1 takes twice as long per micro-batch. Per trial, in
this order: DDP healthy, unbroken healthy, DDP slowed, unbroken slowed (each the median step from
step 40 on). The ideal slowed step is the healthy step scaled by the capacity left (the sum of the
members' speeds: 2.5 of 3), so ``throughput_vs_ideal = healthy * 3 / 2.5 / slowed``.
Also: how many steps after the slowdown began the member was flagged (the ``straggler`` event),
whether the slowed run's final model equals one process's (1e-8, relative), and the healthy step
of unbroken (rebalancing on) over DDP's. Prints a markdown table (``--json``: one JSON object) and
writes benchmarks/results/stragglers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.bench_foundation import _run, _step_seconds  # noqa: E402
from benchmarks.common import save_results  # noqa: E402
from testbed.harness import max_relative_difference  # noqa: E402

SCRIPT = os.path.join(HERE, "straggler_step.py")
SLOW_FROM = 20


def _ddp(tmp: str, slow: bool) -> float:
    extra = ["--slow-rank", "1", "--slow-from", str(SLOW_FROM)] if slow else []
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", SCRIPT,
                "--mode", "ddp", *extra], 600, tmp)
    return _step_seconds(out)


def _unbroken(tmp: str, name: str, slow: bool) -> tuple[float, str]:
    run_dir = os.path.join(tmp, name)
    extra = ["--slow-rank", "1", "--slow-from", str(SLOW_FROM), "--out", os.path.join(tmp, f"{name}.pt")] if slow else []
    out = _run([sys.executable, "-m", "unbroken", "run", "--nproc-per-node", "3", "--progress-interval", "0", "--run-dir",
                run_dir, SCRIPT, "--mode", "unbroken", *extra], 600, tmp)
    return _step_seconds(out), run_dir


def _flagged_after(run_dir: str) -> int | None:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    steps = [e["step"] for e in events if e["kind"] == "straggler"]
    return min(steps) - SLOW_FROM if steps else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    rows: dict[str, list[float]] = {"ddp_healthy": [], "unbroken_healthy": [], "ddp_slowed": [], "unbroken_slowed": []}
    detected, worst = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        _run([sys.executable, SCRIPT, "--mode", "single", "--out", os.path.join(tmp, "single.pt")], 600, tmp)
        single = torch.load(os.path.join(tmp, "single.pt"))
        for trial in range(args.trials):
            rows["ddp_healthy"].append(_ddp(tmp, False))
            rows["unbroken_healthy"].append(_unbroken(tmp, f"h{trial}", False)[0])
            rows["ddp_slowed"].append(_ddp(tmp, True))
            seconds, run_dir = _unbroken(tmp, f"s{trial}", True)
            rows["unbroken_slowed"].append(seconds)
            detected.append(_flagged_after(run_dir))
            worst = max(worst, max_relative_difference(torch.load(os.path.join(tmp, f"s{trial}.pt")), single))
    median = {k: statistics.median(v) for k, v in rows.items()}
    capacity = 3 / 2.5

    def vs_ideal(healthy: str, slowed: str) -> list[float]:
        return [h * capacity / s for h, s in zip(rows[healthy], rows[slowed])]

    result = {
        "throughput_vs_ideal": statistics.median(vs_ideal("unbroken_healthy", "unbroken_slowed")),
        "ddp_vs_ideal": statistics.median(vs_ideal("ddp_healthy", "ddp_slowed")),
        "detected_after_steps": max((d for d in detected if d is not None), default=None) if all(d is not None for d in detected) else None,
        "same_model": worst <= 1e-8,
        "max_relative_difference": worst,
        "healthy_overhead": statistics.median(u / d for u, d in zip(rows["unbroken_healthy"], rows["ddp_healthy"])),
        "step_seconds": rows,
        "trials": args.trials,
    }
    save_results(os.path.join(HERE, "results", "stragglers.json"), result)
    if args.json:
        print(json.dumps(result))
        return 0
    print("| 3 members, rank 1 at half speed from step 20 | plain DDP (torchrun) | unbroken |")
    print("| --- | --- | --- |")
    print(f"| healthy step (median of {args.trials}) | {median['ddp_healthy'] * 1000:.1f} ms | {median['unbroken_healthy'] * 1000:.1f} ms |")
    print(f"| slowed step | {median['ddp_slowed'] * 1000:.1f} ms | {median['unbroken_slowed'] * 1000:.1f} ms |")
    print(f"| throughput vs ideal (sum of the speeds) | {result['ddp_vs_ideal']:.2f} | {result['throughput_vs_ideal']:.2f} |")
    print(f"| healthy step, unbroken / DDP (pairwise median) | | {result['healthy_overhead']:.3f}x |")
    print(f"| flagged, steps after the slowdown began (worst trial) | never | {result['detected_after_steps']} |")
    print(f"| final model vs one process (relative) | | {worst:.1e} ({'same' if result['same_model'] else 'DIFFERENT'}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
