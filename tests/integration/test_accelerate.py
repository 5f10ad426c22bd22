"""Hugging Face Accelerate scripts under unbroken (issue 28): ``examples/train_accelerate.py`` is
Accelerate's minimal example with the import of ``Accelerator`` changed. Two workers, a SIGKILL
mid-run: exit 0, every sample exactly once, the model of a failure-free run and, in float64, of a
single process; a job whose every worker is killed resumes from its checkpoint."""

import os
import re
import subprocess
import sys

import pytest

from testbed import harness
from tests.integration import example_runs
from tests.needs import module

pytestmark = pytest.mark.slow

SCRIPT = example_runs.example("train_accelerate.py")
STEPS, GLOBAL = 24, 16
ARGS = ("--steps", str(STEPS), "--dtype", "float64")


def _single(tmp_path) -> dict:
    return example_runs.alone(SCRIPT, str(tmp_path / "single.pt"), *ARGS)


def _run(tmp_path, name: str, *flags: str) -> tuple:
    module("accelerate")
    return example_runs.two_workers(str(tmp_path / name), SCRIPT, *flags, script_args=ARGS)


@pytest.mark.parametrize("killed", ["leader", "1"], ids=["leader", "other"])
def test_an_accelerate_script_survives_a_kill_with_the_model_of_a_single_process(tmp_path, killed):
    # --min-members 2: the survivor waits for the restarted worker instead of finishing the 15
    # steps left alone (40 ms here, sooner than a restart), so the rejoin and its heal always run
    run, model = _run(tmp_path, "killed", "--min-members", "2", "--chaos", f"kill@allreduce,rank={killed},step=9")
    fault = run.events("fault")[0]
    if killed == "leader":
        assert fault["member"] == "vm.w0.r0", "the first leader is slot 0"
    example_runs.check_one_worker_killed(run, killed=0 if killed == "leader" else 1)
    assert sum(w["restarts"] for w in run.summary()["workers"]) == 1, run.summary()["workers"]
    assert run.events("heal"), "the restarted worker was healed from its peer"
    harness.check_exactly_once(run.run_dir, STEPS, GLOBAL)
    _, healthy = _run(tmp_path, "healthy")
    assert harness.max_relative_difference(model, healthy) < 1e-8
    assert harness.max_relative_difference(model, _single(tmp_path)) < 1e-8


def test_an_accelerate_job_whose_every_worker_is_killed_resumes_from_its_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run, resumed = _run(tmp_path, "resumed", "--checkpoint-dir", ckpt, "--checkpoint-every", "5",
                        "--chaos", "kill@step,rank=0,step=13;kill@step,rank=1,step=13")
    # the newest complete checkpoint before the kill at step 13: 10, or 5 while 10's background write was unfinished
    assert re.search(r"resumed from step (5|10) of", run.stdout), run.stdout[-3000:]
    harness.check_exactly_once(run.run_dir, STEPS, GLOBAL)  # the lineage carried in the checkpoint covers steps 0..9
    assert harness.max_relative_difference(resumed, _single(tmp_path)) < 1e-8


DOCS_STYLE = os.path.join(example_runs.ROOT, "testbed", "scripts", "accelerate_docs_style.py")


def _final(out: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "final", "model.safetensors"))


@pytest.mark.parametrize("killed", ["leader", "1"], ids=["leader", "other"])
def test_a_docs_style_script_with_epochs_save_state_and_a_scheduler_survives_a_kill(tmp_path, killed):
    """Accelerate's docs' loop, one changed line: 3 epochs of 12 steps (96 samples, batches of 4,
    accumulation 2), save_state at each epoch's end, a kill in the second epoch. Exit 0, every
    sample once, each epoch's state saved in Accelerate's layout, and the model of the same script
    run alone."""
    module("accelerate")
    alone_out = str(tmp_path / "alone")
    done = subprocess.run([sys.executable, DOCS_STYLE, "--out", alone_out], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = str(tmp_path / "out")
    run = harness.unbroken(str(tmp_path / "run"), "--nproc-per-node", "2", "--record-samples", "--min-members", "2",
                           "--chaos", f"kill@allreduce,rank={killed},step=16", DOCS_STYLE, "--out", out, timeout=300)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "workers exited before the job finished" not in run.stdout + run.stderr
    example_runs.check_one_worker_killed(run, killed=0 if killed == "leader" else 1)
    harness.check_exactly_once(run.run_dir, 36, 8)
    for epoch in range(3):
        assert sorted(os.listdir(os.path.join(out, f"epoch_{epoch}"))) == ["model.safetensors", "optimizer.bin", "scheduler.bin"]
    assert re.search(r"epoch 2 done at step 36", run.stdout), run.stdout[-3000:]
    assert harness.max_relative_difference(_final(out), _final(alone_out)) < 1e-8
    assert harness.stop([], [run.run_dir]) == []
