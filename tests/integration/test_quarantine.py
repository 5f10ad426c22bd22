"""A worker slot that keeps crashing is quarantined; the others train on; it comes back later."""

import pytest

from testbed import harness

pytestmark = pytest.mark.slow

STEPS = 150
WINDOW = 120
COOLOFF = 8
KILLS = 5  # --max-restarts 4: the fifth failure within the window quarantines the slot


def test_a_slot_killed_five_times_within_the_window_is_quarantined_and_rejoins_after_the_cool_off(tmp_path):
    run_dir = str(tmp_path / "run")
    # every incarnation r0..r4 of slot 1 is killed at its first step (r0 at step 3); r5 is left alone
    chaos = ";".join(["kill@step,rank=1,step=3,restart=0"] + [f"kill@step,rank=1,restart={r}" for r in range(1, KILLS)])
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "4", "--record-samples", "--chaos", chaos,
        "--max-restarts", str(KILLS - 1), "--restart-window", str(WINDOW), "--quarantine-cooloff", str(COOLOFF),
        harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.25", "--out", f"{run_dir}/final",
        timeout=150,
    )
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no worker left behind")

    (quarantine,) = run.events("quarantine")
    assert (quarantine["local_rank"], quarantine["failures"], quarantine["window"], quarantine["seconds"]) == (1, KILLS, WINDOW, COOLOFF)
    assert quarantine["member"].endswith(".w1.r4") and quarantine["reason"] == "killed by SIGKILL"
    slot = quarantine["prefix"].rstrip(".")
    assert quarantine["prefix"] == quarantine["member"][: -len("r4")]
    assert f"[unbroken] worker 1 ({slot}) failed {KILLS} times within {WINDOW} s; quarantined for {COOLOFF} s" in run.stdout

    # the others trained on without it meanwhile
    (end,) = run.events("quarantine_end")
    assert end["local_rank"] == 1 and end["prefix"] == quarantine["prefix"]
    assert end["t"] - quarantine["t"] >= COOLOFF - 0.5
    during = [e for e in run.events("step") if quarantine["t"] < e["t"] < end["t"]]
    assert during and all(e["members"] == 3 for e in during)
    assert not [e for e in run.events("worker_start") if e["local_rank"] == 1 and quarantine["t"] < e["t"] < end["t"]]

    # then the slot was started again, with a fresh budget, and rejoined with a live peer's state
    (back,) = [e for e in run.events("worker_start") if e["local_rank"] == 1 and e["t"] > end["t"]]
    assert back["restart"] == KILLS and back["member"] == f"{slot}.r{KILLS}"
    healed = harness.state_received(run.events, back["member"])
    assert healed and 0 < healed[0]["step"] < STEPS
    assert any(e["members"] == 4 for e in run.events("step") if e["t"] > healed[0]["t"])

    workers = {w["local_rank"]: w for w in run.summary()["workers"]}
    assert (workers[1]["restarts"], workers[1]["quarantines"], workers[1]["state"]) == (KILLS, 1, "succeeded")
    for rank in (0, 2, 3):
        assert (workers[rank]["restarts"], workers[rank]["state"]) == (0, "succeeded")
    harness.check_exactly_once(run_dir, STEPS, 24)
