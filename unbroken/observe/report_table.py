"""The report's figures as a table on the console (``unbroken report`` without ``--json``).

rich is imported inside :func:`print_table`, so importing this module stays light.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from unbroken.observe.incidents import rank


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
    for lost in f.get("progress_lost") or []:
        table.add_row("progress lost", lost.split(": ", 1)[1] if ": " in lost else lost, "")
    table.add_row("wall time", _seconds(f["wall_seconds"]), "first to last event")
    table.add_row("startup", _seconds(f["startup_seconds"]), "first event to first commit")
    table.add_row("steps committed", str(f["steps_committed"]), f"next step {f['next_step']}")
    if "samples" in f:
        table.add_row("samples", str(f["samples"]), "")
    table.add_row("median step", _seconds(f["step_seconds"]["median"]), "")
    goodput = f["goodput"]
    table.add_row("goodput", "-" if goodput is None else f"{goodput:.1%}", "step time / wall time")
    by_kind = ", ".join(f"{n} {k}" for k, n in sorted(f["failures"]["by_kind"].items(), key=lambda kv: rank(kv[0])))
    table.add_row("failures", str(f["failures"]["total"]), by_kind)
    stall = f["stall_seconds"]
    table.add_row("stall per failure", _seconds(stall["mean"]), f"mean; max {_seconds(stall['max'])}" if stall["count"] else "")
    redone = f["redone_steps"]
    table.add_row("steps redone", str(f["steps_redone"]), ", ".join(map(str, redone[:8])) + (" ..." if len(redone) > 8 else ""))
    table.add_row("restarts", str(f["restarts"]), "")
    table.add_row("generations", str(f["generations"]), "")
    heals = f["heals"]
    table.add_row("members healed", str(heals["count"]), f"{_bytes(heals['bytes'])} in {_seconds(heals['seconds'])}" if heals["count"] else "")
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
    if f.get("stragglers"):
        slow = Table(title="stragglers", title_justify="left")
        for name in ("member", "flagged at step", "pace", "share after", "evicted"):
            slow.add_column(name)
        for s in f["stragglers"]:
            pace = "-" if s["pace"] is None else f"{s['pace']:.0%}"
            slow.add_row(str(s["member"]), str(s["step"]), pace, "-" if s["share"] is None else str(s["share"]), "yes" if s["evicted"] else "no")
        console.print(slow)
    if f["bad_lines"]:
        console.print(bad_lines_text(f["bad_lines"]), style="yellow", soft_wrap=True)
    if f.get("timeline"):
        console.print(f"timeline: {f['timeline']}", soft_wrap=True)
