"""Stalls after a hang (SIGSTOP), a whole-node kill and a network partition, each next to the
timeout that governs it.

    python benchmarks/bench_failures.py [--trials 5] [--heartbeat-timeout 2]

Each scenario is one run in which the fault is injected ``--trials`` times, each time after the
previous victim has rejoined. The stall is the time from the fault to the survivors' next
committed step, minus one healthy step. The partition scenario needs root (network namespaces)
and is skipped otherwise. Prints a markdown table and writes benchmarks/results/failures.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks.common import save_results, seconds  # noqa: E402

from testbed import netns  # noqa: E402
from testbed.harness import wait_for  # noqa: E402
from unbroken.observe.events import read_events  # noqa: E402

SCRIPT = os.path.join(HERE, "train_bench.py")
TRAIN = [SCRIPT, "--mode", "unbroken", "--steps", "1000000", "--width", "256"]


def events(dirs: list[str]) -> list[dict]:
    out = []
    for d in dirs:
        path = os.path.join(d, "events.jsonl")
        if os.path.exists(path):
            out += read_events(path)[0]
    return sorted(out, key=lambda e: e["t"])


def full_generation(dirs, size, since):
    def ready():
        ev = events(dirs)
        gens = [e for e in ev if e["kind"] == "generation" and e["t"] > since and len(e["members"]) == size]
        if not gens:
            return None
        steps = [e for e in ev if e["kind"] == "step" and e["t"] > gens[-1]["t"]]
        return gens[-1] if len(steps) >= 20 else None

    return wait_for(ready, 120, f"a generation of {size} with steps")


def stall_after(dirs, t_fault, victim: str) -> float:
    """Fault → the survivors' first commit in a generation without the victim, minus a healthy step."""
    ev = events(dirs)
    steps = [e for e in ev if e["kind"] == "step"]
    healthy = statistics.median(e["seconds"] for e in steps[-200:])

    def first_commit():
        ev = events(dirs)
        gens = [e for e in ev if e["kind"] == "generation" and e["t"] > t_fault and not any(m.startswith(victim) for m in e["members"])]
        if not gens:
            return None
        return [e for e in ev if e["kind"] == "step" and e["t"] > gens[0]["t"] and e["generation"] == gens[0]["generation"]]

    first = wait_for(first_commit, 60, "a commit without the victim")[0]
    return first["t"] - t_fault - healthy


