"""Stragglers: a member slowed down mid-run is flagged and given fewer micro-batches, and the job
keeps the single process's model and every sample exactly once, through a kill too; with
``--stragglers evict`` a member that stays far slower leaves at a step boundary (exit 74), is
restarted, and the job ends well."""

import os
import subprocess
import sys

import pytest
import torch

from testbed import harness
from testbed.watching import status, watched_run
from unbroken.observe.report import analyze, load

pytestmark = pytest.mark.slow

GLOBAL, MICRO = 48, 2
SHAPE = ("--global-batch-size", str(GLOBAL), "--micro-batch-size", str(MICRO), "--micro-delay", "0.01")


def _slowed_member(run) -> str:
    (fault,) = [e for e in run.events("fault") if e.get("fault") == "slow"]
    return fault["member"]


def test_a_slowed_member_is_flagged_and_given_fewer_micro_batches_with_the_same_model_through_a_kill(tmp_path):
    run_dir = str(tmp_path / "run")
    steps = 45
    statuses: list[str] = []

    def observe(metrics: dict[str, float], port: int, token: str) -> None:
        if metrics.get("unbroken_stragglers") == 1 and metrics["unbroken_members"] == 3 and not statuses:
            statuses.append(status(port, token))

    seen = watched_run(run_dir, ["--nproc-per-node", "3", "--record-samples",
                                 "--chaos", "slow@micro,rank=1,step=4,sleep=0.02;kill@step,rank=2,step=30",
                                 harness.EXACT, "--steps", str(steps), *SHAPE, "--out", f"{run_dir}/final"], observe, timeout=300)
    run = seen["run"]
    assert run.code == 0 and seen["leftovers"] == [], run.stdout[-3000:]
    slow = _slowed_member(run)
    # the coordinator's metrics name the straggler while it is one (from the members' heartbeats);
    # taken before the kill, while three members train
    pace, exchange = 'unbroken_member_pace{member="%s"}', 'unbroken_member_exchange_seconds{member="%s"}'
    flagged_scrapes = [m for _, m in seen["scrapes"] if m.get("unbroken_stragglers") == 1 and m["unbroken_members"] == 3
                       and len([k for k in m if k.startswith("unbroken_member_pace{")]) == 3]
    assert flagged_scrapes, [m.get("unbroken_stragglers") for _, m in seen["scrapes"]][-50:]
    seen_paces = {k: v for k, v in flagged_scrapes[0].items() if k.startswith(("unbroken_member_pace", "unbroken_member_exchange"))}
    assert min((v, k) for k, v in seen_paces.items() if k.startswith("unbroken_member_pace"))[1] == pace % slow, seen_paces
    assert seen_paces[pace % slow] < 0.8, seen_paces
    assert max((v, k) for k, v in seen_paces.items() if k.startswith("unbroken_member_exchange"))[1] != exchange % slow, seen_paces
    assert statuses and any(slow in line and "straggler" in line for line in statuses[0].splitlines()), statuses
    flagged = run.events("straggler")
    assert [e["member"] for e in flagged][:1] == [slow], flagged
    assert flagged[0]["step"] <= 4 + 20 and flagged[0]["pace"] < 0.8
    assert "is a straggler" in run.stdout + run.stderr, "the leader's warning reaches the console"
    shares = [e for e in run.events("rebalanced") if e["shares"]]
    assert shares, run.events("rebalanced")
    first = shares[0]
    mine = first["shares"][first["members"].index(slow)]
    assert mine < GLOBAL / 3 and all(s % MICRO == 0 for s in first["shares"]), first
    (row,) = analyze(load([run_dir]))["stragglers"]
    assert row["member"] == slow and row["share"] < GLOBAL / 3 and not row["evicted"], row  # unbroken report's table
    assert len(run.events("generation")) >= 2, "the kill formed a new generation, which started with equal shares"
    harness.check_exactly_once(run.run_dir, steps, GLOBAL)
    single = harness.single_process(str(tmp_path / "single"), "--steps", str(steps), *SHAPE[:4])
    harness.check_same_model(f"{run_dir}/final", single, harness.finished_members(run.run_dir))


