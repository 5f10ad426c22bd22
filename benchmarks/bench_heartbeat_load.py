"""How late a healthy member's heartbeats arrive when its host is loaded: the evidence for the
default heartbeat timeout (issue 17).

    python benchmarks/bench_heartbeat_load.py [--members 2] [--seconds 10] [--gc-objects 20000000]

A coordinator runs in this process; ``--members`` worker processes join it and heartbeat every
0.5 s (the default interval) from their heartbeat thread, exactly as training workers do, while
their main thread is under one load at a time:

- ``idle``: nothing;
- ``cpu``: the worker multiplies matrices and two busy-looping processes per core compete with it;
- ``gc``: the worker holds tens of millions of Python objects and runs full garbage collections
  (the GIL is held throughout each one);
- ``checkpoint``: the worker serialises and deserialises a 1 GiB state the way the checkpoint
  writer and reader do (``unbroken.storage.checkpoint.MemoryFile``);
- ``bytesio``: the same through ``io.BytesIO``, as they did before.

The coordinator's view is sampled every 50 ms: the age of each member's newest heartbeat. The
largest age seen under each load is how close a healthy member came to being declared dead.
Prints a markdown table and writes benchmarks/results/heartbeat_load.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.common import save_results  # noqa: E402

LOADS = ("idle", "cpu", "gc", "checkpoint", "bytesio")

WORKER = r'''
import gc, io, os, sys, time
import torch
torch.set_num_threads(1)
from unbroken.coordinator.client import CoordinatorClient, Heartbeat
member, load, seconds, objects = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
client = CoordinatorClient(os.environ["ADDRESS"], timeout=30)
while client.post("/v1/join", member=member, step=0)["status"] != "formed":
    pass
Heartbeat(client, member, 0.5, lambda view: None).start()
print("ready", flush=True)
sys.stdin.readline()  # go
end = time.monotonic() + seconds
if load == "cpu":
    a = torch.randn(512, 512)
    while time.monotonic() < end:
        a = torch.tanh(a @ a)
elif load == "gc":
    junk = [(i, str(i)) for i in range(objects)]
    while time.monotonic() < end:
        gc.collect()
elif load in ("checkpoint", "bytesio"):
    from unbroken.storage.checkpoint import MemoryFile
    state = {"w": torch.randn(256 * 1024 * 1024)}  # 1 GiB of float32
    while time.monotonic() < end:
        if load == "bytesio":
            buffer = io.BytesIO()
            torch.save(state, buffer)
            buffer.seek(0)
        else:
            buffer = MemoryFile(capacity=(1 << 30) + (1 << 20))
            torch.save(state, buffer)
            buffer = MemoryFile(buffer.getbuffer())
        torch.load(buffer, weights_only=True)
else:
    time.sleep(seconds)
print("done", flush=True)
'''


def _hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)


def measure(load: str, members: int, seconds: float, objects: int) -> dict:
    from unbroken.coordinator.client import CoordinatorClient
    from unbroken.coordinator.server import Coordinator, CoordinatorSettings
    from unbroken.coordinator.membership import MembershipSettings

    coordinator = Coordinator(CoordinatorSettings(), MembershipSettings(heartbeat_timeout=60, expected_members=members)).start_in_thread()
    address = f"127.0.0.1:{coordinator.port}"
    env = dict(os.environ, ADDRESS=address, PYTHONPATH=os.path.dirname(HERE))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, f"m{i}", load, str(seconds), str(objects)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, start_new_session=True) for i in range(members)]
    hogs: list[subprocess.Popen] = []
    ages: list[float] = []
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready"
        if load == "cpu":
            hogs = [_hog() for _ in range(2 * (os.cpu_count() or 1))]
        client = CoordinatorClient(address)
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ages += [m["heartbeat_age"] for m in client.status()["members"]]
            time.sleep(0.05)
    finally:
        for proc in procs + hogs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        coordinator.stop()
    ages.sort()
    return {"max": ages[-1], "p99": ages[int(0.99 * (len(ages) - 1))], "samples": len(ages)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--gc-objects", type=int, default=20_000_000)
    args = parser.parse_args()
    results = {}
    for load in LOADS:
        results[load] = measure(load, args.members, args.seconds, args.gc_objects)
        print(f"{load}: {results[load]}", flush=True)
    print(f"\n{args.members} members, heartbeat every 0.5 s, {args.seconds:.0f} s per load, {os.cpu_count()} cores\n")
    print("| load on the member's host | newest heartbeat's age, p99 | largest age seen |")
    print("| --- | --- | --- |")
    for load in LOADS:
        print(f"| {load} | {results[load]['p99']:.2f} s | {results[load]['max']:.2f} s |")
    save_results(os.path.join(HERE, "results", "heartbeat_load.json"), {"members": args.members, "seconds": args.seconds, "loads": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
