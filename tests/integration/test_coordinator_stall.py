"""A coordinator that stalls for 2 s (issue 14): nobody abandons their generation.

The coordinator's responsiveness is every member's lease. A stall of its event loop (a long
garbage collection, a paused VM, a loaded host) used to make every member's lease run out at
once: every member refused to commit, left its generation and joined again, which added load to
the coordinator that had just stalled. The stall here is the whole coordinator process stopped
with SIGSTOP for 2 s (its event loop, its TCPStore and its threads), longer than a heartbeat
interval and within a member's lease plus one heartbeat interval.

Three workers on one node, a standalone coordinator, steps of 0.3 s. Afterwards: no verdict, no
new generation, the members committed again in the generation they held, and the run still
passes the exactly-once check and equals a single process.
"""

import os
import signal
import time

import pytest

from testbed import harness
from tests.integration.conftest import GLOBAL, STEPS
from tests.integration.test_hangs import coordinator, finish, start

pytestmark = pytest.mark.slow

STALL = 2.0


def test_a_two_second_coordinator_stall_makes_nobody_abandon_their_generation(tmp_path, reference):
    coord, address = coordinator(tmp_path, "--expected-members", "3")
    coord_run = harness.Run(0, "", "", str(tmp_path / "coord"))
    run_dir, final = str(tmp_path / "a"), str(tmp_path / "final")
    node = start(["run", "--run-dir", run_dir, "--coordinator", address, "--node-name", "a", "--nproc-per-node", "3",
                  "--record-samples", harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.3", "--out", final], str(tmp_path))

    def commits():
        try:
            return harness.commits(run_dir, "a.w0.r0")
        except FileNotFoundError:
            return []
    try:
        harness.wait_for(lambda: [g for g in coord_run.events("generation") if len(g["members"]) == 3], 120, "a generation of 3")
        harness.wait_for(lambda: len(commits()) >= 5, 60, "training")
        generations = coord_run.events("generation")
        held = generations[-1]["generation"]
        os.kill(coord.pid, signal.SIGSTOP)
        stopped = time.time()
        time.sleep(STALL)
        os.kill(coord.pid, signal.SIGCONT)
        resumed = time.time()
        harness.wait_for(lambda: [c for c in commits() if c["t"] > resumed + 1.0], 30, "commits after the stall")
        out, err = finish(node, run_dir)
        assert node.returncode == 0, err[-3000:]
    finally:
        for proc in (node, coord):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        harness.kill_leftovers(run_dir)
    assert coord_run.events("verdict") == [], coord_run.events("verdict")
    assert coord_run.events("generation") == generations, "a generation formed after the stall"
    after = [c for c in commits() if c["t"] > stopped]
    assert after and {c["g"] for c in after} == {held}, after[:5]
    harness.check_exactly_once(run_dir, STEPS, GLOBAL)
    harness.check_same_model(final, reference["single"], 3)
