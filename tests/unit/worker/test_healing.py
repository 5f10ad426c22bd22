"""Healing: who sends the training state to whom, and how the state travels."""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.worker import healing
from unbroken.errors import ConfigError, GenerationFailed
from unbroken.worker.healing import HealPlan, TensorSpec, plan

torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# -- plan ------------------------------------------------------------------------------------------


def test_at_the_start_all_members_are_fresh_so_rank_zero_sends_to_everyone():
    assert plan([(0, True)] * 4) == HealPlan(source=0, receivers=(1, 2, 3), step=0)


def test_a_single_fresh_member_has_nobody_to_heal():
    assert plan([(0, True)]) == HealPlan(source=0, receivers=(), step=0)


def test_members_in_step_need_no_healing():
    assert plan([(12, False)] * 3) == HealPlan(source=0, receivers=(), step=12)


def test_a_fresh_joiner_behind_the_others_receives_from_the_lowest_rank_at_the_top():
    assert plan([(7, False), (0, True), (7, False)]) == HealPlan(source=0, receivers=(1,), step=7)


def test_a_member_that_rejoins_behind_receives_even_if_it_is_not_fresh():
    assert plan([(3, False), (9, False), (9, False)]) == HealPlan(source=1, receivers=(0,), step=9)


def test_the_highest_committed_step_wins_when_some_members_committed_a_step_others_did_not():
    # Ranks 2 and 3 committed step 5 (next step 6); ranks 0 and 1 saw the allreduce fail.
    assert plan([(5, False), (5, False), (6, False), (6, False)]) == HealPlan(source=2, receivers=(0, 1), step=6)


def test_ties_at_the_highest_step_choose_the_lowest_rank():
    assert plan([(2, False), (4, False), (4, False), (4, False)]).source == 1


def test_a_member_holding_real_state_is_preferred_over_a_fresh_one_at_the_same_step():
    assert plan([(0, True), (0, False), (0, True)]) == HealPlan(source=1, receivers=(0, 2), step=0)


statuses = st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=1, max_size=10)


@settings(max_examples=200, deadline=None)
@given(statuses)
def test_the_plan_heals_exactly_the_members_behind_or_fresh_from_the_lowest_rank_at_the_top(table):
    result = plan(table)
    top = max(step for step, _ in table)
    best_fresh = all(fresh for step, fresh in table if step == top)
    candidates = [r for r, (step, fresh) in enumerate(table) if step == top and (best_fresh or not fresh)]
    assert result.step == top
    assert result.source == min(candidates)
    assert result.source not in result.receivers
    assert list(result.receivers) == sorted(result.receivers)
    for rank, (step, fresh) in enumerate(table):
        if rank == result.source:
            continue
        must_receive = step < top or fresh or best_fresh
        assert (rank in result.receivers) is must_receive
    # After healing every member holds the source's state: nobody is left behind.
    assert {table[r][0] for r in range(len(table)) if r not in result.receivers} == {top}


def test_a_member_at_the_same_step_with_another_history_receives_the_state():
    from unbroken.worker.healing import extend_digest, lineage_digest

    ours = lineage_digest([1, 1, 2])
    theirs = lineage_digest([1, 1, 3])  # step 2 committed in generation 3, not 2
    assert ours != theirs and extend_digest(lineage_digest([1, 1]), 2) == ours
    plan_ = plan([(3, False, ours), (3, False, theirs), (3, False, ours)])
    assert plan_.source == 0 and plan_.receivers == (1,)


# -- a state like a real one ----------------------------------------------------------------------


def _real_state() -> dict:
    """A training state as the runtime builds it, plus the awkward cases. Deterministic."""
    torch.manual_seed(0)
    random.seed(1)
    numpy.random.seed(2)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 600), torch.nn.Linear(600, 512)
    )  # the last weight is 1.2 MB: a large tensor
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    model(torch.randn(4, 16)).square().mean().backward()
    optimizer.step()
    scheduler.step()
    return {
        "model": model.state_dict(),  # an OrderedDict with _metadata; BatchNorm's int64 0-dim counter
        "optimizer": optimizer.state_dict(),  # Adam's 0-dim float32 steps; param_groups of plain values
        "scheduler": scheduler.state_dict(),
        "extra": None,
        "runtime": {"next_step": 17, "lineage": [1, 1, 2, 3]},
        "plan": {"global_batch_size": 64, "seed": 5, "dataset_len": 1000},
        "rng": healing.rng_state(),  # torch's uint8 tensor, python's tuple, numpy's tuple with an ndarray
        "odd": {
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "bf16": torch.randn(5, 7).to(torch.bfloat16),
            "f16": torch.randn(4).to(torch.float16),
            "bool": torch.rand(9) > 0.5,
            "int64": torch.arange(10),
            "transposed": torch.arange(12.0).reshape(3, 4).t(),
            "strided": torch.arange(100.0)[::3],
            "big transposed": torch.randn(700, 600).t(),  # 1.7 MB, not contiguous
            "nested": [(1, torch.tensor(2.0)), ("x", [torch.ones(2, 2, dtype=torch.float64)]), {"y": (None, 2.5)}],
        },
    }


