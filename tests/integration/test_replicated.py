"""Contract tests of the replicated coordinator state against a real 3-member etcd on
127.0.0.1 (issue 12): one leader, guarded writes, a deposed leader's write refused."""

import asyncio
import base64
import os
import signal
import time

import pytest

from testbed import etcd
from tests.needs import require
from unbroken.coordinator.replicated import EtcdGateway, Leadership, LeadershipSettings, NotLeader

pytestmark = pytest.mark.slow

REASON = etcd.why_not_available()


@pytest.fixture
def cluster(tmp_path):
    require(REASON)
    with etcd.cluster(str(tmp_path)) as made:
        yield made


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_of_two_candidates_exactly_one_leads_and_only_it_can_write(cluster):
    async def scenario():
        a = Leadership(EtcdGateway(cluster.endpoints), LeadershipSettings("job1", lease=2.0), "a:1")
        b = Leadership(EtcdGateway(cluster.endpoints), LeadershipSettings("job1", lease=2.0), "b:1")
        try:
            won = [await a.campaign(), await b.campaign()]
            assert won == [True, False]
            assert a.is_leader() and not b.is_leader()
            assert await b.leader() == "a:1"
            await a.guarded_put("generation", {"number": 7})
            assert await b.read("generation") == {"number": 7}
            with pytest.raises(NotLeader):
                await b.guarded_put("generation", {"number": 8})
            assert await a.read("generation") == {"number": 7}
        finally:
            await a.gateway.close()
            await b.gateway.close()

    run(scenario())


def test_a_leader_that_stops_renewing_is_replaced_and_its_late_write_is_refused(cluster):
    async def scenario():
        settings = LeadershipSettings("job2", lease=2.0, margin=0.5)
        a = Leadership(EtcdGateway(cluster.endpoints), settings, "a:1")
        b = Leadership(EtcdGateway(cluster.endpoints), settings, "b:1")
        try:
            assert await a.campaign()
            started = time.monotonic()
            # a is frozen (renews nothing): by its own clock it stops serving before etcd drops it
            while await b.campaign() is False:
                assert time.monotonic() - started < 10
                await asyncio.sleep(0.1)
            took_over = time.monotonic() - started
            assert not a.is_leader(), "a still believed it led when b took over"
            assert 1.0 <= took_over <= 4.5, took_over
            a.valid_until = time.monotonic() + 10  # a woken leader that wrongly believes it still leads
            with pytest.raises(NotLeader, match="no longer holds the leader key"):
                await a.guarded_put("generation", {"number": 99})
            assert not a.is_leader()
            await b.guarded_put("generation", {"number": 3})
            assert await a.read("generation") == {"number": 3}
        finally:
            await a.gateway.close()
            await b.gateway.close()

    run(scenario())


def test_a_renewing_leader_keeps_leading_and_nobody_writes_without_a_quorum(cluster):
    async def scenario():
        a = Leadership(EtcdGateway(cluster.endpoints, timeout=1.0), LeadershipSettings("job3", lease=2.0), "a:1")
        try:
            assert await a.campaign()
            for _ in range(12):  # 3 s: longer than the lease
                assert await a.renew()
                await asyncio.sleep(0.25)
            assert a.is_leader()
            cluster.stop(1)
            cluster.stop(2)
            with pytest.raises(Exception):  # no quorum: etcd cannot commit the write
                await a.guarded_put("generation", {"number": 1})
        finally:
            await a.gateway.close()

    run(scenario())


def test_a_leaders_validity_counts_from_the_ttl_etcd_granted(cluster):
    """etcd grants whole seconds: a 1.45 s lease is 1 s on its side, and a leader that counted
    from the 1.45 s it asked for would serve 0.45 s after etcd may have let its key go."""

    async def scenario():
        a = Leadership(EtcdGateway(cluster.endpoints), LeadershipSettings("job4", lease=1.45, margin=0.3, poll=0.1), "a:1")
        try:
            sent = time.monotonic()
            assert await a.campaign()
            assert a.granted == 1.0
            # by its own clock: 1.0 s granted - 0.3 s margin from when it asked (not 1.45 - 0.3)
            assert a.valid_until - sent <= 1.0 - 0.3 + 0.1, a.valid_until - sent
        finally:
            await a.gateway.close()

    run(scenario())


