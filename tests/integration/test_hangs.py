"""Hung and stuck members, and a quorum that is not met (issue: hangs, lost nodes, partitions)."""

import os
import signal

import pytest

from testbed import harness
from tests.integration.conftest import GLOBAL, STEPS
from tests.integration.test_survival import check_same_model_and_replicas

pytestmark = pytest.mark.slow



start = harness.start_in


finish = harness.finish


def test_a_stopped_worker_is_dropped_within_the_heartbeat_timeout_and_rejoins_without_stale_commits(tmp_path, reference):
    run_dir = str(tmp_path / "run")
    heartbeat_timeout = 2.0
    proc = start(
        ["run", "--run-dir", run_dir, "--nproc-per-node", "4", "--record-samples",
         "--heartbeat-interval", "0.25", "--heartbeat-timeout", str(heartbeat_timeout),
         "--chaos", "hang@step,rank=2,step=10",
         harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.1", "--out", f"{run_dir}/final"],
        str(tmp_path),
        # compare replicas after every commit: a woken member must not disturb its peers' steps
        env={"UNBROKEN_VERIFY_EVERY": "1"},
    )
    run = harness.Run(0, "", "", run_dir)
    try:
        fault = harness.wait_for(lambda: run.events("fault"), 120, "the worker to stop itself")[0]
        first = harness.wait_for(lambda: [e for e in run.events("step") if e["t"] > fault["t"]], 60, "the others to commit again")[0]
        stall = first["t"] - fault["t"]
        assert first["members"] == 3
        verdicts = [e for e in run.events("verdict") if e["member"] == fault["member"]]
        assert verdicts and verdicts[0]["detected_by"] == "heartbeat"
        # the survivors had said they wait in the allreduce: formed into the next generation by
        # the reply to their heartbeat, none of them sent a join
        after = [e for e in run.events("generation") if e["t"] >= verdicts[0]["t"]]
        assert after and after[0].get("without_joining") == 3, after[:1]
        os.kill(fault["pid"], signal.SIGCONT)
    finally:
        out, err = finish(proc, run_dir)
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    assert stall < heartbeat_timeout + 1.0, f"survivors stalled {stall:.2f} s"
    # It woke up, noticed, rejoined under its own name and was healed; it was never restarted.
    workers = {w["local_rank"]: w for w in run.summary()["workers"]}
    assert workers[2]["restarts"] == 0
    assert any(fault["member"] in e["receivers"] and e["t"] > fault["t"] for e in run.events("heal"))
    harness.check_exactly_once(run_dir, STEPS, GLOBAL)
    check_same_model_and_replicas(run, reference)


def test_a_worker_stuck_in_its_training_loop_is_evicted_and_the_others_continue(tmp_path, reference):
    run_dir = str(tmp_path / "run")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "4", "--record-samples",
        "--heartbeat-interval", "0.25", "--heartbeat-timeout", "2", "--progress-timeout", "3", "--collective-timeout", "10",
        "--chaos", "spin@step,rank=1,step=8",
        harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.1", "--out", f"{run_dir}/final",
    )
    assert run.code == 0, run.stdout[-2000:] + run.stderr[-2000:]
    fault = run.events("fault")[0]
    verdict = [e for e in run.events("verdict") if e["member"] == fault["member"]][0]
    assert verdict["detected_by"] == "progress watchdog"
    after = [e for e in run.events("generation") if e["t"] > verdict["t"]]
    assert fault["member"] not in after[0]["members"] and len(after[0]["members"]) == 3
    workers = {w["local_rank"]: w for w in run.summary()["workers"]}
    assert workers[1]["restarts"] == 1  # it ended itself; its launcher restarted it
    harness.check_exactly_once(run_dir, STEPS, GLOBAL)
    check_same_model_and_replicas(run, reference)


coordinator = harness.coordinator


def node(tmp_path, address, name, *args):
    run_dir = str(tmp_path / name)
    return start(["run", "--run-dir", run_dir, "--coordinator", address, "--node-name", name, "--nproc-per-node", "1", harness.EXACT, "--steps", "10", *args], str(tmp_path)), run_dir


def test_training_waits_below_the_minimum_and_starts_when_a_node_joins(tmp_path):
    coord, address = coordinator(tmp_path, "--min-members", "2", "--start-grace", "1", "--quorum-timeout", "120")
    try:
        a, a_dir = node(tmp_path, address, "a")
        status = lambda: harness.command(["status", address, "--json"], None, 30)  # noqa: E731
        harness.wait_for(lambda: '"state": "waiting"' in status().stdout, 120, "node a to wait for a generation")
        assert '"generation": 0' in status().stdout  # still waiting: below the minimum
        b, b_dir = node(tmp_path, address, "b")
        out_a, err_a = finish(a, a_dir)
        out_b, err_b = finish(b, b_dir)
        assert a.returncode == 0 and b.returncode == 0, err_a[-2000:] + err_b[-2000:]
        assert "step 9 loss" in out_a
    finally:
        os.killpg(coord.pid, signal.SIGKILL)
        coord.wait()


def test_staying_below_the_minimum_past_the_quorum_timeout_ends_with_a_clear_error(tmp_path):
    coord, address = coordinator(tmp_path, "--min-members", "2", "--start-grace", "1", "--quorum-timeout", "3")
    try:
        a, a_dir = node(tmp_path, address, "a")
        out, err = finish(a, a_dir, timeout=120)
    finally:
        os.killpg(coord.pid, signal.SIGKILL)
        coord.wait()
    assert a.returncode == 1
    assert "below the minimum of 2" in err and "quorum_timeout" in err


def test_a_member_stopped_before_its_commit_with_a_heartbeat_in_flight_commits_nothing_where_it_was_declared_dead(tmp_path, reference):
    # Stopped for 3 x the heartbeat timeout between its allreduce and its commit, with a heartbeat
    # long poll outstanding: when it wakes, the reply it reads was written before its verdict.
    run_dir = str(tmp_path / "run")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "3", "--record-samples",
        "--heartbeat-interval", "0.25", "--heartbeat-timeout", "2",
        "--chaos", "hang@commit,rank=2,step=10,for=6",
        # steps long enough that the survivors are still training when it wakes: at 0.15 s they
        # trained the 30 steps left in 4.5 s after re-forming at once, and the job finished as
        # it rejoined (seen in CI), with nobody left to heal it
        harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.25", "--out", f"{run_dir}/final",
        env={"UNBROKEN_VERIFY_EVERY": "1"},
    )
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    fault = run.events("fault")[0]
    victim = fault["member"]
    verdict = [e for e in run.events("verdict") if e["member"] == victim][0]
    assert verdict["detected_by"] == "heartbeat"
    dead_in = max(e["generation"] for e in run.events("generation") if victim in e["members"] and e["t"] < verdict["t"])
    stale = [c for c in harness.commits(run_dir, victim) if c["g"] == dead_in and c["t"] > verdict["t"]]
    assert stale == [], f"{victim} committed {stale} in generation {dead_in} after it was declared dead"
    # it woke, left that generation, rejoined under its own name and was healed
    assert any(victim in e["receivers"] and e["t"] > verdict["t"] for e in run.events("heal"))
    assert {w["local_rank"]: w for w in run.summary()["workers"]}[2]["restarts"] == 0
    harness.check_exactly_once(run_dir, STEPS, GLOBAL)
    check_same_model_and_replicas(run, reference)
