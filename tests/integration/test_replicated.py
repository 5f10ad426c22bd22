"""Contract tests of the replicated coordinator state against a real 3-member etcd on
127.0.0.1 (issue 12): one leader, guarded writes, a deposed leader's write refused."""

import asyncio
import time

import pytest

from tests.integration import etcd
from unbroken.replicated import EtcdGateway, Leadership, LeadershipSettings, NotLeader

pytestmark = pytest.mark.slow

REASON = etcd.why_not_available()


@pytest.fixture
def cluster(tmp_path):
    if REASON:
        pytest.skip(REASON)
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
