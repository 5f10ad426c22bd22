"""The rendezvous of one generation's Gloo group at N members, through one TCPStore (issue 14).

    python benchmarks/bench_rendezvous.py [--members 100 250 1000] [--full-mesh-max 250] [--json]

A real TCPStore server (libuv, as the coordinator hosts it) runs in a subprocess. This process
simulates the ``N`` members of a new generation, no Gloo: one thread per member, spread over
``--processes`` simulator processes, each member with a store connection of its own (a worker
keeps its store connection across generations, so connecting is not timed), all released at
once. Each member performs exactly the store
operations that building a ``ProcessGroupGloo`` makes in torch 2.13, counted on real groups of
2-16 processes with a counting store (tests/unit/worker/test_rendezvous.py asserts them):

- ``full mesh`` (torch's default, unbroken before): each member writes its record (host name,
  device address, and one 8-byte pair identifier per member: 154 + 8N bytes here), then for
  every member, itself included, waits for that member's record and reads it: 1 + 2N
  operations per member, N(2N + 1) per generation, O(N^3) bytes.
- ``full mesh, v2 api`` (``GLOO_ENABLE_STORE_V2_API=1`` and
  ``GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=1``, environment only): the records lose the pair
  identifiers and are read with ``multi_get``, 128 keys per call: 1 + ceil(N/128) operations
  per member, but still every record to every member (O(N^2) bytes) and N - 1 sockets each.
- ``lazy + ring`` (unbroken now, :data:`unbroken.worker.group.LAZY_CONNECT`): the Gloo device connects
  pairs on first use; each member writes its record (154 bytes) and connects its two ring
  neighbours (the pairs of Gloo's ring allreduce) before the group is handed over, reading
  their records: 5 operations per member, 5N per generation. A member that heals another
  connects one pair more (2 operations), not counted here.

Seconds are from the release of all members until the last one holds every record it needs:
the store's share of a rendezvous, not the TCP connects between members that follow. A full
mesh beyond ``--full-mesh-max`` members is not run (about N^2 round trips and N^3 bytes): its
row is extrapolated from the largest size run, operations by the formula and seconds at the
operation rate measured there, and says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time

BATCH = 128  # keys per multi_get in Gloo's connectFullMesh with the v2 api
ADDRESS_BYTES = 136  # a device address: sockaddr_storage (128) and a sequence number (8)
PATTERNS = ("full mesh", "full mesh, v2 api", "lazy + ring")


def record_bytes(members: int, pair_ids: bool) -> int:
    """Size of one member's record as Gloo writes it (measured: 154 + 8N bytes for host "vm")."""
    host = len(socket.gethostname())
    return 8 + host + 8 + ADDRESS_BYTES + (8 * members if pair_ids else 0)


def bytes_per_generation(pattern: str, n: int) -> int:
    """Record bytes written and read: each member writes its record and reads the ones it needs."""
    record = record_bytes(n, pair_ids=pattern == "full mesh")
    reads = n if pattern.startswith("full mesh") else min(2, n - 1)
    return n * (1 + reads) * record


def ops_per_generation(pattern: str, n: int) -> int:
    if pattern == "full mesh":
        return n * (1 + 2 * n)
    if pattern == "full mesh, v2 api":
        return n * (1 + math.ceil(n / BATCH))
    return n * (1 + 2 * min(2, n - 1))  # two neighbours; one when n is 2


# -- the store server (a subprocess) -----------------------------------------------------------


SERVER = """
import datetime, sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=300), use_libuv=True)
print(store.port, flush=True)
sys.stdin.read()
"""


def _quiet_env() -> dict[str, str]:
    """No warning per store connection; and where no DNS server answers, a store client's name
    lookup of its own socket (for its log lines) gives up after 1 s instead of 5 (connecting 1,000
    clients took minutes here otherwise). Neither touches the operations measured."""
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
    env.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    return env


class Server:
    def __enter__(self) -> "Server":
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=_quiet_env(),
        )
        self.port = int(self.proc.stdout.readline())
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


# -- the members ---------------------------------------------------------------------------------


def member(store, pattern: str, prefix: str, rank: int, n: int) -> list[int]:
    """Member ``rank``'s store operations in a rendezvous of ``n``; returns [operations, bytes]."""
    key = lambda r: f"{prefix}/0/{r}"  # noqa: E731 - as Gloo names them under the generation's prefix
    record = bytes(record_bytes(n, pair_ids=pattern == "full mesh"))
    store.set(key(rank), record)
    ops, nbytes = 1, len(record)
    if pattern == "full mesh":
        for r in range(n):
            store.wait([key(r)])
            nbytes += len(store.get(key(r)))
            ops += 2
    elif pattern == "full mesh, v2 api":
        for start in range(0, n, BATCH):
            values = store.multi_get([key(r) for r in range(start, min(n, start + BATCH))])
            nbytes += sum(len(v) for v in values)
            ops += 1
    elif n > 1:
        for r in sorted({(rank - 1) % n, (rank + 1) % n}):
            store.wait([key(r)])
            nbytes += len(store.get(key(r)))
            ops += 2
    return [ops, nbytes]


