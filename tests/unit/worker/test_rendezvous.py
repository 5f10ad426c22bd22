"""The rendezvous of a generation's Gloo group: what it costs in store operations.

Members are threads of this process, each with its own client of one TCPStore (as the
coordinator hosts it), seen through a store that counts every operation Gloo makes.
"""

from __future__ import annotations

import collections
import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from unbroken.worker import group as group_module
from unbroken.worker.group import GenerationGroup


class CountingStore(dist.Store):
    """A store that forwards to another and counts the operations (a Python ``dist.Store``
    subclass, which Gloo accepts)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.counts: collections.Counter[str] = collections.Counter()
        self.keys: list[str] = []

    def set(self, key, value):
        self.counts["set"] += 1
        return self.inner.set(key, value)

    def get(self, key):
        self.counts["get"] += 1
        self.keys.append(key)
        return self.inner.get(key)

    def wait(self, keys, timeout=None):
        self.counts["wait"] += 1
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        self.counts["check"] += 1
        return self.inner.check(keys)

    def add(self, key, value):
        self.counts["add"] += 1
        return self.inner.add(key, value)

    def multi_get(self, keys):
        self.counts["multi_get"] += 1
        return self.inner.multi_get(keys)

    def has_extended_api(self):
        return self.inner.has_extended_api()


def _form(size: int, prefix: str = "g1"):
    """``size`` members connect one generation's group concurrently; returns (groups, stores)."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stores = [
        CountingStore(dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=datetime.timedelta(seconds=30)))
        for _ in range(size)
    ]
    groups = [
        GenerationGroup(1, rank, size, [f"m{r}" for r in range(size)], abandoned=lambda: None, wake=threading.Event(), timeout=20.0)
        for rank in range(size)
    ]
    errors: list[BaseException] = []

    def connect(rank: int) -> None:
        try:
            groups[rank].connect(stores[rank], prefix, "127.0.0.1")
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=connect, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return master, groups, stores


def _allreduce_all(groups):
    out: dict[int, float] = {}

    def run(g):
        t = torch.full((3,), float(g.rank + 1), dtype=torch.float64)
        g.allreduce(t, "test allreduce")
        out[g.rank] = t[0].item()

    threads = [threading.Thread(target=run, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_lazy_group_costs_each_member_one_write_and_its_two_neighbours_reads():
    size = 5
    master, groups, stores = _form(size)
    try:
        for rank, store in enumerate(stores):
            # one record written; the records of the left and right neighbours read (wait + get each)
            assert dict(store.counts) == {"set": 1, "wait": 2, "get": 2}, (rank, store.counts)
            # keys are "<prefix>/<device>/<rank>": Gloo names each member's record by its rank
            assert sorted(int(k.rsplit("/", 1)[1]) for k in store.keys) == sorted({(rank - 1) % size, (rank + 1) % size})
        sums = _allreduce_all(groups)
        assert sums == {r: float(sum(range(1, size + 1))) for r in range(size)}
        # the ring allreduce touches no pair beyond the neighbours: no more store traffic
        assert all(dict(s.counts) == {"set": 1, "wait": 2, "get": 2} for s in stores)
        # a message between members that are not neighbours (healing) connects one more pair
        received = torch.zeros(4)

        def send():
            groups[0].send(torch.arange(4.0), 2, 9, "test send")

        sender = threading.Thread(target=send)
        sender.start()
        groups[2].recv(received, 0, 9, "test recv")
        sender.join(30)
        assert received.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert stores[0].counts["get"] == 3 and stores[2].counts["get"] == 3
    finally:
        for g in groups:
            g.pg = None


def test_a_full_mesh_costs_each_member_a_read_of_every_record(monkeypatch):
    """What the lazy connect replaced (``UNBROKEN_GLOO_FULL_MESH=1``): every member reads every
    member's record, its own included: N waits and N gets, N^2 round trips per generation."""
    monkeypatch.setattr(group_module, "LAZY_CONNECT", False)
    size = 4
    master, groups, stores = _form(size)
    try:
        for store in stores:
            assert dict(store.counts) == {"set": 1, "wait": size, "get": size}
        assert _allreduce_all(groups) == {r: 10.0 for r in range(size)}
    finally:
        for g in groups:
            g.pg = None


@pytest.mark.parametrize("size", [1, 2])
def test_small_groups_connect(size):
    master, groups, stores = _form(size, prefix=f"small{size}")
    try:
        assert _allreduce_all(groups) == {r: float(sum(range(1, size + 1))) for r in range(size)}
    finally:
        for g in groups:
            g.pg = None


@pytest.mark.slow
def test_the_benchmark_runs_each_pattern_against_a_real_store():
    """benchmarks/bench_rendezvous.py at a small size: its members perform the patterns above
    (it asserts the operations and bytes of each run against the formulas)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_rendezvous.py", "--members", "4", "12", "--full-mesh-max", "4", "--processes", "2", "--json"],
        cwd=root, capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stderr
    rows = {(r["pattern"], r["members"]): r for r in map(json.loads, out.stdout.splitlines())}
    assert rows[("full mesh", 4)]["store_ops"] == 4 * (1 + 2 * 4) and not rows[("full mesh", 4)]["extrapolated"]
    assert rows[("full mesh", 12)]["store_ops"] == 12 * 25 and rows[("full mesh", 12)]["extrapolated"]
    assert rows[("full mesh, v2 api", 12)]["store_ops"] == 12 * 2
    assert rows[("lazy + ring", 12)]["store_ops"] == 12 * 5
