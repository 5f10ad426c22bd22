"""The comparison benchmark's log analysis: trajectory, samples, stall and rejoin."""

import json

import pytest

from benchmarks.compare import analysis

G = 6  # global batch


def rec(t, step, rank, world, pid=None, pos=None):
    if pos is None:
        base, extra = divmod(G, world)
        a = step * G + rank * base + min(rank, extra)
        pos = [[a, a + base + (1 if rank < extra else 0)]]
    return {"k": "step", "t": t, "pid": pid if pid is not None else 100 + rank, "step": step, "rank": rank, "world": world, "pos": pos}


def run(steps, world=3, t0=0.0, dt=1.0, pids=None):
    out = []
    for i, s in enumerate(steps):
        for r in range(world):
            out.append(rec(t0 + i * dt + r * 0.01, s, r, world, pid=(pids or {}).get(r)))
    return out


def test_healthy_run_has_no_loss_no_repeat_no_redo():
    traj = analysis.trajectory(run(range(10)))
    assert analysis.samples(traj, G) == {"steps": 10, "useful": 60, "lost": 0, "repeated": 0, "inferred": 0}
    assert traj.redone == 0


def test_rollback_replaces_the_rolled_back_steps_and_counts_them():
    # steps 0..12 committed, then a restart from the checkpoint at step 10: 10, 11, 12 again
    records = run(range(13)) + run(range(10, 16), t0=100)
    traj = analysis.trajectory(records)
    assert traj.redone == 3
    assert analysis.samples(traj, G) == {"steps": 16, "useful": 96, "lost": 0, "repeated": 0, "inferred": 0}


def test_shrunk_global_batch_counts_lost_samples():
    # torchft-like: replica 2 is gone for steps 3 and 4, its share is never read
    records = run(range(3))
    for s in (3, 4):
        records += [{**rec(10 + s, s, r, 2, pos=[[s * G + 2 * r, s * G + 2 * r + 2]]), "slots": 3} for r in range(2)]
    traj = analysis.trajectory(records)
    assert analysis.samples(traj, G) == {"steps": 5, "useful": 26, "lost": 4, "repeated": 0, "inferred": 0}
    assert traj.redone == 0


def test_reading_the_same_positions_twice_counts_repeats():
    records = run(range(2)) + [rec(5, 2, 0, 3, pos=[[0, 2]]), rec(5.1, 2, 1, 3), rec(5.2, 2, 2, 3)]
    assert analysis.samples(analysis.trajectory(records), G)["repeated"] == 2


def test_a_step_redone_in_a_new_member_count_replaces_a_partial_commit():
    # member 2 committed step 4 alone and died; the two survivors redo step 4 with two members
    records = run(range(4)) + [rec(4.0, 4, 2, 3)] + [rec(6 + r * 0.01, 4, r, 2) for r in range(2)]
    traj = analysis.trajectory(records)
    assert [r["world"] for r in traj.by_step[4]] == [2, 2]
    assert analysis.samples(traj, G)["lost"] == 0


def test_stall_is_fault_to_the_first_step_without_the_victim_less_a_step():
    # the victim (pid 101) logged step 4; survivors may still commit 5 with its share, 6 needs a new group
    records = run(range(6), dt=0.1) + run(range(6, 8), t0=3.0, dt=0.1)
    records = [r for r in records if not (r["pid"] == 101 and r["step"] == 5)]
    got = analysis.after_fault(records, t_fault=0.45, victim=101, healthy=0.1)
    assert got["last_step"] == 4
    assert got["stall"] == pytest.approx(3.0 - 0.45 - 0.1)


def test_stall_ignores_the_victims_own_commits_and_is_none_without_progress():
    records = run(range(3), dt=0.1, pids={1: 7})
    assert analysis.after_fault(records, 10.0, victim=7, healthy=0.1)["stall"] is None
    late = records + [rec(11.0, 3, 1, 3, pid=7), rec(12.0, 4, 1, 3, pid=7)]
    assert analysis.after_fault(late, 10.0, victim=7, healthy=0.1)["stall"] is None


