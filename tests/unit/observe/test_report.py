"""``unbroken report``: figures, incidents and the timeline from synthetic event logs."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from unbroken.observe import report
from unbroken.cli import main

T0 = 1_000_000.0
KILL = T0 + 2.0  # the SIGKILL incident of the standard log
STEP = 0.01  # every step's 'seconds' and spacing


class Events:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def add(self, t: float, kind: str, source: str = "coordinator", **fields) -> None:
        self.records.append({"t": t, "kind": kind, "source": source, **fields})

    def steps(self, first: int, count: int, start: float, generation: int, members: int, **extra) -> float:
        """``count`` commits one STEP apart from ``start``; returns the time of the last."""
        for i in range(count):
            t = start + i * STEP
            self.add(t, "step", "worker:a", step=first + i, generation=generation, members=members, seconds=STEP, loss=2.0 / (1 + first + i), **extra)
        return start + (count - 1) * STEP

    def write(self, run_dir: Path, records: list[dict] | None = None) -> Path:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "events.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in (self.records if records is None else records)))
        return path


def standard_log() -> Events:
    """Four workers, steps 0-49; c is killed at KILL; three go on (50-79); c restarts, rejoins,
    is healed; four finish (80-99)."""
    e = Events()
    e.add(T0, "coordinator_start", port=1, store_port=2)
    for i, m in enumerate("abcd"):
        e.add(T0 + 0.01 * i, "worker_start", "launcher:n", member=m, local_rank=i, pid=100 + i, restart=0)
    e.add(T0 + 1.0, "generation", generation=1, members=list("abcd"), reason="4 member(s) ready")
    e.add(T0 + 1.005, "heal", "worker:a", sender="a", generation=1, receivers=list("bcd"), step=0, bytes=1000, seconds=0.004)
    e.steps(0, 50, T0 + 1.01, generation=1, members=4)  # last at T0 + 1.5
    # The kill: the launcher sees the exit, a survivor the broken allreduce, the coordinator
    # gives its verdict: one incident, within 20 ms.
    e.add(KILL, "worker_exit", "launcher:n", member="c", local_rank=2, code=-9, how="killed by SIGKILL")
    e.add(KILL + 0.005, "failure", member="b", generation=1, detected_by="collective", error="allreduce failed")
    e.add(KILL + 0.02, "verdict", member="c", detected_by="launcher", reason="killed by SIGKILL")
    e.add(KILL + 0.03, "generation", generation=2, members=list("abd"), reason="3 member(s) ready")
    e.steps(50, 30, KILL + 0.05, generation=2, members=3)  # 40 ms after the exit
    e.add(KILL + 0.1, "worker_start", "launcher:n", member="c1", local_rank=2, pid=200, restart=1)
    e.add(KILL + 0.1, "restart", "launcher:n", member="c1", local_rank=2, restart=1)
    e.add(KILL + 0.4, "generation", generation=3, members=["a", "b", "d", "c1"], reason="4 member(s) ready")
    e.add(KILL + 0.41, "heal", "worker:a", sender="a", generation=3, receivers=["c1"], step=80, bytes=3000, seconds=0.006)
    last = e.steps(80, 20, KILL + 0.42, generation=3, members=4)
    for m in ("a", "b", "d", "c1"):
        e.add(last + 0.01, "finished", member=m, step=100)
    e.add(last + 0.05, "worker_exit", "launcher:n", member="a", local_rank=0, code=0, how="exit code 0")
    return e


def figures_of(*run_dirs: Path) -> dict:
    return report.analyze(report.load([str(d) for d in run_dirs]))


def test_the_figures_of_a_run_with_one_kill(tmp_path):
    e = standard_log()
    e.write(tmp_path)
    f = figures_of(tmp_path)
    assert f["events"] == len(e.records) and f["bad_lines"] == []
    assert f["steps_committed"] == 100 and f["last_step"] == 99 and f["next_step"] == 100
    assert "samples" not in f  # the step events do not say
    wall = e.records[-1]["t"] - T0
    assert f["wall_seconds"] == pytest.approx(wall)
    assert f["startup_seconds"] == pytest.approx(1.01)
    assert f["step_seconds"] == {"sum": pytest.approx(100 * STEP), "median": pytest.approx(STEP)}
    assert f["goodput"] == pytest.approx(100 * STEP / wall)
    # The exit, the collective failure and the verdict are one failure, found by the launcher.
    assert f["failures"]["total"] == 1
    assert f["failures"]["by_kind"] == {"launcher": 1}
    assert f["failures"]["events_by_detector"] == {"verdict": {"launcher": 1}, "failure": {"collective": 1}}
    (incident,) = f["incidents"]
    assert incident["at"] == pytest.approx(2.0)
    assert (incident["kind"], incident["members"], incident["generation"], incident["affected"], incident["events"]) == (
        "launcher", ["c"], 1, True, 3
    )
    # From the exit to the next commit (in generation 2), 50 ms, less one median step.
    assert incident["stall_seconds"] == pytest.approx(0.05 - STEP)
    assert f["stall_seconds"] == {"count": 1, "mean": pytest.approx(0.04), "max": pytest.approx(0.04)}
    assert (f["steps_redone"], f["redone_steps"]) == (1, [50])  # the step that generation 1 lost
    assert f["restarts"] == 1
    assert f["generations"] == 3
    assert f["heals"] == {"count": 4, "bytes": 4000, "seconds": pytest.approx(0.01)}
    assert f["checkpoints"]["count"] == 0
    assert f["finished"] is True and f["job_failed"] is None


def test_samples_are_summed_when_the_step_events_carry_them(tmp_path):
    e = Events()
    e.add(T0, "generation", generation=1, members=["a", "b"])
    e.steps(0, 10, T0 + 0.1, generation=1, members=2, samples=64)
    e.write(tmp_path)
    assert figures_of(tmp_path)["samples"] == 640


def test_a_step_committed_in_two_generations_counts_once_and_as_redone(tmp_path):
    e = Events()
    e.add(T0, "generation", generation=1, members=["a", "b"])
    e.steps(0, 5, T0 + 0.1, generation=1, members=2)  # 0-4
    e.add(T0 + 0.5, "generation", generation=2, members=["a"])
    e.steps(4, 3, T0 + 0.6, generation=2, members=1)  # 4 again, 5, 6
    e.write(tmp_path)
    f = figures_of(tmp_path)
    assert (f["steps_committed"], f["next_step"]) == (7, 7)
    assert (f["steps_redone"], f["redone_steps"]) == (1, [4])
    assert f["step_seconds"]["sum"] == pytest.approx(7 * STEP)  # the commit that stands, once
    assert f["failures"]["total"] == 0


def test_a_hang_is_classified_by_the_heartbeat_and_its_stall_starts_at_the_fault(tmp_path):
    e = Events()
    e.add(T0, "generation", generation=1, members=["a", "b", "c"])
    e.steps(0, 10, T0 + 0.1, generation=1, members=3)
    e.add(T0 + 1.0, "fault", "chaos:c", fault="stop", point="step", step=10, pid=7, member="c")
    # Five seconds of silence, then the verdict; the survivors' wait is cut short.
    e.add(T0 + 6.0, "verdict", member="c", detected_by="heartbeat", reason="no heartbeat for 5.0 s")
    e.add(T0 + 6.01, "failure", member="a", generation=1, detected_by="collective", error="cut short")
    e.add(T0 + 6.02, "failure", member="b", generation=1, detected_by="collective", error="cut short")
    e.add(T0 + 6.05, "generation", generation=2, members=["a", "b"])
    e.steps(10, 10, T0 + 6.1, generation=2, members=2)
    e.write(tmp_path)
    f = figures_of(tmp_path)
    assert f["failures"]["total"] == 1 and f["failures"]["by_kind"] == {"heartbeat": 1}
    (incident,) = f["incidents"]
    assert incident["at"] == pytest.approx(1.0)  # the fault, not the verdict
    assert incident["members"] == ["c"]
    assert incident["stall_seconds"] == pytest.approx(5.1 - STEP)
    assert f["redone_steps"] == [10]


def test_the_strongest_evidence_names_the_incident_and_separate_incidents_count_apart(tmp_path):
    e = Events()
    e.add(T0, "generation", generation=1, members=["a", "b", "c", "d"])
    e.steps(0, 10, T0 + 0.1, generation=1, members=4)
    e.add(T0 + 1.0, "failure", member="a", generation=1, detected_by="collective", error="x")
    e.add(T0 + 1.5, "verdict", member="d", detected_by="progress watchdog", reason="stuck")  # chained: 0.5 s
    e.add(T0 + 1.6, "generation", generation=2, members=["a", "b", "c"])
    e.steps(10, 10, T0 + 2.0, generation=2, members=3)
    e.add(T0 + 5.0, "failure", member="a", generation=2, detected_by="collective", error="y")  # alone
    e.add(T0 + 5.1, "generation", generation=3, members=["a", "b"])
    e.steps(20, 10, T0 + 5.2, generation=3, members=2)
    e.write(tmp_path)
    f = figures_of(tmp_path)
    assert f["failures"]["by_kind"] == {"progress watchdog": 1, "collective": 1}
    assert [i["kind"] for i in f["incidents"]] == ["progress watchdog", "collective"]
    assert f["incidents"][0]["stall_seconds"] == pytest.approx(1.0 - STEP)
    assert f["incidents"][1]["stall_seconds"] == pytest.approx(0.2 - STEP)
    assert f["stall_seconds"]["mean"] == pytest.approx(0.6 - STEP)
    assert f["stall_seconds"]["max"] == pytest.approx(1.0 - STEP)
    assert f["redone_steps"] == [10, 20]


def test_exits_the_launcher_made_on_purpose_are_not_failures_and_crashes_it_alone_saw_are(tmp_path):
    """Workers stopped at the end of the job exit with a signal, with no verdict: no failure. After a
    Ctrl-C (the launcher's shutdown event) the coordinator's verdicts on that node's members are a
    stop too. A worker that crashed before it ever joined (a script error, restarted until its slot
    was quarantined) is one: the coordinator never saw it, and the report said "failures 0"."""
    e = Events()
    e.add(T0, "generation", generation=1, members=["n.w0.r0", "n.w1.r0"])
    last = e.steps(0, 10, T0 + 0.1, generation=1, members=2)
    e.add(last + 0.01, "finished", member="n.w0.r0", step=10)
    e.add(last + 5.0, "worker_exit", "launcher:n", member="n.w1.r0", local_rank=1, code=-9,
          how="killed by SIGKILL (stopped by the launcher)")
    e.add(last + 10.0, "shutdown", "launcher:n", node="n", signal="SIGINT")
    e.add(last + 10.1, "verdict", member="n.w0.r0", detected_by="connection", reason="its heartbeat connection closed")
    e.add(last + 10.2, "worker_exit", "launcher:n", member="n.w0.r0", local_rank=0, code=-15,
          how="killed by SIGTERM (stopped by the launcher)")
    e.write(tmp_path)
    f = figures_of(tmp_path)
    assert f["failures"]["total"] == 0 and f["incidents"] == []
    for t, restart in ((last + 20.0, 1), (last + 22.0, 2)):
        e.add(t, "worker_exit", "launcher:m", member=f"m.w0.r{restart}", local_rank=0, code=1, how="exit code 1")
    e.add(last + 22.1, "quarantine", "launcher:m", member="m.w0.r2", local_rank=0)
    e.write(tmp_path)
    f = figures_of(tmp_path)
    assert f["failures"]["total"] == 2 and f["failures"]["by_kind"] == {"launcher": 2}


def test_a_worker_lost_outside_the_running_generation_is_a_failure_without_a_stall(tmp_path):
    e = Events()
    e.add(T0, "generation", generation=1, members=["a", "b"])
    e.steps(0, 100, T0 + 0.1, generation=1, members=2)
    # A restarted worker dies before it joined: training never stopped.
    e.add(T0 + 0.5, "worker_exit", "launcher:n", member="c1", local_rank=2, code=1, how="exit code 1")
    e.add(T0 + 0.51, "verdict", member="c1", detected_by="launcher", reason="exit code 1")
    e.write(tmp_path)
    f = figures_of(tmp_path)
    assert f["failures"]["by_kind"] == {"launcher": 1}
    (incident,) = f["incidents"]
    assert incident["affected"] is False and incident["stall_seconds"] is None
    assert f["stall_seconds"] == {"count": 0, "mean": None, "max": None}
    assert f["steps_redone"] == 0


def test_checkpoint_events_are_counted(tmp_path):
    e = Events()
    e.add(T0, "generation", generation=1, members=["a"])
    e.steps(0, 10, T0 + 0.1, generation=1, members=1)
    e.add(T0 + 0.2, "checkpoint", "worker:a", step=5, bytes=500, seconds=0.25)
    e.add(T0 + 0.3, "checkpoint", "worker:a", step=10, bytes=700, stall=0.01, write_seconds=0.5)
    e.write(tmp_path)
    assert figures_of(tmp_path)["checkpoints"] == {"count": 2, "bytes": 1200, "seconds": pytest.approx(0.75), "stall_seconds": pytest.approx(0.01), "last_step": 10}


def test_a_corrupt_and_truncated_log_still_reports_and_names_its_bad_lines(tmp_path, capsys):
    e = standard_log()
    lines = [json.dumps(r) for r in e.records]
    lines.insert(2, "%%% garbage \x00\xff")  # line 3
    lines.insert(6, "[1, 2, 3]")  # line 7: JSON, not an object
    lines.insert(9, json.dumps({"kind": "step", "step": 3}))  # line 10: no time
    lines.insert(12, json.dumps({"t": T0 + 1.3, "kind": "step", "step": "x", "generation": 1}))  # line 13
    full = "\n".join(lines) + "\n"
    truncated = full + json.dumps({"t": T0 + 9, "kind": "step", "step": 100, "generation": 3})[:25]
    (tmp_path / "events.jsonl").write_bytes(truncated.encode("utf-8", "surrogateescape"))
    last_line = len(lines) + 1
    assert main(["report", str(tmp_path), "--no-png"]) == 0
    out = capsys.readouterr().out
    assert "steps committed" in out and "100" in out
    assert f"lines 3, 7, 10, 13, {last_line}" in out
    assert main(["report", str(tmp_path), "--json", "--no-png"]) == 0
    f = json.loads(capsys.readouterr().out)
    assert [b["line"] for b in f["bad_lines"]] == [3, 7, 10, 13, last_line]
    assert f["bad_lines"][2]["why"] == "no numeric 't'"
    assert f["bad_lines"][3]["why"] == "step event without int 'step'"
    assert f["steps_committed"] == 100 and f["failures"]["by_kind"] == {"launcher": 1}


def test_an_empty_log_gives_an_empty_report_and_a_picture(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text("")
    assert main(["report", str(tmp_path), "--json"]) == 0
    f = json.loads(capsys.readouterr().out)
    assert (f["events"], f["steps_committed"], f["wall_seconds"], f["goodput"]) == (0, 0, 0.0, None)
    assert Path(f["timeline"]).is_file()


def test_a_missing_log_is_an_error_not_a_traceback(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "no event log" in capsys.readouterr().err


def test_several_run_directories_are_merged_and_one_given_twice_counts_once(tmp_path):
    e = standard_log()
    launcher = [r for r in e.records if r["source"].startswith("launcher")]
    others = [r for r in e.records if not r["source"].startswith("launcher")]
    e.write(tmp_path / "node0", others)
    e.write(tmp_path / "node1", launcher)
    e.write(tmp_path / "all")
    merged = figures_of(tmp_path / "node0", tmp_path / "node1")
    single = figures_of(tmp_path / "all")
    for figures in (merged, single):
        figures.pop("files")
    assert merged == single
    assert figures_of(tmp_path / "all", tmp_path / "all" / "events.jsonl")["events"] == len(e.records)


def test_the_timeline_is_a_picture_of_sane_size_with_something_drawn(tmp_path, capsys):
    from matplotlib.image import imread

    standard_log().write(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    assert f"timeline: {tmp_path / 'timeline.png'}" in capsys.readouterr().out
    pixels = imread(str(tmp_path / "timeline.png"))
    height, width = pixels.shape[:2]
    assert 500 <= width <= 2000 and 500 <= height <= 2000
    assert pixels[..., :3].std() > 0.05  # not blank


def test_png_elsewhere_or_not_at_all(tmp_path, capsys):
    standard_log().write(tmp_path / "run")
    assert main(["report", str(tmp_path / "run"), "--json", "--png", str(tmp_path / "t.png")]) == 0
    assert json.loads(capsys.readouterr().out)["timeline"] == str(tmp_path / "t.png")
    assert (tmp_path / "t.png").is_file() and not (tmp_path / "run" / "timeline.png").exists()
    assert main(["report", str(tmp_path / "run"), "--json", "--no-png"]) == 0
    assert json.loads(capsys.readouterr().out)["timeline"] is None
    assert not (tmp_path / "run" / "timeline.png").exists()


def test_the_module_imports_rich_and_matplotlib_only_when_used():
    tree = ast.parse(Path(report.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names] + [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in ("rich", "matplotlib")]


def test_the_report_command_parses_its_options():
    from unbroken.cli import build_parser

    args = build_parser().parse_args(["report", "a", "b", "--json", "--png", "x.png"])
    assert (args.command, args.run_dirs, args.json, args.png, args.no_png) == ("report", ["a", "b"], True, "x.png", False)
    args = build_parser().parse_args(["report", "a", "--no-png"])
    assert (args.run_dirs, args.json, args.png, args.no_png) == (["a"], False, None, True)


def straggler_log() -> Events:
    """Three members; b is flagged at step 12, given fewer micro-batches, later evicted."""
    e = Events()
    e.add(T0, "generation", generation=1, members=list("abc"), reason="3 member(s) ready")
    e.steps(0, 10, T0 + 0.1, generation=1, members=3)
    e.add(T0 + 0.5, "straggler", "worker:a", step=12, member="b", pace=0.48, window=5)
    e.add(T0 + 0.6, "rebalanced", "worker:a", step=14, shares=[6, 2, 6], members=list("abc"), paces=[1.0, 0.49, 1.0])
    e.add(T0 + 0.7, "straggler", "worker:a", step=15, member="b", pace=0.47, window=5)  # a later generation's
    e.add(T0 + 0.9, "evicted", "worker:b", step=30, member="b")
    return e


def test_the_report_lists_each_straggler_once_with_its_share_after_rebalancing_and_eviction(tmp_path, capsys):
    straggler_log().write(tmp_path)
    assert figures_of(tmp_path)["stragglers"] == [{"member": "b", "step": 12, "pace": 0.48, "share": 2, "evicted": True}]
    assert main(["report", str(tmp_path), "--no-png"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "48%" in line)
    assert "stragglers" in out and all(cell in row for cell in ("b", "12", "2", "yes"))


def test_the_timeline_marks_stragglers_evictions_and_rebalancing():
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    from unbroken.observe.timeline import _draw_marks

    events = straggler_log().records
    axes = tuple(Figure().subplots(3, 1))
    _draw_marks(axes, events, {"incidents": []}, T0)
    members_labels = axes[0].get_legend_handles_labels()[1]
    assert {"straggler", "evicted"} <= set(members_labels)
    assert "rebalanced" in axes[1].get_legend_handles_labels()[1]
    straggler_line = next(h for h, label in zip(*axes[0].get_legend_handles_labels()) if label == "straggler")
    assert list(straggler_line.get_xdata()) == pytest.approx([0.5, 0.7])
