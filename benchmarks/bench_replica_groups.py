"""Replica groups (issue 18): a healthy step next to plain HSDP, and a group's heal next to raw Gloo.

    python benchmarks/bench_replica_groups.py [--trials 3] [--steps 45] [--heal-trials 3] [--quick] [--json]

1. **Healthy step.** ``benchmarks/fsdp_step.py`` (a float32 MLP 64 -> 1024 x 3 -> 16, 2.18 M
   parameters, AdamW, global batch 64, micro-batches of 8; FSDP2 inside each group) runs as
   2 groups x 2 processes under ``unbroken run --nproc-per-node 4 --group-size 2`` (ours) and as
   plain HSDP under torchrun (``fully_shard`` over a 2-D ``("replicate", "shard")`` mesh, FSDP's own
   replicate allreduce once per step), same model, data and global batch, in interleaved trials
   (the order alternates). The step time is the time between consecutive step ends on one process
   (rank 0 / process 0 of group 0), after ``--warmup`` steps. Per trial and pooled: median and
   p10-p90 of each, and the ratio of the medians (ours / HSDP; the issue's target is <= 1.05).
2. **Heal of a group.** 3 groups x 2 processes (``--nproc-per-node 6 --group-size 2``) train a
   bigger model (``--heal-hidden``, ``--heal-layers``: tens of MB of state) and
   ``--chaos kill@step,rank=3,step=N`` kills process 1 of group 1; the launcher restarts the group,
   which rejoins and is healed shard by shard. From the run's ``heal`` events (one per sending
   process j): bytes and seconds per j; the group's heal time is the max over j. Next to it, raw
   Gloo: two pairs of processes send/recv the same bytes per shard, both pairs at once (the
   slowest process's time, median of ``--raw-trials``).

Prints markdown tables (or JSON with ``--json``) and writes benchmarks/results/replica_groups.json
(``--out``). Every run is bounded by a timeout, and no process is left behind. Run it alone on
the machine (``flock /tmp/unbroken-heavy.lock python benchmarks/bench_replica_groups.py``): the
figures mean little while something else computes; the load average is recorded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.common import save_results  # noqa: E402
from testbed.processes import exit_with_parent, processes_naming, run_spawned  # noqa: E402

SCRIPT = os.path.join(HERE, "fsdp_step.py")
GROUP_SIZE = 2
VARIANTS = ("unbroken", "hsdp")
KILLED_RANK = 3  # local rank 3 = process 1 of group 1 (slot 1)
KILLED_SLOT = KILLED_RANK // GROUP_SIZE


# -- statistics -------------------------------------------------------------------------------------


def summary(times: list[float]) -> dict[str, float]:
    """Median, p10 and p90 (``statistics.quantiles``, exclusive method) of step times, and their count."""
    if not times:
        raise ValueError("no step times")
    if len(times) == 1:
        p10 = p90 = times[0]
    else:
        deciles = statistics.quantiles(times, n=10)
        p10, p90 = deciles[0], deciles[-1]
    return {"median": statistics.median(times), "p10": p10, "p90": p90, "n": len(times)}


def compare(ours: list[float], theirs: list[float]) -> dict[str, Any]:
    """Both summaries and ``ratio``: our median over theirs."""
    a, b = summary(ours), summary(theirs)
    return {"unbroken": a, "hsdp": b, "ratio": a["median"] / b["median"]}


def healthy_figures(trials: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Per trial and overall (every trial's steps pooled) figures from ``[{"unbroken": [...], "hsdp": [...]}, ...]``;
    ``ratio_of_trials`` is the median of the per-trial ratios."""
    per_trial = [compare(t["unbroken"], t["hsdp"]) for t in trials]
    pooled = compare([x for t in trials for x in t["unbroken"]], [x for t in trials for x in t["hsdp"]])
    return {"trials": per_trial, "overall": pooled, "ratio_of_trials": statistics.median(t["ratio"] for t in per_trial)}


def process_of(source: str) -> int:
    """Process index j of an event's source: ``worker:<member>`` is 0, ``worker:<member>.p<j>`` is j."""
    last = source.rsplit(".", 1)[-1]
    return int(last[1:]) if last.startswith("p") and last[1:].isdigit() else 0


