"""The group relay in one process: generations and views relayed, the group-progress rule,
silence judged on the observer's own clock, incarnations isolated, the watchdog's verdict."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from unbroken.replica_groups.group_relay import EXIT_PEER_SILENT, GroupRelay, GroupWatchdog, RelayTimeout, relay_prefix


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_group(store, size: int = 3, prefix: str = "g/0/", **kwargs) -> list[GroupRelay]:
    kwargs.setdefault("peer_timeout", 1.0)
    return [GroupRelay(store, r, size, prefix=prefix, **kwargs) for r in range(size)]


def test_generations_reach_every_peer_in_order_and_a_late_reader_gets_the_newest():
    leader, one, two = make_group(dist.HashStore())
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(one.wait_generation(after=0, timeout=5)))
    waiter.start()
    time.sleep(0.05)
    assert leader.publish_generation({"generation": 7, "members": ["a", "b"]}) == 1
    waiter.join(5)
    assert got and got[0].seq == 1 and got[0].value == {"generation": 7, "members": ["a", "b"]}

    assert leader.publish_generation({"generation": 8}) == 2
    assert one.wait_generation(after=1, timeout=1).value == {"generation": 8}
    # a reader that missed #2 and #3 gets #3: the older one is dead already
    leader.publish_generation({"generation": 9})
    newest = two.wait_generation(after=1, timeout=1)
    assert (newest.seq, newest.value) == (3, {"generation": 9})


def test_waiting_for_a_generation_that_never_comes_times_out_with_a_clear_error():
    _, one, _ = make_group(dist.HashStore())
    started = time.monotonic()
    with pytest.raises(RelayTimeout, match=r"process 1 of group 'g/0/': process 0 published no generation after #0 within 0.1 s"):
        one.wait_generation(after=0, timeout=0.1)
    assert time.monotonic() - started < 1.0


def test_views_are_relayed_newest_first_and_read_at_most_every_refresh_interval():
    clock = Clock()
    leader, one, _ = make_group(dist.HashStore(), clock=clock, view_refresh=0.015)
    assert one.view() == {}
    leader.publish_view({"generation": 1, "broken": False})
    clock.now += 0.02
    assert one.view() == {"generation": 1, "broken": False}
    leader.publish_view({"generation": 1, "broken": True})
    assert one.view() == {"generation": 1, "broken": False}, "read again before the refresh interval passed"
    clock.now += 0.02
    assert one.view() == {"generation": 1, "broken": True}
    assert one.relayed_view().seq == 2
    assert leader.view() == {"generation": 1, "broken": True}


def test_group_progress_moves_only_while_every_process_moves():
    store = dist.HashStore()
    leader, one, two = make_group(store)
    counters = [0, 0, 0]

    def tick(*moving: int) -> int:
        for r in moving:
            counters[r] += 1
        for relay, count in zip((leader, one, two), counters):
            relay.tick(count)
        return leader.group_progress()

    assert leader.group_progress() == 0, "nobody ticked yet"
    assert tick() == 0  # the first round begins
    assert tick(0, 1, 2) == 1
    assert tick(0, 1, 2) == 2
    # process 2 stops: the round in flight never ends, however long the others go on
    assert [tick(0, 1) for _ in range(5)] == [2] * 5
    # it moves again: that one round ends, then every round needs everybody again
    assert tick(2) == 3
    assert tick(0, 2) == 3
    assert tick(1) == 4


def test_a_process_that_never_ticked_holds_the_group_progress_at_zero():
    leader, one, _ = make_group(dist.HashStore())
    for count in range(1, 5):
        leader.tick(count)
        one.tick(count)
        assert leader.group_progress() == 0


def test_a_peer_whose_ticks_stop_is_silent_after_the_peer_timeout_on_the_observers_clock():
    clock = Clock()
    leader, one, two = make_group(dist.HashStore(), clock=clock, peer_timeout=1.0, start_timeout=5.0)
    for relay in (leader, one, two):
        relay.tick(0)
    assert leader.silent_peers() == [] and not one.leader_silent()
    for _ in range(3):
        clock.now += 0.6
        leader.tick(1)
        one.tick(1)  # process 2 no longer ticks
        assert not one.leader_silent()
    assert leader.silent_peers() == [2]
    assert leader.silences()[2] == pytest.approx(1.8)
    # the leader stops too: process 1 sees it silent a peer timeout later
    clock.now += 1.1
    assert one.leader_silent()


def test_a_process_never_seen_is_given_the_start_timeout():
    clock = Clock()
    leader, one, _ = make_group(dist.HashStore(), clock=clock, peer_timeout=1.0, start_timeout=5.0)
    leader.tick(0)
    one.tick(0)
    for _ in range(8):
        clock.now += 0.5
        one.tick(1)
        assert leader.silent_peers() == []
    clock.now += 1.2  # 5.2 s after the relay began, never seen
    one.tick(2)
    assert leader.silent_peers() == [2]


def test_a_restarted_group_under_a_new_incarnation_prefix_reads_nothing_of_the_dead_one():
    store = dist.HashStore()
    old = make_group(store, prefix=relay_prefix("g3", 0))
    old[0].publish_generation({"generation": 4})
    old[0].publish_view({"generation": 4, "broken": True})
    for relay in old:
        relay.tick(99)
    new = make_group(store, prefix=relay_prefix("g3", 1), view_refresh=0.0)
    assert new[1].view() == {}
    with pytest.raises(RelayTimeout):
        new[1].wait_generation(after=0, timeout=0.05)
    new[0].poll()
    assert all(new[0]._peers[r].record is None for r in (1, 2)), "the dead incarnation's ticks were read"
    assert new[0].publish_generation({"generation": 5}) == 1


def test_roles_and_arguments_are_checked():
    leader, one, _ = make_group(dist.HashStore())
    with pytest.raises(RuntimeError, match="process 0"):
        one.publish_generation({})
    with pytest.raises(RuntimeError, match="processes 1..K-1"):
        leader.wait_generation(0, 0.1)
    with pytest.raises(ValueError):
        GroupRelay(dist.HashStore(), 3, 3, prefix="p/", peer_timeout=1.0)
    with pytest.raises(ValueError):
        relay_prefix("a/b", 0)
    with pytest.raises(ValueError, match="below the peer timeout"):
        GroupWatchdog(leader, lambda: 0, interval=1.0)


def test_the_watchdog_stays_quiet_while_every_process_ticks_and_names_the_one_that_stops():
    store = dist.HashStore()
    relays = make_group(store, peer_timeout=0.4, start_timeout=2.0)
    verdicts: list[str] = []
    dogs = [GroupWatchdog(r, lambda: 0, interval=0.05, on_silent=verdicts.append).start() for r in relays]
    try:
        time.sleep(0.8)
        assert verdicts == []
        dogs[2].stop()
        stopped = time.monotonic()
        deadline = stopped + 3.0
        while not verdicts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(verdicts) == 1, verdicts
        # its last tick was at most one interval (0.05 s) before it stopped
        assert 0.34 <= time.monotonic() - stopped < 1.5
        assert "process 0: process 2 silent for" in verdicts[0] and "peer timeout 0.4 s" in verdicts[0]
        assert dogs[0].fired == verdicts[0]
        # process 0's watchdog fired and stopped ticking: process 1 sees its leader silent
        deadline = time.monotonic() + 3.0
        while len(verdicts) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "process 1: process 0 (the group's leader) silent for" in verdicts[1]
    finally:
        for dog in dogs:
            dog.stop()
    assert EXIT_PEER_SILENT not in (0, 1, 3, 78)


def test_a_follower_hears_each_new_view_and_judges_a_vanished_store_host_by_silence():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=1))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=1))
    leader = GroupRelay(server, 0, 2, prefix="g/0/", peer_timeout=0.5)
    one = GroupRelay(client, 1, 2, prefix="g/0/", peer_timeout=0.5)
    views: list[dict] = []
    verdicts: list[str] = []
    leader.tick(0)
    dog = GroupWatchdog(one, lambda: 0, interval=0.05, on_silent=verdicts.append, on_view=views.append).start()
    try:
        for n in (1, 2):
            leader.publish_view({"generation": n})
            leader.tick(n)
            deadline = time.monotonic() + 2.0
            while len(views) < n and time.monotonic() < deadline:
                time.sleep(0.005)
        assert views == [{"generation": 1}, {"generation": 2}]
        del leader, server  # the store's host is gone: every read fails from now on
        deadline = time.monotonic() + 20.0  # 0.5 s alone; a loaded 2-core machine took over 5 s once
        while not verdicts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert verdicts and "process 0 (the group's leader) silent for" in verdicts[0]
        assert one.view() == {"generation": 2}, "a failing store keeps the cached view"
    finally:
        dog.stop()


def test_stopping_the_watchdog_waits_for_its_threads_so_none_is_in_a_store_call_at_exit():
    store = dist.HashStore()
    relays = make_group(store, peer_timeout=0.4, start_timeout=2.0)
    dogs = [GroupWatchdog(r, lambda: 0, interval=0.05, on_silent=lambda _: None).start() for r in relays]
    time.sleep(0.2)
    for dog in dogs:
        dog.stop()
    assert not any(thread.is_alive() for dog in dogs for thread in dog._threads)
