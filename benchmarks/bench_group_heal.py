"""Healing a replica group shard by shard (issue 18): heal time of a group next to the raw link.

    python benchmarks/bench_group_heal.py [--mb 200] [--trials 5] [--json]

Four processes on this machine, one thread each: a live group of K=2 and a restarted group of
K=2, each its own Gloo world sharding a stack of float32 Linear layers (``--mb`` MB of parameters)
with FSDP2, AdamW (the live group after one step: parameters, ``exp_avg`` and ``exp_avg_sq``, so
each group holds about 3 x ``--mb`` MB, each process half of it). Per trial, interleaved (the
order rotates), the slowest process's time of:

(a) :func:`unbroken.group_healing.heal_group`: both shard transfers at once, each over its own
    2-rank channel built for the trial, including the manifest exchange, the small state, the
    digest verification and the group's agreement;
(b) the same bytes moved raw: one Gloo send/recv of one shard's bytes on both pairs at once
    (what (a) moves, with nothing else);
(c) one Gloo send/recv of one shard's bytes between one pair alone;
(d) one Gloo send/recv of the whole group's bytes (both shards) between one pair: what healing
    the replica would cost without sharding, over one link.

Raw buffers are touched beforehand on both sides, and (a) writes into the restarted group's own
tensors (touched when it was built), so no measure pays for new pages; one warm-up trial (which
creates the receiver's optimizer state) is not counted. Prints a markdown table (or JSON with
``--json``) and writes benchmarks/results/group_heal.json. The load average before and after is
recorded: the figures mean little on a machine that is busy with something else. Leaves no
process behind.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.common import exit_with_parent, run_spawned, save_results  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from unbroken.group import GenerationGroup  # noqa: E402

K = 2
WIDTH = 2048
TIMEOUT_S = 600.0
MEASURES = ("heal", "raw_parallel", "raw_one_shard", "raw_group")



def build(mb: float, mesh, live: bool):
    """Float32 Linear layers of about ``mb`` MB, sharded with FSDP2; AdamW, stepped once if ``live``."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0 if live else 1)
    layers = max(1, round(mb * 1e6 / (4 * (WIDTH * WIDTH + WIDTH))))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if live:
        model(torch.randn(2, WIDTH)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, layers


def worker(rank: int, port: int, mb: float, trials: int, warmup: int, out: str) -> None:
    exit_with_parent()
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    from unbroken import healing
    from unbroken.group_healing import heal_group
    from unbroken.replica_groups import local_state_shards

    group, j = divmod(rank, K)
    role = "send" if group == 0 else "receive"
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"group{group}/", store), rank=j, world_size=K)
    model, optimizer, layers = build(mb, init_device_mesh("cpu", (K,), mesh_dim_names=("shard",)), live=group == 0)
    everyone = GenerationGroup(0, rank, 2 * K, [str(r) for r in range(2 * K)], lambda: None, threading.Event(), TIMEOUT_S)
    everyone.connect(store, "bench/", "127.0.0.1")
    pair = GenerationGroup(0, group, 2, ["sender", "receiver"], lambda: None, threading.Event(), TIMEOUT_S)
    pair.connect(store, f"raw/shard{j}/", "127.0.0.1")

    mine = sum(t.numel() * t.element_size() for t in local_state_shards(model, optimizer).values()) if group == 0 else 0
    shard_bytes = [int(b) for b in everyone.allgather_rows(torch.tensor([mine], dtype=torch.int64), "sizes").reshape(-1)[:K]]
    one_shard = torch.ones(shard_bytes[j], dtype=torch.uint8)  # touched: memory in use on both sides
    whole = torch.ones(sum(shard_bytes), dtype=torch.uint8) if j == 0 else None

    def move(buffer: torch.Tensor) -> None:
        if group == 0:
            pair.pg.send([buffer], 1, 1).wait()
        else:
            pair.pg.recv([buffer], 0, 1).wait()

    def timed(body) -> float:
        everyone.allreduce(torch.zeros(1), "barrier")
        started = time.perf_counter()
        body()
        took = time.perf_counter() - started
        return float(everyone.allgather_rows(torch.tensor([took]), "times").max())  # the slowest process

    rows, parts = [], []
    for trial in range(warmup + trials):
        row = {}
        order = MEASURES[trial % len(MEASURES):] + MEASURES[: trial % len(MEASURES)]
        for measure in order:
            if measure == "heal":
                extra = {"step": 1, "rng": healing.rng_state()}
                healed: list = []
                row["heal"] = timed(lambda: healed.append(heal_group(
                    role, store, trial + 1, model, optimizer, group_pg=dist.group.WORLD, extra=extra, timeout=TIMEOUT_S)))
                r = healed[0].report
                part = torch.tensor([r.manifest_s, r.transfer_s, r.verify_s, r.total_s], dtype=torch.float64)
                parts_all = everyone.allgather_rows(part, "parts")
                if trial >= warmup:  # the receivers' view, the slower of the two
                    parts.append([float(v) for v in parts_all[K:].max(dim=0).values])
            elif measure == "raw_parallel":
                row[measure] = timed(lambda: move(one_shard))
            elif measure == "raw_one_shard":
                row[measure] = timed(lambda: move(one_shard) if j == 0 else None)
            else:
                row[measure] = timed(lambda: move(whole) if j == 0 else None)
        if trial >= warmup:
            rows.append(row)
    if rank == 0:
        with open(out + ".tmp", "w") as f:
            json.dump({"rows": rows, "parts": parts, "shard_bytes": shard_bytes, "layers": layers}, f)
        os.replace(out + ".tmp", out)
    everyone.allreduce(torch.zeros(1), "done")
    os._exit(0)  # a Gloo group alive at exit can abort the interpreter


