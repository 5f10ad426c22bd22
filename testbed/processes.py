"""Processes the tests and the benchmarks start: spawned children that end with their parent,
and finding the workers of a run by their environment."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable


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
