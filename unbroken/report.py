"""``unbroken report RUN_DIR...``: what happened in a run, from its event log.

The figures come from ``events.jsonl`` alone (see :mod:`unbroken.telemetry`). A log that is
corrupt or truncated still gives a report: lines that are not JSON objects, and records that lack
the fields their kind needs, are counted and named by file and line number, and left out.
Several run directories (one per node of a multi-node run) are merged by time.

Failures are counted as *incidents*: failure-related events (``verdict``, ``failure``, a
``worker_exit`` with a non-zero status, a chaos ``fault``) that follow each other within
:data:`INCIDENT_GAP` seconds are one incident. A SIGKILL therefore counts once, although the
launcher reports the exit, the coordinator gives its verdict and a survivor reports the broken
collective. The incident is classified by its strongest evidence (:data:`EVIDENCE`). A worker
exit alone, with no verdict or failure from the coordinator near it (a worker stopped at the end
of the job, or by Ctrl-C), is not a failure.

rich and matplotlib are imported inside the functions that need them, so importing this module
stays light.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from unbroken.errors import ConfigError
from unbroken.telemetry import read_events

EVENTS_FILE = "events.jsonl"
TIMELINE_FILE = "timeline.png"

# Failure-related events closer than this (seconds) belong to one incident.
INCIDENT_GAP = 1.0

# Evidence that classifies an incident, strongest first.
EVIDENCE = ("launcher", "heartbeat", "progress watchdog", "collective")

# Fields a record of a kind needs to be used; the value is "int" or "number".
_REQUIRED: dict[str, dict[str, str]] = {
    "step": {"step": "int", "generation": "int"},
    "generation": {"generation": "int"},
    "failure": {"generation": "int"},
    "verdict": {},
    "heal": {},
    "checkpoint": {},
}


# -- reading ---------------------------------------------------------------------------------------


@dataclass
class BadLine:
    file: str
    line: int
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "why": self.why}


@dataclass
class Log:
    """The merged events of one or more run directories, sorted by time."""

    files: list[str]
    events: list[dict[str, Any]]
    bad: list[BadLine] = field(default_factory=list)
    duplicates: int = 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _num(event: dict[str, Any], key: str) -> float | None:
    value = event.get(key)
    return float(value) if _is_number(value) else None


def _problem(record: dict[str, Any]) -> str | None:
    """Why a parsed record cannot be used, or None."""
    if not _is_number(record.get("t")):
        return "no numeric 't'"
    kind = record.get("kind")
    if not isinstance(kind, str):
        return "no string 'kind'"
    for name, want in _REQUIRED.get(kind, {}).items():
        value = record.get(name)
        if not (_is_int(value) if want == "int" else _is_number(value)):
            return f"{kind} event without {want} {name!r}"
    return None


def events_path(run_dir: str) -> str:
    """The event log of a run directory (or the path itself, if it names a file)."""
    path = run_dir if os.path.isfile(run_dir) else os.path.join(run_dir, EVENTS_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"no event log at {path}")
    return path


def load(run_dirs: Sequence[str]) -> Log:
    """Read and merge the event logs of ``run_dirs``; bad lines are recorded, never raised."""
    files: list[str] = []
    for run_dir in run_dirs:
        path = events_path(run_dir)
        if os.path.realpath(path) not in {os.path.realpath(f) for f in files}:
            files.append(path)
    log = Log(files=files, events=[])
    seen: set[str] = set()
    for path in files:
        try:
            records, bad_numbers = read_events(path)
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
        bad_set = set(bad_numbers)
        log.bad.extend(BadLine(path, n, "not a JSON object") for n in bad_numbers)
        # read_events numbers every line; the records are the lines that are not bad, in order.
        numbers = (n for n in range(1, len(records) + len(bad_numbers) + 1) if n not in bad_set)
        for number, record in zip(numbers, records):
            why = _problem(record)
            if why is not None:
                log.bad.append(BadLine(path, number, why))
                continue
            key = json.dumps(record, sort_keys=True, default=str)
            if key in seen:  # the same log given twice under two names, say
                log.duplicates += 1
                continue
            seen.add(key)
            log.events.append(record)
    log.events.sort(key=lambda e: e["t"])
    log.bad.sort(key=lambda b: (files.index(b.file), b.line))
    return log


# -- analysis --------------------------------------------------------------------------------------


@dataclass
class Incident:
    start: float  # time of its first event (a chaos fault, if one led to it)
    end: float
    kind: str  # the strongest evidence, one of EVIDENCE (or another detected_by value)
    members: list[str]  # the members that died (verdicts, non-zero exits, faults)
    generation: int | None  # the generation that was running
    affected: bool  # whether a member of that generation was lost or it reported a failure
    events: list[dict[str, Any]]
    stall: float | None = None  # to the next commit in a later generation, less one median step
    resumed_at: float | None = None


def _rank(kind: str) -> int:
    return EVIDENCE.index(kind) if kind in EVIDENCE else len(EVIDENCE)


def _evidence(event: dict[str, Any]) -> str | None:
    kind = event["kind"]
    if kind == "worker_exit":
        return "launcher"
    if kind in ("verdict", "failure"):
        return str(event.get("detected_by") or ("collective" if kind == "failure" else "unknown"))
    return None


def _is_failure_event(event: dict[str, Any]) -> bool:
    kind = event["kind"]
    if kind == "worker_exit":
        code = event.get("code")
        return _is_int(code) and code != 0
    return kind in ("verdict", "failure", "fault")


def _generation_at(generations: list[dict[str, Any]], t: float) -> dict[str, Any] | None:
    current = None
    for g in generations:
        if g["t"] > t:
            break
        current = g
    return current


def incidents(events: list[dict[str, Any]], steps: list[dict[str, Any]], median_step: float) -> list[Incident]:
    """Group failure-related events into incidents and measure the stall each one caused."""
    related = [e for e in events if _is_failure_event(e)]
    chains: list[list[dict[str, Any]]] = []
    for event in related:
        if chains and event["t"] - chains[-1][-1]["t"] <= INCIDENT_GAP:
            chains[-1].append(event)
        else:
            chains.append([event])
    generations = [e for e in events if e["kind"] == "generation"]
    found: list[Incident] = []
    previous_end = -math.inf
    for chain in chains:
        coordinator = [e for e in chain if e["kind"] in ("verdict", "failure")]
        if not coordinator:
            continue  # an exit or a fault the coordinator never called a failure
        kinds = [k for k in (_evidence(e) for e in chain) if k is not None]
        kind = min(kinds, key=_rank)
        members = []
        for e in chain:
            if e["kind"] in ("verdict", "worker_exit", "fault") and isinstance(e.get("member"), str) and e["member"] not in members:
                members.append(e["member"])
        start, end = chain[0]["t"], chain[-1]["t"]
        # A fault that hung a worker (stop, spin) comes long before the verdict: it is the onset.
        for e in related:
            if e["kind"] == "fault" and previous_end < e["t"] < start and e.get("member") in members:
                start = e["t"]
                break
        failures = [e for e in chain if e["kind"] == "failure"]
        running = _generation_at(generations, start)
        if failures:
            generation = max(e["generation"] for e in failures)
        else:
            generation = running["generation"] if running is not None else None
        if failures or running is None or not isinstance(running.get("members"), list):
            affected = True
        else:
            affected = any(m in running["members"] for m in members)
        incident = Incident(start, end, kind, members, generation, affected, chain)
        if affected:
            later = (s for s in steps if s["t"] >= start and (generation is None or s["generation"] > generation))
            resumed = next(later, None)
            if resumed is not None:
                incident.resumed_at = resumed["t"]
                incident.stall = max(0.0, resumed["t"] - start - median_step)
        found.append(incident)
        previous_end = end
    return found


def _sum_field(events: Iterable[dict[str, Any]], key: str) -> float:
    return float(sum(v for v in (_num(e, key) for e in events) if v is not None))


def analyze(log: Log) -> dict[str, Any]:
    """The report's figures, as JSON-ready values (no NaN)."""
    events = log.events
    t0 = events[0]["t"] if events else None
    wall = events[-1]["t"] - events[0]["t"] if events else 0.0
    steps = [e for e in events if e["kind"] == "step"]

    # The commit of each step index that stands: the one of the latest generation.
    final: dict[int, dict[str, Any]] = {}
    generations_of: dict[int, set[int]] = {}
    for s in steps:
        generations_of.setdefault(s["step"], set()).add(s["generation"])
        if s["step"] not in final or s["generation"] >= final[s["step"]]["generation"]:
            final[s["step"]] = s
    seconds = [v for v in (_num(s, "seconds") for s in steps) if v is not None]
    median_step = statistics.median(seconds) if seconds else 0.0
    step_seconds = _sum_field(final.values(), "seconds")

    redone = {index for index, gens in generations_of.items() if len(gens) > 1}
    for failure in (e for e in events if e["kind"] == "failure"):
        after = next((s for s in steps if s["t"] >= failure["t"] and s["generation"] > failure["generation"]), None)
        if after is not None:
            redone.add(after["step"])

    found = incidents(events, steps, median_step)
    by_kind: dict[str, int] = {}
    for incident in found:
        by_kind[incident.kind] = by_kind.get(incident.kind, 0) + 1
    by_detector: dict[str, dict[str, int]] = {"verdict": {}, "failure": {}}
    for e in events:
        if e["kind"] in by_detector:
            name = _evidence(e) or "unknown"
            by_detector[e["kind"]][name] = by_detector[e["kind"]].get(name, 0) + 1
    stalls = [i.stall for i in found if i.stall is not None]

    heals = [e for e in events if e["kind"] == "heal"]
    checkpoints = [e for e in events if e["kind"] == "checkpoint"]
    generation_numbers = {e["generation"] for e in events if e["kind"] == "generation"}
    failed = [e for e in events if e["kind"] == "job_failed"]

    figures: dict[str, Any] = {
        "files": log.files,
        "events": len(events),
        "bad_lines": [b.as_dict() for b in log.bad],
        "duplicates": log.duplicates,
        "start": t0,
        "wall_seconds": wall,
        "startup_seconds": (steps[0]["t"] - t0) if steps else None,
        "steps_committed": len(final),
        "last_step": max(final) if final else None,
        "next_step": max(final) + 1 if final else 0,
        "step_seconds": {"sum": step_seconds, "median": median_step if seconds else None},
        "goodput": step_seconds / wall if wall > 0 else None,
        "generations": len(generation_numbers),
        "restarts": sum(1 for e in events if e["kind"] == "restart"),
        "failures": {"total": len(found), "by_kind": by_kind, "events_by_detector": by_detector},
        "stall_seconds": {
            "count": len(stalls),
            "mean": statistics.fmean(stalls) if stalls else None,
            "max": max(stalls) if stalls else None,
        },
        "steps_redone": len(redone),
        "redone_steps": sorted(redone),
        "heals": {"count": len(heals), "bytes": int(_sum_field(heals, "bytes")), "seconds": _sum_field(heals, "seconds")},
        "checkpoints": {
            "count": len(checkpoints),
            "bytes": int(_sum_field(checkpoints, "bytes")),
            # 'seconds' as specified; the saver writes 'write_seconds' (background) and 'stall'.
            "seconds": float(sum(_num(e, "seconds") or _num(e, "write_seconds") or 0.0 for e in checkpoints)),
            "stall_seconds": _sum_field(checkpoints, "stall"),
            "last_step": max((e["step"] for e in checkpoints if _is_int(e.get("step"))), default=None),
        },
        "finished": any(e["kind"] == "finished" for e in events),
        "job_failed": str(failed[0].get("reason")) if failed else None,
        "incidents": [
            {
                "at": i.start - t0 if t0 is not None else i.start,
                "kind": i.kind,
                "members": i.members,
                "generation": i.generation,
                "affected": i.affected,
                "stall_seconds": i.stall,
                "events": len(i.events),
            }
            for i in found
        ],
    }
    samples = [_num(s, "samples") for s in final.values()]
    if final and all(v is not None for v in samples):
        figures["samples"] = int(sum(samples))  # type: ignore[arg-type]
    return figures


