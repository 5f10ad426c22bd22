"""Goodput of a long training job on thousands of GPUs under a published failure rate (issue 14).

    python benchmarks/simulate_goodput.py [--days 54] [--trials 20] [--seed 0]
                                          [--gpus 1024 2048 4096 8192 16384] [--plot PATH | --no-plot] [--json]

A discrete-event simulation. Failures arrive as a Poisson process at the Llama 3 paper's rate (419
unexpected interruptions in 54 days on 16,384 GPUs), scaled linearly with the GPU count. Whether
a failure is a crash (connections close, the process exits) or a hang (a host or link goes
silent), and whether its processes restart in place (software) or a node must be replaced
(hardware), are drawn independently with the fractions of that paper's breakdown (Table 5,
classified in ``LLAMA3_CAUSES``). Every strategy sees the same failures. Three strategies:

- ``unbroken``: survivors detect, re-form without the failed replica, redo the interrupted step and
  go on with one replica fewer until its replacement joins. The replacement catches up from a live
  peer while they train (its state, then every step since); then they re-form again, which costs
  them the re-formation and what ``bench_rejoin.py`` measured beyond a step. A replica group is one member of the coordinator
  (``--group-size``), so re-formations are costed at one member per replica, and only the
  communicators across replicas are set up again (each replica's own mesh stays).
- ``restart``: restart-the-world with checkpoints (torchrun-like): detect (a hang only at the
  collective timeout), restart every process, reload the last checkpoint and redo everything since.
- ``torchft``: torchft-like replica loss: the survivors wait for the lighthouse's heartbeat
  timeout, drop the interrupted step and go on with one replica fewer; the replacement heals from a
  peer without stopping the others.

All three take the same asynchronous checkpoint (a copy to host memory). ``restart`` and
``torchft`` take it every Young/Daly interval ``sqrt(2 x stall x MTBF)`` for the job's MTBF at that
size (neither tells failures apart). ``unbroken`` takes it as ``--checkpoint-every auto`` does:
Young/Daly over the failures that live peers cannot heal (the loss of every replica at once,
which this simulation does not draw), estimated ``(prior + seconds trained) / (losses + 1)``, so
its interval grows with the run up to the cap (``unbroken.storage.checkpoint_schedule``). Goodput is
useful training time (at full capacity) over wall time. Every input is in :class:`Inputs`, marked
measured here (with its command) or assumed; the table is printed with the results.

Not modelled: healthy-step overheads (a few ms a step, measured here); planned maintenance;
correlated failures (a switch taking several nodes at once); the loss of every replica at once
(what unbroken's durable checkpoint is for, and what its interval would count); stragglers; scheduling queues and job start-up
beyond the figures given. A failure during a stall is handled after it ends; the step in progress
is lost for a uniform fraction in (0, 1) of a step. The restart baseline gets a spare node at once
and its restart as measured here on 3 CPU processes: real restarts of thousands of GPUs take
longer, so its goodput is an upper bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import os
import random
import sys
from dataclasses import dataclass, field

STRATEGIES = ("unbroken", "restart", "torchft")
DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "goodput.png")

# Llama 3 paper ("The Llama 3 Herd of Models", 2024), Table 5: the 419 unexpected interruptions of
# 54 days on 16,384 H100s, by cause. Ours: "hang" where the failed member's peers see no closed
# connection (a host, NIC or link gone silent, NCCL watchdog); "in place" where the same node can
# restart its processes (software), else the node is replaced.
LLAMA3_CAUSES: dict[str, tuple[int, str, str]] = {
    "faulty GPU": (148, "crash", "replace"), "GPU HBM3 memory": (72, "crash", "replace"),
    "software bug": (54, "crash", "in place"), "network switch/cable": (35, "hang", "replace"),
    "host maintenance (unplanned)": (32, "crash", "replace"), "GPU SRAM memory": (19, "crash", "replace"),
    "GPU system processor": (17, "crash", "replace"), "NIC": (7, "hang", "replace"),
    "NCCL watchdog timeout": (7, "hang", "in place"), "silent data corruption": (6, "crash", "replace"),
    "GPU thermal interface and sensor": (6, "crash", "replace"), "SSD": (3, "crash", "replace"),
    "power supply": (3, "hang", "replace"), "server chassis": (2, "hang", "replace"),
    "IO expansion board": (2, "hang", "replace"), "dependency": (2, "crash", "in place"),
    "CPU": (2, "hang", "replace"), "system memory": (2, "hang", "replace"),
}


def _in(value, unit: str, kind: str, source: str):
    assert kind in ("measured here", "assumed", "published"), kind
    return field(default=value, metadata={"unit": unit, "kind": kind, "source": source})


def _share(kind: str) -> float:
    """The fraction of Llama 3's interruptions whose cause is classified ``kind``."""
    return sum(n for n, *kinds in LLAMA3_CAUSES.values() if kind in kinds) / sum(n for n, *_ in LLAMA3_CAUSES.values())


