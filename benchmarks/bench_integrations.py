"""A healthy step of an Accelerate script under unbroken next to the same script under torchrun
with Accelerate's own ``Accelerator`` (issue 28).

    python benchmarks/bench_integrations.py [--pairs 5] [--steps 40] [--width 1024]

Two CPU workers run ``benchmarks/accelerate_step.py`` (an MLP, two micro-batches of 16 per
worker and step, clipping, AdamW): once with ``torchrun`` and Accelerate's ``Accelerator``, once
with ``unbroken run`` and ``unbroken.integrations.accelerate.Accelerator`` given the same global
batch. The runs alternate, in pairs; each reports the mean step after the first five. Prints a
markdown table with the medians and the ratio, and writes benchmarks/results/integrations.json.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks.common import save_results, seconds  # noqa: E402

SCRIPT = os.path.join(HERE, "accelerate_step.py")


def _step_seconds(argv: list[str]) -> float:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, start_new_session=True, cwd=ROOT)
    found = re.search(r"STEP_SECONDS (\S+)", done.stdout)
    if done.returncode != 0 or not found:
        raise SystemExit(f"{' '.join(argv)} failed (exit {done.returncode}):\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    common = ["--steps", str(args.steps), "--width", str(args.width)]
    torchrun, ours = [], []
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-integrations-") as directory:
        for i in range(args.pairs):
            torchrun.append(_step_seconds([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", SCRIPT,
                                           "--real", *common]))
            ours.append(_step_seconds([sys.executable, "-m", "unbroken", "run", "--run-dir", os.path.join(directory, f"r{i}"),
                                       "--nproc-per-node", "2", SCRIPT, *common]))
    ratios = [b / a for a, b in zip(torchrun, ours)]
    print("| Accelerate script, 2 CPU workers | healthy step |\n| --- | --- |")
    print(f"| torchrun + Accelerate's Accelerator | {seconds(torchrun, 4)} |")
    print(f"| unbroken run + unbroken's Accelerator | {seconds(ours, 4)} |")
    print(f"| ratio (pairwise) | {statistics.median(ratios):.3f}x ({min(ratios):.3f} – {max(ratios):.3f}) |")
    save_results(os.path.join(HERE, "results", "integrations.json"), {"torchrun": torchrun, "unbroken": ours, "ratios": ratios})


if __name__ == "__main__":
    main()