# -- output ----------------------------------------------------------------------------------------


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.1f} ms"
    if value < 120:
        return f"{value:.2f} s"
    return f"{value / 60:.1f} min"


def _bytes(value: int) -> str:
    size = float(value)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{value} B"


def bad_lines_text(bad: list[dict[str, Any]], limit: int = 20) -> str:
    """``3 bad line(s): a/events.jsonl lines 4, 9, 10``."""
    by_file: dict[str, list[int]] = {}
    for b in bad:
        by_file.setdefault(b["file"], []).append(b["line"])
    parts = []
    for path, lines in by_file.items():
        shown = ", ".join(str(n) for n in lines[:limit]) + (f", ... ({len(lines) - limit} more)" if len(lines) > limit else "")
        parts.append(f"{path} line{'s' if len(lines) > 1 else ''} {shown}")
    return f"{len(bad)} bad line(s) skipped: " + "; ".join(parts)


def print_table(figures: dict[str, Any], file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, highlight=False)
    console.print("unbroken report: " + ", ".join(os.path.dirname(f) or "." for f in figures["files"]), soft_wrap=True)
    table = Table()
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("note")
    f = figures
    state = "failed: " + f["job_failed"] if f["job_failed"] else ("finished" if f["finished"] else "not finished")
    table.add_row("job", state, "")
    table.add_row("wall time", _seconds(f["wall_seconds"]), "first to last event")
    table.add_row("startup", _seconds(f["startup_seconds"]), "first event to first commit")
    table.add_row("steps committed", str(f["steps_committed"]), f"next step {f['next_step']}")
    if "samples" in f:
        table.add_row("samples", str(f["samples"]), "")
    table.add_row("median step", _seconds(f["step_seconds"]["median"]), "")
    goodput = f["goodput"]
    table.add_row("goodput", "-" if goodput is None else f"{goodput:.1%}", "step time / wall time")
    by_kind = ", ".join(f"{n} {k}" for k, n in sorted(f["failures"]["by_kind"].items(), key=lambda kv: _rank(kv[0])))
    table.add_row("failures", str(f["failures"]["total"]), by_kind)
    stall = f["stall_seconds"]
    table.add_row("stall per failure", _seconds(stall["mean"]), f"mean; max {_seconds(stall['max'])}" if stall["count"] else "")
    redone = f["redone_steps"]
    table.add_row("steps redone", str(f["steps_redone"]), ", ".join(map(str, redone[:8])) + (" ..." if len(redone) > 8 else ""))
    table.add_row("restarts", str(f["restarts"]), "")
    table.add_row("generations", str(f["generations"]), "")
    heals = f["heals"]
    table.add_row("heals", str(heals["count"]), f"{_bytes(heals['bytes'])} in {_seconds(heals['seconds'])}" if heals["count"] else "")
    cp = f["checkpoints"]
    table.add_row(
        "checkpoints",
        str(cp["count"]),
        f"{_bytes(cp['bytes'])} in {_seconds(cp['seconds'])} (stall {_seconds(cp['stall_seconds'])}), last at step {cp['last_step']}"
        if cp["count"]
        else "",
    )
    table.add_row("events", str(f["events"]), f"{len(f['bad_lines'])} bad line(s)" if f["bad_lines"] else "")
    console.print(table)
    if f["incidents"]:
        inc = Table(title="failures", title_justify="left")
        for name in ("at", "detected by", "members", "generation", "stall"):
            inc.add_column(name)
        for i in f["incidents"]:
            stall_text = _seconds(i["stall_seconds"]) if i["affected"] else "(not in the running generation)"
            inc.add_row(f"{i['at']:.2f} s", i["kind"], ", ".join(i["members"]) or "-", str(i["generation"]), stall_text)
        console.print(inc)
    if f["bad_lines"]:
        console.print(bad_lines_text(f["bad_lines"]), style="yellow", soft_wrap=True)
    if f.get("timeline"):
        console.print(f"timeline: {f['timeline']}", soft_wrap=True)


