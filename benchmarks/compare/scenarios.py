"""The five scenarios, each one run of one system, measured from the step logs.

Every wait has a bound; every run is stopped (all its processes ended) whatever happens.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable

from benchmarks.compare import analysis
from benchmarks.compare.systems import WORKERS, Run, System

GLOBAL_BATCH = 96
HEALTHY_STEPS = 600
FAULT_STEPS = 2500
FAULT_AT = 310  # the torchrun elastic checkpoint before it is step 300: 10 steps to redo
WARMUP = 50


class ScenarioError(RuntimeError):
    """A run did not reach the state the scenario needs (the message says which)."""


def _wait(run: Run, condition: Callable[[], bool], timeout: float) -> bool:
    """Follow the logs until ``condition`` holds (True), the run ended without it, or the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended = run.done()
        run.tail.poll()  # after the check: the last records of an ended run are read too
        if condition():
            return True
        if ended:
            return False
        time.sleep(0.005)
    return False


def _launch(system: System, directory: str, steps: int) -> Run:
    run = Run(system, directory)
    try:
        system.launch(run, steps)
    except BaseException:
        run.stop()
        raise
    return run


def _common(run: Run, result: dict) -> dict:
    records = analysis.read(run.log_dir)
    traj = analysis.trajectory(records)
    starts = sum(1 for r in records if r["k"] == "start")
    result.update(
        finished=run.finished(),
        redone=traj.redone,
        restarts=max(0, starts - WORKERS),
        **{f"samples_{k}": v for k, v in analysis.samples(traj, GLOBAL_BATCH).items()},
    )
    return result


def healthy(system: System, directory: str, steps: int = HEALTHY_STEPS) -> dict:
    run = _launch(system, directory, steps)
    try:
        _wait(run, run.done, 300)
        records = analysis.read(run.log_dir)
        return _common(run, {"step_seconds": analysis.step_seconds(records, WARMUP)})
    finally:
        run.stop()


def _victim(run: Run, at: int) -> tuple[int, set[int]]:
    if not _wait(run, lambda: run.tail.top >= at and run.tail.member(1) is not None, 300):
        raise ScenarioError(f"{run.system.name} did not reach step {at}; see {run.directory}")
    return run.tail.member(1), set(run.tail.latest)


def kill(system: System, directory: str, healthy_step: float, steps: int = FAULT_STEPS, at: int = FAULT_AT) -> dict:
    """SIGKILL member 1 at step ``at``; the run then goes on to its end (or dies)."""
    run = _launch(system, directory, steps)
    try:
        victim, old = _victim(run, at)
        t = time.time()
        os.kill(victim, signal.SIGKILL)
        _wait(run, run.done, 300)
        records = analysis.read(run.log_dir)
        result = analysis.after_fault(records, t, victim, healthy_step)
        result["rejoin"] = analysis.rejoin(records, t, old)
        return _common(run, result)
    finally:
        run.stop()


def stop(system: System, directory: str, healthy_step: float, cap: float, steps: int = FAULT_STEPS, at: int = FAULT_AT) -> dict:
    """SIGSTOP member 1 at step ``at``; SIGCONT once the others commit again, or after ``cap`` s."""
    run = _launch(system, directory, steps)
    try:
        victim, _ = _victim(run, at)
        t = time.time()
        os.kill(victim, signal.SIGSTOP)
        try:
            time.sleep(0.05)
            run.tail.poll()
            # the first step the victim cannot be part of (see analysis.after_fault)
            first_without = run.tail.latest[victim]["step"] + 2
            moved = _wait(run, lambda: any(r["step"] >= first_without and r["pid"] != victim for r in run.tail.latest.values()), cap)
        finally:
            os.kill(victim, signal.SIGCONT)
        _wait(run, run.done, 300)
        records = analysis.read(run.log_dir)
        result = analysis.after_fault(records, t, victim, healthy_step)
        result["cap"] = cap
        if not moved:
            result["stall"] = None  # nothing within the cap
        return _common(run, result)
    finally:
        run.stop()


def chaos(system: System, directory: str, seconds: float, every: float, seed: int) -> dict:
    """SIGKILL a random member about every ``every`` s for ``seconds`` s; goodput and samples."""
    rng = random.Random(seed)
    run = _launch(system, directory, 0)
    kills: list[float] = []
    died = None
    try:
        if not _wait(run, lambda: run.tail.top >= WARMUP, 300):
            raise ScenarioError(f"{system.name} did not reach step {WARMUP}; see {directory}")
        t0 = time.time()
        next_kill = t0 + every * rng.uniform(0.75, 1.25)
        while time.time() < t0 + seconds:
            run.tail.poll()
            if run.done():
                died = time.time() - t0
                break
            if time.time() >= next_kill:
                members = run.tail.members()
                if members:
                    victim = rng.choice(members)
                    os.kill(victim, signal.SIGKILL)
                    kills.append(time.time() - t0)
                next_kill += every * rng.uniform(0.75, 1.25)
            time.sleep(0.05)
        t1 = t0 + seconds  # a job that died early produced nothing for the rest of the window
        run.stop()
        records = analysis.read(run.log_dir)
        traj = analysis.trajectory(records)
        window = analysis.Trajectory({s: rs for s, rs in traj.by_step.items() if t0 <= rs[0]["t"] <= t1})
        useful = analysis.samples(window, GLOBAL_BATCH)["useful"]
        result = _common(run, {"kills": kills, "seconds": seconds, "goodput": useful / (t1 - t0), "died_after": died})
        result["finished"] = None  # chaos runs have no end of their own
        return result
    finally:
        run.stop()
