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
    workers = {w["local_rank"]: w for w in run.summary()["workers"]}
    # the kill happened; the survivor may finish all 24 short steps before the launcher restarts
    # the killed worker (then it is not restarted: the job is done), so restarts are 0 or 1
    assert "killed by SIGKILL" in workers[1]["exits"][0]["how"] and workers[1]["restarts"] <= 1, workers
    assert workers[0]["restarts"] == 0 and workers[0]["state"] == "succeeded", workers
    harness.check_exactly_once(run.run_dir, STEPS, GLOBAL)
    single = example_runs.alone(SCRIPT, str(tmp_path / "single.pt"), *ARGS)
    assert harness.max_relative_difference(killed, single) < 1e-8