COMPARE = "`python benchmarks/bench_compare.py`"
CATCH_UP_STALL = 0.59  # benchmarks/bench_rejoin.py, 2026-12-03, the later run (the heal: 0.63 s; the earlier run 0.87 and 1.25 s)


@dataclass(frozen=True)
class Inputs:
    """Every input of the simulation; ``kind`` and ``source`` say where its value comes from."""

    interruptions: int = _in(419, "failures", "published", "Llama 3 paper, unexpected interruptions")
    observed_days: float = _in(54.0, "days", "published", "Llama 3 paper, 54 days of pre-training")
    observed_gpus: int = _in(16384, "GPUs", "published", "Llama 3 paper, 16,384 H100s; rate linear in GPUs")
    hang_fraction: float = _in(_share("hang"), "", "assumed", "Llama 3 Table 5 causes that close no connection "
                               "(network, NIC, host power/board/CPU/memory, NCCL watchdog)")
    in_place_fraction: float = _in(_share("in place"), "", "assumed", "Llama 3 Table 5 software causes "
                                   "(software bug, dependency, NCCL watchdog) restart on the same node")
    step_s: float = _in(5.0, "s", "assumed", "a large model's step at scale; weak scaling, the same at every size")
    gpus_per_replica: int = _in(128, "GPUs", "assumed", "one data-parallel replica group "
                                "(Llama 3 405B: 8-way tensor x 16-way pipeline)")
    state_bytes: float = _in(405e9 * 16, "bytes", "assumed", "405B parameters x 16 B "
                             "(bf16 weights and gradients, fp32 master weights, 2 Adam moments)")
    link_bytes_per_s: float = _in(50e9, "B/s per GPU", "assumed", "one 400 Gb/s NIC per GPU")
    heal_efficiency: float = _in(1.0, "of link", "measured here", "a warmed heal over two connections in 0.65-0.72x "
                                 "the time of a Gloo broadcast over one, 1.21 GB (`python benchmarks/bench_heal.py`): "
                                 "at the link's speed, taken as 1")
    snapshot_bytes_per_s: float = _in(25e9, "B/s per GPU", "assumed", "pinned device-to-host copy, 8 GPUs per host "
                                      "(measured here on CPU only: 2.05 GB/s, `python benchmarks/bench_checkpoint.py`)")
    storage_bytes_per_s: float = _in(2e12, "B/s", "assumed", "the Llama 3 paper's storage, 2 TB/s sustained; "
                                     "a checkpoint read once, then broadcast")
    checkpoint_interval_s: float | None = _in(None, "s", "assumed", "Young/Daly sqrt(2 x stall x MTBF) at each "
                                              "size (restart, torchft)")
    checkpoint_prior_s: float = _in(3600.0, "s", "assumed", "unbroken's `auto`: the prior MTBF of losses of every live "
                                    "copy (`UNBROKEN_CHECKPOINT_MTBF`'s default)")
    checkpoint_max_interval_s: float = _in(1800.0, "s", "assumed", "unbroken's `auto`: the cap on its interval "
                                           "(`UNBROKEN_CHECKPOINT_MAX_INTERVAL`'s default)")
    pg_setup_s_per_1k_gpus: float = _in(0.5, "s", "assumed", "NCCL communicator set-up per 1,000 GPUs, "
                                        "paid by every strategy each time a group forms")
    replacement_s: float = _in(300.0, "s", "assumed", "a standby node taken, its processes started, CUDA ready")
    unbroken_crash_s: float = _in(0.083, "s", "measured here", "whole node killed -> survivors commit again "
                                  "(`python benchmarks/bench_lost_node.py`)")
    unbroken_hang_s: float = _in(3.0, "s", "measured here", "the default heartbeat timeout: a hang stalled 1.83 s "
                                 "at `--heartbeat-timeout 2` (`python benchmarks/bench_failures.py`)")
    unbroken_reform_s: tuple = _in(
        ((128, 0.006), (256, 0.009), (1000, 0.033), (4096, 0.143), (8192, 0.241), (16384, 0.367)), "(members, s)",
        "measured here", "a member killed -> every survivor re-formed, heartbeat interval 2 s, 2 shared cores (`python "
        "benchmarks/bench_coordinator.py --members 128 256 1000 4096 8192 16384`; "
        "docs/guide/scale.md); linear between, extrapolated beyond 16,384; a replica group is one member")
    unbroken_rejoin_s: float = _in(3.92, "s", "measured here", f"restarted process -> its first commit ({COMPARE})")
    unbroken_catch_up_stall_s: float = _in(CATCH_UP_STALL, "s", "measured here", "what a rejoin costs the survivors beyond "
                                           "a step, the newcomer caught up while they trained; 1 GB of state on 2 CPU "
                                           "cores (`python benchmarks/bench_rejoin.py`)")
    restart_crash_s: float = _in(6.41, "s", "measured here", "torchrun elastic, SIGKILL -> survivors commit again "
                                 f"({COMPARE})")
    restart_hang_s: float = _in(630.0, "s", "assumed", "torch's NCCL collective timeout (10 min) + torchrun's 30 s "
                                "shutdown grace (measured here with Gloo's 30-min timeout: 1831.6 s)")
    torchft_crash_s: float = _in(5.10, "s", "measured here", f"torchft 0.2.0, SIGKILL stall, 5 s heartbeat timeout ({COMPARE})")
    torchft_hang_s: float = _in(5.03, "s", "measured here", f"torchft 0.2.0, SIGSTOP -> survivors commit again ({COMPARE})")
    torchft_rejoin_s: float = _in(5.05, "s", "measured here", f"torchft 0.2.0, restart -> first commit ({COMPARE})")


