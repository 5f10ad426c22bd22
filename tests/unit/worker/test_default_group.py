"""torch.distributed's default group follows the generation, and a past generation's is let go off
the joining thread: its backend's destructor can wait on Gloo's threads while a broken peer keeps
them (20 s seen in the demo: the member was fenced for it)."""

import threading
import time
import types
import weakref

import torch
import torch.distributed as dist

from unbroken.worker.default_group import DefaultGroup
from unbroken.worker.graveyard import Graveyard


def _generation(number: int) -> types.SimpleNamespace:
    """What the default group reads of a generation's group, over a real one-process Gloo group."""
    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"gen{number}", store), 0, 1)
    return types.SimpleNamespace(number=number, rank=0, size=1, backend="gloo", device=torch.device("cpu"),
                                 pg=pg, store=store)


def test_the_next_generation_hands_the_past_default_group_to_release_instead_of_dropping_it():
    released = []
    default = DefaultGroup(lambda exc: None, released.append)
    first = _generation(1)
    default.enter(first, "127.0.0.1", 1)
    past = weakref.ref(dist.distributed_c10d._get_default_group())
    first.pg = None  # the graveyard let go of the generation's own reference
    default.enter(_generation(2), "127.0.0.1", 2)
    try:
        assert past() is not None and released == [past()], "the past default group was dropped in the join"
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert dist.distributed_c10d._get_default_group() is not past()
    finally:
        default.leave()
    assert not dist.is_initialized()
    released.clear()
    assert past() is None


def test_what_is_buried_is_dropped_on_the_reaper_thread_and_counted_until_then():
    dropped = threading.Event()
    where = []

    class SlowToDestroy:
        def __del__(self):
            where.append(threading.current_thread().name)
            dropped.set()

    graveyard = Graveyard(poll=0.01)
    graveyard.bury(SlowToDestroy())
    assert dropped.wait(10), "the buried object was never dropped"
    assert where == ["unbroken-graveyard"]
    deadline = time.monotonic() + 10
    while len(graveyard) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(graveyard) == 0, "what was dropped is still counted"