def heal_figures(events: list[dict[str, Any]], slot: int = KILLED_SLOT, group_size: int = GROUP_SIZE) -> dict[str, Any]:
    """The heal of the group in ``slot`` after its first restart, from a run's events: every heal
    event of the generation whose process-0 event names the restarted member as a receiver.

    Returns ``processes`` (j -> {"bytes", "seconds", "source"}), ``bytes`` (the group's, summed over
    j) and ``seconds`` (max over j), and, when the events have them, ``kill_to_heal_s`` (the fault
    to the end of the slowest transfer) and ``restart_to_commit_s`` (the restarted group's start to
    the first step committed with it). Raises ``ValueError`` if no such heal is in the events."""
    restarted = [e for e in events if e.get("kind") == "worker_start" and e.get("local_rank") == slot and e.get("restart", 0) >= 1]
    if not restarted:
        raise ValueError(f"slot {slot} was never restarted")
    member = restarted[0]["member"]
    started = restarted[0]["t"]
    heals = [e for e in events if e.get("kind") == "heal" and e["t"] >= started]
    # process 0's event names the member as its receiver; process j > 0's names the receiver's rank
    # in the shard-j group ("rank2"): the rejoin's events are those of the generation that healed it
    named = [e for e in heals if any(r == member or r.startswith(member + ".") for r in e.get("receivers", []))]
    processes: dict[int, dict[str, Any]] = {}
    for e in heals:
        if not named or e.get("generation") != named[0].get("generation"):
            continue
        j = process_of(e["source"])
        if j not in processes:
            processes[j] = {"bytes": int(e["bytes"]), "seconds": float(e["seconds"]), "source": e["source"], "t": e["t"]}
    if not processes:
        raise ValueError(f"no heal event names {member} as a receiver")
    if len(processes) < group_size:
        raise ValueError(f"heal events of only {len(processes)} of the group's {group_size} processes")
    out: dict[str, Any] = {
        "member": member,
        "processes": {str(j): processes[j] for j in sorted(processes)},
        "bytes": sum(p["bytes"] for p in processes.values()),
        "seconds": max(p["seconds"] for p in processes.values()),
    }
    faults = [e for e in events if e.get("kind") == "fault"]
    if faults:
        out["kill_to_heal_s"] = max(p["t"] for p in processes.values()) - faults[0]["t"]
    groups = len({e["local_rank"] for e in events if e.get("kind") == "worker_start"})
    healed = max(p["t"] for p in processes.values())
    full = [e for e in events if e.get("kind") == "step" and e["t"] > healed and e.get("members") == groups]
    if full:
        out["restart_to_commit_s"] = full[0]["t"] - started
    return out