# --- the costs, from the inputs -------------------------------------------------------------

def failure_rate_per_s(inp: Inputs, gpus: int) -> float:
    return inp.interruptions / (inp.observed_days * 86400.0) * gpus / inp.observed_gpus


def checkpoint_stall_s(inp: Inputs) -> float:
    """Every GPU copies its shard of one replica's state to host memory."""
    return inp.state_bytes / inp.gpus_per_replica / inp.snapshot_bytes_per_s


def checkpoint_interval_s(inp: Inputs, gpus: int) -> float:
    """The configured interval, or Young/Daly's for the MTBF at ``gpus``; never under one step."""
    rate = failure_rate_per_s(inp, gpus)
    if inp.checkpoint_interval_s is not None:
        return max(inp.step_s, inp.checkpoint_interval_s)
    return math.inf if rate == 0 else max(inp.step_s, math.sqrt(2 * checkpoint_stall_s(inp) / rate))


def unbroken_interval_s(inp: Inputs, trained_s: float) -> float:
    """unbroken's ``auto`` interval after ``trained_s`` seconds without a loss of every live copy."""
    from unbroken.storage.checkpoint_schedule import young_daly_interval

    ideal = young_daly_interval(checkpoint_stall_s(inp), inp.checkpoint_prior_s + trained_s)
    return max(inp.step_s, min(inp.checkpoint_max_interval_s, ideal))


def heal_s(inp: Inputs) -> float:
    """Each GPU of the new replica receives its shard from its counterpart in a live one."""
    return inp.state_bytes / inp.gpus_per_replica / (inp.link_bytes_per_s * inp.heal_efficiency)


def pg_setup_s(inp: Inputs, gpus: int) -> float:
    return inp.pg_setup_s_per_1k_gpus * gpus / 1000


def reform_s(inp: Inputs, gpus: int) -> float:
    """The measured re-formation time at ``gpus`` members, linear between points and beyond."""
    pts = inp.unbroken_reform_s
    (x0, y0), (x1, y1) = next(((a, b) for a, b in zip(pts, pts[1:]) if gpus <= b[0]), (pts[-2], pts[-1]))
    return max(0.0, y0 + (y1 - y0) * (gpus - x0) / (x1 - x0))


def reload_s(inp: Inputs) -> float:
    return inp.state_bytes / inp.storage_bytes_per_s + heal_s(inp)


# --- the simulation -------------------------------------------------------------------------

def draw_failures(inp: Inputs, gpus: int, horizon_s: float, rng: random.Random) -> list[tuple[float, bool, bool, float]]:
    """(time, hang?, in place?, fraction of the step in progress) of every failure before the horizon."""
    rate, out, t = failure_rate_per_s(inp, gpus), [], 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= horizon_s:
            break
        out.append((t, rng.random() < inp.hang_fraction, rng.random() < inp.in_place_fraction, rng.random()))
    return out


