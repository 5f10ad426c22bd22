"""A whole node lost (issue 17): two launchers, nodes a and b, against a standalone coordinator.

- b's launcher and workers SIGKILLed together: nobody reports the exits, but the kernel closed
  their heartbeat connections, so the coordinator declares them dead at once, not after the
  heartbeat timeout;
- b's launcher and workers stopped (SIGSTOP): their sockets stay open, so they are declared dead
  by the heartbeat timeout, not earlier.

Both end with the exactly-once check and the model of a single process.
"""

import os
import signal
import time

import pytest

from testbed import harness
from tests.integration.conftest import GLOBAL, STEPS
from tests.integration.test_hangs import coordinator, finish, start

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT = 3.0


def _nodes(tmp_path, address):
    final = str(tmp_path / "final")
    procs, dirs = {}, {}
    for name, count in (("a", "2"), ("b", "1")):
        dirs[name] = str(tmp_path / name)
        procs[name] = start(["run", "--run-dir", dirs[name], "--coordinator", address, "--node-name", name, "--nproc-per-node", count,
                             "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--record-samples",
                             harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.3", "--out", final], str(tmp_path))
    return procs, dirs, final


def _signal_node(run_dir: str, launcher, sig: int) -> None:
    """``sig`` to a node's launcher and to every worker it started (each in a session of its own)."""
    os.killpg(launcher.pid, sig)
    for event in harness.Run(0, "", "", run_dir).events("worker_start"):
        try:
            os.killpg(event["pid"], sig)
        except ProcessLookupError:
            pass


def _scenario(tmp_path, reference, sig: int):
    coord, address = coordinator(tmp_path, "--expected-members", "3", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT))
    coord_run = harness.Run(0, "", "", str(tmp_path / "coord"))
    procs, dirs, final = _nodes(tmp_path, address)

    def commits():
        try:
            return harness.commits(dirs["a"], "a.w0.r0")
        except FileNotFoundError:
            return []
    try:
        harness.wait_for(lambda: [g for g in coord_run.events("generation") if len(g["members"]) == 3], 120, "both nodes in a generation")
        harness.wait_for(lambda: len(commits()) >= 6, 60, "training")
        _signal_node(dirs["b"], procs["b"], sig)
        lost = time.time()
        verdict = harness.wait_for(lambda: [e for e in coord_run.events("verdict") if e["member"].startswith("b.")], 30, "a verdict on b")[0]
        new = lambda: {g["generation"] for g in coord_run.events("generation") if g["t"] > lost}  # noqa: E731
        resumed = harness.wait_for(lambda: [c for c in commits() if c["g"] in new()], 60, "a's commits without b")[0]
        if sig == signal.SIGSTOP:
            _signal_node(dirs["b"], procs["b"], signal.SIGKILL)
        out, err = finish(procs["a"], dirs["a"])
        assert procs["a"].returncode == 0, err[-3000:]
    finally:
        for proc in (*procs.values(), coord):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for d in dirs.values():
            harness.kill_leftovers(d)
    harness.check_exactly_once(list(dirs.values()), STEPS, GLOBAL)
    harness.check_same_model(final, reference["single"], 2, prefix="a.")  # b was lost whole: only a's two finish
    return verdict, verdict["t"] - lost, resumed["t"] - lost


def test_a_node_killed_whole_is_declared_dead_as_its_connections_close(tmp_path, reference):
    verdict, detected, resumed = _scenario(tmp_path, reference, signal.SIGKILL)
    print(f"node killed: declared dead after {detected:.3f} s, survivors commit again after {resumed:.3f} s")
    assert verdict["detected_by"] == "connection", verdict
    assert detected < HEARTBEAT_TIMEOUT / 3, detected


def test_a_stopped_node_keeps_its_connections_and_waits_for_the_heartbeat_timeout(tmp_path, reference):
    verdict, detected, resumed = _scenario(tmp_path, reference, signal.SIGSTOP)
    print(f"node stopped: declared dead after {detected:.3f} s, survivors commit again after {resumed:.3f} s")
    assert verdict["detected_by"] == "heartbeat", verdict
    assert detected > HEARTBEAT_TIMEOUT - 1.0, detected
