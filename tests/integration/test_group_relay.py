"""The group relay with real processes (issue 18): three processes of one replica group, the test
process hosting their TCPStore. Process 0 relays a generation to the others, all three tick and
run their watchdogs with a 1 s peer timeout. A stopped (SIGSTOP) or killed (SIGKILL) process 2 is
caught by process 0's watchdog, which ends process 0 with EXIT_PEER_SILENT and names process 2;
process 1 then finds its leader silent and ends the same way: the launcher would restart the group."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from testbed import harness
from unbroken.replica_groups.group_relay import EXIT_PEER_SILENT

pytestmark = pytest.mark.slow

SIZE = 3
PEER_TIMEOUT_S = 1.0
INTERVAL_S = 0.2
READY_TIMEOUT_S = 90.0  # three processes importing torch on a busy 2-core machine
VERDICT_BOUND_S = 5.0  # peer timeout 1 s, plus the judge's period and a loaded machine's slack
LIFETIME_S = 120.0  # a worker that nobody stopped ends by itself


def _worker(rank: int, port: int, prefix: str, stderr_path: str) -> None:
    """Process ``rank`` of the group: relays (or receives) one generation, then ticks a moving
    progress counter under its watchdog, whose default verdict ends this process."""
    harness.exit_with_parent()
    torch.set_num_threads(1)
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    from unbroken.replica_groups.group_relay import GroupRelay, GroupWatchdog

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    relay = GroupRelay(store, rank, SIZE, prefix=prefix, peer_timeout=PEER_TIMEOUT_S, start_timeout=READY_TIMEOUT_S)
    progress = [0]
    GroupWatchdog(relay, lambda: progress[0], INTERVAL_S).start()
    if rank == 0:
        relay.publish_generation({"generation": 1, "members": ["g0", "g1"]})
    else:
        got = relay.wait_generation(after=0, timeout=READY_TIMEOUT_S)
        assert got.value["generation"] == 1, got
    store.set(f"test/ready/{rank}", "1")
    deadline = time.monotonic() + LIFETIME_S
    while time.monotonic() < deadline:
        progress[0] += 1
        time.sleep(0.02)
    os._exit(0)


def _wait_exit(proc, bound: float) -> float:
    """Seconds until ``proc`` ended (fails if it outlives ``bound``)."""
    started = time.monotonic()
    proc.join(bound)
    assert proc.exitcode is not None, f"process {proc.pid} still running {bound} s after its peer failed"
    return time.monotonic() - started


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_stopped_or_killed_process_ends_its_whole_group_through_the_watchdogs(tmp_path, fault):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    context = multiprocessing.get_context("spawn")
    stderr = [str(tmp_path / f"stderr{r}.txt") for r in range(SIZE)]
    procs = [context.Process(target=_worker, args=(r, server.port, "unbroken/relay/g0/0/", stderr[r]), daemon=True) for r in range(SIZE)]
    try:
        for p in procs:
            p.start()
        harness.wait_for(lambda: server.check([f"test/ready/{r}" for r in range(SIZE)]) or any(p.exitcode is not None for p in procs),
                         READY_TIMEOUT_S, "the group's processes to relay their generation")
        assert [p.exitcode for p in procs] == [None] * SIZE, [open(path).read() for path in stderr]
        time.sleep(3 * INTERVAL_S)
        assert all(p.is_alive() for p in procs), "a watchdog fired while every process ticked"

        os.kill(procs[2].pid, fault)
        leader_took = _wait_exit(procs[0], VERDICT_BOUND_S)
        assert procs[0].exitcode == EXIT_PEER_SILENT, open(stderr[0]).read()
        assert PEER_TIMEOUT_S - INTERVAL_S - 0.1 <= leader_took, f"process 0 ended after {leader_took:.2f} s, before the peer timeout"
        leader_line = open(stderr[0]).read()
        assert "process 0: process 2 silent for" in leader_line and "ending this process" in leader_line, leader_line

        _wait_exit(procs[1], VERDICT_BOUND_S)
        assert procs[1].exitcode == EXIT_PEER_SILENT, open(stderr[1]).read()
        assert "process 1: process 0 (the group's leader) silent for" in open(stderr[1]).read()
        if fault == signal.SIGKILL:
            assert procs[2].exitcode == -signal.SIGKILL
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
            p.join(5)
        assert all(p.exitcode is not None for p in procs if p.pid is not None), "a process was left behind"
