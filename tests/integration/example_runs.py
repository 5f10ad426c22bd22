"""The examples of the integrations as tests run them: alone (the reference), or under
``unbroken run`` with two workers, each saving the final model with ``--out``."""

import os
import subprocess
import sys

import torch

from testbed import harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def example(name: str) -> str:
    return os.path.join(ROOT, "examples", name)


def alone(script: str, out: str, *args: str) -> dict:
    """The script as a single process (no UNBROKEN_* variable): its final model."""
    done = subprocess.run([sys.executable, script, *args, "--out", out], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")})
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


def two_workers(run_dir: str, script: str, *flags: str, script_args: tuple[str, ...] = ()) -> tuple:
    """``unbroken run --nproc-per-node 2 --record-samples FLAGS script SCRIPT_ARGS``: exit 0, nobody
    left behind; the run and the leader's final model."""
    out = f"{run_dir}.pt"
    run = harness.unbroken(run_dir, "--nproc-per-node", "2", "--record-samples", *flags, script, *script_args, "--out", out,
                           timeout=300)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    harness.wait_for(lambda: not harness.alive_workers(run_dir), 30, "no process left behind")
    return run, torch.load(out, weights_only=True)


def check_one_worker_killed(run: harness.Run, killed: int = 1) -> None:
    """The kill happened to local rank ``killed`` and nobody else failed. The survivor may finish
    a short job before the launcher restarts the killed worker (then it is not restarted: the job
    is done), so its restarts are 0 or 1."""
    workers = {w["local_rank"]: w for w in run.summary()["workers"]}
    assert "killed by SIGKILL" in workers[killed]["exits"][0]["how"] and workers[killed]["restarts"] <= 1, workers
    assert all(w["restarts"] == 0 and w["state"] == "succeeded" for rank, w in workers.items() if rank != killed), workers
