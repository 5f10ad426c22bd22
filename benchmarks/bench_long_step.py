"""The survivors' stall after a kill in the middle of a long step (issue 10: jobs of real shape).

    python benchmarks/bench_long_step.py [--trials 3] [--micro 1.25]

Three workers; each step is 8 micro-batches of ``--micro`` seconds per worker (10 s at the
default), standing in for a large model's forward and backward. In each trial one worker is
SIGKILLed halfway through a step. Measured, from the kill:

- *left*: until the coordinator formed the survivors' generation (they abandoned the broken
  step and came to join);
- *rest of the step*: what a survivor that finishes its step before noticing would have waited;
- the target: one micro-batch plus a heartbeat interval.

Prints a markdown table and writes benchmarks/results/long_step.json. Leaves no process behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks.common import save_results, seconds  # noqa: E402

from testbed import harness  # noqa: E402

HEARTBEAT_INTERVAL = 0.5


def trial(micro: float, directory: str) -> dict[str, float]:
    run_dir = os.path.join(directory, "run")
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken", "run", "--run-dir", run_dir, "--nproc-per-node", "3",
         "--heartbeat-interval", str(HEARTBEAT_INTERVAL), "--max-restarts", "0",
         harness.EXACT, "--steps", "4", "--micro-batch-size", "1", "--micro-delay", str(micro)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    run = harness.Run(0, "", "", run_dir)
    try:
        first = harness.wait_for(lambda: run.events("step"), 300, "the first committed step")[0]
        step_seconds = 8 * micro
        time.sleep(max(0.0, first["t"] + step_seconds / 2 - time.time()))  # halfway through the next step
        victim = [e for e in run.events("worker_start") if e["local_rank"] == 2][0]
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        formed = harness.wait_for(
            lambda: [e for e in run.events("generation") if e["t"] > killed_at and victim["member"] not in e["members"]],
            300, "the survivors' generation",
        )[0]
        left = formed["t"] - killed_at
        next_step_end = first["t"] + step_seconds
        return {"left": left, "rest_of_step": next_step_end - killed_at, "target": micro + HEARTBEAT_INTERVAL}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        harness.kill_leftovers(run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--micro", type=float, default=1.25, help="seconds per micro-batch (8 per step)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "long_step.json"))
    args = parser.parse_args()
    results = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as directory:
            results.append(trial(args.micro, directory))
        print(f"trial {i + 1}: survivors left {results[-1]['left']:.2f} s after the kill", flush=True)

    def row(key: str) -> str:
        return seconds([r[key] for r in results])

    print(f"\nstep {8 * args.micro:.0f} s (8 micro-batches of {args.micro} s), 3 workers, one SIGKILLed mid-step; median (min – max) of {args.trials}\n")
    print("| measure | seconds |")
    print("| --- | --- |")
    print(f"| kill → survivors' generation formed | {row('left')} |")
    print(f"| rest of the step at the kill (what finishing it first would cost) | {row('rest_of_step')} |")
    print(f"| target: one micro-batch + one heartbeat interval | {args.micro + HEARTBEAT_INTERVAL:.2f} s |")
    save_results(args.out, {"micro": args.micro, "trials": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
