"""Goodput under a storm of failures: kills, stops and whole-node kills at a fixed wall-clock rate.

    python benchmarks/bench_storm.py [--every 60 15] [--failures 10 100] [--step-delay 0.05] [--json]

Four members on two nodes of this machine (a standalone coordinator, two launchers of two workers
each, the default timeouts), the exact-arithmetic training script. First a failure-free run sets
the healthy rate. Then, for each ``--every`` (seconds between failures) and its ``--failures``
count, a run long enough for that many failures, with one failure every ``every`` seconds from
the warm-up on until the job ends, drawn in turn from a seeded shuffle of:

- ``kill``: SIGKILL one worker (its launcher restarts it; a peer heals it);
- ``stop``: SIGSTOP one worker for 5 s (the heartbeat timeout declares it dead; on SIGCONT it
  finds itself fenced, ends itself and is restarted);
- ``node``: SIGKILL one launcher with its workers, nobody reports the exits, and start a
  replacement node (a new launcher under a new node name), as a scheduler would.

Goodput is committed samples per second from the warm-up step to the last commit, over the
failure-free run's. At the end of every run: every sample exactly once (the shared invariant
checker over every node's logs and the coordinator's) and the final model equal to one process's
to 1e-8; "every copy lost" counts the generations formed behind the job (``state_lost``: every
member holding the newest steps lost before another had them, so those steps were trained again
from the best state left). The
launchers allow 1000 restarts per slot: a storm is the test, not a crash loop to quarantine.
Prints a markdown table; ``--json`` prints one JSON object. Writes benchmarks/results/storm.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.common import save_results  # noqa: E402
from testbed import harness  # noqa: E402

WARMUP = 20
STOP_SECONDS = 5.0
KINDS = ("kill", "stop", "node")


class Cluster:
    """A standalone coordinator and the nodes of one run, each node a launcher in its own
    session with its own run directory; every process is ended by :meth:`close`."""

    def __init__(self, directory: str, steps: int, step_delay: float) -> None:
        self.directory, self.steps, self.step_delay = directory, steps, step_delay
        self.out = os.path.join(directory, "final")
        self.nodes: dict[str, subprocess.Popen] = {}  # node name -> launcher
        self.dirs: list[str] = []
        self._files: list = []
        self._serial = 0
        log = open(os.path.join(directory, "coordinator.txt"), "w")
        self._files.append(log)
        self.coordinator = subprocess.Popen(
            [sys.executable, "-m", "unbroken", "coordinator", "--host", "127.0.0.1", "--port", "0", "--expected-members", "4",
             "--run-dir", os.path.join(directory, "coord")],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=directory,
        )
        self.address = harness.wait_for(self._address, 60, "the coordinator to listen")

    def _address(self) -> str | None:
        with open(os.path.join(self.directory, "coordinator.txt")) as f:
            for line in f:
                if "listening on " in line:
                    return line.split("listening on ")[1].split()[0]
        return None

    def start_node(self) -> str:
        """A new node (launcher and two workers) under a name never used before in this run."""
        name = f"n{self._serial}"
        self._serial += 1
        run_dir = os.path.join(self.directory, name)
        log = open(run_dir + ".txt", "w")
        self._files.append(log)
        self.nodes[name] = subprocess.Popen(
            [sys.executable, "-m", "unbroken", "run", "--run-dir", run_dir, "--coordinator", self.address, "--node-name", name,
             "--nproc-per-node", "2", "--record-samples", "--max-restarts", "1000",
             harness.EXACT, "--steps", str(self.steps), "--step-delay", str(self.step_delay), "--out", self.out],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.directory,
        )
        self.dirs.append(run_dir)
        return name

    def running(self) -> bool:
        return any(p.poll() is None for p in self.nodes.values())

    def workers(self) -> list[int]:
        """The live worker processes of the live nodes."""
        return [pid for name, p in self.nodes.items() if p.poll() is None
                for pid in harness.alive_workers(os.path.join(self.directory, name))]

    def commits(self) -> dict[int, float]:
        """Each committed step and when (the first ``step`` event for it in any node's log)."""
        first: dict[int, float] = {}
        for run_dir in self.dirs:
            for event in harness.Run(0, "", "", run_dir).events("step"):
                first[event["step"]] = min(first.get(event["step"], math.inf), event["t"])
        return first

    def kill_node(self, rng: random.Random) -> str:
        name = rng.choice([n for n, p in self.nodes.items() if p.poll() is None])
        launcher = self.nodes.pop(name)
        os.killpg(launcher.pid, signal.SIGKILL)
        harness.kill_leftovers(os.path.join(self.directory, name))
        launcher.wait()
        return name

    def close(self) -> list[int]:
        leftovers = harness.stop([*self.nodes.values(), self.coordinator], self.dirs)
        for f in self._files:
            f.close()
        return leftovers


def run_storm(directory: str, steps: int, step_delay: float, every: float | None, target: int, seed: int) -> dict:
    """One run of ``steps``; with ``every``, a failure every ``every`` s from the warm-up on."""
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    cluster = Cluster(directory, steps, step_delay)
    faults: list[dict] = []
    stopped: list[tuple[float, int]] = []
    try:
        cluster.start_node()
        cluster.start_node()
        harness.wait_for(lambda: len(cluster.commits()) >= WARMUP or not cluster.running(), 300, "the warm-up steps")
        kinds: list[str] = []
        next_fault = time.monotonic() + (every or math.inf)
        while cluster.running():
            now = time.monotonic()
            for when, pid in [s for s in stopped if s[0] <= now]:
                stopped.remove((when, pid))
                _signal(pid, signal.SIGCONT)
            if now >= next_fault:
                if not kinds:
                    kinds = list(KINDS)
                    rng.shuffle(kinds)
                faults.append(_inject(kinds.pop(), cluster, rng, stopped))
                next_fault += every
            time.sleep(0.05)
    finally:
        for _, pid in stopped:
            _signal(pid, signal.SIGCONT)
        leftovers = cluster.close()
    commits = cluster.commits()
    top = max(commits, default=-1)
    window = commits[top] - commits[WARMUP] if top > WARMUP else math.nan
    return {"every": every, "faults": faults, "failures": len([f for f in faults if f.get("victim")]),
            "target": target, "steps": steps, "committed": len(commits), "seconds": window,
            "samples_per_s": (top - WARMUP) * harness.GLOBAL / window if window > 0 else math.nan,
            "dirs": cluster.dirs, "coordinator_dir": os.path.join(directory, "coord"), "out": cluster.out,
            "leftovers": leftovers}


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _inject(kind: str, cluster: Cluster, rng: random.Random, stopped: list[tuple[float, int]]) -> dict:
    at = time.time()
    if kind == "node":
        name = cluster.kill_node(rng)
        cluster.start_node()
        return {"kind": kind, "t": at, "victim": name}
    pids = cluster.workers()
    if not pids:
        return {"kind": kind, "t": at, "victim": None}
    pid = rng.choice(pids)
    if kind == "kill":
        _signal(pid, signal.SIGKILL)
    else:
        _signal(pid, signal.SIGSTOP)
        stopped.append((time.monotonic() + STOP_SECONDS, pid))
    return {"kind": kind, "t": at, "victim": pid}


def check(result: dict, single: dict) -> dict:
    """The shared invariant checker and the single process's model, over every node of the run."""
    finished = sorted({m for d in result["dirs"] for m in harness.finished_members(d)})
    # the coordinator's events too: a generation it formed behind the job (state_lost) may commit steps again
    exact = harness.check_exactly_once([*result["dirs"], result["coordinator_dir"]], result["steps"], harness.GLOBAL)
    worst = harness.check_same_model(result["out"], single, finished)
    lost = harness.Run(0, "", "", result["coordinator_dir"]).events("state_lost")
    return {"exactly_once": True, "redone_attempts": exact["redone_attempts"], "generations": len(exact["generations"]),
            "state_lost": len(lost),
            "max_relative_difference": worst, "same_model": worst < 1e-8}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, nargs="+", default=[60.0, 15.0], help="seconds between failures, per case")
    parser.add_argument("--failures", type=int, nargs="+", default=[10, 100], help="failures wanted, per case")
    parser.add_argument("--healthy-steps", type=int, default=400, help="steps of the failure-free run")
    parser.add_argument("--step-delay", type=float, default=0.05, help="sleep per step in the script, standing in for compute")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "storm.json"), help="where the figures go (JSON)")
    parser.add_argument("--work", default=None, help="keep every run's logs under this folder (default: a temporary one)")
    args = parser.parse_args(argv)
    if len(args.every) != len(args.failures) or min(args.every) <= 0 or min(args.failures) < 1:
        parser.error("--every and --failures need one positive value per case each")
    with (contextlib.nullcontext(os.path.abspath(args.work)) if args.work else tempfile.TemporaryDirectory(prefix="storm-")) as work:
        healthy = run_storm(os.path.join(work, "healthy"), args.healthy_steps, args.step_delay, None, 0, args.seed)
        rate = healthy["samples_per_s"]
        if not rate > 0:
            raise SystemExit(f"the failure-free run committed {healthy['committed']} steps of {args.healthy_steps}; see its logs")
        cases = []
        for n, (every, failures) in enumerate(zip(args.every, args.failures)):
            # long enough for the failures at the healthy rate, plus a fifth for what they cost
            steps = WARMUP + math.ceil(rate / harness.GLOBAL * every * (failures + 0.5) * 1.2)
            case = run_storm(os.path.join(work, f"every{every:g}"), steps, args.step_delay, every, failures, args.seed + n)
            single = harness.single_process(os.path.join(work, f"single{n}"), "--steps", str(steps), timeout=1800)
            case.update(check(case, single), goodput=case["samples_per_s"] / rate)
            cases.append(case)
            print(f"done: a failure every {every:g} s, {case['failures']} failures", file=sys.stderr, flush=True)
    report = {"healthy_samples_per_s": rate, "healthy_steps": args.healthy_steps, "step_delay": args.step_delay,
              "cases": [{k: v for k, v in c.items() if k not in ("dirs", "coordinator_dir", "out")} for c in cases]}
    save_results(args.out, report)
    if args.json:
        print(json.dumps(report))
        return 0
    print("| a failure every | failures (kill / stop / node) | steps | goodput vs failure-free | exactly once | every copy lost | model vs one process |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in cases:
        kinds = [sum(1 for f in c["faults"] if f["kind"] == k and f["victim"]) for k in KINDS]
        print(f"| {c['every']:g} s | {c['failures']} ({' / '.join(map(str, kinds))}) | {c['steps']} | {100 * c['goodput']:.1f} % |"
              f" {'yes' if c['exactly_once'] else 'NO'} | {c['state_lost']} | {c['max_relative_difference']:.1e} |")
    print(f"\nfailure-free: {rate:.1f} samples/s over {args.healthy_steps} steps, step delay {args.step_delay} s;"
          f" 4 members on 2 nodes of this machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
