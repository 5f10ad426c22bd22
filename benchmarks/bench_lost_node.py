"""The stall when a whole node is lost: its launcher and workers die together, so nobody reports
the exits (issue 17).

    python benchmarks/bench_lost_node.py [--trials 5] [--heartbeat-timeout 3]

Each trial: a standalone coordinator and two nodes on this machine (a: 2 workers, b: 1 worker),
the default heartbeat timeout; b's launcher and workers are SIGKILLed together. Measured from
the kill to the verdict, and to the survivors' first commit in a generation formed after it
(that includes redoing the interrupted step, about 20 ms here). Prints a markdown table and
writes benchmarks/results/lost_node.json.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.common import save_results, seconds  # noqa: E402
from testbed import harness  # noqa: E402


def trial(directory: pathlib.Path, heartbeat_timeout: float) -> dict[str, float]:
    coord, address = harness.coordinator(directory, "--expected-members", "3", "--heartbeat-timeout", str(heartbeat_timeout))
    coord_run = harness.Run(0, "", "", str(directory / "coord"))
    procs = {}
    for name, count in (("a", "2"), ("b", "1")):
        procs[name] = harness.start_in(["run", "--run-dir", str(directory / name), "--coordinator", address, "--node-name", name,
                             "--nproc-per-node", count, "--heartbeat-timeout", str(heartbeat_timeout), "--record-samples",
                             harness.EXACT, "--steps", "100000", "--step-delay", "0.02"], str(directory))
    try:
        def commits():
            try:
                return harness.commits(str(directory / "a"), "a.w0.r0")
            except FileNotFoundError:
                return []

        harness.wait_for(lambda: len(commits()) >= 50, 120, "training")
        os.killpg(procs["b"].pid, signal.SIGKILL)
        for event in harness.Run(0, "", "", str(directory / "b")).events("worker_start"):
            os.killpg(event["pid"], signal.SIGKILL)
        lost = time.time()
        verdict = harness.wait_for(lambda: [e for e in coord_run.events("verdict") if e["member"].startswith("b.")], 30, "a verdict")[0]
        new = lambda: {g["generation"] for g in coord_run.events("generation") if g["t"] > lost}  # noqa: E731
        resumed = harness.wait_for(lambda: [c for c in commits() if c["g"] in new()], 60, "a commit without b")[0]
        harness.check_commits([str(directory / "a"), str(directory / "b")])  # the shared invariant checker, as the tests end
        return {"verdict": verdict["t"] - lost, "resumed": resumed["t"] - lost, "detected_by": verdict["detected_by"]}
    finally:
        for proc in (*procs.values(), coord):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for name in procs:
            harness.kill_leftovers(str(directory / name))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "lost_node.json"))
    args = parser.parse_args()
    results = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(trial(pathlib.Path(tmp), args.heartbeat_timeout))
        print(f"trial {i + 1}: {results[-1]}", flush=True)
    print(f"\n3 workers on 2 nodes, heartbeat timeout {args.heartbeat_timeout:g} s; median (min – max) of {args.trials}\n")
    print("| node b's launcher and workers SIGKILLed together | |")
    print("| --- | --- |")
    print(f"| declared dead after (by: {', '.join(sorted({r['detected_by'] for r in results}))}) | {seconds([r['verdict'] for r in results], 3)} |")
    print(f"| survivors commit again after | {seconds([r['resumed'] for r in results], 3)} |")
    save_results(args.out, {"heartbeat_timeout": args.heartbeat_timeout, "trials": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
