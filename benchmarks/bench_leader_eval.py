"""What a leader-only evaluation costs the other workers (issue 27): ``job.on_leader``.

    python benchmarks/bench_leader_eval.py [--eval-seconds 5] [--runs 2]

Three workers, timeouts scaled down (heartbeat 1 s, progress 1.5 s, collective 2 s) so that the
leader's evaluation is longer than every timeout that watches the workers, as a long evaluation is
against the defaults. Every 4 steps the leader evaluates for ``--eval-seconds`` through
``job.on_leader``. Measured per evaluation, on the workers that waited: how long ``on_leader``
took them (the target: the evaluation itself), and over the run the workers fenced or restarted
(the target: none). Each run ends with the invariant checker (every sample exactly once). Prints
a markdown table and writes benchmarks/results/leader_eval.json. Leaves no process behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks.common import save_results, seconds  # noqa: E402

from testbed import harness  # noqa: E402
from testbed.harness import GLOBAL  # noqa: E402

FAST = ["--heartbeat-interval", "0.25", "--heartbeat-timeout", "1", "--progress-timeout", "1.5", "--collective-timeout", "2"]
STEPS, EVERY = 12, 4


def run(eval_seconds: float, directory: str) -> dict:
    run_dir, log = os.path.join(directory, "run"), os.path.join(directory, "evals.jsonl")
    done = harness.unbroken(run_dir, "--nproc-per-node", "3", "--record-samples", *FAST, harness.EXACT, "--steps", str(STEPS),
                            "--eval-every", str(EVERY), "--eval-seconds", str(eval_seconds), "--eval-log", log, timeout=600)
    if done.code != 0:
        raise SystemExit(f"the run failed (exit {done.code}):\n{done.stderr[-2000:]}")
    harness.check_exactly_once(run_dir, STEPS, GLOBAL)
    records = [json.loads(line) for line in open(log)]
    return {
        "waits": [r["waited"] for r in records if not r["ran"]],
        "fenced": len([e for e in done.events("verdict") if "explains" not in e]),
        "restarts": sum(w["restarts"] for w in done.summary()["workers"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    waits, fenced, restarts = [], 0, 0
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="unbroken-leader-eval-") as directory:
            result = run(args.eval_seconds, directory)
        waits += result["waits"]
        fenced += result["fenced"]
        restarts += result["restarts"]
    overhead = [w - args.eval_seconds for w in waits]
    print(f"| evaluation on the leader | the others' wait in on_leader | wait - evaluation | fenced | restarts |\n"
          f"| --- | --- | --- | --- | --- |\n"
          f"| {args.eval_seconds:.1f} s | {seconds(waits)} | {seconds(overhead, 3)} | {fenced} | {restarts} |")
    print(f"({len(waits)} waits over {args.runs} runs of {STEPS} steps, an evaluation every {EVERY}; the invariant checker passed)")
    save_results(os.path.join(HERE, "results", "leader_eval.json"),
                 {"eval_seconds": args.eval_seconds, "waits": waits, "fenced": fenced, "restarts": restarts})


if __name__ == "__main__":
    main()