def _assert_same(got, want, where="state"):
    """Equal structure, types, dtypes, shapes and values, exactly."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} is not {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
        assert torch.equal(got, want), f"{where}: values differ"
    elif isinstance(want, numpy.ndarray):
        assert got.dtype == want.dtype and numpy.array_equal(got, want), f"{where}: arrays differ"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} vs {list(want)}"
        assert getattr(got, "_metadata", None) == getattr(want, "_metadata", None), f"{where}: _metadata differs"
        for key in want:
            _assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} vs {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


class _Link:
    """A stand-in for a GenerationGroup of Gloo on the CPU between two ranks in one process: a
    send queues a copy of its tensor (from any device) under its tag, a receive takes the oldest
    one of its tag, which must have the same dtype and size (as Gloo requires). ``cut_after``
    receives, the link fails."""

    def __init__(self, cut_after: int | None = None) -> None:
        self.queues: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.log: list[tuple] = []
        self.cut_after = cut_after
        self.received = 0

    def send(self, tensor, dst, tag, what):
        # as GenerationGroup.send on a Gloo group: a tensor on another device goes through a copy
        assert tensor.is_contiguous() and tensor.numel() > 0
        self.queues[tag].append(tensor.to("cpu", copy=True))
        self.log.append(("send", tag, tensor.numel() * tensor.element_size(), tensor.data_ptr()))

    def recv(self, tensor, src, tag, what):
        if self.cut_after is not None and self.received >= self.cut_after:
            raise GenerationFailed(f"generation 1: {what} failed: Connection closed by peer")
        item = self.queues[tag].popleft()
        assert (item.dtype, item.numel()) == (tensor.dtype, tensor.numel()), f"{what}: {item.dtype}[{item.numel()}] into {tensor.dtype}[{tensor.numel()}]"
        tensor.copy_(item)
        self.received += 1


def _round_trip(state, link=None):
    link = link or _Link()
    sent = healing.send_state(link, state, 1)
    back, received = healing.recv_state(link, 0)
    assert sent == received
    assert not any(link.queues.values()), "messages left unread"
    return back, received, link


@contextlib.contextmanager
def _sizes(large, pack, message):
    saved = healing.LARGE_BYTES, healing.PACK_BYTES, healing.MESSAGE_BYTES
    healing.LARGE_BYTES, healing.PACK_BYTES, healing.MESSAGE_BYTES = large, pack, message
    try:
        yield
    finally:
        healing.LARGE_BYTES, healing.PACK_BYTES, healing.MESSAGE_BYTES = saved


# -- skeleton and messages (pure) ------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]


def _tensor(dtype, shape, seed, transpose):
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        tensor = torch.randn(shape, generator=generator).to(dtype)
    else:
        tensor = torch.randint(0, 100, shape, generator=generator).to(dtype)
    return tensor.transpose(0, 1) if transpose and tensor.dim() >= 2 else tensor


tensors = st.builds(
    _tensor, st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3).map(tuple), st.integers(0, 10_000), st.booleans()
)
leaves = tensors | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4) | st.none() | st.booleans()
structures = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=4)
    | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=4), children, max_size=4)
    | st.dictionaries(st.text(max_size=4), children, max_size=4).map(collections.OrderedDict),
    max_leaves=25,
)


@settings(max_examples=200, deadline=None)
@given(structures)
def test_a_state_split_into_skeleton_and_tensors_joins_back_to_an_equal_state(state):
    skeleton, parts = healing.split(state)
    assert all(isinstance(t, torch.Tensor) for t in parts)
    assert skeleton.specs == tuple(TensorSpec(t.dtype, tuple(t.shape)) for t in parts)
    # the receiver's tensors are its own, contiguous copies
    _assert_same(healing.join(skeleton, [t.contiguous().clone() for t in parts]), state)


@settings(max_examples=200, deadline=None)
@given(structures)
def test_any_state_survives_the_transfer_in_slices_and_packs(state):
    with _sizes(large=64, pack=200, message=96):  # tiny thresholds: every path is taken
        back, _, _ = _round_trip({"x": state})
    _assert_same(back, {"x": state})


def test_the_skeleton_holds_no_tensor_data_and_keeps_plain_leaves_out_of_the_tensor_path():
    state = _real_state()
    skeleton, parts = healing.split(state)
    assert sum(spec.nbytes for spec in skeleton.specs) > 3_000_000
    assert len(skeleton.body) < 20_000  # python's and numpy's RNG states are its bulk
    assert all(type(t) is torch.Tensor for t in parts)  # the ndarray of numpy's RNG state is not one


def test_one_tensor_object_met_twice_is_sent_once_and_arrives_as_one_object():
    shared = torch.arange(4.0)
    base = torch.arange(6.0)
    view = base[2:]
    skeleton, parts = healing.split({"a": shared, "b": [shared], "base": base, "view": view})
    assert len(parts) == 3
    back, _, _ = _round_trip({"a": shared, "b": [shared], "base": base, "view": view})
    assert back["a"] is back["b"][0]
    # storage shared in the sender is not in the receiver: the view arrives as its own tensor
    assert torch.equal(back["view"], view) and back["view"].untyped_storage().data_ptr() != back["base"].untyped_storage().data_ptr()


def test_join_refuses_tensors_that_do_not_match_the_skeleton():
    skeleton, parts = healing.split({"x": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="tensor 0 is torch.float64"):
        healing.join(skeleton, [torch.zeros(2, 3, dtype=torch.float64)])
    with pytest.raises(ValueError, match="holds 1 tensors, got 0"):
        healing.join(skeleton, [])


specs = st.lists(
    st.builds(TensorSpec, st.sampled_from(DTYPES), st.lists(st.integers(0, 700), max_size=2).map(tuple)), max_size=30
)


@settings(max_examples=300, deadline=None)
@given(specs)
def test_messages_carry_every_element_once_large_tensors_in_slices_small_ones_in_packs_of_one_dtype(table):
    table = tuple(table)
    with _sizes(large=4096, pack=20_000, message=50_000):
        plan_ = healing.messages(table)
        pieces = collections.defaultdict(list)  # index: [(start, count)] of the elements sent
        for message in plan_:
            if message[0] == "slice":
                _, index, start, count = message
                assert table[index].nbytes >= healing.LARGE_BYTES
                assert 0 < count * table[index].dtype.itemsize <= healing.MESSAGE_BYTES
                pieces[index].append((start, count))
            else:
                _, dtype, indices = message
                assert all(table[i].dtype == dtype and 0 < table[i].nbytes < healing.LARGE_BYTES for i in indices)
                assert len(indices) == 1 or sum(table[i].nbytes for i in indices) <= healing.PACK_BYTES
                for i in indices:
                    pieces[i].append((0, table[i].numel))
    assert set(pieces) == {i for i, spec in enumerate(table) if spec.numel > 0}
    for index, sent in pieces.items():  # the pieces of each tensor tile it exactly
        ends = [0]
        for start, count in sorted(sent):
            assert start == ends[-1]
            ends.append(start + count)
        assert ends[-1] == table[index].numel


# -- the transfer, in one process ------------------------------------------------------------------


def test_a_real_state_arrives_exactly():
    state = _real_state()
    back, received, link = _round_trip(state)
    _assert_same(back, state)
    assert received == sum(entry[2] for entry in link.log)
    assert received >= sum(spec.nbytes for spec in healing.split(state)[0].specs)


def test_large_contiguous_tensors_are_sent_from_their_own_memory_in_slices():
    big = torch.randn(40 << 20 >> 2)  # 40 MiB of float32
    with _sizes(large=1 << 20, pack=16 << 20, message=16 << 20):
        _, _, link = _round_trip({"w": big})
    slices = [entry for entry in link.log if entry[1] == healing.TAG_TENSOR]
    assert [size for _, _, size, _ in slices] == [16 << 20, 16 << 20, 8 << 20]
    assert [ptr for _, _, _, ptr in slices] == [big.data_ptr() + k * (16 << 20) for k in range(3)]


def test_thousands_of_small_tensors_go_in_a_few_messages():
    state = {f"t{i}": torch.full((10,), float(i)) for i in range(5000)} | {"flags": [torch.tensor(True)] * 3}
    back, _, link = _round_trip(state)
    _assert_same(back, state)
    assert [tag for _, tag, _, _ in link.log] == [healing.TAG_HEADER, healing.TAG_MANIFEST, healing.TAG_PACK, healing.TAG_PACK]


def test_on_started_comes_once_after_the_manifest_and_progress_after_every_message():
    events = []

    class Recording(_Link):
        def send(self, tensor, dst, tag, what):
            super().send(tensor, dst, tag, what)
            events.append(tag)

    link = Recording()
    healing.send_state(link, _real_state(), 1, on_started=lambda: events.append("started"), progress=lambda: events.append("progress"))
    tags = [e for e in events if isinstance(e, int)]
    assert events.count("started") == 1 and events.count("progress") == len(tags) >= 4
    assert events[:5] == [healing.TAG_HEADER, "progress", healing.TAG_MANIFEST, "progress", "started"]
    received = []
    healing.recv_state(link, 0, progress=lambda: received.append(1))
    assert len(received) == len(tags)


def test_a_transfer_cut_short_raises_and_returns_nothing():
    link = _Link(cut_after=3)
    healing.send_state(link, _real_state(), 1)
    with pytest.raises(GenerationFailed, match="Connection closed"):
        healing.recv_state(link, 0)


def test_a_cut_transfer_empties_the_warm_memory_it_was_landing_in():
    """A receive left posted by a failed heal may still write into the warm tensors it was
    landing in, so they must never become the model's memory in a later heal."""
    state = {"w": torch.randn(1 << 19), "b": torch.randn(8)}  # 2 MB: a large tensor, sliced
    into = {("w",): torch.zeros(1 << 19)}
    with _sizes(large=1 << 20, pack=16 << 20, message=1 << 19):
        link = _Link(cut_after=3)  # header, manifest, one slice of four: then the link fails
        healing.send_state(link, state, 1)
        with pytest.raises(GenerationFailed):
            healing.recv_state(link, 0, into=into)
    assert into == {}
    back, _, _ = _round_trip(state)  # and the next heal, into new memory, is whole
    _assert_same(back, state)