# -- running the jobs -------------------------------------------------------------------------------


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_bounded(cmd: list[str], timeout: float, run_dir: str | None = None,
                until: Callable[[], bool] | None = None) -> tuple[int | None, str]:
    """Run ``cmd`` in its own session until it ends, ``timeout`` passes, or ``until()`` (polled every
    0.5 s) is true; in the last two cases it gets SIGTERM (an unbroken launcher stops its workers),
    then SIGKILL. Afterwards nothing it started is left: its process group and an unbroken run's
    workers (found by ``run_dir``) are killed. Returns (exit code, None if it timed out; output)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        timed_out = False
        try:
            deadline = time.monotonic() + timeout
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                if until is not None and until():
                    break
                time.sleep(0.5)
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=20)
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    pass
        finally:
            _kill_group(proc.pid)
            proc.wait()
            if run_dir is not None:
                for pid in processes_naming(run_dir):
                    _kill_group(pid)
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        log.seek(0)
        return (None if timed_out else proc.returncode), log.read()


def command(variant: str, nproc: int, run_dir: str, script_args: list[str], chaos: str | None = None) -> list[str]:
    """The command line of one run of ``fsdp_step.py``."""
    if variant == "hsdp":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
                SCRIPT, "--mode", "hsdp", "--group-size", str(GROUP_SIZE), *script_args]
    cmd = [sys.executable, "-m", "unbroken", "run", "--nproc-per-node", str(nproc), "--group-size", str(GROUP_SIZE),
           "--run-dir", run_dir, "--progress-interval", "0"]
    if chaos:
        cmd += ["--chaos", chaos, "--max-restarts", "3"]
    return [*cmd, SCRIPT, "--mode", "unbroken", *script_args]


def read_events(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    events = []
    with open(path) as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # a line still being written
                pass
    return events


def one_healthy(variant: str, args: argparse.Namespace, where: str, name: str) -> dict[str, Any]:
    """One run of ``variant``; its step times after the warm-up (and the raw record)."""
    times_path = os.path.join(where, f"{name}.json")
    run_dir = os.path.join(where, name)
    script_args = ["--steps", str(args.steps), "--hidden", str(args.hidden), "--layers", str(args.layers),
                   "--global-batch-size", str(args.global_batch_size), "--micro-batch-size", str(args.micro_batch_size),
                   "--times", times_path]
    code, out = run_bounded(command(variant, 2 * GROUP_SIZE, run_dir, script_args), args.run_timeout, run_dir)
    if not os.path.exists(times_path):
        raise RuntimeError(f"{variant} run {name} wrote no step times (exit {code}):\n{out[-3000:]}")
    with open(times_path) as f:
        record = json.load(f)
    kept = [t for s, t, m in zip(record["steps"], record["times"], record["members"]) if s > args.warmup and m == 2]
    if code != 0:  # the times were written by a run that then failed (say, at exit): keep them, say so
        print(f"  note: {variant} run {name} exited {code} after writing its times; last lines:\n"
              + "\n".join("    " + line for line in out.strip().splitlines()[-3:]), flush=True)
    return {"times": kept, "backward": [b for s, b in zip(record["steps"], record["backward"]) if s > args.warmup],
            "exit": code, "parameters": record["parameters"]}


def healthy(args: argparse.Namespace) -> dict[str, Any]:
    trials, raw = [], []
    with tempfile.TemporaryDirectory(prefix="bench-rg-") as where:
        for trial in range(args.trials):
            order = VARIANTS if trial % 2 == 0 else VARIANTS[::-1]
            runs = {v: one_healthy(v, args, where, f"{v}{trial}") for v in order}
            trials.append({v: runs[v]["times"] for v in VARIANTS})
            raw.append({"order": list(order), **{v: runs[v] for v in VARIANTS}})
            c = compare(runs["unbroken"]["times"], runs["hsdp"]["times"])
            print(f"trial {trial + 1} ({' first, '.join(order)} second): unbroken {1000 * c['unbroken']['median']:.1f} ms,"
                  f" hsdp {1000 * c['hsdp']['median']:.1f} ms, ratio {c['ratio']:.3f}", flush=True)
    figures = healthy_figures(trials)
    figures["runs"] = raw
    figures["backward_median"] = {v: statistics.median(b for r in raw for b in r[v]["backward"]) for v in VARIANTS}
    figures["parameters"] = raw[0]["unbroken"]["parameters"]
    return figures


def one_heal(args: argparse.Namespace, where: str, trial: int) -> dict[str, Any]:
    run_dir = os.path.join(where, f"heal{trial}")
    script_args = ["--steps", str(args.heal_steps), "--hidden", str(args.heal_hidden), "--layers", str(args.heal_layers),
                   "--global-batch-size", str(args.global_batch_size), "--micro-batch-size", str(args.micro_batch_size)]
    chaos = f"kill@step,rank={KILLED_RANK},step={args.kill_step}"

    def healed_and_committed() -> bool:  # then the rest of the run tells nothing: stop it
        try:
            return "restart_to_commit_s" in heal_figures(read_events(run_dir))
        except ValueError:
            return False

    code, out = run_bounded(command("unbroken", 3 * GROUP_SIZE, run_dir, script_args, chaos), args.run_timeout, run_dir,
                            until=healed_and_committed)
    events = read_events(run_dir)
    try:
        figures = heal_figures(events)
    except ValueError as e:
        kinds = {k: sum(1 for x in events if x.get("kind") == k) for k in ("worker_start", "fault", "heal", "step")}
        heals = [x for x in events if x.get("kind") == "heal"]
        raise RuntimeError(f"heal run {trial}: {e} (exit {code}; events {kinds}; heals {heals}):\n{out[-3000:]}") from None
    figures["exit"] = code
    return figures


def raw_worker(rank: int, port: int, shard_bytes: list[int], trials: int, out: str) -> None:
    """Rank j < K sends ``shard_bytes[j]`` to rank K + j, both pairs at once, each over its own 2-rank
    Gloo group; the slowest process's time per trial (rank 0 writes them)."""
    exit_with_parent()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    k = len(shard_bytes)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank, world_size=2 * k)
    pairs = [dist.new_group([j, k + j]) for j in range(k)]
    j = rank % k
    buffer = torch.ones(shard_bytes[j], dtype=torch.uint8)  # touched on both sides
    times = []
    for _ in range(trials + 1):  # the first is a warm-up (connections)
        dist.barrier()
        started = time.perf_counter()
        if rank < k:
            dist.send(buffer, k + j, group=pairs[j])
        else:
            dist.recv(buffer, j, group=pairs[j])
        took = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(float(took))
    if rank == 0:
        with open(out + ".tmp", "w") as f:
            json.dump(times[1:], f)
        os.replace(out + ".tmp", out)
    dist.barrier()
    os._exit(0)  # a Gloo group alive at exit can abort the interpreter


