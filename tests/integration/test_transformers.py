"""The Hugging Face Trainer under unbroken (issue 45): ``examples/train_transformers.py`` is a
Trainer script as its docs write it (accumulation, warm-up schedule, evaluation, logging,
checkpoints, an early-stopping callback) with unbroken's ``Trainer``. Two workers, a SIGKILL of
the leader or of the other worker while it trains, the killed one back before the end: exit 0,
every sample exactly once, the model of a single process in float64, bit for bit."""

import pytest

from testbed import harness
from tests.integration import example_runs

pytestmark = pytest.mark.slow

SCRIPT = example_runs.example("train_transformers.py")
STEPS, GLOBAL = 24, 8  # per_device_train_batch_size 4 x gradient_accumulation_steps 2


@pytest.mark.parametrize("killed", [0, 1], ids=["leader", "other"])
def test_a_trainer_script_survives_a_kill_and_equals_a_single_process(tmp_path, killed):
    # the survivor sleeps at each commit from the kill on: the killed worker (a fresh interpreter
    # importing transformers) is back while it trains, and is healed
    chaos = f"kill@allreduce,rank={killed},step=5;slow@commit,rank={1 - killed},sleep=0.5,step=5"
    args = ("--steps", str(STEPS), "--dtype", "float64", "--output-dir", str(tmp_path / "out"))
    run, model = example_runs.two_workers(str(tmp_path / "run"), SCRIPT, "--chaos", chaos, script_args=args)
    example_runs.check_one_worker_killed(run, killed)
    assert run.events("generation")[0]["members"][0] == "vm.w0.r0", "the first leader is slot 0, as rank 0 under torchrun"
    assert harness.state_received(run.events, f"vm.w{killed}.r1"), "the killed worker came back and got the state"
    assert (tmp_path / "out" / "final" / "model.safetensors").exists(), "save_model after train() wrote on the leader"
    assert [e["step"] for e in run.events("checkpoint")][:2] == [10, 20], "save_steps=10: unbroken's durable checkpoints"
    harness.check_exactly_once(run.run_dir, STEPS, GLOBAL)
    single = example_runs.alone(SCRIPT, str(tmp_path / "single.pt"), "--steps", str(STEPS), "--dtype", "float64",
                                "--output-dir", str(tmp_path / "single"))
    assert harness.max_relative_difference(model, single) == 0.0
