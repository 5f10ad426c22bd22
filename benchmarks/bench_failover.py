"""The stall when the coordinator's host is lost, next to the stall when another node is lost
(issue 12).

    python benchmarks/bench_failover.py [--trials 5]

Each trial: a local 3-member etcd, three coordinator candidates (``unbroken coordinator --etcd``)
and one node of three workers on this machine, heartbeat timeout 2 s, leader lease 2 s. First a
worker falls silent, then the leading candidate is SIGKILLed. Measured from each fault to the first step committed without the victim (for the
coordinator: in a generation the new leader formed); also how long until a new leader serves.
The worker "lost" is a SIGSTOP, not a SIGKILL: a killed worker is reported by its launcher at
once, while a lost host (power, kernel panic) reports nothing, which SIGSTOP reproduces.
Needs the etcd binary. Prints a markdown table and writes benchmarks/results/failover.json.
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
from testbed import etcd, harness  # noqa: E402

HEARTBEAT_TIMEOUT = 2.0


def _end(procs: list[subprocess.Popen], node_dir: str) -> None:
    """End what a trial started, whatever happened."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    harness.kill_leftovers(node_dir)


def _start(argv: list[str], cwd: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "unbroken", *argv], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True, cwd=cwd)


def trial(directory: str) -> dict[str, float]:
    procs: list[subprocess.Popen] = []
    node_dir = os.path.join(directory, "node")
    with etcd.cluster(directory) as made:
        try:
            candidates = []
            for i in range(3):
                proc = _start(["coordinator", "--host", "127.0.0.1", "--port", "0", "--etcd", ",".join(made.endpoints),
                               "--job-id", "bench", "--leader-lease", "2", "--expected-members", "3",
                               "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--run-dir", os.path.join(directory, f"c{i}")], directory)
                procs.append(proc)
                candidates.append((proc, proc.stdout.readline().split("listening on ")[1].split()[0]))
            runs = [harness.Run(0, "", "", os.path.join(directory, f"c{i}")) for i in range(3)]
            node = _start(["run", "--run-dir", node_dir, "--coordinator", ",".join(a for _, a in candidates), "--nproc-per-node", "3",
                           "--heartbeat-interval", "0.25", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
                           harness.EXACT, "--steps", "100000", "--step-delay", "0.05"], directory)
            procs.append(node)
            node_run = harness.Run(0, "", "", node_dir)
            harness.wait_for(lambda: len(node_run.events("step")) > 20, 120, "training")

            # a worker that falls silent: only the heartbeat timeout tells
            victim = [e for e in node_run.events("worker_start") if e["local_rank"] == 2][0]
            os.kill(victim["pid"], signal.SIGSTOP)
            stopped = time.time()
            without = harness.wait_for(lambda: [e for e in node_run.events("step") if e["t"] > stopped and e["members"] == 2], 60, "steps without it")[0]
            node_stall = without["t"] - stopped
            os.kill(victim["pid"], signal.SIGCONT)
            harness.wait_for(lambda: [e for e in node_run.events("step") if e["t"] > without["t"] and e["members"] == 3], 60, "it back")

            leading = [i for i, r in enumerate(runs) if r.events("leader")][-1]
            os.killpg(candidates[leading][0].pid, signal.SIGKILL)
            killed = time.time()
            new = harness.wait_for(lambda: [e for i, r in enumerate(runs) if i != leading for e in r.events("leader") if e["t"] > killed], 30, "a new leader")[0]
            formed = lambda: {e["generation"] for i, r in enumerate(runs) if i != leading for e in r.events("generation")}  # noqa: E731
            under = harness.wait_for(lambda: [e for e in node_run.events("step") if e["t"] > killed and e["generation"] in formed()], 60, "a commit under it")[0]
            return {"node_lost": node_stall, "coordinator_lost": under["t"] - killed, "new_leader": new["t"] - killed}
        finally:
            _end(procs, node_dir)


def restart_trial(directory: str) -> dict[str, float]:
    """A standalone coordinator (no etcd) SIGKILLed and started again on its port: how long until
    it serves, and until its members commit again in a generation it formed."""
    import pathlib


    base = pathlib.Path(directory)
    coord, address = harness.coordinator(base, "--expected-members", "3", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT))
    port = address.rsplit(":", 1)[1]
    node_dir = str(base / "node")
    node = _start(["run", "--run-dir", node_dir, "--coordinator", address, "--nproc-per-node", "3",
                   "--heartbeat-interval", "0.25", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
                   harness.EXACT, "--steps", "100000", "--step-delay", "0.05"], directory)
    procs = [coord, node]
    node_run = harness.Run(0, "", "", node_dir)
    try:
        harness.wait_for(lambda: len(node_run.events("step")) > 20, 120, "training")
        os.killpg(coord.pid, signal.SIGKILL)
        coord.wait()
        killed = time.time()
        again = _start(["coordinator", "--host", "127.0.0.1", "--port", port, "--run-dir", str(base / "coord2"),
                        "--expected-members", "3", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT)], directory)
        procs.append(again)
        assert "listening on" in again.stdout.readline()
        serving = time.time() - killed
        second = harness.Run(0, "", "", str(base / "coord2"))
        formed = lambda: {e["generation"] for e in second.events("generation")}  # noqa: E731
        under = harness.wait_for(lambda: [e for e in node_run.events("step") if e["t"] > killed and e["generation"] in formed()], 60, "a commit under it")[0]
        return {"serving": serving, "training": under["t"] - killed}
    finally:
        _end(procs, node_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "failover.json"))
    args = parser.parse_args()
    reason = etcd.why_not_available()
    if reason:
        print(f"skipped: {reason}")
        return 1
    results = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as directory:
            results.append(trial(directory))
        print(f"trial {i + 1}: {results[-1]}", flush=True)

    restarts = []
    for i in range(args.trials):
        with tempfile.TemporaryDirectory() as directory:
            restarts.append(restart_trial(directory))
        print(f"restart {i + 1}: {restarts[-1]}", flush=True)

    def fmt(key: str, rows=results) -> str:
        return seconds([r[key] for r in rows])

    print(f"\n3 workers, heartbeat timeout {HEARTBEAT_TIMEOUT:g} s, leader lease 2 s, etcd election timeout 500 ms; median (min – max) of {args.trials}\n")
    print("| fault | until the first commit without it |")
    print("| --- | --- |")
    print(f"| a worker falls silent (SIGSTOP: only the heartbeat timeout tells) | {fmt('node_lost')} |")
    print(f"| the leading coordinator candidate is SIGKILLed | {fmt('coordinator_lost')} |")
    print(f"| … of which until a new leader serves | {fmt('new_leader')} |")
    print(f"| a standalone coordinator (no etcd) SIGKILLed and started again at once on its port | {fmt('training', restarts)} |")
    print(f"| … of which until it serves | {fmt('serving', restarts)} |")
    save_results(args.out, {"trials": results, "restarts": restarts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
