"""Checkpoint cost on a model of about 100 MB of parameters with Adam state.

    python benchmarks/bench_checkpoint.py [--trials 3] [--dir DIR]

Measures, in one process: the training stall of a save (the copy into host memory) next to a
plain memory copy of the same bytes; the background write time; the slowdown of the training
steps that run while the write is in flight; and the overhead at the interval ``auto`` picks
(Young/Daly with the default MTBF of one hour). Prints a markdown table, writes
benchmarks/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.common import nbytes, save_results  # noqa: E402

import torch  # noqa: E402

from unbroken.storage.checkpoint import CheckpointStore, Saver, snapshot, young_daly_interval  # noqa: E402


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(3072, 3072) for _ in range(3)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(8, 3072)

    def step():
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # creates Adam's state
    return model, optimizer, step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--mtbf", type=float, default=3600.0)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "checkpoint.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, optimizer, step = build()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    size = nbytes(state)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    base = []
    for _ in range(5):
        t = time.perf_counter()
        step()
        base.append(time.perf_counter() - t)
    healthy = statistics.median(base)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        for trial in range(args.trials):
            t = time.perf_counter()
            copy = snapshot(state)
            memcpy = time.perf_counter() - t
            del copy
            done = []
            saver = Saver(CheckpointStore(where), keep=1, on_done=done.append)
            stall = saver.save(trial + 1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, {"generation": 1, "members": ["bench"]})
            during = []
            while not done and saver.error is None:
                t = time.perf_counter()
                step()
                during.append(time.perf_counter() - t)
            saver.wait()
            if saver.error is not None:
                raise saver.error
            contention = max(0.0, sum(d - healthy for d in during))
            # as the runtime does: a save costs training its stall plus the slowdown while written
            interval = young_daly_interval(stall + contention, args.mtbf)
            rows.append({
                "memcpy_s": memcpy, "stall_s": stall, "write_s": done[0]["write_seconds"], "steps_during_write": len(during),
                "contention_s": contention, "auto_interval_s": interval,
                "overhead_pct": 100.0 * (stall + contention) / interval,
            })
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    mb = size / 1e6
    result = {"date": time.strftime("%Y-%m-%d"), "state_mb": mb, "params_mb": params / 1e6, "healthy_step_s": healthy, "trials": rows, "median": med}
    print(f"\nOne process, {params / 1e6:.0f} MB of parameters + Adam state = {mb:.0f} MB, local disk, {result['date']};"
          f" median of {args.trials}\n")
    print("| measure | result | target |")
    print("| --- | --- | --- |")
    print(f"| plain memory copy of the state | {med['memcpy_s'] * 1000:.0f} ms ({mb / med['memcpy_s']:.0f} MB/s) | |")
    print(f"| training stall per checkpoint | {med['stall_s'] * 1000:.0f} ms ({mb / med['stall_s']:.0f} MB/s), {med['stall_s'] / med['memcpy_s']:.2f}x the copy | ≤ 1.5x the copy |")
    print(f"| background write (serialize, checksum, write, fsync, publish) | {med['write_s']:.2f} s ({mb / med['write_s']:.0f} MB/s) | |")
    print(f"| extra step time while the write runs | {med['contention_s'] * 1000:.0f} ms over {med['steps_during_write']:.0f} steps of {healthy * 1000:.0f} ms | |")
    print(f"| interval `auto` picks (Young/Daly from stall + extra, MTBF {args.mtbf:.0f} s) | {med['auto_interval_s']:.1f} s | |")
    print(f"| overhead at that interval ((stall + extra) / interval) | {med['overhead_pct']:.2f} % | < 2 % |")
    save_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
