"""Three hosts as network namespaces: a partitioned host and a lost node (launcher and workers
killed together) leave the others training; the cut-off host rejoins without stale commits and a
new node joins later; the result equals a failure-free run."""

import os
import signal
import subprocess
import sys
import time

import pytest

from testbed import harness, netns
from tests.integration.conftest import GLOBAL, STEPS
from tests.needs import needs

pytestmark = [pytest.mark.slow]

REASON = netns.why_not_available()


def events(dirs, kind):
    out = []
    for d in dirs:
        out += harness.Run(0, "", "", d).events(kind)
    return sorted(out, key=lambda e: e["t"])



def _coordinator(hosts, coord_dir):
    """A standalone coordinator on host 0, port 29400 (the namespace is the test's own)."""
    return hosts.popen(0, [sys.executable, "-m", "unbroken", "coordinator", "--host", hosts.addresses[0],
                           "--port", "29400", "--store-port", "29401", "--advertise-host", hosts.addresses[0],
                           "--expected-members", "3", "--heartbeat-timeout", "2", "--progress-timeout", "4",
                           "--run-dir", coord_dir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_all(procs, dirs):
    """End what the test started, whatever happened: its processes, then any worker left."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for d in dirs:
        harness.kill_leftovers(d)


@needs(REASON)
def test_a_partitioned_host_and_a_lost_node_leave_the_others_training(tmp_path, reference):
    base = str(tmp_path)
    coord_dir = os.path.join(base, "coord")
    dirs = [coord_dir] + [os.path.join(base, n) for n in ("h0", "h1", "h2", "h1-new")]
    final = os.path.join(base, "final")
    procs = []
    with netns.hosts(3) as hosts:
        address = f"{hosts.addresses[0]}:29400"

        def node(index, name):
            proc = hosts.popen(
                index,
                [sys.executable, "-m", "unbroken", "run", "--coordinator", address, "--node-name", name,
                 "--nproc-per-node", "1", "--heartbeat-interval", "0.25", "--heartbeat-timeout", "2",
                 "--record-samples", "--run-dir", os.path.join(base, name),
                 harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.4", "--out", final],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            procs.append(proc)
            return proc

        def generations():
            return events([coord_dir], "generation")

        try:
            procs.append(_coordinator(hosts, coord_dir))
            h0, h1, h2 = node(0, "h0"), node(1, "h1"), node(2, "h2")
            harness.wait_for(lambda: [g for g in generations() if len(g["members"]) == 3], 120, "three hosts in a generation")
            harness.wait_for(lambda: len(events(dirs, "step")) >= 4, 60, "training to start")

            # 1. Partition h2: the others go on without it; it commits nothing meanwhile.
            hosts.cut(2)
            t_cut = time.time()
            without = harness.wait_for(lambda: [g for g in generations() if g["t"] > t_cut and "h2.w0.r0" not in g["members"]], 60, "a generation without h2")[0]
            harness.wait_for(lambda: len([e for e in events(dirs, "step") if e["t"] > without["t"]]) >= 3, 60, "steps without h2")
            hosts.restore(2)
            t_restore = time.time()
            harness.wait_for(lambda: [e for e in events(dirs, "heal") if "h2.w0.r0" in e["receivers"] and e["t"] > t_restore], 90, "h2 to rejoin and be healed")

            # 2. Lose node h1 whole: its launcher and its worker die together.
            worker = events([os.path.join(base, "h1")], "worker_start")[-1]["pid"]
            os.killpg(h1.pid, signal.SIGKILL)
            os.killpg(worker, signal.SIGKILL)
            t_kill = time.time()
            lost = harness.wait_for(lambda: [g for g in generations() if g["t"] > t_kill and "h1.w0.r0" not in g["members"]], 60, "a generation without h1")[0]
            harness.wait_for(lambda: len([e for e in events(dirs, "step") if e["t"] > lost["t"]]) >= 2, 60, "steps without h1")

            # 3. A new node starts later, joins and is healed.
            new = node(1, "h1-new")
            for proc in (h0, h2, new):
                out, err = proc.communicate(timeout=180)
                assert proc.returncode == 0, err[-3000:]
        finally:
            _stop_all(procs, dirs)

    assert harness.state_received(lambda kind: events(dirs, kind), "h1-new.w0.r0")  # a heal, or a catch-up
    harness.check_exactly_once(dirs, STEPS, GLOBAL)
    finals = harness.final_params(final)
    assert {"h0.w0.r0", "h2.w0.r0", "h1-new.w0.r0"} <= set(finals)
    for member in ("h0.w0.r0", "h2.w0.r0", "h1-new.w0.r0"):
        assert harness.max_relative_difference(finals[member], reference["single"]) < 1e-8, member
    assert len({e["hash"] for e in events(dirs, "replicas")}) == 1


@needs(REASON)
def test_a_host_cut_off_from_the_coordinator_but_not_from_its_peers_commits_nothing_after_its_verdict(tmp_path, reference):
    # The case the lease exists for: host 3 still reaches its peers (its Gloo connections stay up)
    # but not the coordinator. It must stop committing before the others go on without it.
    base = str(tmp_path)
    coord_dir = os.path.join(base, "coord")
    names = ("h1", "h2", "h3")
    dirs = [coord_dir] + [os.path.join(base, n) for n in names]
    final = os.path.join(base, "final")
    procs = []
    with netns.hosts(4) as hosts:
        address = f"{hosts.addresses[0]}:29400"
        try:
            procs.append(_coordinator(hosts, coord_dir))
            nodes = [hosts.popen(
                i + 1,
                [sys.executable, "-m", "unbroken", "run", "--coordinator", address, "--node-name", name,
                 "--nproc-per-node", "1", "--heartbeat-interval", "0.25", "--heartbeat-timeout", "2",
                 "--record-samples", "--run-dir", os.path.join(base, name),
                 harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.4", "--out", final],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ) for i, name in enumerate(names)]
            procs += nodes
            harness.wait_for(lambda: [g for g in events([coord_dir], "generation") if len(g["members"]) == 3], 120, "three hosts in a generation")
            harness.wait_for(lambda: len(events(dirs, "step")) >= 4, 60, "training to start")
            hosts.cut_route(3, 0)
            t_cut = time.time()
            verdict = harness.wait_for(lambda: [e for e in events([coord_dir], "verdict") if e["member"] == "h3.w0.r0" and e["t"] > t_cut], 60, "h3's verdict")[0]
            without = harness.wait_for(lambda: [g for g in events([coord_dir], "generation") if g["t"] > t_cut and "h3.w0.r0" not in g["members"]], 60, "a generation without h3")[0]
            harness.wait_for(lambda: len([e for e in events(dirs, "step") if e["t"] > without["t"]]) >= 3, 60, "steps without h3")
            hosts.restore_route(3, 0)
            t_restore = time.time()
            harness.wait_for(lambda: [e for e in events(dirs, "heal") if "h3.w0.r0" in e["receivers"] and e["t"] > t_restore], 90, "h3 to rejoin and be healed")
            for proc in nodes:
                out, err = proc.communicate(timeout=180)
                assert proc.returncode == 0, err[-3000:]
        finally:
            _stop_all(procs, dirs)

    assert verdict["detected_by"] == "heartbeat"
    dead_in = max(g["generation"] for g in events([coord_dir], "generation") if "h3.w0.r0" in g["members"] and g["t"] < verdict["t"])
    stale = [c for c in harness.commits(os.path.join(base, "h3"), "h3.w0.r0") if c["g"] == dead_in and c["t"] > verdict["t"]]
    assert stale == [], f"h3 committed {stale} in generation {dead_in} after its verdict"
    harness.check_exactly_once(dirs, STEPS, GLOBAL)
    finals = harness.final_params(final)
    for member in ("h1.w0.r0", "h2.w0.r0", "h3.w0.r0"):
        assert harness.max_relative_difference(finals[member], reference["single"]) < 1e-8, member
