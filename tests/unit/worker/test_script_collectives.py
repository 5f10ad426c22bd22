"""Members meet in the store before each collective of the script's own inside a step
(unbroken.worker.script_collectives): the same collectives go ahead, different ones (another
operation or shape, or one member making more) fail every member with LoopMisuse before anything
is sent. Three members in threads over one store."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from unbroken.errors import LoopMisuse
from unbroken.worker import script_collectives


class FakeGroup:
    def __init__(self, store, rank, size=3):
        self.store, self.rank, self.size, self.number, self.backend = store, rank, size, 1, "gloo"
        self.pg = f"pg{rank}"

    def watch_unbounded(self, done, what, poll):
        deadline = time.monotonic() + 20
        while not done():
            assert time.monotonic() < deadline, f"{what}: never done"
            time.sleep(0.01)


def _members(store):
    failed = []
    made = [script_collectives.ScriptCollectives(FakeGroup(store, r), failed.append, lambda r=r: f"side{r}") for r in range(3)]
    return made, failed


def _in_threads(*calls):
    results = [None] * len(calls)

    def run(i, call):
        try:
            results[i] = call()
        except Exception as exc:  # noqa: BLE001 - the test looks at what each member raised
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_the_same_collectives_go_ahead_on_the_scripts_own_group():
    made, failed = _members(dist.HashStore())
    tensor = torch.zeros(3)
    for _ in range(3):
        results = _in_threads(*[lambda m=m: m.begin(5, "allreduce", ([tensor],)) for m in made])
        assert results == ["side0", "side1", "side2"] and not failed


def test_a_collective_of_another_shape_fails_every_member():
    made, failed = _members(dist.HashStore())
    results = _in_threads(lambda: made[0].begin(5, "allreduce", ([torch.zeros(3)],)),
                          lambda: made[1].begin(5, "allreduce", ([torch.zeros(3)],)),
                          lambda: made[2].begin(5, "allreduce", ([torch.zeros(4)],)))
    assert all(isinstance(r, LoopMisuse) for r in results), results
    assert "differs between members" in str(results[0]) and "same collectives" in str(results[0])
    assert failed  # the job is recorded as failed: no restart repeats it


def test_one_member_more_per_step_fails_the_ones_that_wait_and_the_one_in_the_exchange(monkeypatch):
    monkeypatch.setattr(script_collectives, "SLOW_CHECK", 0.2)
    made, failed = _members(dist.HashStore())
    tensor = torch.zeros(1)
    _in_threads(*[lambda m=m: m.begin(7, "allreduce", ([tensor],)) for m in made])  # the first: all three

    def more(m):
        return m.begin(7, "allreduce", ([tensor],))  # a second micro-batch: members 0 and 1 only

    def exchange():
        time.sleep(0.3)
        for _ in range(50):  # the exchange's idle slices
            made[2].in_exchange(7)
            time.sleep(0.05)

    results = _in_threads(lambda: more(made[0]), lambda: more(made[1]), exchange)
    assert all(isinstance(r, LoopMisuse) for r in results), results
    assert "reached the gradient exchange after 1" in str(results[0])
    assert "waits in the script's collective number 2" in str(results[2])


def test_a_member_that_committed_with_fewer_and_went_on_is_found_by_both_sides(monkeypatch):
    # shares of 3, 3 and 2 micro-batches: the third member's buckets were all in, it committed the
    # step and makes the next step's first collective while the others wait for their third
    monkeypatch.setattr(script_collectives, "SLOW_CHECK", 0.2)
    made, failed = _members(dist.HashStore())
    tensor = torch.zeros(1)
    for _ in range(2):
        _in_threads(*[lambda m=m: m.begin(0, "allreduce", ([tensor],)) for m in made])
    results = _in_threads(lambda: made[0].begin(0, "allreduce", ([tensor],)),
                          lambda: made[1].begin(0, "allreduce", ([tensor],)),
                          lambda: (time.sleep(0.1), made[2].begin(1, "allreduce", ([tensor],)))[1])
    assert all(isinstance(r, LoopMisuse) for r in results), results
    assert "went on to step 1" in str(results[0])
    assert "made 2 in that step" in str(results[2])


def test_counters_of_steps_before_the_last_are_deleted_by_rank_0():
    store = dist.HashStore()
    made, _ = _members(store)
    for step in (1, 2, 3):
        _in_threads(*[lambda m=m, s=step: m.begin(s, "barrier", ()) for m in made])
    assert not store.check(["script/1/1"]) and store.check(["script/2/1"]) and store.check(["script/3/1"])
