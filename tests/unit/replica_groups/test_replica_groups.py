"""Replica groups (issue 18): the data plan split per group and process, the group shape check, and
the local shards of an FSDP2 module (one process, a 1-rank Gloo group over a FileStore)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.data.data_plan import DataPlan
from unbroken.errors import ConfigError
from unbroken.replica_groups.sharding import (
    GroupMismatch,
    GroupShape,
    ProcessPlan,
    check_groups_match,
    load_local_state_shards,
    local_gradient_shards,
    local_state_shards,
    process_micro_batches,
    process_share,
    sharded_parameters,
    sharding_fingerprint,
    state_layout,
    sum_gradients,
)

torch.set_num_threads(1)

FAST = settings(max_examples=80, deadline=None)


def _positions(ranges) -> list[int]:
    return [p for r in ranges for p in r]


# -- the data plan split ---------------------------------------------------------------------------


@FAST
@given(g=st.integers(1, 64), n=st.integers(1, 12), k=st.integers(1, 9), step=st.integers(0, 10_000), m=st.integers(1, 20))
def test_the_processes_of_all_groups_cover_the_step_exactly_once(g, n, k, step, m):
    plan = DataPlan(dataset_len=100, global_batch_size=g, micro_batch_size=m)
    parts = [process_share(plan, step, gi, n, j, k) for gi in range(n) for j in range(k)]
    assert _positions(parts) == list(range(step * g, (step + 1) * g))  # in order, each once
    micro = [process_micro_batches(plan, step, gi, n, j, k) for gi in range(n) for j in range(k)]
    assert _positions(mb for mbs in micro for mb in mbs) == list(range(step * g, (step + 1) * g))


@FAST
@given(g=st.integers(1, 64), n=st.integers(1, 12), k=st.integers(1, 9), step=st.integers(0, 1000), m=st.integers(1, 20))
def test_the_plan_a_process_of_a_group_runs_with_is_its_part_of_the_group_s_share(g, n, k, step, m):
    # the runtime's step and loader ask a ProcessPlan for member (group) gi of n, as they ask a plain plan
    plan = DataPlan(dataset_len=100, global_batch_size=g, micro_batch_size=m, seed=3)
    for gi in range(n):
        for j in range(k):
            mine = ProcessPlan(100, g, m, 3, group_size=k, process=j)
            assert mine.share(step, gi, n) == process_share(plan, step, gi, n, j, k)
            assert mine.micro_batches(step, gi, n) == process_micro_batches(plan, step, gi, n, j, k)
            assert mine.indices(mine.share(step, gi, n)).tolist() == plan.indices(process_share(plan, step, gi, n, j, k)).tolist()
    with pytest.raises(ValueError, match="process index 2"):
        ProcessPlan(100, g, m, 3, group_size=2, process=2)


@FAST
@given(g=st.integers(1, 64), n=st.integers(1, 12), k=st.integers(1, 9), m=st.integers(1, 20))
def test_a_group_shares_as_a_member_does_and_its_processes_split_it_contiguously(g, n, k, m):
    plan = DataPlan(dataset_len=100, global_batch_size=g, micro_batch_size=m)
    for gi in range(n):
        parts = [process_share(plan, 3, gi, n, j, k) for j in range(k)]
        assert _positions(parts) == list(plan.share(3, gi, n))
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@FAST
@given(g=st.integers(1, 64), n=st.integers(1, 12), k=st.integers(1, 9), m=st.integers(1, 20))
def test_every_process_of_a_group_runs_the_same_number_of_micro_batches_none_too_large(g, n, k, m):
    plan = DataPlan(dataset_len=100, global_batch_size=g, micro_batch_size=m)
    for gi in range(n):
        counts = set()
        for j in range(k):
            mbs = process_micro_batches(plan, 5, gi, n, j, k)
            counts.add(len(mbs))
            assert all(len(mb) <= m for mb in mbs)
            assert _positions(mbs) == list(process_share(plan, 5, gi, n, j, k))
        assert len(counts) == 1 and counts.pop() >= 1


def test_one_group_of_one_process_is_the_plain_data_plan():
    plan = DataPlan(dataset_len=50, global_batch_size=17, micro_batch_size=5)
    assert process_share(plan, 4, 0, 1, 0, 1) == plan.share(4, 0, 1)
    assert process_micro_batches(plan, 4, 0, 1, 0, 1) == plan.micro_batches(4, 0, 1)


def test_more_processes_than_samples_get_empty_micro_batches():
    plan = DataPlan(dataset_len=50, global_batch_size=3, micro_batch_size=2)
    mbs = [process_micro_batches(plan, 0, g, 2, j, 2) for g in range(2) for j in range(2)]
    assert [len(m) for m in mbs] == [1, 1, 1, 1]
    assert [len(m[0]) for m in mbs] == [1, 1, 1, 0]


def test_a_process_index_outside_the_group_is_refused():
    plan = DataPlan(dataset_len=50, global_batch_size=8, micro_batch_size=2)
    with pytest.raises(ValueError, match="process index 2"):
        process_share(plan, 0, 0, 2, 2, 2)
    with pytest.raises(ValueError):
        process_micro_batches(plan, 0, 0, 2, -1, 2)


# -- the group shape check -------------------------------------------------------------------------


def test_groups_of_the_same_shape_pass():
    shape = GroupShape(2, "abc")
    assert check_groups_match({"a": shape, "b": GroupShape(2, "abc")}) == shape


def test_a_group_of_another_size_is_refused_naming_the_sizes():
    with pytest.raises(GroupMismatch) as info:
        check_groups_match({"a": GroupShape(2, "x"), "b": GroupShape(3, "y"), "c": GroupShape(2, "x")})
    message = str(info.value)
    assert "group 'b' has 3 processes but the job's groups have 2" in message
    assert "--group-size 2" in message
    assert isinstance(info.value, ConfigError)


def test_the_expected_shape_wins_over_the_majority():
    with pytest.raises(GroupMismatch, match="group 'a' has 2 processes but the job's groups have 4"):
        check_groups_match({"a": GroupShape(2), "b": GroupShape(2)}, expected=GroupShape(4))


def test_a_group_sharded_differently_is_refused():
    with pytest.raises(GroupMismatch, match="shards the model differently"):
        check_groups_match({"a": GroupShape(2, "x"), "b": GroupShape(2, "y")}, expected=GroupShape(2, "x"))


# -- local shards of an FSDP2 module (a one-process group) -----------------------------------------


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized(), "a process group already exists in this process (tests/conftest.py names the test that leaked it)"
    store = dist.FileStore(os.fspath(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    finally:
        dist.destroy_process_group()


def _sharded_model(mesh, seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6, dtype=torch.float64), torch.nn.Tanh(),
                                torch.nn.Linear(6, 2, dtype=torch.float64), torch.nn.BatchNorm1d(2, dtype=torch.float64))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return sum_gradients(model)


def _train_once(model, opt):
    model(torch.ones(3, 4, dtype=torch.float64)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_gradient_shards_are_the_local_tensors_of_the_dtensor_grads(one_rank_group):
    model = _sharded_model(one_rank_group)
    assert local_gradient_shards(model) == [None] * 6
    model(torch.ones(3, 4, dtype=torch.float64)).pow(2).sum().backward()
    names = [n for n, _ in sharded_parameters(model)]
    assert names == [n for n, _ in model.named_parameters()]
    shards = local_gradient_shards(model)
    for (_, p), s in zip(sharded_parameters(model), shards):
        assert type(p.grad).__name__ == "DTensor" and s is p.grad._local_tensor
    shards[0].mul_(0).add_(7.0)  # in place: the allreduce's result reaches the gradient
    assert torch.equal(model[0].weight.grad.to_local(), torch.full_like(shards[0], 7.0))


def test_state_shards_move_to_a_fresh_process_and_its_fresh_optimizer(one_rank_group):
    live = _sharded_model(one_rank_group, seed=0)
    live_opt = torch.optim.AdamW(live.parameters(), lr=0.1)
    _train_once(live, live_opt)
    sent = {k: v.clone() for k, v in local_state_shards(live, live_opt).items()}
    assert "model/3.running_mean" in sent and "optim/0.weight/exp_avg" in sent and "optim/0.weight/step" in sent

    fresh = _sharded_model(one_rank_group, seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert sharding_fingerprint(fresh) == sharding_fingerprint(live)
    load_local_state_shards(fresh, fresh_opt, sent)
    got = local_state_shards(fresh, fresh_opt)
    assert state_layout(got) == state_layout(sent)
    assert all(torch.equal(got[k], sent[k]) for k in sent)
    assert fresh_opt.param_groups[0]["lr"] == 0.1
    _train_once(live, live_opt)  # and the next step stays identical
    _train_once(fresh, fresh_opt)
    after_live, after_fresh = local_state_shards(live, live_opt), local_state_shards(fresh, fresh_opt)
    assert all(torch.equal(after_live[k], after_fresh[k]) for k in after_live)


def test_shards_of_another_layout_are_refused_before_anything_is_written(one_rank_group):
    model = _sharded_model(one_rank_group)
    before = {k: v.clone() for k, v in local_state_shards(model).items()}
    wrong = dict(before)
    wrong["model/0.weight"] = torch.zeros(5, 4, dtype=torch.float64)
    wrong["model/2.bias"] = torch.full((2,), 9.0, dtype=torch.float64)
    with pytest.raises(GroupMismatch, match="model/0.weight"):
        load_local_state_shards(model, None, wrong)
    assert all(torch.equal(before[k], v) for k, v in local_state_shards(model).items())
    with pytest.raises(GroupMismatch, match="missing"):
        load_local_state_shards(model, None, {k: v for k, v in before.items() if k != "model/2.bias"})


def test_the_fingerprint_sees_a_different_model():
    a = torch.nn.Linear(4, 6)
    b = torch.nn.Linear(4, 7)
    assert sharding_fingerprint(a) != sharding_fingerprint(b)
    assert sharding_fingerprint(a) == sharding_fingerprint(torch.nn.Linear(4, 6))
