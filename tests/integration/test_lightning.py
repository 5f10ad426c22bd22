"""PyTorch Lightning's Trainer under unbroken (issue 28): ``examples/train_lightning.py`` is a
LightningModule (``self.log(sync_dist=True)``, a scheduler stepped per step, validation) and a
Trainer (``accumulate_grad_batches``, ``gradient_clip_val``) with ``strategy=UnbrokenStrategy()``.
Two workers, a SIGKILL mid-run: exit 0, every sample exactly once, ``global_step`` counts
committed steps only, the model of a failure-free run and, in float64, of a single process; a job
whose every worker is killed resumes from its checkpoint."""

import os
import re

import pytest
import torch

from testbed import harness
from tests.integration import example_runs
from tests.needs import module

pytestmark = pytest.mark.slow

SCRIPT = example_runs.example("train_lightning.py")
STEPS, GLOBAL = 24, 16
ARGS = ("--steps", str(STEPS), "--dtype", "float64")


def _single(tmp_path) -> dict:
    return example_runs.alone(SCRIPT, str(tmp_path / "single.pt"), *ARGS)


def _run(tmp_path, name: str, *flags: str) -> tuple:
    module("lightning")
    return example_runs.two_workers(str(tmp_path / name), SCRIPT, *flags, script_args=ARGS)


def test_a_lightning_trainer_survives_a_kill_with_the_model_of_a_single_process(tmp_path):
    run, killed = _run(tmp_path, "killed", "--chaos", "kill@allreduce,rank=1,step=9")
    example_runs.check_one_worker_killed(run)
    harness.check_exactly_once(run.run_dir, STEPS, GLOBAL)
    assert re.search(rf"done: {STEPS} steps", run.stdout), run.stdout[-2000:]  # global_step: committed steps only
    _, healthy = _run(tmp_path, "healthy")
    assert harness.max_relative_difference(killed, healthy) < 1e-8
    assert harness.max_relative_difference(killed, _single(tmp_path)) < 1e-8


def test_a_lightning_job_whose_every_worker_is_killed_resumes_from_its_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run, resumed = _run(tmp_path, "resumed", "--checkpoint-dir", ckpt, "--checkpoint-every", "5",
                        "--chaos", "kill@step,rank=0,step=13;kill@step,rank=1,step=13")
    # the newest complete checkpoint before the kill at step 13: 10, or 5 while 10's background write was unfinished
    assert re.search(r"resumed from step (5|10) of", run.stdout), run.stdout[-3000:]
    harness.check_exactly_once(run.run_dir, STEPS, GLOBAL)
    assert harness.max_relative_difference(resumed, _single(tmp_path)) < 1e-8


def test_a_restarted_worker_rejoins_with_lightnings_counters_at_the_jobs_step(tmp_path):
    module("lightning")
    steps, run_dir, out = 400, str(tmp_path / "run"), str(tmp_path / "rejoined.pt")
    # 400 steps of 50 ms: the restarted worker (Lightning takes seconds to import) rejoins long before the end
    run = harness.unbroken(run_dir, "--nproc-per-node", "2", "--record-samples", "--chaos", "kill@allreduce,rank=1,step=20", SCRIPT,
                           "--steps", str(steps), "--dtype", "float64", "--step-delay", "0.05", "--out", out, timeout=300)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    kill = run.events("fault")[0]["t"]
    assert [e for e in run.events("generation") if e["t"] > kill and len(e["members"]) == 2], "the restarted worker never rejoined"
    restarted = open(os.path.join(run_dir, "workers", "w1.log")).read().split("===== vm.w1.r1 starting =====")[-1]
    assert f"done: {steps} steps" in restarted, restarted[-2000:]  # healed at the job's step, its global_step too
    harness.check_exactly_once(run_dir, steps, GLOBAL)
    single = example_runs.alone(SCRIPT, str(tmp_path / "single.pt"), "--steps", str(steps), "--dtype", "float64")
    assert harness.max_relative_difference(torch.load(out, weights_only=True), single) < 1e-8
