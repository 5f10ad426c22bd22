"""The workload every compared system trains, and the step log every training script writes.

Only torch is needed here, so that the same file runs inside each system's environment. All
systems train the same MLP on the same synthetic data with the same global batch; a step's
samples are named by their *stream positions* (position p is sample p mod n of epoch p div n),
so that samples lost or repeated can be counted the same way for every system.

Each process appends JSON lines to ``<log dir>/w_<pid>.jsonl``:
``{"k": "start", "t", "pid"}`` when the script starts (before ``import torch``),
``{"k": "step", "t", "pid", "step", "rank", "world", "pos": [[a, b], ...]}`` after each step
it committed (torchft adds ``"slots": 3``: its shares do not follow the member count) (``t`` is when the optimizer step returned), ``{"k": "done", "t", "pid"}`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import time

SCRIPT_START = time.time()

import torch  # noqa: E402
from plan import share  # noqa: E402,F401  (re-exported for the training scripts)

SAMPLES = 9600
FEATURES = 128
CLASSES = 10


def arguments(extra=None) -> argparse.Namespace:
    """The options every training script takes (``extra`` adds the system's own)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-log", required=True, help="directory for the step logs")
    parser.add_argument("--steps", type=int, default=600, help="steps to train; 0 = until stopped")
    parser.add_argument("--global-batch", type=int, default=96)
    parser.add_argument("--width", type=int, default=256)
    if extra is not None:
        extra(parser)
    return parser.parse_args()


class StepLog:
    """Appends this process's records, one ``write`` per line (O_APPEND)."""

    def __init__(self, directory: str, start: float | None = None) -> None:
        os.makedirs(directory, exist_ok=True)
        self.pid = os.getpid()
        self._fd = os.open(os.path.join(directory, f"w_{self.pid}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.write("start", t=start or SCRIPT_START)

    def write(self, kind: str, **fields) -> None:
        record = {"k": kind, "t": fields.pop("t", None) or time.time(), "pid": self.pid, **fields}
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def step(self, step: int, rank: int, world: int, ranges: list[tuple[int, int]], slots: int | None = None) -> None:
        """A committed step; ``slots`` is the number of shares the batch is cut into if not ``world``."""
        extra = {"slots": slots} if slots is not None else {}
        self.write("step", step=step, rank=rank, world=world, pos=[list(r) for r in ranges], **extra)


def setup(width: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module, torch.optim.Optimizer]:
    """Data, model and optimizer, identical in every process and every system."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, width), torch.nn.ReLU(), torch.nn.Linear(width, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return x, y, model, optimizer


def batch(x: torch.Tensor, y: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples at stream positions [a, b)."""
    idx = torch.arange(a, b) % x.shape[0]
    return x[idx], y[idx]
