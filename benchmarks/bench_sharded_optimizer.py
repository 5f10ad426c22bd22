"""Sharded optimizer state (``--shard-optimizer``) next to plain DDP, torch's ZeroRedundancyOptimizer
and DeepSpeed's ZeRO-1: memory, healthy step, and the stall when a member is killed (issue 47).

    python benchmarks/bench_sharded_optimizer.py [--members 2,3,4] [--width 4870] [--steps 24] [--pairs 1]
        [--torchrun-malloc default|tuned] [--out PATH] [--json]

For each member count, one run of each system per pair, interleaved (``benchmarks/train_bench.py``:
the same MLP, about 25 M parameters at the default width, AdamW, the same samples per step): the
optimizer state each process holds (the largest over its processes) and the median step. DDP and
ZeroRedundancyOptimizer run under torchrun; DeepSpeed (stage 1, ``torch_adam``, Gloo) too, when it
is installed (``pip install deepspeed``), else its column says so. Then, at the largest member
count, a member is SIGKILLed mid-run under unbroken with plain members and with the sharded state:
the survivors' stall (the fault to their first commit without it, less one healthy step), with the
bytes and seconds of the sharded re-partition next to those of the plain run's heal. Then a healthy
run of each saving checkpoints: what rank 0 writes (with the sharded state: the model and its own
part; plain: everything) and what any other member writes, the stall and the write. Last, the
guarantee: the float64 test script with a member killed between its update and the gather, against
one process. Prints a markdown table (``--json``: one line) and writes
benchmarks/results/sharded_optimizer.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.bench_foundation import SCRIPT, _run, _step_seconds  # noqa: E402
from benchmarks.common import save_results, torchrun_malloc_env  # noqa: E402

SYSTEMS = ("ddp", "zero", "deepspeed", "sharded")


def _command(system: str, members: int, width: int, steps: int, run_dir: str, chaos: str | None = None) -> list[str]:
    mode = "unbroken" if system in ("sharded", "plain") else system
    script = [SCRIPT, "--mode", mode, "--steps", str(steps), "--width", str(width), "--warmup", str(max(2, steps // 4))]
    if mode != "unbroken":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(members), *script]
    extra = ["--shard-optimizer"] if system == "sharded" else []
    if chaos:
        extra += ["--chaos", chaos, "--max-restarts", "2"]
    return [sys.executable, "-m", "unbroken", "run", "--nproc-per-node", str(members), "--progress-interval", "0",
            "--run-dir", run_dir, *extra, *script]


def _healthy(system: str, members: int, width: int, steps: int, tmp: str, index: int,
             malloc: dict[str, str] | None = None) -> dict[str, float]:
    env = malloc if system in ("ddp", "zero", "deepspeed") else None
    out = _run(_command(system, members, width, steps, os.path.join(tmp, f"{system}{members}-{index}")), 1800, tmp, env)
    return {"step_s": _step_seconds(out), "bytes": max(int(v) for v in re.findall(r"OPTIMIZER_BYTES (\d+)", out))}


def _events(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def _stall(system: str, members: int, width: int, steps: int, tmp: str) -> dict[str, float]:
    """Kill one non-leader member at a third of the run: the survivors' stall, and what moved."""
    run_dir = os.path.join(tmp, f"kill-{system}")
    _run(_command(system, members, width, steps, run_dir, chaos=f"kill@step,rank=1,step={steps // 3}"), 1800, tmp)
    ev = _events(run_dir)
    (fault,) = [e for e in ev if e["kind"] == "fault"]
    victim = fault["member"]
    healthy = statistics.median(e["seconds"] for e in ev if e["kind"] == "step" and e["t"] < fault["t"] and e["step"] > 1)
    before = max(e["generation"] for e in ev if e["kind"] == "generation" and e["t"] < fault["t"])
    # the survivors' first commit in a later generation (the killed member's restart may be in it already)
    first_step = min((e for e in ev if e["kind"] == "step" and e["t"] > fault["t"] and e["generation"] > before), key=lambda e: e["t"])
    first = first_step["t"]
    moved = [e for e in ev if e["kind"] == "reshard" and e["t"] > fault["t"] and e["generation"] <= first_step["generation"]
             and not e["source"].endswith(victim)]
    heals = [e for e in ev if e["kind"] == "heal" and e["t"] > fault["t"]]
    return {"stall_s": first - fault["t"] - healthy, "healthy_step_s": healthy,
            "reshard_bytes": sum(e["bytes_received"] for e in moved), "reshard_s": max((e["seconds"] for e in moved), default=0.0),
            "heal_bytes": sum(e["bytes"] for e in heals), "heal_s": max((e["seconds"] for e in heals), default=0.0)}