def stop_all(procs):
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def kill_workers(dirs):
    for e in events(dirs):
        if e["kind"] == "worker_start":
            try:
                os.killpg(e["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def hang(trials: int, hb: float) -> list[float]:
    """SIGSTOP a non-leader worker; governed by the heartbeat timeout."""
    with tempfile.TemporaryDirectory() as run_dir:
        proc = subprocess.Popen(
            [sys.executable, "-m", "unbroken", "run", "--nproc-per-node", "3", "--run-dir", run_dir,
             "--heartbeat-interval", "0.25", "--heartbeat-timeout", str(hb), *TRAIN],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        stalls, since = [], 0.0
        try:
            for _ in range(trials):
                generation = full_generation([run_dir], 3, since)
                victim = generation["members"][-1]
                pid = [e for e in events([run_dir]) if e["kind"] == "worker_start" and e["member"] == victim][-1]["pid"]
                t = time.time()
                os.kill(pid, signal.SIGSTOP)
                stalls.append(stall_after([run_dir], t, victim))
                os.kill(pid, signal.SIGCONT)
                since = time.time()
        finally:
            stop_all([proc])
            kill_workers([run_dir])
    return stalls


def node_kill(trials: int, hb: float) -> list[float]:
    """Kill a whole node (launcher and worker) of three on one coordinator; governed by the heartbeat timeout."""
    with tempfile.TemporaryDirectory() as base:
        coord = subprocess.Popen(
            [sys.executable, "-m", "unbroken", "coordinator", "--host", "127.0.0.1", "--port", "0", "--expected-members", "3",
             "--heartbeat-timeout", str(hb), "--run-dir", os.path.join(base, "coord")],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        )
        address = coord.stdout.readline().split("listening on ")[1].split()[0]
        nodes: dict[str, subprocess.Popen] = {}
        dirs = [os.path.join(base, "coord")]

        def start(name):
            dirs.append(os.path.join(base, name))
            nodes[name] = subprocess.Popen(
                [sys.executable, "-m", "unbroken", "run", "--coordinator", address, "--node-name", name, "--nproc-per-node", "1",
                 "--heartbeat-interval", "0.25", "--heartbeat-timeout", str(hb), "--run-dir", dirs[-1], *TRAIN],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )

        for i in range(3):
            start(f"n{i}")
        stalls, since = [], 0.0
        try:
            for trial in range(trials):
                generation = full_generation(dirs, 3, since)
                victim = generation["members"][-1].split(".w")[0]
                worker = [e for e in events(dirs) if e["kind"] == "worker_start" and e["member"].startswith(victim + ".")][-1]["pid"]
                t = time.time()
                os.killpg(nodes[victim].pid, signal.SIGKILL)
                os.killpg(worker, signal.SIGKILL)
                stalls.append(stall_after(dirs, t, victim + "."))
                start(f"new{trial}")
                since = time.time()
        finally:
            stop_all(list(nodes.values()) + [coord])
            kill_workers(dirs)
    return stalls


def partition(trials: int, hb: float) -> list[float] | str:
    """Cut one host's link (network namespaces); governed by the heartbeat timeout (and the lease)."""
    reason = netns.why_not_available()
    if reason:
        return f"skipped: {reason}"
    with tempfile.TemporaryDirectory() as base, netns.hosts(3) as hosts:
        address = f"{hosts.addresses[0]}:29400"
        dirs = [os.path.join(base, n) for n in ("coord", "h0", "h1", "h2")]
        procs = [hosts.popen(0, [sys.executable, "-m", "unbroken", "coordinator", "--host", hosts.addresses[0], "--port", "29400",
                                 "--store-port", "29401", "--advertise-host", hosts.addresses[0], "--expected-members", "3",
                                 "--heartbeat-timeout", str(hb), "--run-dir", dirs[0]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        for i in range(3):
            procs.append(hosts.popen(i, [sys.executable, "-m", "unbroken", "run", "--coordinator", address, "--node-name", f"h{i}",
                                         "--nproc-per-node", "1", "--heartbeat-interval", "0.25", "--heartbeat-timeout", str(hb),
                                         "--run-dir", dirs[i + 1], *TRAIN], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        stalls, since = [], 0.0
        try:
            for _ in range(trials):
                generation = full_generation(dirs, 3, since)
                victim = generation["members"][-1]
                index = int(victim[1])
                t = time.time()
                hosts.cut(index)
                stalls.append(stall_after(dirs, t, victim))
                hosts.restore(index)
                since = time.time()
        finally:
            stop_all(procs)
            kill_workers(dirs)
    return stalls


def fmt(values) -> str:
    if isinstance(values, str):
        return values
    return seconds(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "failures.json"))
    args = parser.parse_args()
    hb = args.heartbeat_timeout
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "heartbeat_timeout": hb,
        "sigstop": hang(args.trials, hb),
        "node_kill": node_kill(args.trials, hb),
        "partition": partition(args.trials, hb),
    }
    print(f"\n3 CPU workers, Gloo, {result['date']}; stall = fault → survivors' next commit − one healthy step;"
          f" median (min – max) of {args.trials}\n")
    print("| failure | stall | governed by | target |")
    print("| --- | --- | --- | --- |")
    for key, label in (("sigstop", "hung worker (SIGSTOP)"), ("node_kill", "whole node killed (launcher + worker)"), ("partition", "host partitioned (link down)")):
        print(f"| {label} | {fmt(result[key])} | heartbeat timeout {hb:g} s | ≤ {hb + 1:g} s |")
    save_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