# -- timeline picture ------------------------------------------------------------------------------


def _throughput(times: list[float], end: float, median_step: float) -> tuple[list[float], list[float], float]:
    """Committed steps per second on a regular grid, over a trailing window."""
    import numpy as np

    if not times:
        return [], [], 0.0
    span = max(times[-1] - times[0], 1e-3)
    window = max(span / 50, 10 * median_step, 1e-3)
    grid = np.linspace(0.0, max(end, times[-1]), 500)
    stamps = np.asarray(times)
    counts = np.searchsorted(stamps, grid, side="right") - np.searchsorted(stamps, grid - window, side="right")
    return grid.tolist(), (counts / window).tolist(), window


def write_timeline(log: Log, figures: dict[str, Any], path: str) -> str:
    """Draw members, throughput and loss against time since the first event; returns the path."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    events = log.events
    t0 = events[0]["t"] if events else 0.0
    end = (events[-1]["t"] - t0) if events else 1.0
    steps = [e for e in events if e["kind"] == "step"]
    generations = [e for e in events if e["kind"] == "generation"]

    fig = Figure(figsize=(10, 7), dpi=100)
    ax_members, ax_rate, ax_loss = fig.subplots(3, 1, sharex=True)
    fig.suptitle("unbroken run: " + ", ".join(os.path.dirname(f) or "." for f in log.files), fontsize=10)

    # Members per generation.
    if generations:
        xs = [g["t"] - t0 for g in generations]
        ys = [len(g["members"]) if isinstance(g.get("members"), list) else 0 for g in generations]
    else:
        xs = [s["t"] - t0 for s in steps if _is_int(s.get("members"))]
        ys = [s["members"] for s in steps if _is_int(s.get("members"))]
    finished = next((e["t"] - t0 for e in events if e["kind"] == "finished"), None)
    if xs:
        if finished is not None and finished >= xs[-1]:  # the job ended: nobody trains after
            xs, ys = xs + [finished], ys + [0]
        ax_members.step([0.0] + xs + [end], [0] + ys + [ys[-1]], where="post", color="tab:blue", label="members")
        ax_members.set_ylim(0, max(ys) + 1)
    ax_members.set_ylabel("members")
    ax_members.yaxis.get_major_locator().set_params(integer=True)

    # Throughput.
    median_step = figures["step_seconds"]["median"] or 0.0
    grid, rate, window = _throughput([s["t"] - t0 for s in steps], end, median_step)
    if grid:
        ax_rate.plot(grid, rate, color="tab:green", label=f"steps/s ({window:.2g} s window)")
        ax_rate.fill_between(grid, rate, color="tab:green", alpha=0.2)
        ax_rate.legend(loc="upper left", fontsize=8)
    ax_rate.set_ylabel("steps / s")
    ax_rate.set_ylim(bottom=0)

    # Loss.
    points = [(s["t"] - t0, s["loss"]) for s in steps if _is_number(s.get("loss"))]
    if points:
        ax_loss.plot([p[0] for p in points], [p[1] for p in points], color="tab:purple", linewidth=1)
        values = [p[1] for p in points]
        if min(values) > 0 and max(values) / min(values) > 20:
            ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")
    ax_loss.set_xlabel("seconds since the first event")
    for ax, empty in ((ax_rate, not grid), (ax_loss, not points)):
        if empty:
            ax.text(0.5, 0.5, "no step events", transform=ax.transAxes, ha="center", va="center", color="gray")

    # Failures, checkpoints and restarts.
    for n, incident in enumerate(figures["incidents"]):
        for ax in (ax_members, ax_rate, ax_loss):
            ax.axvline(incident["at"], color="tab:red", linestyle="--", linewidth=1, label="failure" if n == 0 and ax is ax_members else None)
    for n, cp in enumerate(e for e in events if e["kind"] == "checkpoint"):
        for ax in (ax_members, ax_rate, ax_loss):
            ax.axvline(cp["t"] - t0, color="tab:gray", linestyle=":", linewidth=1, label="checkpoint" if n == 0 and ax is ax_members else None)
    restarts = [e["t"] - t0 for e in events if e["kind"] == "restart"]
    if restarts:
        top = ax_members.get_ylim()[1]
        ax_members.plot(restarts, [top - 0.5] * len(restarts), linestyle="none", marker="v", color="tab:orange", label="restart")
    if ax_members.get_legend_handles_labels()[0]:
        ax_members.legend(loc="lower right", fontsize=8)
    for ax in (ax_members, ax_rate, ax_loss):
        ax.set_xlim(0, max(end, 1e-3))
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


# -- the command -----------------------------------------------------------------------------------


def main(run_dirs: Sequence[str], as_json: bool = False, png: str | None = None, no_png: bool = False, out=None) -> int:
    """``unbroken report``: print the figures (a table, or JSON) and draw the timeline."""
    out = out or sys.stdout
    log = load(run_dirs)
    figures = analyze(log)
    figures["timeline"] = None
    if not no_png:
        path = png or os.path.join(os.path.dirname(log.files[0]), TIMELINE_FILE)
        try:
            figures["timeline"] = write_timeline(log, figures, path)
        except (OSError, ValueError) as exc:
            print(f"unbroken: could not write the timeline {path}: {exc}", file=sys.stderr)
    if as_json:
        print(json.dumps(figures, indent=2), file=out)
    else:
        print_table(figures, file=out)
    return 0
