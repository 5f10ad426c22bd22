"""The owners' parts of a sharded optimizer's checkpoint: written apart, met in the directory,
published by rank 0 only when all are there and cover the state, verified whole when read."""

import os
import threading
import time

import pytest
import torch

from unbroken.storage.checkpoint import FORMAT_WITH_PARTS, CheckpointCorrupt, CheckpointStore
from unbroken.errors import ConfigError
from unbroken.storage.optimizer_parts import (PARTS_DIR, PartMissing, PartsIncomplete, PartsMismatch, merge, per_parameter_state,
                                              read_spans, wait_for_parts, write_part)
from unbroken.storage.parts_saver import PartsSaver

SIZES = [10, 3]
LAYOUT = [[[0, 0, 10]], [[1, 0, 3]]]


def spans_of(member, n=2):
    """Member ``member``'s partition of SIZES among ``n``: its spans with made-up Adam-like state."""
    out = {}
    for g, size in enumerate(SIZES):
        width = -(-size // n)
        start, end = min(size, member * width), min(size, (member + 1) * width)
        if end > start:
            out[(g, start, end)] = {"exp_avg": torch.arange(start, end, dtype=torch.float64) + 100 * g,
                                    "step": torch.tensor(7.0)}
    return out


def part_state(member, members=2):
    train = {"model": {"w": torch.ones(3)}, "optimizer": {"state": {}, "param_groups": []}} if member == 0 else None
    meta = {"generation": 4, "parts": {"member": member, "members": members, "generation": 4, "tag": "g4-1f",
                                       "sizes": SIZES, "layout": LAYOUT}}
    return {"train": train, "spans": spans_of(member)}, meta


def save_both(store, given_up=lambda generation: None, timeout=30.0, skip=()):
    """Members 1 and 0 save step 6, each with its own saver, as two processes would; returns rank 0's saver."""
    done = []
    savers = [PartsSaver(store, 3, done.append, given_up=given_up, timeout=timeout) for _ in range(2)]
    for member in (1, 0):
        if member not in skip:
            state, meta = part_state(member)
            assert savers[member].save(6, state, meta) is not None
    for saver in savers:
        saver.wait(60)
        assert not saver.busy()
    return savers[0], done


@pytest.mark.parametrize("where", ["local", "object-store"])
def test_rank_zero_publishes_once_every_part_is_there_and_a_read_verifies_every_file(tmp_path, where):
    store = CheckpointStore(str(tmp_path) if where == "local" else f"memory://parts-{os.getpid()}/{tmp_path.name}")
    saver, done = save_both(store)
    assert saver.error is None and store.steps() == [6]
    manifest, _ = store.read(6)
    assert manifest["format"] == FORMAT_WITH_PARTS and manifest["optimizer_parts"]["members"] == 2
    assert {f"{PARTS_DIR}/m0/.metadata", f"{PARTS_DIR}/m1/.metadata", f"{PARTS_DIR}/.metadata", "state.pt"} <= set(manifest["files"])
    assert done and done[0]["parts"] == 2
    state, _, _ = store.load_latest()
    assert state["optimizer"]["state"] == {}  # no optimizer state in rank 0's file: it is in the parts
    spans = read_spans(store.fs, store._path("step-00000006"), [(0, 3, 8)])  # across both members' parts
    torch.testing.assert_close(spans[(0, 3, 8)]["exp_avg"], torch.arange(3, 8, dtype=torch.float64), rtol=0, atol=0)
    # one flipped byte of member 1's part: the checkpoint is refused, and a resume skips it
    data = next(f for f in manifest["files"] if f.startswith(f"{PARTS_DIR}/m1/__"))
    path = store._path("step-00000006", data)
    with store.fs.open(path, "rb") as f:
        blob = bytearray(f.read())
    blob[100] ^= 1
    with store.fs.open(path, "wb") as f:
        f.write(bytes(blob))
    with pytest.raises(CheckpointCorrupt, match="m1/__0_0.distcp does not match its checksum"):
        store.read(6)
    assert store.load_latest() is None


def test_a_part_that_never_comes_leaves_the_checkpoint_unpublished(tmp_path):
    store = CheckpointStore(str(tmp_path))
    started = time.monotonic()
    saver, done = save_both(store, given_up=lambda generation: f"generation {generation} ended", skip=(1,))
    assert time.monotonic() - started < 20  # it did not wait for the part of a generation that ended
    assert isinstance(saver.error, PartMissing) and "generation 4 ended" in str(saver.error)
    assert store.steps() == [] and not done
    # a member still in the job but whose part does not come: given up after the timeout
    saver, done = save_both(CheckpointStore(str(tmp_path / "other")), timeout=0.5, skip=(1,))
    assert isinstance(saver.error, PartMissing) and "did not arrive within" in str(saver.error)


def test_a_member_that_cannot_write_its_part_says_so_and_rank_zero_stops_waiting(tmp_path):
    store = CheckpointStore(str(tmp_path))
    member = PartsSaver(store, 3, lambda info: None)
    state, meta = part_state(1)
    state["spans"][(0, 5, 10)]["exp_avg"] = lambda: None  # DCP cannot write it (it pickles what is not a tensor)
    member.save(6, state, meta)
    member.wait(30)
    assert member.error is not None
    rank0 = PartsSaver(store, 3, lambda info: None, timeout=600)
    state, meta = part_state(0)
    started = time.monotonic()
    rank0.save(6, state, meta)
    rank0.wait(60)
    assert time.monotonic() - started < 30 and isinstance(rank0.error, PartMissing), rank0.error
    assert "member 1 could not write its part" in str(rank0.error) and store.steps() == []


def test_a_member_still_writing_its_previous_part_refuses_the_next_without_waiting(tmp_path):
    store = CheckpointStore(str(tmp_path))
    member = PartsSaver(store, 3, lambda info: None)
    gate = threading.Event()
    member._write = lambda step, copy, meta: gate.wait(30)  # a store that takes its time
    state, meta = part_state(1)
    assert member.save(6, state, meta) is not None
    state, meta = part_state(1)
    meta["parts"]["tag"] = "g4-2a"
    started = time.monotonic()
    assert member.save(9, state, meta) is None and time.monotonic() - started < 5  # never blocks training
    marker = store._path(f".step-00000009.tmp-g4-2a/{PARTS_DIR}/m1.json")
    deadline = time.monotonic() + 30
    while not store.fs.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(PartMissing, match="still being written"):
        wait_for_parts(store.fs, store._path(".step-00000009.tmp-g4-2a"), 2, timeout=30, tag="g4-2a")
    gate.set()
    member.wait(30)


def test_a_leftover_of_the_same_step_with_parts_is_replaced(tmp_path):
    store = CheckpointStore(str(tmp_path))
    os.makedirs(os.path.join(str(tmp_path), "step-00000006", PARTS_DIR, "m0"))  # an earlier, unpublished try
    open(os.path.join(str(tmp_path), "step-00000006", PARTS_DIR, "m0", "stale"), "w").close()
    saver, _ = save_both(store)
    assert saver.error is None and store.steps() == [6]
    assert not os.path.exists(os.path.join(str(tmp_path), "step-00000006", PARTS_DIR, "m0", "stale"))


def test_parts_must_cover_the_state_exactly_once(tmp_path):
    store = CheckpointStore(str(tmp_path))
    root = store._path("step-00000001")
    only = write_part(store.fs, root, 0, spans_of(0))
    with pytest.raises(PartsIncomplete, match="parameter group 0"):
        merge(store.fs, root, [only], SIZES)
    twice = write_part(store.fs, root, 1, spans_of(0))  # member 1 wrote member 0's spans
    with pytest.raises(PartsIncomplete):
        merge(store.fs, root, [only, twice], SIZES)
    whole = write_part(store.fs, root, 2, {(0, 0, 10): {"exp_avg": torch.zeros(10)}, (1, 0, 3): {"exp_avg": torch.zeros(3)}})
    with pytest.raises(PartsIncomplete, match="held twice"):  # every element covered, some twice
        merge(store.fs, root, [whole, only], SIZES)


def test_an_optimizer_without_state_and_a_job_of_other_parameters(tmp_path):
    store = CheckpointStore(str(tmp_path))
    root = store._path("step-00000001")
    stateless = {span: {} for span in spans_of(0)} | {span: {} for span in spans_of(1)}  # SGD without momentum
    merge(store.fs, root, [write_part(store.fs, root, 0, stateless)], SIZES)
    assert read_spans(store.fs, root, [(0, 2, 7), (1, 0, 3)]) == {(0, 2, 7): {}, (1, 0, 3): {}}
    shapes = {0: torch.Size([2, 5]), 1: torch.Size([3])}
    assert per_parameter_state(store.fs, root, LAYOUT, shapes) == {}  # as torch's SGD holds none
    with pytest.raises(PartsMismatch, match="holds 10 elements for parameter 0"):
        per_parameter_state(store.fs, root, LAYOUT, {0: torch.Size([11]), 1: torch.Size([3])})
    assert issubclass(PartsMismatch, ConfigError)


def test_waiting_for_parts_returns_them_in_member_order_as_they_arrive_and_ignores_an_earlier_trys(tmp_path):
    store = CheckpointStore(str(tmp_path))
    root = store._path("step-00000002")
    write_part(store.fs, root, 1, spans_of(1), tag="g3")  # an earlier generation's try at this step
    late = threading.Timer(0.3, lambda: write_part(store.fs, root, 1, spans_of(1), tag="g5"))
    late.start()
    write_part(store.fs, root, 0, spans_of(0), tag="g5")
    markers = wait_for_parts(store.fs, root, 2, timeout=30, tag="g5")  # member 1's earlier marker is not this try's
    late.join()
    assert [(m["member"], m["tag"]) for m in markers] == [(0, "g5"), (1, "g5")]
    assert markers[1]["spans"] == [[0, 5, 10], [1, 2, 3]]