def simulate(port: int, index: int, processes: int, most: int) -> None:
    """One simulator process (``--simulate``): the members whose rank is ``index`` modulo
    ``processes``, each with a store connection of its own. Reads one command (JSON) per line on
    stdin, runs that rendezvous once the main process sets its gate key, prints one JSON line."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=600)
    client = lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)  # noqa: E731
    gate = client()
    ranks = list(range(index, most, processes))
    stores = {rank: client() for rank in ranks}
    print(json.dumps({"ready": len(stores)}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        n = command["members"]
        mine = [r for r in ranks if r < n]
        counts = {r: [0, 0] for r in mine}
        ends: dict[int, float] = {}
        errors: list[str] = []
        go = threading.Event()

        def run(rank: int) -> None:
            go.wait()
            try:
                counts[rank] = member(stores[rank], command["pattern"], command["prefix"], rank, n)
            except BaseException as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            ends[rank] = time.monotonic()

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in mine]
        for t in threads:
            t.start()
        gate.set(f"{command['prefix']}/ready/{index}", b"1")
        gate.wait([command["prefix"] + "/go"])
        go.set()
        for t in threads:
            t.join()
        print(json.dumps({
            "ops": sum(c[0] for c in counts.values()),
            "bytes": sum(c[1] for c in counts.values()),
            "end": max(ends.values(), default=0.0),
            "errors": errors[:3],
        }), flush=True)


class Simulators:
    """``processes`` simulator processes holding ``most`` member connections between them."""

    def __init__(self, port: int, processes: int, most: int) -> None:
        import torch.distributed as dist

        self.gate = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=600))
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--simulate", str(port), str(i), str(processes), str(most)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env=_quiet_env(),
            )
            for i in range(processes)
        ]
        for proc in self.procs:
            json.loads(proc.stdout.readline())  # connected

    def rendezvous(self, pattern: str, n: int, generation: int) -> dict:
        prefix = f"g{generation}"
        for proc in self.procs:
            proc.stdin.write(json.dumps({"pattern": pattern, "members": n, "prefix": prefix}) + "\n")
            proc.stdin.flush()
        self.gate.wait([f"{prefix}/ready/{i}" for i in range(len(self.procs))])
        start = time.monotonic()
        self.gate.set(f"{prefix}/go", b"1")
        parts = [json.loads(proc.stdout.readline()) for proc in self.procs]
        errors = [e for p in parts for e in p["errors"]]
        if errors:
            raise RuntimeError(f"{pattern} at {n}: {errors}")
        ops = sum(p["ops"] for p in parts)
        return {
            "pattern": pattern,
            "members": n,
            "store_ops": ops,
            "ops_per_member": round(ops / n, 2),
            "bytes": sum(p["bytes"] for p in parts),
            # Not rounded: a small run can take under a millisecond, and the rate divides by it.
            "seconds": max(p["end"] for p in parts) - start,
            "extrapolated": False,
        }

    def close(self) -> None:
        for proc in self.procs:
            proc.stdin.close()
        for proc in self.procs:
            proc.wait(60)


def extrapolate(measured: dict, n: int) -> dict:
    pattern = measured["pattern"]
    ops = ops_per_generation(pattern, n)
    rate = measured["store_ops"] / max(measured["seconds"], 1e-6)
    m = measured["members"]
    return {
        "pattern": pattern,
        "members": n,
        "store_ops": ops,
        "ops_per_member": round(ops / n, 2),
        "bytes": bytes_per_generation(pattern, n),
        "seconds": round(ops / rate, 1),
        "extrapolated": f"from {m} members at {rate:,.0f} ops/s",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[100, 250, 1000])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    parser.add_argument("--full-mesh-max", type=int, default=250, help="largest full mesh run; beyond, extrapolated")
    parser.add_argument("--processes", type=int, default=8, help="simulator processes the members are spread over")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON, one per line")
    parser.add_argument("--simulate", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.simulate:
        simulate(*args.simulate)
        return

    rows: list[dict] = []
    most = max(args.members + [min(args.full_mesh_max, max(args.members))])
    with Server() as server:
        sims = Simulators(server.port, args.processes, most)
        try:
            generation = 0
            for pattern in args.patterns:
                largest: dict | None = None
                for n in sorted(args.members):
                    if pattern == "full mesh" and n > args.full_mesh_max:
                        if largest is None or largest["members"] < args.full_mesh_max:
                            generation += 1
                            largest = sims.rendezvous(pattern, args.full_mesh_max, generation)
                            rows.append(largest)
                        rows.append(extrapolate(largest, n))
                        continue
                    generation += 1
                    row = sims.rendezvous(pattern, n, generation)
                    assert row["store_ops"] == ops_per_generation(pattern, n), row
                    assert row["bytes"] == bytes_per_generation(pattern, n), row
                    rows.append(row)
                    largest = row
        finally:
            sims.close()
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print("| pattern | members | store operations | per member | bytes through the store | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        secs = f"{r['seconds']:.3f}" if not r["extrapolated"] else f"~{r['seconds']:.3g} (extrapolated {r['extrapolated']})"
        print(f"| {r['pattern']} | {r['members']:,} | {r['store_ops']:,} | {r['ops_per_member']:g} | {r['bytes']:,} | {secs} |")


if __name__ == "__main__":
    main()