def test_lanes_only_for_a_gloo_group_more_than_one_and_a_state_with_large_tensors():
    from types import SimpleNamespace

    from unbroken.worker.heal_lanes import lanes_for

    gloo, nccl = SimpleNamespace(backend="gloo"), SimpleNamespace(backend="nccl")
    sliced, packed = [("pack", torch.float32, (0,)), ("slice", 1, 0, 10)], [("pack", torch.float32, (0, 1))]
    assert lanes_for(gloo, 2, sliced) == 2 and lanes_for(gloo, 3, sliced) == 3
    assert lanes_for(gloo, 1, sliced) == lanes_for(nccl, 2, sliced) == lanes_for(_Link(), 2, sliced) == 0
    assert lanes_for(gloo, 2, packed) == 0  # nothing to stripe: no group made for it


def test_a_sender_of_another_state_version_is_refused_with_a_clear_error():
    link = _Link()
    healing.send_state(link, {"x": torch.ones(3)}, 1)
    link.queues[healing.TAG_HEADER][0][1] += 1
    with pytest.raises(ConfigError, match=f"version {healing.STATE_VERSION + 1} from rank 0 is not {healing.STATE_VERSION}"):
        healing.recv_state(link, 0)


def test_a_header_that_is_not_a_healing_header_is_refused():
    link = _Link()
    healing.send_state(link, {"x": torch.ones(3)}, 1)
    link.queues[healing.TAG_HEADER][0][0] = 12345
    with pytest.raises(ConfigError, match="does not start with a healing header"):
        healing.recv_state(link, 0)