def run(mb: float, trials: int, warmup: int) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    with tempfile.TemporaryDirectory() as where:
        out = os.path.join(where, "result.json")
        codes = run_spawned(worker, [(rank, store.port, mb, trials, warmup, out) for rank in range(2 * K)])
        if not os.path.exists(out):
            raise SystemExit(f"no result (exit codes {codes})")
        with open(out) as f:
            return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="MB of float32 parameters (the state is about 3x)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "group_heal.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    raw = run(args.mb, args.trials, args.warmup)
    load_after = os.getloadavg()[0]
    rows, shard_bytes = raw["rows"], raw["shard_bytes"]
    med = {m: statistics.median(r[m] for r in rows) for m in MEASURES}
    low = {m: min(r[m] for r in rows) for m in MEASURES}
    high = {m: max(r[m] for r in rows) for m in MEASURES}
    parts = {name: statistics.median(p[i] for p in raw["parts"]) for i, name in enumerate(("manifest_s", "transfer_s", "verify_s", "total_s"))}
    group_bytes = sum(shard_bytes)
    result = {
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "mb": args.mb, "layers": raw["layers"], "width": WIDTH,
        "group_size": K, "shard_bytes": shard_bytes, "group_bytes": group_bytes, "trials": rows, "median": med,
        "min": low, "max": high, "receiver_parts_median": parts, "heal_over_raw_parallel": med["heal"] / med["raw_parallel"],
        "heal_over_raw_group": med["heal"] / med["raw_group"], "load_average": [load_before, load_after],
    }
    save_results(args.out, result)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    gb = group_bytes / 1e9
    print(f"\nTwo groups of K={K} processes (FSDP2, Gloo over 127.0.0.1, one thread each); {raw['layers']} float32 Linear"
          f"({WIDTH}, {WIDTH}) layers with AdamW = {gb:.2f} GB per group, shards of {shard_bytes[0] / 1e9:.2f} and"
          f" {shard_bytes[1] / 1e9:.2f} GB; {result['date']}, torch {torch.__version__}; median of {args.trials} interleaved"
          f" (min–max), slowest process; load average {load_before:.1f} before, {load_after:.1f} after\n")
    print("| measure | seconds | GB/s (group's bytes) | × (b) |")
    print("| --- | --- | --- | --- |")
    for label, key in (
        ("(a) `heal_group`: both shards at once, manifest, small state, digest, agreement", "heal"),
        ("(b) raw Gloo send/recv of one shard's bytes, both pairs at once (same bytes as (a))", "raw_parallel"),
        ("(c) raw Gloo send/recv of one shard's bytes, one pair alone", "raw_one_shard"),
        ("(d) raw Gloo send/recv of the whole group's bytes, one pair (an unsharded heal's link time)", "raw_group"),
    ):
        print(f"| {label} | {med[key]:.3f} ({low[key]:.3f}–{high[key]:.3f}) | {gb / med[key]:.2f} | {med[key] / med['raw_parallel']:.2f} |")
    print(f"\n(a) is {result['heal_over_raw_parallel']:.2f}x (b) and {result['heal_over_raw_group']:.2f}x (d). Receiver's side of (a),"
          f" median: manifest {parts['manifest_s']:.3f} s, shards and small state {parts['transfer_s']:.3f} s,"
          f" verification {parts['verify_s']:.3f} s, total {parts['total_s']:.3f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
