"""``unbroken run --rdzv-endpoint HOST:PORT`` (issue 27): the same command on every node. Two
launchers on this machine stand for two nodes: the first hosts the coordinator on the port, the
second finds it taken and joins, warning about the coordinator's flag it ignores; the job trains
with both, exactly once, to the single process's model."""

import os
import socket

import pytest

from testbed import harness
from testbed.harness import GLOBAL

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_same_command_on_two_nodes_hosts_the_coordinator_on_one_and_joins_it_from_the_other(tmp_path):
    port = _free_port()
    runs = [str(tmp_path / "a"), str(tmp_path / "b")]
    common = ["--rdzv-endpoint", f"127.0.0.1:{port}", "--nnodes", "2", "--token", "s3cret", "--record-samples"]
    script = [harness.EXACT, "--steps", "12", "--step-delay", "0.05"]
    procs: list = []
    try:
        procs.append(harness.start(["run", "--run-dir", runs[0], "--node-name", "a", *common, *script, "--out", f"{runs[0]}/final"]))
        harness.wait_for(lambda: os.path.exists(os.path.join(runs[0], "coordinator.json")), 60, "node a hosts the coordinator")
        procs.append(harness.start(["run", "--run-dir", runs[1], "--node-name", "b", *common, "--start-grace", "5", *script,
                                    "--out", f"{runs[1]}/final"]))
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        leftovers = harness.stop(procs, runs)
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert leftovers == []
    assert "coordinator listening" in outputs[0] or os.path.exists(os.path.join(runs[0], "coordinator.json"))
    assert not os.path.exists(os.path.join(runs[1], "coordinator.json")), "node b hosted a coordinator of its own"
    assert f"--start-grace 5.0 is ignored on this node: it joins the coordinator at 127.0.0.1:{port}" in outputs[1], outputs[1][-2000:]
    harness.check_exactly_once(runs, 12, GLOBAL)
    single = harness.single_process(str(tmp_path / "single"), "--steps", "12")
    for run_dir in runs:
        harness.check_same_model(f"{run_dir}/final", single, 1)
