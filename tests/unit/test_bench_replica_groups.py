"""benchmarks/bench_replica_groups.py and benchmarks/fsdp_step.py: statistics, event parsing, command
lines and the model, without starting a job."""

import statistics

import pytest
import torch

from benchmarks import bench_replica_groups as bench
from benchmarks import fsdp_step


def test_summary_gives_the_median_and_the_outer_deciles():
    times = [float(v) for v in range(1, 12)]  # 1..11
    s = bench.summary(times)
    deciles = statistics.quantiles(times, n=10)
    assert s == {"median": 6.0, "p10": deciles[0], "p90": deciles[-1], "n": 11}
    assert s["p10"] < 2.0 and s["p90"] > 10.0
    assert bench.summary([0.2]) == {"median": 0.2, "p10": 0.2, "p90": 0.2, "n": 1}
    with pytest.raises(ValueError):
        bench.summary([])


def test_ratio_is_ours_over_hsdp_per_trial_and_over_the_pooled_steps():
    trials = [
        {"unbroken": [0.21, 0.22, 0.20], "hsdp": [0.20, 0.20, 0.20]},  # 1.05
        {"unbroken": [0.10, 0.10, 0.10, 0.10], "hsdp": [0.125, 0.125, 0.125, 0.125]},  # 0.8
        {"unbroken": [0.3, 0.3, 0.3], "hsdp": [0.3, 0.3, 0.3]},  # 1.0
    ]
    figures = bench.healthy_figures(trials)
    assert [round(t["ratio"], 6) for t in figures["trials"]] == [1.05, 0.8, 1.0]
    assert figures["ratio_of_trials"] == pytest.approx(1.0)
    pooled = figures["overall"]
    assert pooled["unbroken"]["n"] == 10 and pooled["hsdp"]["n"] == 10
    assert pooled["unbroken"]["median"] == pytest.approx(0.205)  # 0.1 x4, 0.2, 0.21, 0.22, 0.3 x3
    assert pooled["hsdp"]["median"] == pytest.approx(0.2)  # 0.125 x4, 0.2 x3, 0.3 x3
    assert pooled["ratio"] == pytest.approx(1.025)


def _event(kind, t, **fields):
    return {"kind": kind, "t": t, **fields}


def test_the_heal_of_the_restarted_group_is_read_per_process_and_its_time_is_the_slowest():
    events = [
        _event("worker_start", 0.0, member="vm.w0.r0", local_rank=0, restart=0),
        _event("worker_start", 0.0, member="vm.w1.r0", local_rank=1, restart=0),
        _event("worker_start", 0.0, member="vm.w2.r0", local_rank=2, restart=0),
        _event("step", 9.0, members=3, step=4),
        _event("fault", 10.0, member="vm.w1.r0"),
        _event("step", 10.5, members=2, step=5),
        _event("worker_start", 11.0, member="vm.w1.r1", local_rank=1, restart=1),
        _event("step", 15.0, members=2, step=12),
        _event("heal", 16.0, source="worker:vm.w0.r0.p1", generation=3, receivers=["rank1"], bytes=1, seconds=9.0),  # another heal
        # one event per sending process; process 1's source ends in .p1 and names the receiver's rank
        _event("heal", 17.0, source="worker:vm.w0.r0", generation=4, receivers=["vm.w1.r1"], bytes=30_000_000, seconds=0.40),
        _event("heal", 17.2, source="worker:vm.w0.r0.p1", generation=4, receivers=["rank2"], bytes=29_000_000, seconds=0.55),
        _event("step", 17.4, members=2, step=13),  # not yet with the healed group
        _event("step", 17.9, members=3, step=14),
    ]
    h = bench.heal_figures(events)
    assert h["member"] == "vm.w1.r1"
    assert h["processes"]["0"]["bytes"] == 30_000_000 and h["processes"]["1"]["seconds"] == 0.55
    assert h["bytes"] == 59_000_000 and h["seconds"] == 0.55
    assert h["kill_to_heal_s"] == pytest.approx(7.2)
    assert h["restart_to_commit_s"] == pytest.approx(6.9)
    assert bench.process_of("worker:vm.w0.r0") == 0 and bench.process_of("worker:vm.w0.r0.p1") == 1
    with pytest.raises(ValueError, match="never restarted"):
        bench.heal_figures(events[:6])
    with pytest.raises(ValueError, match="no heal event"):
        bench.heal_figures(events[:9])
    with pytest.raises(ValueError, match="only 1 of the group's 2"):
        bench.heal_figures(events[:10])


def test_both_variants_run_the_same_script_with_the_same_arguments():
    args = ["--steps", "7", "--times", "t.json"]
    ours = bench.command("unbroken", 4, "/tmp/run", args)
    hsdp = bench.command("hsdp", 4, "/tmp/run", args)
    assert ours[1:4] == ["-m", "unbroken", "run"] and hsdp[1:3] == ["-m", "torch.distributed.run"]
    assert ours[ours.index("--group-size") + 1] == "2" and ours[ours.index("--nproc-per-node") + 1] == "4"
    assert hsdp[hsdp.index("--nproc-per-node") + 1] == "4" and "--standalone" in hsdp
    for cmd, mode in ((ours, "unbroken"), (hsdp, "hsdp")):
        tail = cmd[cmd.index(bench.SCRIPT) + 1 :]
        assert tail[:2] == ["--mode", mode] and tail[-4:] == args
        fsdp_step.parse_args(tail)  # the script accepts them
    chaos = bench.command("unbroken", 6, "/tmp/run", [], chaos="kill@step,rank=3,step=5")
    assert chaos[chaos.index("--chaos") + 1] == "kill@step,rank=3,step=5"


def test_bench_arguments_and_quick():
    args = bench.parse_args([])
    assert (args.trials, args.steps, args.warmup, args.heal_hidden) == (3, 45, 5, 1536)
    quick = bench.parse_args(["--quick"])
    assert quick.trials == 1 and quick.steps < args.steps and quick.heal_trials == 1
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "5", "--warmup", "5"])


def test_fsdp_step_builds_the_model_it_documents():
    args = fsdp_step.parse_args(["--mode", "hsdp"])
    assert (args.hidden, args.layers, args.dtype, args.global_batch_size, args.micro_batch_size) == (1024, 3, "float32", 64, 8)
    model = fsdp_step.make_model(args.hidden, args.layers, torch.float32)
    assert sum(p.numel() for p in model.parameters()) == fsdp_step.parameter_count(1024, 3) == 2_182_160
    again = fsdp_step.make_model(args.hidden, args.layers, torch.float32)  # every process builds the same model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    x, y = fsdp_step.make_data(torch.float32)
    assert x.shape == (fsdp_step.DATASET, fsdp_step.IN_FEATURES) and y.shape == (fsdp_step.DATASET, fsdp_step.OUT_FEATURES)
    assert fsdp_step.squared_error_sum(model, x[:0], y[:0]).item() == 0.0  # an empty micro-batch adds 0, not NaN
    with pytest.raises(SystemExit):
        fsdp_step.parse_args(["--mode", "ddp"])
    with pytest.raises(SystemExit):
        fsdp_step.parse_args(["--mode", "hsdp", "--hidden", "0"])