def _checkpoints(system: str, members: int, width: int, steps: int, tmp: str) -> dict[str, float]:
    """A healthy run saving every third of its steps: the bytes each member writes (rank 0, and the
    most any other member writes), rank 0's stall and the write's seconds (medians over the saves)."""
    run_dir, ckpt = os.path.join(tmp, f"save-{system}"), os.path.join(tmp, f"checkpoints-{system}")
    cmd = _command(system, members, width, steps, run_dir)
    at = cmd.index("--run-dir")
    cmd[at:at] = ["--checkpoint-dir", ckpt, "--checkpoint-every", str(max(1, steps // 3))]
    _run(cmd, 1800, tmp)
    saves = [e for e in _events(run_dir) if e["kind"] == "checkpoint"]
    newest = max(saves, key=lambda e: e["step"])
    with open(os.path.join(newest["location"], "manifest.json")) as f:
        files = json.load(f)["files"]
    by_member: dict[str, int] = {}
    for name, entry in files.items():  # optimizer/m<k>/...: member k's part; the rest is rank 0's
        owner = name.split("/")[1] if name.startswith("optimizer/m") else "m0"
        by_member[owner] = by_member.get(owner, 0) + entry["bytes"]
    return {"rank0_bytes": by_member.pop("m0"), "other_bytes": max(by_member.values(), default=0), "saves": len(saves),
            "stall_s": statistics.median(e["stall"] for e in saves), "write_s": statistics.median(e["write_seconds"] for e in saves)}


def _same_model(tmp: str) -> float:
    """The float64 test script, a member killed between its update and the gather, against one process."""
    from testbed import harness

    single = harness.single_process(os.path.join(tmp, "single"), "--steps", "24")
    run_dir = os.path.join(tmp, "exact")
    cmd = [sys.executable, "-m", "unbroken", "run", "--nproc-per-node", "4", "--shard-optimizer", "--run-dir", run_dir,
           "--progress-interval", "0", "--chaos", "kill@gather,rank=1,step=9", harness.EXACT, "--steps", "24",
           "--step-delay", "0.05", "--out", os.path.join(run_dir, "final")]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    finals = harness.final_params(os.path.join(run_dir, "final"))
    assert len(finals) == 4, finals.keys()
    return max(harness.max_relative_difference(p, single) for p in finals.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", default="2,3,4")
    parser.add_argument("--width", type=int, default=4870, help="MLP width (default 4870: about 25 M parameters)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--torchrun-malloc", choices=["default", "tuned"], default="default",
                        help="tuned: torchrun's workers get glibc's malloc thresholds as unbroken's workers set them (tune_malloc)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "sharded_optimizer.json"), help="where the figures go")
    parser.add_argument("--json", action="store_true", help="print one line: a JSON object of the headline figures")
    args = parser.parse_args()
    counts = [int(m) for m in args.members.split(",")]
    systems = [s for s in SYSTEMS if s != "deepspeed" or importlib.util.find_spec("deepspeed") is not None]
    rows: dict[int, dict[str, list[dict[str, float]]]] = {m: {s: [] for s in systems} for m in counts}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.pairs):
            for m in counts:
                for system in systems:
                    rows[m][system].append(_healthy(system, m, args.width, args.steps, tmp, index,
                                                    torchrun_malloc_env(args.torchrun_malloc)))
        table = {m: {s: {"step_s": statistics.median(r["step_s"] for r in runs), "bytes": max(r["bytes"] for r in runs),
                         "vs_ddp": statistics.median(r["step_s"] / d["step_s"] for r, d in zip(runs, rows[m]["ddp"]))}
                     for s, runs in by.items()} for m, by in rows.items()}
        path = args.out
        save_results(path, {"args": vars(args), "table": table, "runs": rows})  # kept if what follows fails
        top = max(counts)
        stalls = {s: _stall(s, top, args.width, max(args.steps, 24), tmp) for s in ("plain", "sharded")}
        saves = {s: _checkpoints(s, top, args.width, args.steps, tmp) for s in ("plain", "sharded")}
        same = _same_model(tmp)
    headline = {
        "members": top,
        "optimizer_bytes_vs_ddp": table[top]["sharded"]["bytes"] / table[top]["ddp"]["bytes"],
        "healthy_step_vs_ddp": table[top]["sharded"]["vs_ddp"],
        "healthy_step_s": table[top]["sharded"]["step_s"],
        "stall_after_kill_s": stalls["sharded"]["stall_s"],
        "plain_stall_after_kill_s": stalls["plain"]["stall_s"],
        "same_model": same < 1e-12,
    }
    save_results(path, {"args": vars(args), "table": table, "runs": rows, "stalls": stalls, "checkpoints": saves, "same_model_difference": same,
                                       "deepspeed": "deepspeed" in systems, **headline})
    if args.json:
        print(json.dumps(headline))
        return 0
    print("| members | system | optimizer state per member (MB) | vs DDP | healthy step (s) | vs DDP |\n|---|---|---|---|---|---|")
    for m in counts:
        for s in SYSTEMS:
            if s not in table[m]:
                print(f"| {m} | {s} | not installed (pip install deepspeed) | | | |")
                continue
            r = table[m][s]
            print(f"| {m} | {s} | {r['bytes'] / 1e6:.1f} | {r['bytes'] / table[m]['ddp']['bytes']:.3f} | {r['step_s']:.3f} | {r['vs_ddp']:.3f}x |")
    for s, r in stalls.items():
        print(f"\nkill at {top} members, {s}: stall {r['stall_s']:.3f} s (healthy step {r['healthy_step_s']:.3f} s);"
              f" re-partition {r['reshard_bytes'] / 1e6:.1f} MB in {r['reshard_s']:.3f} s; heal {r['heal_bytes'] / 1e6:.1f} MB in {r['heal_s']:.3f} s")
    for s, r in saves.items():
        print(f"\ncheckpoint at {top} members, {s}: rank 0 writes {r['rank0_bytes'] / 1e6:.1f} MB, any other member at most"
              f" {r['other_bytes'] / 1e6:.1f} MB; stall {r['stall_s']:.3f} s, write {r['write_s']:.3f} s (median of {r['saves']} saves)")
    print(f"\nsame model as one process (float64, a kill between update and gather): {same:.2e} relative")
    return 0


if __name__ == "__main__":
    sys.exit(main())
