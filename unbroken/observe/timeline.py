"""The report's timeline picture: members, throughput and loss against time, failures marked.

matplotlib (and numpy) are imported inside the functions that draw, so importing this module
stays light.
"""

from __future__ import annotations

import os
from typing import Any

from unbroken.observe.run_log import Log, is_int, is_number


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
    axes = (ax_members, ax_rate, ax_loss)
    _draw_members(ax_members, events, steps, generations, t0, end)
    grid = _draw_throughput(ax_rate, steps, t0, end, figures["step_seconds"]["median"] or 0.0)
    points = _draw_loss(ax_loss, steps, t0)
    for ax, empty in ((ax_rate, not grid), (ax_loss, not points)):
        if empty:
            ax.text(0.5, 0.5, "no step events", transform=ax.transAxes, ha="center", va="center", color="gray")
    _draw_marks(axes, events, figures, t0)
    for ax in axes:
        ax.set_xlim(0, max(end, 1e-3))
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _draw_members(ax: Any, events: list[dict[str, Any]], steps: list[dict[str, Any]], generations: list[dict[str, Any]], t0: float, end: float) -> None:
    """Members per generation (from the step events if there are no generation events)."""
    if generations:
        xs = [g["t"] - t0 for g in generations]
        ys = [len(g["members"]) if isinstance(g.get("members"), list) else 0 for g in generations]
    else:
        xs = [s["t"] - t0 for s in steps if is_int(s.get("members"))]
        ys = [s["members"] for s in steps if is_int(s.get("members"))]
    finished = next((e["t"] - t0 for e in events if e["kind"] == "finished"), None)
    if xs:
        if finished is not None and finished >= xs[-1]:  # the job ended: nobody trains after
            xs, ys = xs + [finished], ys + [0]
        ax.step([0.0] + xs + [end], [0] + ys + [ys[-1]], where="post", color="tab:blue", label="members")
        ax.set_ylim(0, max(ys) + 1)
    ax.set_ylabel("members")
    ax.yaxis.get_major_locator().set_params(integer=True)


def _draw_throughput(ax: Any, steps: list[dict[str, Any]], t0: float, end: float, median_step: float) -> list[float]:
    """Committed steps per second; returns the grid (empty without steps)."""
    grid, rate, window = _throughput([s["t"] - t0 for s in steps], end, median_step)
    if grid:
        ax.plot(grid, rate, color="tab:green", label=f"steps/s ({window:.2g} s window)")
        ax.fill_between(grid, rate, color="tab:green", alpha=0.2)
        ax.legend(loc="upper left", fontsize=8)
    ax.set_ylabel("steps / s")
    ax.set_ylim(bottom=0)
    return grid


def _draw_loss(ax: Any, steps: list[dict[str, Any]], t0: float) -> list[tuple[float, float]]:
    """The loss of every commit (log scale when it spans more than 20x); returns the points."""
    points = [(s["t"] - t0, s["loss"]) for s in steps if is_number(s.get("loss"))]
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], color="tab:purple", linewidth=1)
        values = [p[1] for p in points]
        if min(values) > 0 and max(values) / min(values) > 20:
            ax.set_yscale("log")
    ax.set_ylabel("loss")
    ax.set_xlabel("seconds since the first event")
    return points


def _draw_marks(axes: tuple[Any, Any, Any], events: list[dict[str, Any]], figures: dict[str, Any], t0: float) -> None:
    """Failures and checkpoints on every panel, restarts and stragglers (flagged, evicted) on the
    members panel, rebalancing on the throughput panel, and the legend."""
    ax_members = axes[0]
    for n, incident in enumerate(figures["incidents"]):
        for ax in axes:
            ax.axvline(incident["at"], color="tab:red", linestyle="--", linewidth=1, label="failure" if n == 0 and ax is ax_members else None)
    for n, cp in enumerate(e for e in events if e["kind"] == "checkpoint"):
        for ax in axes:
            ax.axvline(cp["t"] - t0, color="tab:gray", linestyle=":", linewidth=1, label="checkpoint" if n == 0 and ax is ax_members else None)
    restarts = [e["t"] - t0 for e in events if e["kind"] == "restart"]
    if restarts:
        top = ax_members.get_ylim()[1]
        ax_members.plot(restarts, [top - 0.5] * len(restarts), linestyle="none", marker="v", color="tab:orange", label="restart")
    for kind, marker, color in (("straggler", "x", "tab:brown"), ("evicted", "X", "black")):
        when = [e["t"] - t0 for e in events if e["kind"] == kind]
        if when:
            ax_members.plot(when, [0.5] * len(when), linestyle="none", marker=marker, color=color, label=kind)
    rebalanced = [e["t"] - t0 for e in events if e["kind"] == "rebalanced"]
    if rebalanced:
        ax_rate = axes[1]
        ax_rate.plot(rebalanced, [0.0] * len(rebalanced), linestyle="none", marker="^", color="tab:olive", label="rebalanced", clip_on=False)
        ax_rate.legend(loc="upper left", fontsize=8)
    if ax_members.get_legend_handles_labels()[0]:
        ax_members.legend(loc="lower right", fontsize=8)
