"""Watching a job from outside while it runs: start ``unbroken run`` with its console in a file,
scrape its embedded coordinator's ``/metrics`` every few tens of milliseconds until it ends.

Used by the tests that check what an operator sees (metrics, ``unbroken status``) during a run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from prometheus_client.parser import text_string_to_metric_families

from testbed import harness


def scrape(port: int, token: str) -> dict[str, float] | None:
    """``{metric name{labels}: value}`` from the coordinator, or None if it did not answer."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            found[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return found


def status(port: int, token: str) -> str:
    """What ``unbroken status`` prints for the coordinator at ``port``."""
    done = subprocess.run(
        [sys.executable, "-m", "unbroken", "status", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "UNBROKEN_TOKEN": token},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


Observer = Callable[[dict[str, float], int, str], None]
"""Called with every scrape, the coordinator's port and its token."""


def watched_run(run_dir: str, args: list[str], observe: Observer | None = None, timeout: float = 240.0) -> dict[str, Any]:
    """Run ``unbroken run --run-dir RUN_DIR ARGS...`` and scrape its metrics until it ends (within
    ``timeout``). Returns ``scrapes`` (time, metrics), ``code``, ``console``, ``leftovers`` (workers
    that had to be killed) and ``run`` (a :class:`harness.Run`)."""
    out_path = os.path.join(os.path.dirname(run_dir), os.path.basename(run_dir) + ".console.txt")
    argv = [sys.executable, "-m", "unbroken", "run", "--run-dir", run_dir, *args]
    seen: dict[str, Any] = {"scrapes": []}
    with open(out_path, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        start = harness.wait_for(lambda: harness.Run(0, "", "", run_dir).events("coordinator_start"), 60, "the coordinator to start")
        port = start[0]["port"]
        token_file = os.path.join(run_dir, "coordinator.json")  # the embedded coordinator's token, this user's only
        harness.wait_for(lambda: os.path.exists(token_file), 30, "the coordinator's token file")  # written once it listens
        seen["token_mode"] = oct(os.stat(token_file).st_mode & 0o777)
        with open(token_file) as f:
            token = json.load(f)["token"]

        def one() -> bool:
            if proc.poll() is not None:
                return True
            metrics = scrape(port, token)
            if metrics is not None:
                seen["scrapes"].append((time.time(), metrics))
                if observe is not None:
                    observe(metrics, port, token)
            return False

        harness.wait_for(one, timeout, "the run to end")
        seen["code"] = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        seen["leftovers"] = harness.kill_leftovers(run_dir)
    with open(out_path) as f:
        seen["console"] = f.read()
    seen["run"] = harness.Run(seen["code"], seen["console"], "", run_dir)
    return seen
