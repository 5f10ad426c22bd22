"""Lightning Fabric loops under unbroken (issue 28): ``examples/train_fabric.py`` is a Fabric loop
with unbroken's ``Fabric`` and a scheduler given to ``fabric.setup``. Two workers, a SIGKILL
mid-run: exit 0, every sample exactly once, the model of a single process in float64; and when
the killed worker is back before the survivor is done, it gets the survivor's state (scheduler
included) and trains on."""

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


@pytest.mark.parametrize("rank", [0, 1], ids=["leader", "other"])
def test_a_killed_worker_that_comes_back_gets_the_survivors_state_scheduler_included(tmp_path, rank):
    """The survivor sleeps at each commit from the kill on, so the restarted worker rejoins while it
    trains. Its scheduler once carried unbroken's step in its state_dict, a closure: every heal and
    catch-up failed to pickle, the survivor died sending, and the job went back to step 0. Local
    rank 0 leads the first generation: killing it kills the leader."""
    chaos = f"kill@allreduce,rank={rank},step=9;slow@commit,rank={1 - rank},sleep=0.15,step=9"
    run, killed = example_runs.two_workers(str(tmp_path / "back"), SCRIPT, "--chaos", chaos, script_args=ARGS)
    example_runs.check_one_worker_killed(run, rank)
    assert run.events("generation")[0]["members"][0] == "vm.w0.r0"
    assert harness.state_received(run.events, f"vm.w{rank}.r1"), "the restarted worker rejoined with the survivor's state"
    assert not run.events("state_lost") and run.events("finished")
    harness.check_exactly_once(run.run_dir, STEPS, GLOBAL)
    single = example_runs.alone(SCRIPT, str(tmp_path / "single.pt"), *ARGS)
    assert harness.max_relative_difference(killed, single) < 1e-8
