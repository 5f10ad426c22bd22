"""A healthy step of an Accelerate script, a Lightning Trainer and a Hugging Face Trainer under
unbroken, each next to the same script under torchrun with the framework's own distribution
(issues 28 and 45).

    python benchmarks/bench_integrations.py [--pairs 5] [--steps 40] [--width 1024] [--frameworks accelerate,lightning,transformers]
                                            [--torchrun-malloc default|tuned]

Two CPU workers run the same MLP (two micro-batches of 16 per worker and step, clipping, AdamW):
``benchmarks/accelerate_step.py`` with Accelerate's ``Accelerator`` under ``torchrun`` and with
``unbroken.integrations.accelerate.Accelerator`` under ``unbroken run``; ``benchmarks/lightning_step.py``
with ``strategy="ddp"`` under ``torchrun`` and with ``UnbrokenStrategy`` under ``unbroken run``;
``benchmarks/transformers_step.py`` with ``transformers.Trainer`` under ``torchrun`` and with
``unbroken.integrations.transformers.Trainer`` under ``unbroken run``; unbroken's given the same
global batch. The runs alternate, in pairs; each reports the mean step
after the first five. Prints a markdown table with the medians and the pairwise ratios, and
writes benchmarks/results/integrations.json. unbroken's workers fix glibc's malloc thresholds
(``tune_malloc``); ``--torchrun-malloc tuned`` gives torchrun's workers the same ones through
glibc's variables, to tell that part of a difference from the rest (results in
integrations_tuned_torchrun.json).
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

from benchmarks.common import save_results, seconds, torchrun_malloc_env  # noqa: E402


def _step_seconds(argv: list[str], env: dict[str, str] | None = None) -> float:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, start_new_session=True, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    found = re.search(r"STEP_SECONDS (\S+)", done.stdout)
    if done.returncode != 0 or not found:
        raise SystemExit(f"{' '.join(argv)} failed (exit {done.returncode}):\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    return float(found.group(1))


SCRIPTS = {"accelerate": ("accelerate_step.py", "Accelerate's Accelerator", "unbroken's Accelerator"),
           "lightning": ("lightning_step.py", "Lightning's DDP strategy", "UnbrokenStrategy"),
           "transformers": ("transformers_step.py", "transformers.Trainer", "unbroken's Trainer")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--frameworks", default="accelerate,lightning,transformers")
    parser.add_argument("--torchrun-malloc", choices=["default", "tuned"], default="default",
                        help="tuned: run torchrun's workers with glibc's thresholds fixed as unbroken's workers fix them"
                             " (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_; docs/guide/settings.md, tune_malloc)")
    args = parser.parse_args()
    malloc = torchrun_malloc_env(args.torchrun_malloc)
    common = ["--steps", str(args.steps), "--width", str(args.width)]
    results: dict[str, dict[str, list[float]]] = {}
    print("| 2 CPU workers | torchrun | unbroken run | ratio (pairwise) |\n| --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-integrations-") as directory:
        for framework in [f for f in args.frameworks.split(",") if f]:
            script, theirs, ours_name = SCRIPTS[framework]
            path = os.path.join(HERE, script)
            torchrun, ours = [], []
            for i in range(args.pairs):
                torchrun.append(_step_seconds([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", path,
                                               "--real", *common], malloc))
                ours.append(_step_seconds([sys.executable, "-m", "unbroken", "run", "--run-dir",
                                           os.path.join(directory, f"{framework}{i}"), "--nproc-per-node", "2", path, *common]))
            ratios = [b / a for a, b in zip(torchrun, ours)]
            results[framework] = {"torchrun": torchrun, "unbroken": ours, "ratios": ratios}
            print(f"| {framework}: {theirs} / {ours_name} | {seconds(torchrun, 4)} | {seconds(ours, 4)} |"
                  f" {statistics.median(ratios):.3f}x ({min(ratios):.3f} – {max(ratios):.3f}) |", flush=True)
    name = "integrations.json" if args.torchrun_malloc == "default" else "integrations_tuned_torchrun.json"
    save_results(os.path.join(HERE, "results", name), results)


if __name__ == "__main__":
    main()