def _advance(t: float, end: float, since: float, interval: float, stall: float) -> tuple[float, float, float, int]:
    """Train from wall time ``t`` until ``end``, stalling ``stall`` after every ``interval`` of
    training. Returns (new time, training time, training time since the last checkpoint,
    checkpoints); the new time is past ``end`` when ``end`` falls inside a stall."""
    first = t + interval - since
    if first >= end:
        return end, end - t, since + end - t, 0
    cycles, rem = divmod(end - first, interval + stall)
    trained = (interval - since) + cycles * interval
    if rem < stall:
        return end + stall - rem, trained, 0.0, int(cycles) + 1
    return end, trained + rem - stall, rem - stall, int(cycles) + 1


_RETAKE_S = 3600.0


def simulate(strategy: str, inp: Inputs, gpus: int, failures: list, horizon_s: float) -> dict:
    """One run of ``strategy`` through ``failures``: useful and wall seconds, checkpoints taken."""
    replicas = max(1, gpus // inp.gpus_per_replica)
    interval, stall = checkpoint_interval_s(inp, gpus), checkpoint_stall_s(inp)
    grows = strategy == "unbroken" and inp.checkpoint_interval_s is None  # `auto`: not from the failure rate
    if math.isinf(interval) and not grows:
        stall = 0.0
    # restart sets up every GPU's communicators again; unbroken and torchft only those across replicas
    pg = pg_setup_s(inp, gpus) if strategy == "restart" else pg_setup_s(inp, replicas)
    heal, reform = heal_s(inp), reform_s(inp, replicas)
    t = useful = since = 0.0
    checkpoints, out, i = 0, [], 0  # out: a heap of the times replicas come back
    while True:
        next_failure = failures[i][0] if i < len(failures) else math.inf
        next_return = out[0] if out else math.inf
        # unbroken's interval is taken again at least every simulated hour (and at every event)
        end = min(next_failure, next_return, horizon_s, t + _RETAKE_S if grows else math.inf)
        if end > t:
            capacity = max(0, replicas - len(out)) / replicas
            if grows:  # no loss of every replica is drawn: its interval grows with the run
                interval = unbroken_interval_s(inp, t)
            t, trained, since, n = _advance(t, end, since, interval, stall)
            useful += capacity * trained
            checkpoints += n
        if end == horizon_s and end < min(next_failure, next_return):
            break
        if end < min(next_failure, next_return, horizon_s):
            continue  # only the interval is taken again
        if next_return <= next_failure:  # a replacement joins
            heapq.heappop(out)
            # unbroken: the newcomer caught up while the others trained; they re-form for it
            t += reform + pg + inp.unbroken_catch_up_stall_s if strategy == "unbroken" else pg
            continue
        _, hang, in_place, frac = failures[i]
        i += 1
        capacity = max(0, replicas - len(out)) / replicas
        if strategy == "restart":
            useful -= since  # everything since the last checkpoint is redone
            since = 0.0
            t += (inp.restart_hang_s if hang else 0.0) + inp.restart_crash_s + pg + reload_s(inp)
            continue
        useful -= capacity * frac * inp.step_s  # the interrupted step
        if strategy == "unbroken":
            t += (inp.unbroken_hang_s if hang else inp.unbroken_crash_s) + reform + pg
            back = inp.unbroken_rejoin_s if in_place else inp.replacement_s
        else:
            t += (inp.torchft_hang_s if hang else inp.torchft_crash_s) + pg
            back = (inp.torchft_rejoin_s if in_place else inp.replacement_s) + heal
        heapq.heappush(out, t + back)
    return {"useful_s": useful, "wall_s": t, "failures": len(failures), "checkpoints": checkpoints, "stall_s": stall}


def run(inp: Inputs, gpus_list: list[int], days: float, trials: int, seed: int) -> dict:
    horizon = days * 86400.0
    results = []
    for gpus in gpus_list:
        runs: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
        for trial in range(trials):
            failures = draw_failures(inp, gpus, horizon, random.Random(f"{seed}/{gpus}/{trial}"))
            for s in STRATEGIES:
                runs[s].append(simulate(s, inp, gpus, failures, horizon))
        rate = failure_rate_per_s(inp, gpus)
        interval = checkpoint_interval_s(inp, gpus)
        row = {"gpus": gpus, "replicas": max(1, gpus // inp.gpus_per_replica),
               "mtbf_h": None if rate == 0 else 1 / rate / 3600,
               "failures_per_trial": sum(r["failures"] for r in runs["unbroken"]) / trials,
               "checkpoint_interval_s": None if math.isinf(interval) else interval, "strategies": {}}
        for s, rs in runs.items():
            goodputs = [r["useful_s"] / r["wall_s"] for r in rs]
            failures = sum(r["failures"] for r in rs)
            lost = sum(r["wall_s"] - r["useful_s"] - r["checkpoints"] * r["stall_s"] for r in rs)
            row["strategies"][s] = {
                "goodput": sum(goodputs) / trials, "goodput_min": min(goodputs), "goodput_max": max(goodputs),
                "lost_s_per_failure": lost / failures if failures else None,
                "checkpoints_per_trial": sum(r["checkpoints"] for r in rs) / trials,
                "checkpoint_overhead": sum(r["checkpoints"] * r["stall_s"] for r in rs) / sum(r["wall_s"] for r in rs)}
        results.append(row)
    return {"seed": seed, "days": days, "trials": trials, "inputs": inputs_table(inp), "derived": derived(inp),
            "results": results}


def inputs_table(inp: Inputs) -> list[dict]:
    return [{"name": f.name, "value": getattr(inp, f.name), "unit": f.metadata["unit"],
             "kind": f.metadata["kind"], "source": f.metadata["source"]}
            for f in dataclasses.fields(inp)]


def derived(inp: Inputs) -> dict:
    return {"checkpoint_stall_s": checkpoint_stall_s(inp), "heal_s": heal_s(inp), "reload_s": reload_s(inp),
            "state_bytes_per_gpu": inp.state_bytes / inp.gpus_per_replica}


# --- output ---------------------------------------------------------------------------------

def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, tuple):
        return ", ".join(f"{m:,}: {s} s" for m, s in value)
    return "auto" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def markdown(report: dict) -> str:
    lines = ["| GPUs | replicas | MTBF | failures | checkpoint every (restart, torchft) | "
             + " | ".join(f"{s} goodput (min-max)" for s in STRATEGIES) + " | lost per failure: " + " / ".join(STRATEGIES)
             + " | checkpoint stalls: " + " / ".join(STRATEGIES) + " |",
             "|" + " --- |" * (7 + len(STRATEGIES))]
    for row in report["results"]:
        cells = [f"{row['gpus']:,}", str(row["replicas"]),
                 "-" if row["mtbf_h"] is None else f"{row['mtbf_h']:.1f} h", f"{row['failures_per_trial']:.1f}",
                 "never" if row["checkpoint_interval_s"] is None else f"{row['checkpoint_interval_s']:.0f} s"]
        rs = [row["strategies"][s] for s in STRATEGIES]
        cells += [f"{100 * r['goodput']:.2f} % ({100 * r['goodput_min']:.2f}-{100 * r['goodput_max']:.2f})" for r in rs]
        cells.append(" / ".join("-" if r["lost_s_per_failure"] is None else f"{r['lost_s_per_failure']:.1f} s" for r in rs))
        cells.append(" / ".join(f"{100 * r['checkpoint_overhead']:.2f} %" for r in rs))
        lines.append("| " + " | ".join(cells) + " |")
    d = report["derived"]
    lines += ["", f"Derived: checkpoint stall {d['checkpoint_stall_s']:.2f} s, heal {d['heal_s']:.2f} s, "
              f"restart's reload {d['reload_s']:.2f} s, {d['state_bytes_per_gpu'] / 1e9:.1f} GB of state per GPU.", "",
              "| input | value | unit | kind | source |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['name']} | {_fmt(r['value'])} | {r['unit']} | {r['kind']} | {r['source']} |" for r in report["inputs"]]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [row["gpus"] for row in report["results"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s, label in zip(STRATEGIES, ("unbroken", "restart the world + checkpoints (torchrun-like)", "torchft-like")):
        ax.plot(gpus, [100 * row["strategies"][s]["goodput"] for row in report["results"]], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [f"{g:,}" for g in gpus])
    ax.set_xlabel("GPUs (failure rate linear in GPUs, Llama 3)")
    ax.set_ylabel("goodput, % of wall time")
    ax.set_title(f"Simulated goodput, {report['days']:g} days, mean of {report['trials']} trials")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--days", type=float, default=54.0, help="simulated wall time per trial")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--plot", default=DEFAULT_PLOT, help=f"where to draw the chart (default {DEFAULT_PLOT})")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.days <= 0 or args.trials < 1:
        parser.error("--days must be positive and --trials at least 1")
    report = run(Inputs(), args.gpus, args.days, args.trials, args.seed)
    if not args.no_plot:
        plot(report, args.plot)
        report["plot"] = args.plot
    print(json.dumps(report) if args.json else markdown(report))
    if not args.json and not args.no_plot:
        print(f"\nchart: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