def test_a_killed_members_missing_record_is_inferred_when_shares_follow_the_member_count():
    records = run(range(3)) + [rec(3.0, 3, 0, 3), rec(3.01, 3, 2, 3)]
    assert analysis.samples(analysis.trajectory(records), G) == {"steps": 4, "useful": 24, "lost": 0, "repeated": 0, "inferred": 1}
    ft = [{**r, "slots": 4} for r in records]  # shares do not follow the member count: not inferred
    assert analysis.samples(analysis.trajectory(ft), G)["lost"] == 2


def test_rejoin_measures_new_processes_from_their_start():
    records = run(range(3), dt=0.1) + [{"k": "start", "t": 5.0, "pid": 9}] + [rec(8.5, 3, 1, 3, pid=9), rec(8.6, 4, 1, 3, pid=9)]
    records.sort(key=lambda r: r["t"])
    assert analysis.rejoin(records, 4.0, old_pids={100, 101, 102}) == pytest.approx(3.5)
    assert analysis.rejoin(records, 4.0, old_pids={9}) is None


def test_step_seconds_is_the_median_gap_after_warmup():
    records = run(range(100), dt=0.01)
    assert analysis.step_seconds(records, warmup=50) == pytest.approx(0.01)
    assert analysis.step_seconds(records, warmup=200) is None


def test_read_skips_torn_lines(tmp_path):
    good = [rec(2, 1, 0, 3), rec(1, 0, 0, 3)]
    (tmp_path / "w_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good) + '{"k": "st')
    assert [r["step"] for r in analysis.read(str(tmp_path))] == [0, 1]


def test_summarize_reports_missing_runs():
    assert analysis.summarize([1.0, None, 3.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 2, "missing": 1}
    assert analysis.summarize([None])["median"] is None


def test_a_late_record_of_a_stopped_member_joins_its_own_execution():
    # member 1 was stopped between its commit of step 3 and writing the record
    records = run(range(3)) + [rec(3.0, 3, 0, 3), rec(3.01, 3, 2, 3)] + [rec(8 + r * 0.01, 4, r, 2) for r in range(2)] + [rec(9.0, 3, 1, 3)]
    traj = analysis.trajectory(records)
    assert traj.redone == 0
    assert sorted(r["rank"] for r in traj.by_step[3]) == [0, 1, 2]
    assert 4 in traj.by_step


def _result(runs):
    from benchmarks.compare import report

    result = {
        "date": "2026-11-30",
        "systems": ["a", "ddp"],
        "labels": {"a": "A", "ddp": "plain DDP"},
        "governs": {"a": "heartbeat", "ddp": "Gloo timeout"},
        "settings": {"stop_cap": 30.0, "workers": 3, "repeats": 2},
        "runs": runs,
    }
    result["summary"] = report.summary(runs, result["systems"])
    return result


def test_table_gives_median_range_counts_and_caps(tmp_path):
    from benchmarks.compare import report

    runs = [
        {"system": "a", "scenario": "kill", "stall": 0.02, "finished": True},
        {"system": "a", "scenario": "kill", "stall": 0.04, "finished": True},
        {"system": "ddp", "scenario": "kill", "stall": None, "finished": False},
        {"system": "a", "scenario": "stop", "stall": 4.9, "finished": True},
        {"system": "ddp", "scenario": "stop", "stall": None, "finished": True},
        {"system": "ddp", "scenario": "stop", "error": "ScenarioError: did not reach step 310"},
    ]
    table = report.markdown(_result(runs))
    row = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
    assert "0.03 s (0.02–0.04)" in row["SIGKILL: stall"]
    assert row["SIGKILL: run finished"].endswith("| 2/2 | 0/1 |")
    assert "none within 30 s (1 of 1); 1 failed to run" in row["SIGSTOP: survivors commit again after"]
    assert "chaos: goodput / healthy plain DDP" not in row  # no chaos runs: no row
    assert row["SIGSTOP: what decides it"].endswith("| heartbeat | Gloo timeout |")
    assert "SIGSTOP: what decides it" not in report.markdown(_result(runs[:3]))
    report.write(_result(runs), str(tmp_path))
    assert json.loads((tmp_path / "compare.json").read_text())["summary"]["a"]["kill.stall"]["n"] == 2
    assert (tmp_path / "compare.png").stat().st_size > 10_000
