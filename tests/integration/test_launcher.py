"""The launcher: Ctrl-C and SIGTERM end the whole job cleanly; worker output is logged."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from testbed import harness
from testbed.harness import GLOBAL

pytestmark = pytest.mark.slow



@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_a_signal_to_the_launcher_stops_every_worker_and_exits_with_its_code(tmp_path, sig, code):
    run_dir = str(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "unbroken", "run", "--run-dir", run_dir, "--nproc-per-node", "2", harness.EXACT, "--steps", "100000", "--step-delay", "0.01"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        harness.wait_for(lambda: harness.Run(0, "", "", run_dir).events("generation"), 120, "training to start")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        leftovers = harness.stop([proc], [run_dir])
    assert proc.returncode == code, err
    assert f"stopped by {signal.Signals(sig).name}" in err
    assert leftovers == []
    run = harness.Run(0, "", "", run_dir)
    summary = run.summary()
    assert all(w["state"] == "stopped" for w in summary["workers"])
    # what happened is on record, and it is a stop, not a failure: every worker's exit (event and
    # summary), no coordinator warning on the console, and `unbroken report` counts no failure
    assert sorted(e["member"] for e in run.events("worker_exit")) == ["vm.w0.r0", "vm.w1.r0"]
    assert all(len(w["exits"]) == 1 and "stopped by the launcher" in w["exits"][0]["how"] for w in summary["workers"])
    assert "declared dead" not in err
    report = subprocess.run([sys.executable, "-m", "unbroken", "report", run_dir, "--json", "--no-png"], capture_output=True,
                            text=True, timeout=60)
    assert json.loads(report.stdout)["failures"]["total"] == 0, report.stdout


def test_a_module_given_with_dash_m_trains_as_a_script_would(tmp_path):
    """``unbroken run -m package.module`` (torchrun's ``-m``): the workers run ``python -m``, found
    from the launcher's directory (the repository root, where the tests run)."""
    module = os.path.relpath(harness.EXACT, os.getcwd())[: -len(".py")].replace(os.sep, ".")
    run = harness.unbroken(str(tmp_path), "--nproc-per-node", "2", "--record-samples", "-m", module, "--steps", "4")
    assert run.code == 0, run.stderr
    harness.check_exactly_once(run.run_dir, 4, GLOBAL)


def test_each_worker_writes_its_own_log_and_the_console_shows_one_worker(tmp_path):
    run = harness.unbroken(str(tmp_path), "--nproc-per-node", "2", harness.EXACT, "--steps", "5")
    assert run.code == 0, run.stderr
    for rank in (0, 1):
        with open(os.path.join(run.run_dir, "workers", f"w{rank}.log")) as f:
            log = f.read()
        assert "step 4 loss" in log
    # one worker's lines: the leader's, tagged from the first step on (the worker marks its place
    # in the generation before it trains: the console does not wait for the coordinator's answer)
    shown = [line for line in run.stdout.splitlines() if " loss " in line]
    assert [line.split("] ")[1].split(" loss")[0] for line in shown] == [f"step {i}" for i in range(5)], shown
    assert len({line.split("] ")[0] for line in shown}) == 1 and re.match(r"\[w[01] leader\] ", shown[0]), shown


def test_a_node_that_waits_for_a_quorum_says_who_is_missing_and_an_unmet_quorum_is_one_line(tmp_path):
    """``--nnodes 2`` on one host: no other node comes. The console says every few seconds what the
    job waits for and where the others must point; when the quorum timeout ends it, the reason is
    one line (no worker traceback, no coordinator log line saying it again), exit 1."""
    run = harness.unbroken(str(tmp_path / "run"), "--nnodes", "2", "--nproc-per-node", "1", "--start-grace", "1",
                           "--quorum-timeout", "8", harness.EXACT, "--steps", "5", timeout=120)
    out = run.stdout + run.stderr
    assert run.code == 1, out[-3000:]
    waits = re.findall(r"^\[unbroken\] waiting for members: the job needs 2, 1 joined \(node \w+\); start the other nodes"
                       r" with --rdzv-endpoint 127\.0\.0\.1:\d+ \(the job fails if still short in (\d+) s", run.stdout, re.M)
    assert len(waits) >= 1 and [int(w) for w in waits] == sorted((int(w) for w in waits), reverse=True), run.stdout
    assert "Traceback" not in out and "unbroken.coordinator" not in out, out[-3000:]
    assert len(re.findall(r"the job cannot go on|job failed", out)) == 1, out[-3000:]
    assert "unbroken: the job cannot go on: only 1 live member(s), below the minimum of 2" in run.stderr
    with open(os.path.join(run.run_dir, "workers", "w0.log")) as f:
        assert "unbroken: the job cannot go on:" in f.read()  # the worker's own line, in its log
    assert harness.stop([], [run.run_dir]) == [], "no worker left behind"
