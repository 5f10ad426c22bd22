"""Small helpers the benchmarks share."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from typing import Any, Callable

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


def exit_with_parent() -> None:
    """End this spawned worker if the benchmark that started it dies (no orphan left training)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def run_spawned(target: Callable[..., Any], args: list[tuple], limit: float = 1800.0) -> list[int | None]:
    """Start one spawned process per entry of ``args``, wait for all within ``limit`` seconds,
    kill whatever is left; returns their exit codes (None: killed)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    children = []
    try:
        for entry in args:
            child = context.Process(target=target, args=entry, daemon=True)
            child.start()
            children.append(child)
        deadline = time.monotonic() + limit
        for child in children:
            child.join(max(0.1, deadline - time.monotonic()))
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
                child.join()
    return [child.exitcode for child in children]


def processes_naming(run_dir: str) -> list[int]:
    """Processes whose environment names ``run_dir``: the workers an unbroken run started, including
    one spawned in the instant before its launcher was killed (no event names it yet)."""
    marker = f"UNBROKEN_RUN_DIR={os.path.abspath(run_dir)}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read() + b"\0":
                        found.append(int(entry))
            except OSError:
                pass
    return found
