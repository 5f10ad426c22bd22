"""Compound faults (issue 26): two or three overlapping faults from a seeded schedule
(:mod:`tests.integration.compound`) on a 3-worker job, each run ending with the shared invariant
checker: every position once, every step committed by one generation, no generation from behind,
the model of a single process. ``python tests/soak/compound.py`` runs many more seeds."""

import pytest

from testbed import harness
from tests.integration import compound
from tests.integration.conftest import GLOBAL, STEPS

pytestmark = pytest.mark.slow

SEEDS = (1, 2, 3)


@pytest.mark.parametrize("seed", SEEDS)
def test_overlapping_faults_keep_every_invariant(tmp_path, reference, seed):
    chaos = compound.schedule(seed, workers=3, steps=STEPS)
    run_dir = str(tmp_path / "run")
    run = harness.unbroken(run_dir, "--nproc-per-node", "3", "--record-samples", "--heartbeat-timeout", "2",
                           "--chaos", chaos, harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.1",
                           "--out", f"{run_dir}/final", timeout=240)
    fired = [(f["fault"], f["point"], f["step"]) for f in run.events("fault")]
    print(f"seed {seed}: {chaos}; fired {fired}")
    assert run.code == 0, chaos + "\n" + run.stdout[-3000:] + run.stderr[-3000:]
    assert fired, f"no fault of {chaos} fired"
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no process left behind")
    harness.check_exactly_once(run_dir, STEPS, GLOBAL)
    # a member killed late may be restarted after the job finished: it never rejoins, nor writes
    finished = harness.finished_members(run_dir)
    assert len(finished) >= 2, finished
    harness.check_same_model(f"{run_dir}/final", reference["single"], finished)