def test_rng_state_travels_with_the_state_and_restores_the_random_streams():
    torch.manual_seed(1)
    random.seed(2)
    numpy.random.seed(3)
    sent = {"rng": healing.rng_state()}
    expected = (torch.rand(3).tolist(), random.random(), numpy.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    numpy.random.seed(99)
    back, _, _ = _round_trip(sent)
    healing.set_rng_state(back["rng"])
    assert (torch.rand(3).tolist(), random.random(), numpy.random.rand()) == expected


def test_faulting_in_pages_ahead_of_the_data_never_changes_what_is_already_there():
    tensors = [torch.arange(3 << 20, dtype=torch.float32) for _ in range(3)] + [torch.empty(0), torch.ones(5)]
    expected = [t.clone() for t in tensors]
    prefault = healing._Prefault(tensors)
    tensors[0].mul_(2)  # written while the helper thread may run over it
    expected[0].mul_(2)
    if prefault._thread is not None:
        prefault._thread.join(timeout=30)
        assert not prefault._thread.is_alive()
    prefault.stop()
    for got, want in zip(tensors, expected):
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_tensors_arrive_on_the_cpu():
    state = {"w": torch.randn(300, 1000, device="cuda"), "s": torch.tensor(2.0, device="cuda")}
    back, _, _ = _round_trip(state)
    _assert_same(back, {k: v.cpu() for k, v in state.items()})


# -- the transfer between two processes over a real Gloo group -------------------------------------


def _worker(role: str, port: str, out: str, timeout: str, die: str = "0", lanes: str = "2") -> None:
    """One end of a transfer (run in a child process): rank 0 sends, rank 1 receives; the
    result goes to ``out`` (JSON), a received state to ``out``.pt."""
    from unbroken.worker.group import GenerationGroup
    import torch.distributed as dist

    parent = os.getppid()

    def orphaned() -> None:  # never outlive the test
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(3)

    threading.Thread(target=orphaned, daemon=True).start()
    torch.set_num_threads(1)
    rank = 0 if role == "send" else 1
    store = dist.TCPStore("127.0.0.1", int(port), is_master=False, timeout=datetime.timedelta(seconds=float(timeout)))
    group = GenerationGroup(1, rank, 2, ["sender", "receiver"], lambda: None, threading.Event(), float(timeout))
    group.connect(store, "heal-test/", "127.0.0.1")
    result: dict = {}
    healing.MESSAGE_BYTES = 256 << 10  # the two large tensors in 12 slices: several on each lane
    count = [0]

    def progress() -> None:
        count[0] += 1

    if role == "send":
        kill = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if die == "1" else (lambda: None)
        result["bytes"] = healing.send_state(group, _real_state(), 1, on_started=kill, progress=progress, lanes=int(lanes))
    else:
        started = time.monotonic()
        try:
            state, result["bytes"] = healing.recv_state(group, 0, progress=progress)
            torch.save(state, out + ".pt")
        except GenerationFailed as exc:
            result["error"] = str(exc)
        result["seconds"] = time.monotonic() - started
    result["messages"] = count[0]
    result["lane_groups"] = len(group.side_groups)
    if "error" not in result:
        group.allreduce(torch.zeros(1), "done")  # neither end leaves before the other is done
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    os._exit(0)  # a Gloo group alive at exit can abort the interpreter


def _transfer(tmp_path, timeout: float, die: bool = False, lanes: int = 2) -> tuple[dict, dict]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    code = "import sys; from tests.unit.worker.test_healing import _worker; _worker(*sys.argv[1:])"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    children: list[subprocess.Popen] = []
    try:
        for role in ("send", "recv"):
            with open(tmp_path / f"{role}.log", "w") as log:
                args = [role, str(store.port), str(tmp_path / f"{role}.json"), str(timeout), "1" if die else "0", str(lanes)]
                children.append(subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 90
        for child in children:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    logs = {role: (tmp_path / f"{role}.log").read_text() for role in ("send", "recv")}
    results = {}
    for role in ("send", "recv"):
        path = tmp_path / f"{role}.json"
        results[role] = json.loads(path.read_text()) if path.exists() else None
    assert results["recv"] is not None, f"the receiver reported nothing:\n{logs}"
    return results, logs


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_a_real_state_crosses_a_real_gloo_group_between_two_processes_exactly(tmp_path, lanes):
    """Over the group alone (1 lane) or over parallel connections made for the heal (the large
    tensors' slices, several in flight on each lane, :mod:`unbroken.worker.heal_lanes`)."""
    results, logs = _transfer(tmp_path, timeout=30.0, lanes=lanes)
    assert results["send"] is not None and "error" not in results["recv"], logs
    assert results["recv"]["bytes"] == results["send"]["bytes"]
    assert results["recv"]["messages"] == results["send"]["messages"] > 12, results  # every message reported once
    assert results["send"]["lane_groups"] == results["recv"]["lane_groups"] == (0 if lanes == 1 else 1), results
    back = torch.load(tmp_path / "recv.json.pt", weights_only=False)
    _assert_same(back, _real_state())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sender_killed_after_the_manifest_makes_the_receiver_fail_within_the_timeout_without_a_state(tmp_path):
    timeout = 5.0
    results, logs = _transfer(tmp_path, timeout=timeout, die=True)
    assert results["send"] is None  # it died in on_started
    recv = results["recv"]
    assert "error" in recv and "healing transfer" in recv["error"], logs
    assert recv["seconds"] < timeout + 2.0
    assert recv["messages"] <= 2  # header and manifest at most: no tensor came
    assert not (tmp_path / "recv.json.pt").exists()


class _Code:
    """An object whose unpickling would run code."""

    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_healing_skeleton_that_names_code_to_run_is_refused_not_executed(capsys):
    skeleton, tensors = healing.split({"model": {"w": torch.ones(2)}, "extra": _Code()})
    with pytest.raises(Exception, match="builtins.print, which is not plain data"):
        healing.join(skeleton, tensors)
    assert "this must never run" not in capsys.readouterr().out


def test_the_rng_state_is_plain_data_and_round_trips_numpy_too():
    import numpy

    numpy.random.seed(3)
    state = healing.rng_state()
    expected = numpy.random.rand(3)
    assert isinstance(state["numpy"][1], list)
    healing.set_rng_state(state)
    assert (numpy.random.rand(3) == expected).all()


def test_state_digest_is_equal_for_equal_states_whatever_their_rng_and_differs_on_one_bit():
    def state(seed: int, noise: float = 0.0):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        with torch.no_grad():
            model[0].weight[0, 0] += noise
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "runtime": {"next_step": 0}, "rng": healing.rng_state()}

    a, b = state(0), state(0)
    torch.randn(5)  # another RNG position: not part of the digest
    b["rng"] = healing.rng_state()
    # nor the checkpoint schedule's history: two processes started a moment apart count other seconds
    a["runtime"]["checkpoint_schedule"] = {"losses": 0, "seconds": 0.123}
    b["runtime"]["checkpoint_schedule"] = {"losses": 0, "seconds": 0.456}
    assert healing.state_digest(a) == healing.state_digest(b)
    assert healing.state_digest(a) != healing.state_digest(state(0, noise=1e-7))
    assert healing.state_digest(a) != healing.state_digest(state(1))
    assert healing.state_digest({"x": torch.zeros(2)}) != healing.state_digest({"x": torch.zeros(2, dtype=torch.float64)})
    assert healing.state_digest({"x": torch.zeros(2)}) != healing.state_digest({"x": torch.zeros(1, 2)})
    assert 0 <= healing.state_digest(a) < 2**63


# -- the fan-out ---------------------------------------------------------------------------------


@given(st.integers(min_value=1, max_value=300), st.data())
@settings(max_examples=200, deadline=None)
def test_the_fan_out_heals_every_receiver_once_from_a_holder_in_log_rounds(size, data):
    source = data.draw(st.integers(min_value=0, max_value=size - 1))
    others = [r for r in range(size) if r != source]
    receivers = tuple(sorted(data.draw(st.sets(st.sampled_from(others), max_size=len(others))) if others else ()))
    schedule = healing.rounds(HealPlan(source, receivers, 5), size)
    holders = {r for r in range(size) if r not in receivers}
    healed = []
    for pairs in schedule:
        busy = [r for pair in pairs for r in pair]
        assert len(busy) == len(set(busy)), "a member sends or receives twice in one round"
        for sender, receiver in pairs:
            assert sender in holders, "a member sends before it holds the state"
            assert receiver not in holders
        holders |= {receiver for _, receiver in pairs}
        healed += [receiver for _, receiver in pairs]
    assert sorted(healed) == sorted(receivers)
    start = size - len(receivers)  # the holders before the first round: each round doubles them
    depth = 0
    while start << depth < size:
        depth += 1
    assert len(schedule) == depth  # 1 source and 15 receivers: 4 rounds, not 15 transfers


def test_receivers_send_on_in_later_rounds():
    schedule = healing.rounds(HealPlan(0, tuple(range(1, 8)), 3), 8)
    assert schedule == [[(0, 1)], [(0, 2), (1, 3)], [(0, 4), (1, 5), (2, 6), (3, 7)]]
