"""Running real jobs from tests and benchmarks: bounded, and leaving no process behind whatever happens."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from testbed.processes import exit_with_parent  # noqa: F401  (for spawned test workers too)
from testbed.processes import processes_naming as _processes_of

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
GLOBAL = 24
"""The global batch size of the test script (train_exact.py) by default."""
EXACT = os.path.join(SCRIPTS, "train_exact.py")


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    run_dir: str

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        path = os.path.join(self.run_dir, "events.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            events = [json.loads(line) for line in f]
        return [e for e in events if kind is None or e["kind"] == kind]

    def summary(self) -> dict[str, Any]:
        with open(os.path.join(self.run_dir, "launcher.json")) as f:
            return json.load(f)


def wait_for(predicate, timeout: float, what: str):
    """Poll ``predicate`` until it returns something truthy (returned), or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def kill_leftovers(run_dir: str) -> list[int]:
    """SIGKILL every worker the run started that is still alive (by process group and by pid)."""
    killed = []
    for pid in [e["pid"] for e in Run(0, "", "", run_dir).events("worker_start")] + _processes_of(run_dir):
        if not _running(pid):
            continue
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def _running(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (an orphan waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def alive_workers(run_dir: str) -> list[int]:
    """Workers of the run that still run (their process-group leaders); not the launcher's
    zygote, which forks them (:mod:`unbroken.launch.zygote`), though ``kill_leftovers`` ends it too."""
    pids = {e["pid"] for e in Run(0, "", "", run_dir).events("worker_start")} | set(_processes_of(run_dir))
    return sorted(pid for pid in pids if _running(pid) and not _is_zygote(pid))


def _is_zygote(pid: int) -> bool:
    from unbroken.launch.zygote import ZYGOTE_NAME

    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == ZYGOTE_NAME[:15]
    except OSError:
        return False


def unbroken(run_dir: str, *args: str, timeout: float = 180.0, env: dict[str, str] | None = None) -> Run:
    """``unbroken run --run-dir RUN_DIR ARGS...``; fails the test if it outlives ``timeout``."""
    return command(["run", "--run-dir", run_dir, *args], run_dir, timeout, env)


def command(argv: list[str], run_dir: str | None, timeout: float, env: dict[str, str] | None = None) -> Run:
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    out, err = finish(proc, run_dir, timeout, f"unbroken {' '.join(argv)}")
    return Run(proc.returncode, out, err, run_dir or "")


def finish(proc: subprocess.Popen, run_dir: str | None, timeout: float = 180.0, what: str = "unbroken") -> tuple[str, str]:
    """Wait for ``proc`` (started in its own session) within ``timeout``, killing its session if it
    outlives it (the test fails, showing the ends of its output); then every worker of
    ``run_dir`` still alive. Returns its stdout and stderr."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{what} did not end within {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        if run_dir:
            kill_leftovers(run_dir)
    return out, err


def start(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """``unbroken ARGV...`` in the background (its own session, output captured as text); end it
    with :func:`stop` in a ``finally``."""
    return subprocess.Popen(
        [sys.executable, "-m", "unbroken", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True, start_new_session=True, env={**os.environ, **(env or {})},
    )


def start_in(argv: list[str], cwd: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``unbroken ARGV...`` in the background from ``cwd`` (its own session; stdout and stderr
    captured apart, as text)."""
    return subprocess.Popen(
        [sys.executable, "-m", "unbroken", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, cwd=cwd, env={**os.environ, **(env or {})},
    )


def coordinator(directory, *flags: str) -> tuple[subprocess.Popen, str]:
    """``unbroken coordinator`` alone on 127.0.0.1 (a free port, its events in DIRECTORY/coord);
    returns the process and the address it listens on. End it with ``os.killpg``."""
    proc = start_in(["coordinator", "--host", "127.0.0.1", "--port", "0", "--run-dir", os.path.join(str(directory), "coord"), *flags], str(directory))
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, line.split("listening on ")[1].split()[0]


def stop(procs: list[subprocess.Popen | None], run_dirs: list[str]) -> list[int]:
    """SIGKILL every launcher of ``procs`` still running (with its session) and every worker of
    ``run_dirs`` still alive, and reap the launchers; returns the workers that had to be killed."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return [pid for run_dir in run_dirs for pid in kill_leftovers(run_dir)]


def single_process(out_dir: str, *args: str, timeout: float = 120.0) -> dict[str, torch.Tensor]:
    """The reference: the same script as a plain process, no launcher."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    subprocess.run([sys.executable, EXACT, "--out", out_dir, *args], check=True, timeout=timeout, env=env, capture_output=True)
    return torch.load(os.path.join(out_dir, "single.pt"))


def final_params(out_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    return {os.path.basename(p)[:-3]: torch.load(p) for p in sorted(glob.glob(os.path.join(out_dir, "*.pt")))}


def check_same_model(out_dir: str, reference: dict[str, torch.Tensor], members: int | list[str], prefix: str = "",
                     tolerance: float = 1e-8) -> float:
    """Exactly ``members`` members (a count, or their names) whose names start with ``prefix``
    wrote their final parameters to ``out_dir``, and every one equals ``reference`` within
    ``tolerance`` (relative); returns the worst difference. Counting first means that a run in
    which nobody wrote cannot pass."""
    finals = {m: p for m, p in final_params(out_dir).items() if m.startswith(prefix)}
    if isinstance(members, int):
        assert len(finals) == members, f"{len(finals)} members wrote final parameters to {out_dir} ({sorted(finals)}), expected {members}"
    else:
        assert members and sorted(finals) == sorted(members), f"final parameters from {sorted(finals)}, expected {sorted(members)}"
    worst = 0.0
    for member, params in finals.items():
        difference = max_relative_difference(params, reference)
        assert difference < tolerance, f"{member}: relative difference {difference:.3g} from the reference"
        worst = max(worst, difference)
    return worst


def jsonl_by(path: str, key: str) -> dict[Any, list[dict[str, Any]]]:
    """The JSON lines of ``path`` (a script's own log), grouped by the value of ``key``, in order."""
    grouped: dict[Any, list[dict[str, Any]]] = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            grouped.setdefault(record[key], []).append(record)
    return grouped


def state_received(events_of: Callable[[str], list[dict[str, Any]]], member: str) -> list[dict[str, Any]]:
    """The events in which a member whose name contains ``member`` got the job's live state from
    a peer, oldest first: a heal that sent it the state, or its catch-up (it loaded a donor's state
    and replayed the steps since, unbroken.worker.catch_up). ``events_of(kind)`` lists a run's
    events of one kind (``Run.events``)."""
    heals = [e for e in events_of("heal") if any(member in r for r in e["receivers"])]
    caught = [e for e in events_of("catch_up") if member in e["member"] and e["loaded"] and e["error"] is None]
    return sorted(heals + caught, key=lambda e: e["t"])


def finished_members(run_dir: str) -> list[str]:
    """The members that finished the job (they wrote their lineage: ``--record-samples``)."""
    return sorted(os.path.basename(p)[: -len(".lineage.json")] for p in glob.glob(os.path.join(run_dir, "samples", "*.lineage.json")))


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest element-wise relative difference |a - b| / max(|a|, |b|) over every tensor
    (elements that are both exactly zero count as equal)."""
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        x, y = a[key].double(), b[key].double()
        scale = torch.maximum(x.abs(), y.abs())
        diff = (x - y).abs()
        relative = torch.where(scale > 0, diff / scale.clamp_min(1e-300), torch.zeros_like(diff))
        worst = max(worst, relative.max().item() if relative.numel() else 0.0)
    return worst


def check_exactly_once(run_dir: str | list[str], steps: int, global_batch_size: int) -> dict[str, Any]:
    """Every stream position of steps [0, steps) was applied in exactly one committed step, and
    every commit of the run keeps the invariants of :func:`check_commits`.

    The lineage (the generation that committed each step, carried in the healed state) comes from
    the members that finished; the positions each member processed in each attempt come from the
    sample logs. The committed attempt of step s is generation lineage[s]: its members' shares
    must cover [s*G, (s+1)*G) exactly once.
    """
    dirs = [run_dir] if isinstance(run_dir, str) else run_dir
    lineages = []
    for path in (p for d in dirs for p in glob.glob(os.path.join(d, "samples", "*.lineage.json"))):
        with open(path) as f:
            lineages.append(json.load(f)["lineage"])
    assert lineages, "no member finished with a lineage"
    assert all(l == lineages[0] for l in lineages), "finished members disagree on which generation committed each step"
    lineage = lineages[0]
    assert len(lineage) == steps, f"{len(lineage)} steps committed, expected {steps}"
    attempts: dict[tuple[int, int], list[dict[str, int]]] = {}
    for path in (p for d in dirs for p in glob.glob(os.path.join(d, "samples", "*.jsonl"))):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if "commit" not in record:
                    attempts.setdefault((record["g"], record["s"]), []).append(record)
    for step, generation in enumerate(lineage):
        records = attempts.get((generation, step), [])
        covered: list[int] = []
        for record in records:
            covered.extend(range(record["a"], record["b"]))
        expected = list(range(step * global_batch_size, (step + 1) * global_batch_size))
        assert sorted(covered) == expected, f"step {step} (generation {generation}): positions {sorted(covered)[:8]}... != {expected[:8]}..."
        parts = records[0]["n"] * records[0].get("k", 1)  # k: processes per replica group
        assert len(records) == parts, f"step {step}: {len(records)} shares logged for {parts} parts ({records[0]['n']} members)"
    # an attempt beyond the lineage: a step begun and never committed (the job stopped early)
    redone = sum(1 for (g, s) in attempts if s >= len(lineage) or lineage[s] != g)
    check_commits(dirs)
    return {"generations": sorted(set(lineage)), "redone_attempts": redone, "lineage": lineage}


def check_commits(run_dir: str | list[str], every_holder_lost: bool = False) -> dict[str, Any]:
    """The invariants over every commit of a run, every generation and every process included
    (DESIGN: Copies of the truth), from the sample logs and the resume events:

    - each step is committed by at most one generation (a resume from a checkpoint at step c,
      or a ``state_lost`` generation formed at step c after every holder of the state was lost,
      lets later generations commit steps >= c again: everyone that held them is gone);
    - no generation's first commit is behind the highest step committed before it;
    - in each generation every process that committed step s holds the same lineage digest, and
      in a replica group each member's K processes committed the same steps.

    ``every_holder_lost``: the test lost every holder of the state on purpose, without a
    checkpoint, so the job started over: only the last check applies.
    """
    dirs = [run_dir] if isinstance(run_dir, str) else run_dir
    records: list[dict[str, Any]] = []
    for path in (p for d in dirs for p in glob.glob(os.path.join(d, "samples", "*.jsonl"))):
        member = os.path.basename(path)[: -len(".jsonl")]
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if "commit" in record:
                    records.append({**record, "member": member})
    assert records, "no commit was recorded (was the run started with --record-samples?)"
    # a checkpoint's resume, or a generation the coordinator formed behind the job after every
    # holder of the state was lost (state_lost): the steps from there on may be committed again
    resumes = sorted((e["t"], e["step"]) for d in dirs for kind in ("resume", "state_lost") for e in Run(0, "", "", d).events(kind))
    timeline = sorted([(r["t"], 1, r) for r in records] + [(t, 0, {"resume": step}) for t, step in resumes], key=lambda x: (x[0], x[1]))
    by_step: dict[int, int] = {}
    highest = -1
    first_of: dict[int, int] = {}
    for _, _, r in timeline:
        if "resume" in r:
            by_step = {s: g for s, g in by_step.items() if s < r["resume"]}
            highest = r["resume"] - 1
            continue
        g, s = r["g"], r["s"]
        if every_holder_lost:
            continue
        assert by_step.setdefault(s, g) == g, f"step {s} committed by generations {by_step[s]} and {g} ({r['member']})"
        if g not in first_of:
            first_of[g] = s
            assert s > highest, f"generation {g} first committed step {s}, behind step {highest} committed before it"
        highest = max(highest, s)
    digests: dict[tuple[int, int], set[int]] = {}
    processes: dict[tuple[str, int], dict[int, set[int]]] = {}
    for r in records:
        if "d" in r:
            digests.setdefault((r["g"], r["s"]), set()).add(r["d"])
        processes.setdefault((r["member"], r["g"]), {}).setdefault(r.get("p", 0), set()).add(r["s"])
    split = {k: v for k, v in digests.items() if len(v) > 1}
    assert not split, f"processes of one generation committed a step with different lineages: {sorted(split)[:5]}"
    for (member, g), steps in processes.items():
        if len(steps) > 1:  # a replica group: its processes must have committed the same steps
            first = next(iter(steps.values()))
            assert all(v == first for v in steps.values()), (
                f"the processes of {member} committed different steps in generation {g}: "
                + ", ".join(f"process {p}: {sorted(v)[:6]}" for p, v in sorted(steps.items())))
    return {"commits": len(records), "generations": len(first_of), "resumes": len(resumes)}


def commits(run_dir: str, member: str) -> list[dict[str, Any]]:
    """The steps ``member`` committed: ``{g, s, t}`` (generation, step, wall time), in order."""
    path = os.path.join(run_dir, "samples", f"{member}.jsonl")
    with open(path) as f:
        return [r for r in map(json.loads, f) if "commit" in r]



def spawn_all(target, args: list[tuple], timeout: float, what: str = "processes") -> None:
    """Run one spawned process per entry of ``args``; fail unless all exit 0 within ``timeout``
    seconds; kill whatever is left, pass or fail."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=target, args=entry, daemon=True) for entry in args]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in procs]
        assert codes == [0] * len(procs), f"{what}: exit codes {codes} (None: still running after {timeout} s)"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
