"""benchmarks/simulate_goodput.py: the goodput simulator's arithmetic and its output (fast)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
try:
    import simulate_goodput as sim
finally:
    sys.path.pop(0)

GPUS = [1024, 4096, 16384]


def _goodputs(inp: sim.Inputs, days: float = 20, trials: int = 3, seed: int = 0) -> dict[tuple[int, str], float]:
    report = sim.run(inp, GPUS, days, trials, seed)
    return {(row["gpus"], s): r["goodput"] for row in report["results"] for s, r in row["strategies"].items()}


def test_with_no_failures_every_strategy_loses_only_its_checkpoint_stalls() -> None:
    inp = dataclasses.replace(sim.Inputs(), interruptions=0, checkpoint_interval_s=600.0)
    stall = sim.checkpoint_stall_s(inp)
    assert stall > 1.0  # the default workload's stall is seconds: the test below can see it
    for (_, strategy), goodput in _goodputs(inp, days=30, trials=1).items():
        assert goodput == pytest.approx(600.0 / (600.0 + stall), abs=1e-4), strategy


def test_with_no_failures_and_the_auto_interval_only_unbroken_checkpoints() -> None:
    inp = dataclasses.replace(sim.Inputs(), interruptions=0)
    assert math.isinf(sim.checkpoint_interval_s(inp, 16384))  # Young/Daly over no failure: never
    for (_, strategy), goodput in _goodputs(inp, trials=1).items():
        if strategy == "unbroken":  # its `auto` guards against losses it has not seen, up to its cap
            assert 1 - 2 * sim.checkpoint_stall_s(inp) / inp.checkpoint_max_interval_s < goodput < 1.0
        else:
            assert goodput == pytest.approx(1.0), strategy


def test_goodput_falls_as_failures_become_more_frequent() -> None:
    base = sim.Inputs()
    often = dataclasses.replace(base, interruptions=4 * base.interruptions)
    low, high = _goodputs(often), _goodputs(base)
    for key in high:
        assert low[key] < high[key], key
    # and with the GPU count, whose failures come more often; not unbroken's, which is flat: its
    # checkpoints do not follow the failure rate and a failure costs it 1 / replicas of its capacity
    for strategy in ("restart", "torchft"):
        assert high[(1024, strategy)] > high[(4096, strategy)] > high[(16384, strategy)], strategy
    assert max(high[(g, "unbroken")] for g in GPUS) - min(high[(g, "unbroken")] for g in GPUS) < 0.001


def test_a_restart_of_the_world_costs_more_the_longer_the_checkpoint_interval() -> None:
    # no checkpoint stall, so only the work redone after a failure differs
    base = dataclasses.replace(sim.Inputs(), snapshot_bytes_per_s=math.inf)
    failures = sim.draw_failures(base, 16384, 30 * 86400.0, random.Random(1))
    lost = {}
    for interval in (600.0, 3600.0):
        inp = dataclasses.replace(base, checkpoint_interval_s=interval)
        r = sim.simulate("restart", inp, 16384, failures, 30 * 86400.0)
        lost[interval] = (r["wall_s"] - r["useful_s"]) / r["failures"]
    assert lost[3600.0] > lost[600.0] + 1000  # half an interval more per failure, about 1,500 s
    unbroken = [sim.simulate("unbroken", dataclasses.replace(base, checkpoint_interval_s=i), 16384, failures, 30 * 86400.0)
                for i in (600.0, 3600.0)]
    assert unbroken[0]["useful_s"] == pytest.approx(unbroken[1]["useful_s"], rel=1e-6)  # unbroken redoes no interval


def test_a_hang_costs_restart_the_collective_timeout_and_unbroken_the_heartbeat_timeout() -> None:
    inp = dataclasses.replace(sim.Inputs(), snapshot_bytes_per_s=math.inf, replacement_s=0.0)
    horizon = 86400.0
    crash, hang = [(1000.0, False, False, 0.5)], [(1000.0, True, False, 0.5)]
    for strategy, extra in (("restart", inp.restart_hang_s), ("unbroken", inp.unbroken_hang_s - inp.unbroken_crash_s),
                            ("torchft", inp.torchft_hang_s - inp.torchft_crash_s)):
        useful = [sim.simulate(strategy, inp, 4096, f, horizon)["useful_s"] for f in (crash, hang)]
        assert useful[0] - useful[1] == pytest.approx(extra, abs=1e-6), strategy


def test_the_checkpoint_clock_stalls_after_every_interval_of_training() -> None:
    # 100 s of training, then a 10 s stall, ...: from 0 to 250 s: 2 checkpoints, 230 s trained
    assert sim._advance(0.0, 250.0, 0.0, 100.0, 10.0) == (250.0, 230.0, 30.0, 2)
    # an end inside a stall finishes the stall
    assert sim._advance(0.0, 105.0, 0.0, 100.0, 10.0) == (110.0, 100.0, 0.0, 1)
    assert sim._advance(0.0, 50.0, 20.0, math.inf, 10.0) == (50.0, 50.0, 70.0, 0)


def test_the_reformation_time_follows_the_measured_points() -> None:
    inp = sim.Inputs()
    for members, seconds in inp.unbroken_reform_s:
        assert sim.reform_s(inp, members) == pytest.approx(seconds)
    assert sim.reform_s(inp, 16000) > sim.reform_s(inp, 8000) > sim.reform_s(inp, 6000) > sim.reform_s(inp, 4000)


def test_the_json_has_every_strategy_and_size_and_marks_every_input(capsys) -> None:
    assert sim.main(["--json", "--no-plot", "--days", "5", "--trials", "2", "--gpus", *map(str, GPUS)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1
    report = json.loads(out[0])
    assert {"seed", "days", "trials", "inputs", "derived", "results"} <= report.keys()
    assert [row["gpus"] for row in report["results"]] == GPUS
    for row in report["results"]:
        assert {"replicas", "mtbf_h", "failures_per_trial", "checkpoint_interval_s"} <= row.keys()
        for strategy in sim.STRATEGIES:
            r = row["strategies"][strategy]
            assert 0 < r["goodput_min"] <= r["goodput"] <= r["goodput_max"] <= 1
            assert {"lost_s_per_failure", "checkpoint_overhead"} <= r.keys()
    kinds = {row["name"]: row["kind"] for row in report["inputs"]}
    assert set(kinds.values()) == {"measured here", "assumed", "published"}
    assert kinds["unbroken_crash_s"] == "measured here" and kinds["step_s"] == "assumed"
    assert all("`python benchmarks/" in row["source"] for row in report["inputs"] if row["kind"] == "measured here")


def test_the_same_seed_gives_the_same_figures_and_another_seed_others() -> None:
    one, two, other = (sim.run(sim.Inputs(), [4096], 10, 2, seed) for seed in (7, 7, 8))
    assert one == two
    assert one["results"][0]["strategies"]["restart"]["goodput"] != other["results"][0]["strategies"]["restart"]["goodput"]


def test_the_chart_is_drawn(tmp_path) -> None:
    path = tmp_path / "goodput.png"
    sim.plot(sim.run(sim.Inputs(), [1024, 4096], 2, 1, 0), str(path))
    assert path.stat().st_size > 1000


def test_unbroken_checkpoints_as_auto_does_counting_only_losses_of_every_live_copy() -> None:
    inp = sim.Inputs()
    stall = sim.checkpoint_stall_s(inp)
    assert sim.unbroken_interval_s(inp, 0.0) == pytest.approx(math.sqrt(2 * stall * inp.checkpoint_prior_s))
    assert sim.unbroken_interval_s(inp, 86400.0) > sim.unbroken_interval_s(inp, 3600.0)  # grows while none is lost
    assert sim.unbroken_interval_s(inp, 1e9) == inp.checkpoint_max_interval_s  # capped
    # at 16,384 GPUs the others checkpoint at Young/Daly over every failure, unbroken far less often
    row = sim.run(inp, [16384], 10, 1, 0)["results"][0]["strategies"]
    assert row["unbroken"]["checkpoints_per_trial"] < row["torchft"]["checkpoints_per_trial"] / 2
    assert row["unbroken"]["checkpoint_overhead"] < row["torchft"]["checkpoint_overhead"] / 2
