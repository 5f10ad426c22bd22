"""Lightning Fabric loops under unbroken (issue 28): ``examples/train_fabric.py`` is a Fabric loop
with unbroken's ``Fabric``. Two workers, a SIGKILL mid-run: exit 0, every sample exactly once, the
model of a single process in float64."""

import pytest

from testbed import harness
from tests.integration import example_runs

pytestmark = pytest.mark.slow

SCRIPT = example_runs.example("train_fabric.py")
STEPS, GLOBAL = 24, 16
ARGS = ("--steps", str(STEPS), "--dtype", "float64")


def test_a_fabric_loop_survives_a_kill_with_the_model_of_a_single_process(tmp_path):
    run, killed = example_runs.two_workers(str(tmp_path / "killed"), SCRIPT, "--chaos", "kill@allreduce,rank=1,step=9",
                                           script_args=ARGS)
    example_runs.check_one_worker_killed(run)
    harness.check_exactly_once(run.run_dir, STEPS, GLOBAL)
    single = example_runs.alone(SCRIPT, str(tmp_path / "single.pt"), *ARGS)
    assert harness.max_relative_difference(killed, single) < 1e-8
