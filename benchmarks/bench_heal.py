"""Healing transfer cost: a model of about 100M float32 parameters with AdamW state (~1.2 GB).

    python benchmarks/bench_heal.py [--params 100_000_000] [--trials 3] [--lanes 2]

Two processes on this machine, one Gloo group over 127.0.0.1, one thread each. Measures:
(a) ``send_state``/``recv_state`` of the full training state {model, optimizer, rng}, from the
start of the send to the state complete on the receiver, into new memory; (a') the same into a
newcomer as unbroken heals one: its own model built, its optimizer state and tensors like its
parameters warmed before it joined (:mod:`unbroken.worker.warm_state`), so that the state lands
in warm memory, timed until it is loaded into the newcomer's model and optimizer (the received
parameters become the model's memory), its large tensors over ``--lanes`` connections
(:mod:`unbroken.worker.heal_lanes`); (a'') the same over one connection; (b) a plain Gloo broadcast of the same
number of bytes as one uint8 tensor (the link limit), into a buffer the receiver already uses
and into one it allocates for the purpose, as ``recv_state`` must; (c) a memory copy of those
bytes in one process, the same two ways; (d) for reference, the former way: ``torch.save`` of the
state into memory and ``torch.load`` back, in one process. Prints a markdown table, writes
benchmarks/results/heal.json. Leaves no process behind.

A receiver that does not hold the memory yet pays for the first touch of every new page, which
on a virtual machine can cost more than the transfer: (b') and (c') show that cost apart from the
link. ``recv_state`` faults pages in on a helper thread while the data comes; running with
``THP_MEM_ALLOC_ENABLE=1`` (torch's switch for transparent huge pages on large allocations)
makes new memory much cheaper where the kernel allows it. The load average before and after is
recorded: the figures mean little on a machine that is busy with something else.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.common import nbytes, save_results  # noqa: E402
from testbed.processes import exit_with_parent, run_spawned  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from unbroken.worker import healing  # noqa: E402
from unbroken.worker.group import GenerationGroup  # noqa: E402
from unbroken.worker.warm_state import RELEASE_THREAD, adopt_parameters, warm_model, warm_optimizer  # noqa: E402

GROUP_TIMEOUT = 600.0  # the receiver waits in a barrier while the sender measures (d) alone


def build_fresh(params: int):
    """A stack of square Linear layers of about ``params`` parameters and its AdamW, as a process
    that has just started holds them (no optimizer state yet); returns (model, optimizer, width)."""
    torch.manual_seed(0)
    width = min(4096, max(8, int(math.sqrt(params))))
    layers = max(1, round(params / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), width


def build(params: int):
    """The same after one step (the state a live member sends)."""
    model, optimizer, width = build_fresh(params)
    model(torch.randn(2, width)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer



def worker(rank: int, port: int, params: int, trials: int, out: str, lanes: int) -> None:
    exit_with_parent()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    group = GenerationGroup(1, rank, 2, ["sender", "receiver"], lambda: None, threading.Event(), GROUP_TIMEOUT)
    group.connect(store, "bench-heal/", "127.0.0.1")
    barrier_tensor = torch.zeros(1)

    def barrier() -> None:
        group.allreduce(barrier_tensor, "barrier")

    result: dict = {"rank": rank, "trials": []}
    if rank == 0:
        model, optimizer = build(params)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": healing.rng_state()}
        size = nbytes(state)
        result.update(state_bytes=size, params=sum(p.numel() for p in model.parameters()),
                      tensors=len(healing.split(state)[1]))
        size_tensor = torch.tensor([size], dtype=torch.int64)
    else:
        size_tensor = torch.zeros(1, dtype=torch.int64)
    group.allreduce(size_tensor, "size")
    size = int(size_tensor.item())
    payload = torch.ones(size, dtype=torch.uint8)  # touched: memory in use, on both ranks
    options = dist.BroadcastOptions()
    options.rootRank = 0

    def broadcast(tensor: torch.Tensor) -> None:
        group.wait(group.pg.broadcast([tensor], options), "broadcast")

    for _ in range(trials):
        row: dict = {}
        # (a) the healing transfer
        barrier()
        t = time.perf_counter()
        if rank == 0:
            row["heal_bytes"] = healing.send_state(group, state, 1, lanes=lanes)
        else:
            received, row["heal_bytes"] = healing.recv_state(group, 0)
        row["heal_s"] = time.perf_counter() - t
        if rank == 1:
            del received
        # (a') the same into a newcomer that warmed its optimizer state and tensors like its
        # parameters before joining (its own model built, as a started process has it): the state
        # lands in warm memory, and the time runs until it is loaded into the newcomer's model and
        # optimizer (the received parameters become the model's memory: no copy)
        # lanes: the state's large tensors over that many connections (1: over the group alone)
        for key, count in (("heal_warm_s", lanes), ("heal_warm_one_s", 1)):
            warm = None
            if rank == 1:
                newcomer, newcomer_optimizer, _ = build_fresh(params)
                warm = {**warm_optimizer(newcomer_optimizer), **warm_model(newcomer)}
            barrier()
            t = time.perf_counter()
            if rank == 0:
                healing.send_state(group, state, 1, lanes=count)
            else:
                received, _ = healing.recv_state(group, 0, into=warm)
                adopt_parameters(newcomer, received["model"])
                newcomer.load_state_dict(received["model"])
                newcomer_optimizer.load_state_dict(received["optimizer"])
            row[key] = time.perf_counter() - t
            if rank == 1:
                del received, warm, newcomer, newcomer_optimizer
                # the newcomer's replaced parameter memory is freed on a thread of its own, off
                # the heal's path: let it finish before the next measurement shares the cores
                for thread in threading.enumerate():
                    if thread.name == RELEASE_THREAD:
                        thread.join()
        # (b) broadcast into a buffer in use
        barrier()
        t = time.perf_counter()
        broadcast(payload)
        row["bcast_warm_s"] = time.perf_counter() - t
        # (b') broadcast into a buffer the receiver allocates
        barrier()
        t = time.perf_counter()
        fresh = payload if rank == 0 else torch.empty(size, dtype=torch.uint8)
        broadcast(fresh)
        row["bcast_fresh_s"] = time.perf_counter() - t
        del fresh
        # (c) memory copies, in the sender alone
        barrier()
        if rank == 0:
            target = torch.empty(size, dtype=torch.uint8)
            t = time.perf_counter()
            target.copy_(payload)
            row["memcpy_fresh_s"] = time.perf_counter() - t
            t = time.perf_counter()
            target.copy_(payload)
            row["memcpy_warm_s"] = time.perf_counter() - t
            del target
        result["trials"].append(row)
    del payload
    barrier()
    # (d) the former way, in the sender alone (the receiver waits at the barrier)
    if rank == 0:
        result["former"] = []
        for _ in range(trials):
            buffer = io.BytesIO()
            t = time.perf_counter()
            torch.save(state, buffer)
            save_s = time.perf_counter() - t
            buffer.seek(0)
            t = time.perf_counter()
            back = torch.load(buffer, weights_only=False)
            load_s = time.perf_counter() - t
            del back, buffer
            result["former"].append({"save_s": save_s, "load_s": load_s, "total_s": save_s + load_s})
    barrier()
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    os._exit(0)  # a Gloo group alive at exit can abort the interpreter


def run(params: int, trials: int, lanes: int) -> tuple[dict, dict]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    with tempfile.TemporaryDirectory() as where:
        outs = [os.path.join(where, f"rank{rank}.json") for rank in (0, 1)]
        codes = run_spawned(worker, [(rank, store.port, params, trials, outs[rank], lanes) for rank in (0, 1)])
        missing = [rank for rank in (0, 1) if not os.path.exists(outs[rank])]
        if missing:
            raise SystemExit(f"rank(s) {missing} reported nothing (exit codes {codes})")
        with open(outs[0]) as f0, open(outs[1]) as f1:
            return json.load(f0), json.load(f1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--lanes", type=int, default=2, help="connections of the heal (RuntimeSettings.heal_lanes); a heal over one is measured too")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "heal.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    sender, receiver = run(args.params, args.trials, args.lanes)
    load_after = os.getloadavg()[0]
    size = sender["state_bytes"]
    rows = []
    for s, r in zip(sender["trials"], receiver["trials"]):
        assert s["heal_bytes"] == r["heal_bytes"]
        rows.append({
            "heal_s": max(s["heal_s"], r["heal_s"]),
            "heal_send_s": s["heal_s"],
            "heal_warm_s": max(s["heal_warm_s"], r["heal_warm_s"]),
            "heal_warm_one_s": max(s["heal_warm_one_s"], r["heal_warm_one_s"]),
            "bcast_warm_s": max(s["bcast_warm_s"], r["bcast_warm_s"]),
            "bcast_fresh_s": max(s["bcast_fresh_s"], r["bcast_fresh_s"]),
            "memcpy_warm_s": s["memcpy_warm_s"],
            "memcpy_fresh_s": s["memcpy_fresh_s"],
        })
    for row, former in zip(rows, sender["former"]):
        row.update(former_save_s=former["save_s"], former_load_s=former["load_s"], former_s=former["total_s"])
    keys = list(rows[0])
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    low = {k: min(r[k] for r in rows) for k in keys}
    high = {k: max(r[k] for r in rows) for k in keys}
    gb = size / 1e9
    link = med["bcast_warm_s"]
    result = {
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "params": sender["params"], "tensors": sender["tensors"],
        "state_bytes": size, "heal_bytes": sender["trials"][0]["heal_bytes"], "trials": rows,
        "median": med, "min": low, "max": high, "heal_over_broadcast": med["heal_s"] / link,
        "heal_over_fresh_broadcast": med["heal_s"] / med["bcast_fresh_s"],
        "warm_heal_over_broadcast": med["heal_warm_s"] / link, "lanes": args.lanes,
        "warm_heal_one_lane_over_broadcast": med["heal_warm_one_s"] / link,
        "load_average": [load_before, load_after], "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
    }
    print(f"\nTwo processes, Gloo over 127.0.0.1, one thread each; {sender['params'] / 1e6:.0f}M float32 parameters with AdamW"
          f" after one step = {sender['tensors']} tensors, {gb:.2f} GB; {result['date']}, torch {torch.__version__};"
          f" median of {args.trials} (min–max); load average {load_before:.1f} before, {load_after:.1f} after"
          f"{'; THP_MEM_ALLOC_ENABLE=1' if result['thp_mem_alloc'] == '1' else ''}\n")
    print("| measure | seconds | GB/s | × broadcast |")
    print("| --- | --- | --- | --- |")

    def line(label: str, key: str) -> None:
        print(f"| {label} | {med[key]:.3f} ({low[key]:.3f}–{high[key]:.3f}) | {gb / med[key]:.2f} | {med[key] / link:.2f} |")

    line("(a) `send_state` → `recv_state`, full state, into new memory", "heal_s")
    line(f"(a') the same into a newcomer whose state was warmed before it joined, loaded (unbroken's path), {args.lanes} lanes", "heal_warm_s")
    line("(a'') the same over one connection (`heal_lanes=1`)", "heal_warm_one_s")
    line("(b) Gloo broadcast, same bytes, into a buffer the receiver already uses (link limit)", "bcast_warm_s")
    line("(b') Gloo broadcast, same bytes, into a buffer the receiver allocates", "bcast_fresh_s")
    line("(c) memory copy, one process, into a buffer in use", "memcpy_warm_s")
    line("(c') memory copy, one process, into a new buffer", "memcpy_fresh_s")
    line("(d) former way: `torch.save` to memory + `torch.load`, one process", "former_s")
    line("    of which `torch.save`", "former_save_s")
    line("    of which `torch.load`", "former_load_s")
    print(f"\n(a) is {result['heal_over_broadcast']:.2f}x (b) and {result['heal_over_fresh_broadcast']:.2f}x (b');"
          f" (a') is {result['warm_heal_over_broadcast']:.2f}x (b), (a'') {result['warm_heal_one_lane_over_broadcast']:.2f}x (b).")
    save_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
