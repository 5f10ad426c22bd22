"""``unbroken report RUN_DIR...``: what happened in a run, from its event log.

The report reads the run's event logs (:mod:`unbroken.observe.run_log`: merged by time, a corrupt or
truncated log still gives a report, its bad lines named), counts failures as incidents
(:mod:`unbroken.observe.incidents`: the events of one failure within :data:`INCIDENT_GAP` seconds count
once, classified by their strongest :data:`EVIDENCE`), computes its figures here
(:func:`analyze`), and prints them as a table (:mod:`unbroken.observe.report_table`) or JSON, with a
timeline picture (:mod:`unbroken.observe.timeline`).

rich and matplotlib are imported inside the functions that need them, so importing this module
stays light.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any, Iterable, Sequence

from unbroken.observe.incidents import EVIDENCE, INCIDENT_GAP, Incident, evidence, incidents, progress_lost
from unbroken.observe.report_table import bad_lines_text, print_table
from unbroken.observe.run_log import EVENTS_FILE, BadLine, Log, events_path, is_int, load, num
from unbroken.observe.timeline import write_timeline

__all__ = [
    "EVENTS_FILE", "TIMELINE_FILE", "INCIDENT_GAP", "EVIDENCE", "BadLine", "Log", "Incident",
    "load", "events_path", "incidents", "analyze", "bad_lines_text", "print_table", "write_timeline", "main",
]

TIMELINE_FILE = "timeline.png"


# -- analysis --------------------------------------------------------------------------------------


def _sum_field(events: Iterable[dict[str, Any]], key: str) -> float:
    return float(sum(v for v in (num(e, key) for e in events) if v is not None))


def _standing_commits(steps: list[dict[str, Any]]) -> tuple[dict[int, dict[str, Any]], dict[int, set[int]]]:
    """The commit of each step index that stands (the one of the latest generation), and the
    generations that committed each index."""
    final: dict[int, dict[str, Any]] = {}
    generations_of: dict[int, set[int]] = {}
    for s in steps:
        generations_of.setdefault(s["step"], set()).add(s["generation"])
        if s["step"] not in final or s["generation"] >= final[s["step"]]["generation"]:
            final[s["step"]] = s
    return final, generations_of


def _redone(events: list[dict[str, Any]], steps: list[dict[str, Any]], generations_of: dict[int, set[int]]) -> set[int]:
    """Steps committed in more than one generation, and the first step after each failure."""
    redone = {index for index, gens in generations_of.items() if len(gens) > 1}
    for failure in (e for e in events if e["kind"] == "failure"):
        after = next((s for s in steps if s["t"] >= failure["t"] and s["generation"] > failure["generation"]), None)
        if after is not None:
            redone.add(after["step"])
    return redone


def _failure_figures(events: list[dict[str, Any]], found: list[Incident]) -> dict[str, Any]:
    by_kind: dict[str, int] = {}
    for incident in found:
        by_kind[incident.kind] = by_kind.get(incident.kind, 0) + 1
    by_detector: dict[str, dict[str, int]] = {"verdict": {}, "failure": {}}
    for e in events:
        if e["kind"] in by_detector:
            name = evidence(e) or "unknown"
            by_detector[e["kind"]][name] = by_detector[e["kind"]].get(name, 0) + 1
    return {"total": len(found), "by_kind": by_kind, "events_by_detector": by_detector}


def _checkpoint_figures(checkpoints: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "count": len(checkpoints),
        "bytes": int(_sum_field(checkpoints, "bytes")),
        # 'seconds' as specified; the saver writes 'write_seconds' (background) and 'stall'.
        "seconds": float(sum(num(e, "seconds") or num(e, "write_seconds") or 0.0 for e in checkpoints)),
        "stall_seconds": _sum_field(checkpoints, "stall"),
        "last_step": max((e["step"] for e in checkpoints if is_int(e.get("step"))), default=None),
    }


def _incident_rows(found: list[Incident], t0: float | None) -> list[dict[str, Any]]:
    return [
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
    ]


def _straggler_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per flagged member: when, how slow, the share it was given after, whether evicted."""
    rows: dict[str, dict[str, Any]] = {}
    for e in events:
        member = e.get("member")
        if e["kind"] == "straggler" and member not in rows:
            rows[member] = {"member": member, "step": e.get("step"), "pace": e.get("pace"), "share": None, "evicted": False}
        elif e["kind"] == "rebalanced" and e.get("shares"):
            for name, share in zip(e.get("members") or [], e["shares"]):
                if name in rows:
                    rows[name]["share"] = share
        elif e["kind"] == "evicted" and member in rows:
            rows[member]["evicted"] = True
    return list(rows.values())


def analyze(log: Log) -> dict[str, Any]:
    """The report's figures, as JSON-ready values (no NaN)."""
    events = log.events
    t0 = events[0]["t"] if events else None
    wall = events[-1]["t"] - events[0]["t"] if events else 0.0
    steps = [e for e in events if e["kind"] == "step"]
    final, generations_of = _standing_commits(steps)
    seconds = [v for v in (num(s, "seconds") for s in steps) if v is not None]
    median_step = statistics.median(seconds) if seconds else 0.0
    step_seconds = _sum_field(final.values(), "seconds")
    redone = _redone(events, steps, generations_of)
    found = incidents(events, steps, median_step)
    stalls = [i.stall for i in found if i.stall is not None]
    heals = [e for e in events if e["kind"] == "heal"]
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
        "generations": len({e["generation"] for e in events if e["kind"] == "generation"}),
        "restarts": sum(1 for e in events if e["kind"] == "restart"),
        "failures": _failure_figures(events, found),
        "stall_seconds": {
            "count": len(stalls),
            "mean": statistics.fmean(stalls) if stalls else None,
            "max": max(stalls) if stalls else None,
        },
        "steps_redone": len(redone),
        "redone_steps": sorted(redone),
        # one event per sender of a fan-out: count the members healed, and each healing's longest sender
        "heals": {"count": sum(len(e.get("receivers") or [1]) for e in heals), "bytes": int(_sum_field(heals, "bytes")),
                  "seconds": sum(max(num(e, "seconds") or 0.0 for e in group) for group in _by_generation(heals).values())},
        "checkpoints": _checkpoint_figures([e for e in events if e["kind"] == "checkpoint"]),
        "finished": any(e["kind"] == "finished" for e in events),
        "job_failed": str(failed[0].get("reason")) if failed else None,
        "progress_lost": progress_lost(events),
        "incidents": _incident_rows(found, t0),
        "stragglers": _straggler_rows(events),
    }
    samples = [num(s, "samples") for s in final.values()]
    if final and all(v is not None for v in samples):
        figures["samples"] = int(sum(samples))  # type: ignore[arg-type]
    return figures


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


def _by_generation(events: list[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    groups: dict[Any, list[dict[str, Any]]] = {}
    for event in events:
        groups.setdefault(event.get("generation"), []).append(event)
    return groups