def test_evict_ends_a_member_that_stays_far_slower_and_the_job_finishes(tmp_path):
    run_dir = str(tmp_path / "run")
    steps = 50
    run = harness.unbroken(run_dir, "--nproc-per-node", "3", "--record-samples", "--stragglers", "evict",
                           "--chaos", "slow@micro,rank=1,step=3,sleep=0.05", harness.EXACT, "--steps", str(steps), *SHAPE,
                           "--out", f"{run_dir}/final", timeout=300)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    slow = _slowed_member(run)
    (evicted,) = run.events("evicted")
    assert evicted["member"] == slow and "straggler" in evicted["reason"], evicted
    exits = [e for e in run.events("worker_exit") if e.get("member") == slow]
    assert any(e.get("code") == 74 or "74" in str(e.get("how", "")) for e in exits), exits
    assert run.events("restart"), "the launcher restarted the evicted member"
    harness.check_exactly_once(run.run_dir, steps, GLOBAL)
    single = harness.single_process(str(tmp_path / "single"), "--steps", str(steps), *SHAPE[:4])
    harness.check_same_model(f"{run_dir}/final", single, harness.finished_members(run.run_dir))


FSDP_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_fsdp.py")


def test_a_slow_process_sets_its_replica_groups_pace_and_the_group_gets_fewer_micro_batches(tmp_path):
    """Three replica groups of two FSDP processes; process 1 of group 1 (local rank 3) sleeps at
    every micro-batch from step 4: its group is flagged and given fewer of the global batch's
    micro-batches (whole ones of the group: 2 processes x 4 samples), with every sample once and
    the model of one plain process."""
    run_dir, steps, global_batch = str(tmp_path / "run"), 30, 96
    script = [FSDP_EXAMPLE, "--steps", str(steps), "--global-batch-size", str(global_batch), "--step-delay", "0.05"]
    run = harness.unbroken(run_dir, "--nproc-per-node", "6", "--group-size", "2", "--record-samples",
                           "--chaos", "slow@micro,rank=3,step=4,sleep=0.05", *script, "--out", f"{run_dir}/final", timeout=300)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run.run_dir), 30, "no process left behind")
    (group,) = [m for m in run.events("generation")[0]["members"] if ".w1." in m]
    flagged = run.events("straggler")
    assert flagged and flagged[0]["member"] == group and flagged[0]["step"] <= 4 + 20, flagged
    first = next(e for e in run.events("rebalanced") if e["shares"])
    assert first["shares"][first["members"].index(group)] < global_batch / 3, first
    assert all(s % 8 == 0 for s in first["shares"]) and sum(first["shares"]) == global_batch, first
    harness.check_exactly_once(run.run_dir, steps, global_batch)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    subprocess.run([sys.executable, *script[:5], "--out", str(tmp_path / "single")], check=True, timeout=120, env=env,
                   capture_output=True)
    single = torch.load(os.path.join(tmp_path, "single", "single.pt"))
    finals = harness.final_params(f"{run_dir}/final")
    assert len(finals) == 3 and all(harness.max_relative_difference(p, single) < 1e-8 for p in finals.values()), sorted(finals)


def test_a_straggler_whose_steps_outlast_every_timeout_but_the_collectives_is_rebalanced_not_fenced(tmp_path):
    """Real shape, scaled down: the straggler's micro-batch takes 0.75 s (half the progress
    timeout) and its step 3 s, so the others wait in the gradient exchange three times the
    heartbeat timeout. Nobody is declared dead: the straggler keeps making progress and the others
    are waiting in a collective. It is flagged and rebalanced within the one generation."""
    run_dir, steps, global_batch = str(tmp_path / "run"), 14, 12
    shape = ("--global-batch-size", str(global_batch), "--micro-batch-size", "1", "--micro-delay", "0.05")
    run = harness.unbroken(run_dir, "--nproc-per-node", "3", "--record-samples", "--heartbeat-interval", "0.25",
                           "--heartbeat-timeout", "1", "--progress-timeout", "1.5", "--collective-timeout", "20",
                           "--chaos", "slow@micro,rank=1,step=1,sleep=0.75", harness.EXACT, "--steps", str(steps), *shape,
                           "--out", f"{run_dir}/final", timeout=300)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert [e for e in run.events("verdict") if "explains" not in e] == [] and run.events("failure") == []
    assert all(w["restarts"] == 0 for w in run.summary()["workers"]) and len(run.events("generation")) == 1
    slow = _slowed_member(run)
    assert [e["member"] for e in run.events("straggler")] == [slow]
    first = next(e for e in run.events("rebalanced") if e["shares"])
    assert first["shares"][first["members"].index(slow)] < global_batch / 3, first
    long_steps = [e["seconds"] for e in run.events("step") if e["step"] >= 1 and e["step"] < first["step"]]
    assert long_steps and min(long_steps) > 2.0, long_steps  # before rebalancing, steps outlasted the progress timeout
    harness.check_exactly_once(run.run_dir, steps, global_batch)
    single = harness.single_process(str(tmp_path / "single"), "--steps", str(steps), *shape[:4])
    harness.check_same_model(f"{run_dir}/final", single, harness.finished_members(run.run_dir))
