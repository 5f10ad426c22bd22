"""Stragglers: a member slowed down mid-run is flagged and given fewer micro-batches, and the job
keeps the single process's model and every sample exactly once, through a kill too; with
``--stragglers evict`` a member that stays far slower leaves at a step boundary (exit 74), is
restarted, and the job ends well."""

import pytest

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
