"""A cold start of 16 real members heals in log-depth rounds (issue 14).

A 4-worker job is killed whole after a checkpoint; 16 workers resume it. Nobody holds live state,
so the new generation's rank 0 reads the checkpoint and is the only source. Healing fans out: each
member healed becomes a source in the next round, so the 15 receivers are healed in 4 rounds
(1 -> 2 -> 4 -> 8 -> 16 holders), not by 15 transfers from rank 0. The run still passes the
exactly-once check and equals a single process.
"""

import pytest

from testbed import harness
from tests.integration.conftest import GLOBAL, STEPS
from tests.integration.test_checkpoints import start_and_kill_all
from unbroken.storage.checkpoint import CheckpointStore

pytestmark = pytest.mark.slow

MEMBERS = 16


def test_sixteen_members_resuming_a_checkpoint_heal_in_four_rounds_through_each_other(tmp_path, reference):
    ckpt, first, second = str(tmp_path / "ckpt"), str(tmp_path / "first"), str(tmp_path / "second")
    start_and_kill_all(first, ckpt, lambda run: [e for e in run.events("checkpoint") if e["step"] >= 5])
    newest = CheckpointStore(ckpt).steps()[0]
    run = harness.unbroken(second, "--nproc-per-node", str(MEMBERS), "--record-samples", "--checkpoint-dir", ckpt,
                           "--checkpoint-every", "5", harness.EXACT, "--steps", str(STEPS), "--out", f"{second}/final",
                           timeout=400)
    assert run.code == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"resumed from step {newest}" in run.stdout
    resumed = run.events("resume")[0]
    heals = [e for e in run.events("heal") if e["step"] == newest and e["t"] >= resumed["t"]]
    generation = heals[0]["generation"]
    heals = [e for e in heals if e["generation"] == generation]
    receivers = [r for e in heals for r in e["receivers"]]
    assert len(receivers) == len(set(receivers)) == MEMBERS - 1, heals
    assert {e["rounds"] for e in heals} == {4}, heals
    relays = [e for e in heals if e["received_from"] is not None]
    assert relays, "no healed member sent the state on"
    assert all(e["sender"] in receivers for e in relays)
    assert len(heals) == MEMBERS // 2  # every member healed in the first three rounds sends in the last
    harness.check_exactly_once([first, second], STEPS, GLOBAL)
    finals = harness.final_params(f"{second}/final")
    assert len(finals) == MEMBERS
    for member, params in finals.items():
        assert harness.max_relative_difference(params, reference["single"]) < 1e-8, member
