"""What a run's step logs say: step time, stall, steps redone, rejoin, samples lost or repeated.

Pure functions over the records that ``workload.StepLog`` writes, the same for every system.

The *final trajectory* is what the finished model is made of: for each step number, the last
execution of it. A system that rolls back to a checkpoint commits steps again; the later
commits replace the earlier ones. All records of step s of one execution come before any record
of step s + 1 (a member's next allreduce needs every member's previous commit), so a record for
a step at or below the highest seen so far starts a new execution of that step when it comes
from a rank already recorded for it, from a different member count, or when the step has no
record yet; otherwise it is a late record of the same execution (its writer was stopped).
"""

from __future__ import annotations

import glob
import json
import os
import statistics
from dataclasses import dataclass, field

from benchmarks.compare.plan import share


def read(directory: str) -> list[dict]:
    """Every record of every process under ``directory``, ordered by time; torn lines are skipped."""
    records = []
    for path in glob.glob(os.path.join(directory, "w_*.jsonl")):
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    records.sort(key=lambda r: r["t"])
    return records


def steps(records: list[dict]) -> list[dict]:
    return [r for r in records if r["k"] == "step"]


@dataclass
class Trajectory:
    """The final trajectory: step number -> the records of its last execution."""

    by_step: dict[int, list[dict]] = field(default_factory=dict)
    redone: int = 0  # committed steps that were executed again after a rollback


def trajectory(records: list[dict]) -> Trajectory:
    result = Trajectory()
    top = -1
    for r in steps(records):
        if not r["pos"]:
            continue  # a step this process committed without contributing samples (healing)
        s = r["step"]
        current = result.by_step.get(s)
        again = current is not None and (any(c["rank"] == r["rank"] for c in current) or current[0]["world"] != r["world"])
        late = current is not None and not again  # e.g. a member stopped before it wrote its record
        if (s < top and not late) or again:
            dropped = [k for k in result.by_step if k >= s]
            result.redone += len(dropped)
            for k in dropped:
                del result.by_step[k]
        result.by_step.setdefault(s, []).append(r)
        top = s if ((s < top and not late) or again) else max(top, s)
    return result


def samples(traj: Trajectory, global_batch: int) -> dict:
    """Samples the final model missed (lost) or saw more than once (repeated), by stream position.

    A member killed after its share went into a committed step but before it wrote its
    record leaves fewer records than the step's member count. Where the shares follow from the
    member count (``slots`` equal to ``world``), the missing members' shares are filled in and
    counted as ``inferred``.
    """
    seen: dict[int, int] = {}
    inferred = 0
    for s, records in traj.by_step.items():
        ranges = [tuple(p) for r in records for p in r["pos"]]
        world, slots = records[0]["world"], records[0].get("slots", records[0]["world"])
        if len(records) < world and slots == world:
            present = {r["rank"] for r in records}
            for rank in set(range(world)) - present:
                ranges.append(share(s, rank, world, global_batch))
                inferred += 1
        for a, b in ranges:
            for p in range(a, b):
                seen[p] = seen.get(p, 0) + 1
    expected = {p for s in traj.by_step for p in range(s * global_batch, (s + 1) * global_batch)}
    return {
        "steps": len(traj.by_step),
        "useful": len(expected & seen.keys()),
        "lost": len(expected - seen.keys()),
        "repeated": sum(c - 1 for c in seen.values()) + len(seen.keys() - expected),
        "inferred": inferred,
    }


def step_seconds(records: list[dict], warmup: int = 50) -> float | None:
    """Median time between consecutive commits of the lowest rank, after ``warmup`` steps."""
    times = {}
    for r in steps(records):
        if r["rank"] == 0 and r["step"] >= warmup:
            times[r["step"]] = r["t"]
    gaps = [times[s] - times[s - 1] for s in times if s - 1 in times]
    return statistics.median(gaps) if gaps else None


def after_fault(records: list[dict], t_fault: float, victim: int, healthy: float) -> dict:
    """Stall: fault to the survivors' first commit of a step the victim cannot be part of, less a step.

    The victim may have sent its share of the step after its last record before it was
    stopped or killed, so the survivors may still commit that one step without it; the step
    after it needs a new group. A victim's record is written after its commit and before its
    next allreduce, so that first step is two beyond its last record.
    """
    mine = [r["step"] for r in steps(records) if r["pid"] == victim and r["t"] < t_fault + 0.1]
    before = [r["step"] for r in steps(records) if r["t"] < t_fault]
    last = max(before) if before else -1
    first_without = (max(mine) if mine else last) + 2
    progress = [r for r in steps(records) if r["t"] >= t_fault and r["step"] >= first_without and r["pid"] != victim]
    return {"last_step": last, "stall": (progress[0]["t"] - t_fault - healthy) if progress else None}


def rejoin(records: list[dict], t_fault: float, old_pids: set[int]) -> float | None:
    """The slowest new process started after the fault: its start to its first commit."""
    starts = {r["pid"]: r["t"] for r in records if r["k"] == "start" and r["pid"] not in old_pids and r["t"] >= t_fault - 1}
    firsts: dict[int, float] = {}
    for r in steps(records):
        if r["pid"] in starts and r["pid"] not in firsts:
            firsts[r["pid"]] = r["t"]
    if not firsts:
        return None
    return max(firsts[p] - starts[p] for p in firsts)


def summarize(values: list[float | None]) -> dict:
    """Median and range of the measured values; ``missing`` counts runs that gave none."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0, "missing": len(values)}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got), "missing": len(values) - len(got)}
