"""``examples/train_gpt.py`` (issue 27): a DDP-shaped GPT script ported to unbroken (warm-up and
cosine schedule, gradient accumulation, clipping, evaluation and saving through ``on_leader``,
logging on the leader, early stop by ``break``). Under kills, two workers end with the model of a
single process, in float64; the DDP script it was ported from runs under torchrun."""

import os
import subprocess
import sys

import pytest
import torch

from testbed import harness

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT = os.path.join(ROOT, "examples", "train_gpt.py")
DDP = os.path.join(ROOT, "examples", "porting", "train_gpt_ddp.py")
SMALL = ["--batch-size", "8", "--micro-batch-size", "2", "--block", "16", "--layers", "1", "--width", "16",
         "--eval-every", "10", "--dtype", "float64"]


def _single(tmp_path, *args: str) -> str:
    out = str(tmp_path / "single.pt")
    done = subprocess.run([sys.executable, GPT, *SMALL, "--data-dir", str(tmp_path / "data"), "--out", out, *args],
                          capture_output=True, text=True, timeout=300, env={k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_gpt_example_under_kills_trains_the_single_process_model(tmp_path):
    run_dir = str(tmp_path / "run")
    out = str(tmp_path / "gpt.pt")
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "2", "--record-samples", "--chaos", "kill@allreduce,rank=1,step=7;kill@step,rank=0,step=16",
        GPT, "--steps", "24", *SMALL, "--data-dir", str(tmp_path / "data"), "--out", out, timeout=300,
    )
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sum(w["restarts"] for w in run.summary()["workers"]) == 2, run.summary()["workers"]
    assert "val loss" in run.stdout and "[w" in run.stdout, run.stdout[-2000:]  # the leader's lines reach the console
    single = torch.load(_single(tmp_path, "--steps", "24"), weights_only=True)
    ours = torch.load(out, weights_only=True)
    assert harness.max_relative_difference(ours, single) < 1e-8
    assert os.path.exists(out + ".best"), "the leader saved the best model through on_leader"
    harness.check_exactly_once(run_dir, 24, 8)  # --batch-size 8


def test_early_stop_by_break_ends_every_worker_with_exit_0(tmp_path):
    run_dir = str(tmp_path / "run")
    out = str(tmp_path / "gpt.pt")
    # with a learning rate of 0 the evaluation after step 10 is no better than step 0's, and with
    # --patience 1 every worker breaks after step 10's commit
    run = harness.unbroken(
        run_dir, "--nproc-per-node", "2", GPT, "--steps", "40", *SMALL, "--lr", "0", "--patience", "1",
        "--data-dir", str(tmp_path / "data"), "--out", out, timeout=300,
    )
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert any("left the loop after step 10" in (e.get("reason") or "") for e in run.events("finished")), run.events("finished")
    single = torch.load(_single(tmp_path, "--steps", "40", "--lr", "0", "--patience", "1"), weights_only=True)
    assert harness.max_relative_difference(torch.load(out, weights_only=True), single) < 1e-8


def test_the_ddp_script_it_was_ported_from_runs_under_torchrun(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", DDP, "--steps", "12", *SMALL,
         "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "ddp.pt")],
        capture_output=True, text=True, timeout=300, start_new_session=True,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "val loss" in done.stdout and os.path.exists(tmp_path / "ddp.pt")
