"""Small helpers the benchmarks share."""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import torch


def nbytes(state: Any) -> int:
    """Bytes of every tensor in a nested state (dicts, lists, tuples)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(nbytes(v) for v in state)
    return 0


def seconds(values: list[float], digits: int = 2, unit: str = "s") -> str:
    """``median s (min – max)`` of a benchmark's trials."""
    return f"{statistics.median(values):.{digits}f} {unit} ({min(values):.{digits}f} – {max(values):.{digits}f})"


def save_results(path: str, result: dict[str, Any]) -> None:
    """Write a benchmark's figures as JSON, making the folder if needed."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def torchrun_malloc_env(choice: str) -> dict[str, str] | None:
    """``--torchrun-malloc``: ``tuned`` gives torchrun's workers, through glibc's variables, the
    malloc thresholds unbroken's workers set themselves (``tune_malloc``); ``default`` leaves them."""
    if choice != "tuned":
        return None
    from unbroken.worker.allocator import MMAP_THRESHOLD, TRIM_THRESHOLD

    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