def raw_gloo(shard_bytes: list[int], trials: int, limit: float = 300.0) -> list[float]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=limit))
    with tempfile.TemporaryDirectory() as where:
        out = os.path.join(where, "raw.json")
        codes = run_spawned(raw_worker, [(r, store.port, shard_bytes, trials, out) for r in range(2 * len(shard_bytes))], limit)
        if not os.path.exists(out):
            raise RuntimeError(f"raw Gloo measurement gave no result (exit codes {codes})")
        with open(out) as f:
            return json.load(f)


def heal(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-rg-heal-") as where:
        runs = []
        for trial in range(args.heal_trials):
            r = one_heal(args, where, trial)
            runs.append(r)
            per = ", ".join(f"p{j} {p['bytes'] / 1e6:.1f} MB in {p['seconds']:.3f} s" for j, p in r["processes"].items())
            print(f"heal {trial + 1}: {per}; group {r['seconds']:.3f} s", flush=True)
    shard_bytes = [max(r["processes"][str(j)]["bytes"] for r in runs) for j in range(GROUP_SIZE)]
    raw = raw_gloo(shard_bytes, args.raw_trials)
    print(f"raw Gloo, {' and '.join(f'{b / 1e6:.1f} MB' for b in shard_bytes)} on 2 pairs at once: "
          f"median {statistics.median(raw):.3f} s", flush=True)
    group_s = [r["seconds"] for r in runs]
    from benchmarks.fsdp_step import parameter_count

    return {
        "runs": runs, "shard_bytes": shard_bytes, "group_bytes": sum(shard_bytes), "raw_seconds": raw,
        "heal_median_s": statistics.median(group_s), "raw_median_s": statistics.median(raw),
        "ratio": statistics.median(group_s) / statistics.median(raw),
        "parameters": parameter_count(args.heal_hidden, args.heal_layers),
    }


# -- the report -------------------------------------------------------------------------------------


def _ms(s: dict[str, float]) -> str:
    return f"{1000 * s['median']:.1f} ms ({1000 * s['p10']:.1f}–{1000 * s['p90']:.1f})"


def print_tables(result: dict[str, Any]) -> None:
    print(f"\n{result['date']}, torch {result['torch']}, Gloo on the CPU, one thread per process;"
          f" load average {result['load_average'][0]:.1f} before, {result['load_average'][1]:.1f} after\n")
    h = result.get("healthy")
    if h:
        s = result["settings"]
        print(f"Healthy step, 2 groups x 2 processes: float32 MLP {64}-{s['hidden']}x{s['layers']}-16 ({h['parameters'] / 1e6:.2f} M"
              f" parameters), AdamW, global batch {s['global_batch_size']}, micro-batches of {s['micro_batch_size']};"
              f" {s['steps']} steps a run, the first {s['warmup']} dropped; {len(h['trials'])} interleaved trials;"
              f" median (p10–p90) of one process's time between step ends\n")
        print("| trial | unbroken (2 groups x 2) | plain HSDP (torchrun, 2-D mesh) | unbroken / HSDP | target |")
        print("| --- | --- | --- | --- | --- |")
        for i, t in enumerate(h["trials"]):
            print(f"| {i + 1} | {_ms(t['unbroken'])} | {_ms(t['hsdp'])} | {t['ratio']:.3f} x | ≤ 1.05 x |")
        o = h["overall"]
        print(f"| all steps pooled | {_ms(o['unbroken'])} | {_ms(o['hsdp'])} | {o['ratio']:.3f} x | ≤ 1.05 x |")
        b = h["backward_median"]
        print(f"\nMedian time in the micro-batch loop (forward, backward, FSDP's collectives; HSDP's replicate allreduce):"
              f" unbroken {1000 * b['unbroken']:.1f} ms, HSDP {1000 * b['hsdp']:.1f} ms; the rest of a step is the commit"
              f" (unbroken: cross-group allreduce, vote, optimizer) or the optimizer step.\n")
    g = result.get("heal")
    if g:
        s = result["settings"]
        print(f"Heal of a restarted group, 3 groups x 2 processes: float32 MLP 64-{s['heal_hidden']}x{s['heal_layers']}-16"
              f" ({g['parameters'] / 1e6:.2f} M parameters; with AdamW {g['group_bytes'] / 1e6:.1f} MB per group),"
              f" process 1 of group 1 killed at step {s['kill_step']}; {len(g['runs'])} runs; raw: median of"
              f" {len(g['raw_seconds'])}\n")
        print("| run | process 0: bytes, seconds | process 1: bytes, seconds | group (max) | kill to healed | restart to first commit with it |")
        print("| --- | --- | --- | --- | --- | --- |")
        for i, r in enumerate(g["runs"]):
            cells = [f"{p['bytes'] / 1e6:.1f} MB, {p['seconds']:.3f} s" for p in r["processes"].values()]
            cells += ["–"] * (GROUP_SIZE - len(cells))
            extra = [f"{r[k]:.2f} s" if k in r else "–" for k in ("kill_to_heal_s", "restart_to_commit_s")]
            print(f"| {i + 1} | {cells[0]} | {cells[1]} | {r['seconds']:.3f} s | {extra[0]} | {extra[1]} |")
        raw = g["raw_seconds"]
        print(f"| raw Gloo send/recv, same bytes per shard, both pairs at once | | | {statistics.median(raw):.3f} s"
              f" ({min(raw):.3f}–{max(raw):.3f}) | | |")
        print(f"\nGroup heal / raw Gloo: {g['ratio']:.2f} x (medians).")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="interleaved pairs of healthy runs")
    parser.add_argument("--steps", type=int, default=45, help="steps per healthy run")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped at the start of each run")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--heal-trials", type=int, default=3, help="runs with a killed process")
    parser.add_argument("--heal-hidden", type=int, default=1536, help="width of the heal runs' model (state: 3 x 4 bytes a parameter)")
    parser.add_argument("--heal-layers", type=int, default=3)
    parser.add_argument("--heal-steps", type=int, default=10_000,
                        help="steps of a heal run (an upper bound: it is stopped once the healed group has committed)")
    parser.add_argument("--kill-step", type=int, default=5)
    parser.add_argument("--raw-trials", type=int, default=5)
    parser.add_argument("--only", choices=("healthy", "heal"), default=None)
    parser.add_argument("--run-timeout", type=float, default=300.0, help="seconds one run may take")
    parser.add_argument("--quick", action="store_true", help="a short run: 1 trial of 15 steps, 1 heal run of a small model")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of tables")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "replica_groups.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.trials, args.steps, args.warmup = 1, 12, 2
        args.heal_trials, args.heal_hidden, args.kill_step, args.raw_trials = 1, 512, 3, 3
    if args.steps <= args.warmup + 2:
        parser.error("--steps must exceed --warmup by at least 3")
    if args.heal_steps <= args.kill_step:
        parser.error("--heal-steps must exceed --kill-step")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    load_before = os.getloadavg()[0]
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cpus": os.cpu_count(),
                              "settings": {k: v for k, v in vars(args).items() if k not in ("json", "out")}}
    if args.only in (None, "healthy"):
        result["healthy"] = healthy(args)
    if args.only in (None, "heal"):
        result["heal"] = heal(args)
    result["load_average"] = [load_before, os.getloadavg()[0]]
    save_results(args.out, result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_tables(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
