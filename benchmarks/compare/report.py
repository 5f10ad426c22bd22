"""The comparison's table (markdown), its JSON and its chart."""

from __future__ import annotations

import json
import os

from benchmarks.compare.analysis import summarize

MEASURES = [
    # (scenario, key, label, unit, scale)
    ("healthy", "step_seconds", "healthy step", "ms", 1000),
    ("healthy", "ratio", "healthy step / plain DDP", "x", 1),
    ("kill", "stall", "SIGKILL: stall", "s", 1),
    ("kill", "redone", "SIGKILL: committed steps redone", "", 1),
    ("kill", "restarts", "SIGKILL: processes restarted", "", 1),
    ("kill", "finished", "SIGKILL: run finished", "", 1),
    ("stop", "stall", "SIGSTOP: survivors commit again after", "s", 1),
    ("stop", "finished", "SIGSTOP: run finished (SIGCONT at the cap)", "", 1),
    ("kill", "rejoin", "rejoin: restart to first commit", "s", 1),
    ("chaos", "goodput_ratio", "chaos: goodput / healthy plain DDP", "%", 100),
    ("chaos", "samples_lost", "chaos: samples lost", "", 1),
    ("chaos", "samples_repeated", "chaos: samples repeated", "", 1),
    ("chaos", "died_after", "chaos: job died after", "s", 1),
]


def summary(runs: list[dict], systems: list[str]) -> dict:
    out: dict = {}
    for system in systems:
        out[system] = {}
        for scenario, key, *_ in MEASURES:
            mine = [r for r in runs if r["system"] == system and r["scenario"] == scenario and "error" not in r]
            errors = sum(1 for r in runs if r["system"] == system and r["scenario"] == scenario and "error" in r)
            if key == "finished":
                out[system][f"{scenario}.{key}"] = {"yes": sum(1 for r in mine if r.get(key)), "n": len(mine) + errors}
            else:
                out[system][f"{scenario}.{key}"] = {**summarize([r.get(key) for r in mine]), "errors": errors}
    return out


def _cell(stats: dict, unit: str, scale: float, key: str, cap: float | None) -> str:
    if "yes" in stats:
        return f"{stats['yes']}/{stats['n']}" if stats["n"] else "–"
    parts = []
    if stats["n"]:
        def f(v):
            v *= scale
            return f"{v:.0f}" if abs(v) >= 100 or unit == "" else f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"
        text = f"{f(stats['median'])} {unit}".strip()
        if stats["n"] > 1 and stats["min"] != stats["max"]:
            text += f" ({f(stats['min'])}–{f(stats['max'])})"
        parts.append(text)
    if stats["missing"]:
        if key == "stop.stall" and cap:
            parts.append(f"none within {cap:.0f} s ({stats['missing']} of {stats['n'] + stats['missing']})")
        elif key == "chaos.died_after":
            parts.append(f"never ({stats['missing']} of {stats['n'] + stats['missing']})")
        elif not stats["n"]:
            parts.append("–")
    if stats.get("errors"):
        parts.append(f"{stats['errors']} failed to run")
    return "; ".join(parts)


def markdown(result: dict) -> str:
    systems = result["systems"]
    labels = result["labels"]
    cap = result["settings"]["stop_cap"]
    lines = ["| | " + " | ".join(labels[s] for s in systems) + " |", "|---|" + "---|" * len(systems)]
    for scenario, key, label, unit, scale in MEASURES:
        full = f"{scenario}.{key}"
        if all(result["summary"][s][full].get("n", 0) == 0 and not result["summary"][s][full].get("missing") for s in systems):
            continue
        lines.append(f"| {label} | " + " | ".join(_cell(result["summary"][s][full], unit, scale, full, cap) for s in systems) + " |")
    if any(r["scenario"] == "stop" for r in result["runs"]):
        governs = " | ".join(result["governs"][s] for s in systems)
        lines.append(f"| SIGSTOP: what decides it | {governs} |")
    return "\n".join(lines) + "\n"


def chart(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = result["systems"]
    panels = [
        ("healthy.ratio", "healthy step / plain DDP (x)", 1),
        ("kill.stall", "SIGKILL stall (s)", 1),
        ("stop.stall", f"SIGSTOP stall (s, capped at {result['settings']['stop_cap']:.0f})", 1),
        ("kill.rejoin", "rejoin (s)", 1),
        ("kill.redone", "committed steps redone after a kill", 1),
        ("chaos.goodput_ratio", "chaos goodput (% of healthy DDP)", 100),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    colors = plt.cm.tab10.colors
    for ax, (key, title, scale) in zip(axes.flat, panels):
        for i, system in enumerate(systems):
            stats = result["summary"][system][key]
            if stats["n"]:
                m = stats["median"] * scale
                ax.bar(i, m, color=colors[i % 10], yerr=[[m - stats["min"] * scale], [stats["max"] * scale - m]], capsize=4)
            elif key == "stop.stall" and stats["missing"]:
                ax.bar(i, result["settings"]["stop_cap"], color=colors[i % 10], hatch="//", alpha=0.4)
                ax.text(i, result["settings"]["stop_cap"], "none", ha="center", va="bottom", fontsize=8)
            else:
                ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(systems)))
        ax.set_xticklabels(systems, fontsize=8, rotation=20)
    fig.text(0.5, 0.005, "; ".join(f"{s}: {result['labels'][s]}" for s in systems), ha="center", fontsize=7)
    fig.suptitle(f"unbroken vs others, {result['settings']['workers']} CPU workers (Gloo), median and range of {result['settings']['repeats']} runs, {result['date']}")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write(result: dict, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    table = markdown(result)
    with open(os.path.join(directory, "compare.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(directory, "compare.md"), "w") as f:
        f.write(table)
    chart(result, os.path.join(directory, "compare.png"))
    return table


if __name__ == "__main__":
    import sys

    # Rewrite the table and chart of a finished run: python -m benchmarks.compare.report DIR
    with open(os.path.join(sys.argv[1], "compare.json")) as f:
        print(write(json.load(f), sys.argv[1]))