def test_a_failed_job_is_recorded_for_good_and_a_new_leader_keeps_it_failed(cluster):
    from unbroken.coordinator.server import Coordinator, CoordinatorSettings
    from unbroken.coordinator.membership import MembershipSettings

    async def lead(name):
        leadership = Leadership(EtcdGateway(cluster.endpoints), LeadershipSettings("job5", lease=2.0), name)
        assert await leadership.campaign()
        coordinator = Coordinator(CoordinatorSettings(), MembershipSettings(), leadership=leadership)
        await coordinator._take_over()
        return coordinator

    async def scenario():
        first = await lead("a:1")
        try:
            assert first.state.failed is None and not first.state.finished
            first.state.failed = "only 0 live member(s), below the minimum of 2, for more than quorum_timeout=1 s"
            first._record_outcome_once()
            deadline = time.monotonic() + 10
            while await first.leadership.read("outcome") is None:
                assert time.monotonic() < deadline, "the outcome was never recorded"
                await asyncio.sleep(0.05)
            reply = await first.leadership.gateway.call("kv/range", {"key": base64.b64encode(b"/unbroken/job5/outcome").decode()})
            assert "lease" not in reply["kvs"][0], "the outcome must not expire"
            await first.leadership.resign()
        finally:
            await first.leadership.gateway.close()
        second = await lead("b:1")  # takes over after the failure, as after the leader's loss
        try:
            assert second.state.failed == "only 0 live member(s), below the minimum of 2, for more than quorum_timeout=1 s"
            assert not second.state.finished
        finally:
            await second.leadership.gateway.close()

    run(scenario())


def _candidate(tmp_path, name, endpoints, *flags):
    from tests.integration.test_hangs import start

    proc = start(["coordinator", "--host", "127.0.0.1", "--port", "0", "--etcd", ",".join(endpoints), "--job-id", "job",
                  "--leader-lease", "2", "--run-dir", str(tmp_path / name), *flags], str(tmp_path))
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, line.split("listening on ")[1].split()[0]


def test_the_leading_coordinator_killed_the_others_take_over_and_training_goes_on(tmp_path, reference):
    from testbed import harness
    from tests.integration.conftest import GLOBAL, STEPS
    from tests.integration.test_hangs import finish, start

    require(REASON)
    flags = ["--expected-members", "3", "--heartbeat-timeout", "2"]
    run_dir = str(tmp_path / "node")
    procs = []
    with etcd.cluster(str(tmp_path)) as made:
        try:
            candidates = [_candidate(tmp_path, f"c{i}", made.endpoints, *flags) for i in range(3)]
            procs += [p for p, _ in candidates]
            runs = {name: harness.Run(0, "", "", str(tmp_path / name)) for name in ("c0", "c1", "c2")}
            first = harness.wait_for(lambda: [n for n, r in runs.items() if r.events("leader")], 30, "a leader")
            assert len(first) == 1
            # the node is told only of the leader, which is killed: it must have learned the others
            told = candidates[int(first[0][1:])][1]
            node = start(["run", "--run-dir", run_dir, "--coordinator", told,
                          "--nproc-per-node", "3", "--heartbeat-interval", "0.25", "--heartbeat-timeout", "2", "--record-samples",
                          harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.3", "--out", f"{run_dir}/final"], str(tmp_path))
            procs.append(node)
            node_run = harness.Run(0, "", "", run_dir)
            harness.wait_for(lambda: [e for e in node_run.events("step") if e["step"] >= 8], 120, "training")
            leader = candidates[int(first[0][1:])][0]
            os.killpg(leader.pid, signal.SIGKILL)
            leader.communicate()
            killed = time.time()
            took_over = harness.wait_for(
                lambda: [(n, e) for n, r in runs.items() if n != first[0] for e in r.events("leader") if e["t"] > killed], 30, "a new leader")
            new_generations = lambda: {e["generation"] for e in runs[took_over[0][0]].events("generation")}  # noqa: E731
            # the first step committed in a generation the new leader formed
            resumed = harness.wait_for(
                lambda: [e for e in node_run.events("step") if e["generation"] in new_generations()], 60, "training under the new leader")[0]
            out, err = finish(node, run_dir)
            assert node.returncode == 0, out[-2000:] + err[-2000:]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate()
            harness.kill_leftovers(run_dir)
    stall = resumed["t"] - killed
    print(f"leader killed: new leader after {took_over[0][1]['t'] - killed:.2f} s, first commit under it after {stall:.2f} s")
    assert stall < 5.0, f"{stall:.2f} s; docs/guide/etcd.md documents 2.42 s (2.23-2.46) for this failover"
    new_leader = runs[took_over[0][0]]
    before = runs[first[0]].events("generation")
    after = new_leader.events("generation")
    assert after and min(e["generation"] for e in after) > max(e["generation"] for e in before)  # numbers continue from etcd
    harness.check_exactly_once(run_dir, STEPS, GLOBAL)
    harness.check_same_model(f"{run_dir}/final", reference["single"], 3)
