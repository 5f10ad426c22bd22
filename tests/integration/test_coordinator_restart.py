"""The coordinator may fail too (issue 12, first part): a standalone coordinator restarted in
place fences the old generation instead of running a second job beside it, and a launcher's
death takes its workers with it at once."""

import os
import signal
import subprocess
import sys

import pytest

from testbed import harness
from tests.integration.conftest import GLOBAL, STEPS
from tests.integration.test_hangs import finish, start

pytestmark = pytest.mark.slow


def _coordinator(tmp_path, name, port, *flags):
    proc = start(["coordinator", "--host", "127.0.0.1", "--port", str(port), "--run-dir", str(tmp_path / name), *flags], str(tmp_path))
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, line.split("listening on ")[1].split()[0]


def test_a_coordinator_restarted_in_place_fences_the_old_generation_and_its_members_rejoin(tmp_path, reference):
    flags = ["--min-members", "2", "--expected-members", "2", "--heartbeat-timeout", "2"]
    first, address = _coordinator(tmp_path, "coord1", 0, *flags)
    port = int(address.rsplit(":", 1)[1])
    ckpt = str(tmp_path / "ckpt")
    nodes, second = [], None
    try:
        for name in ("a", "b"):
            run_dir = str(tmp_path / name)
            nodes.append((start(
                ["run", "--run-dir", run_dir, "--coordinator", address, "--node-name", name, "--nproc-per-node", "1",
                 "--record-samples", "--heartbeat-interval", "0.25", "--heartbeat-timeout", "2",
                 "--checkpoint-dir", ckpt, "--checkpoint-every", "5",
                 harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.25", "--out", f"{tmp_path}/final"],
                str(tmp_path)), run_dir))
        runs = [harness.Run(0, "", "", d) for _, d in nodes]
        harness.wait_for(lambda: [e for r in runs for e in r.events("step") if e["step"] >= 8], 120, "steps before the restart")
        first.send_signal(signal.SIGKILL)
        first.communicate()
        # in place: the same port at once (address reuse), a new incarnation with an empty memory
        second, again = _coordinator(tmp_path, "coord2", port, *flags)
        assert again == address
        for proc, run_dir in nodes:
            out, err = finish(proc, run_dir)
            assert proc.returncode == 0, out[-2000:] + err[-2000:]
    finally:
        for proc in [first, second] + [p for p, _ in nodes]:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        for _, run_dir in nodes:
            harness.kill_leftovers(run_dir)
    before = harness.Run(0, "", "", str(tmp_path / "coord1")).events("generation")
    after = harness.Run(0, "", "", str(tmp_path / "coord2")).events("generation")
    assert before and after
    # generation numbers continue: no second generation 1 beside the old one
    assert min(e["generation"] for e in after) > max(e["generation"] for e in before), (before, after)
    # no second checkpoint writer: every step written once, by one member
    written = [e for d in ("a", "b") for e in harness.Run(0, "", "", str(tmp_path / d)).events("checkpoint")]
    steps = [e["step"] for e in written]
    assert len(steps) == len(set(steps)), written
    harness.check_exactly_once([str(tmp_path / "a"), str(tmp_path / "b")], STEPS, GLOBAL)
    harness.check_same_model(f"{tmp_path}/final", reference["single"], 2)


def test_the_workers_of_a_killed_launcher_are_gone_within_the_lease(tmp_path):
    run_dir = str(tmp_path / "run")
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken", "run", "--run-dir", run_dir, "--nproc-per-node", "2",
         harness.EXACT, "--steps", "100000", "--step-delay", "0.05"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    run = harness.Run(0, "", "", run_dir)
    try:
        harness.wait_for(lambda: run.events("step"), 120, "training")
        workers = harness.alive_workers(run_dir)
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone, with the coordinator inside it
        proc.wait()
        # the lease is --heartbeat-timeout - --heartbeat-interval = 4.5 s by default
        harness.wait_for(lambda: not harness.alive_workers(run_dir), 4.5, "every worker to be gone")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        harness.kill_leftovers(run_dir)
