"""The gradient reducer's buckets: order, presence, control slots, and fresh buffers after an
abandoned generation."""

import threading
import types

import pytest
import torch

from unbroken.worker.gradients import GradientReducer


def _run_members(member, groups, errors) -> None:
    """Run ``member(group)`` for every member on threads of their own (bounded); fail on any error."""
    threads = [threading.Thread(target=member, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a member did not finish within 60 s"
    assert not errors, errors


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))


def test_buckets_hold_every_parameter_once_in_reverse_order_with_a_small_first_bucket():
    m = model()
    reducer = GradientReducer(list(m.parameters()), bucket_cap_bytes=1 << 20, first_bucket_cap_bytes=200)
    flat = [p for b in reducer.buckets for p in b.params]
    assert [id(p) for p in flat] == [id(p) for p in reversed(list(m.parameters()))]
    assert len(reducer.buckets) >= 2 and reducer.buckets[0].control and not reducer.buckets[1].control


def test_pack_and_unpack_round_trip_and_keep_missing_gradients_missing():
    m = model()
    reducer = GradientReducer(list(m.parameters()), bucket_cap_bytes=1 << 20)
    params = list(m.parameters())
    for p in params[:-1]:
        p.grad = torch.randn_like(p)
    expected = [p.grad.clone() for p in params[:-1]]
    for bucket in reducer.buckets:
        bucket.pack()
    for p in params:
        p.grad = None
    for bucket in reducer.buckets:
        bucket.unpack()
    assert all(torch.equal(p.grad, e) for p, e in zip(params[:-1], expected))
    assert params[-1].grad is None


def test_an_abandoned_generation_leaves_its_buffers_behind():
    m = model()
    reducer = GradientReducer(list(m.parameters()), bucket_cap_bytes=1 << 20)
    old = [b.flat for b in reducer.buckets]
    reducer.renew_buffers()
    for before, bucket in zip(old, reducer.buckets):
        assert bucket.flat.shape == before.shape
        assert bucket.flat.untyped_storage().data_ptr() != before.untyped_storage().data_ptr()
        before.fill_(7.0)  # what a stale collective writes later must not reach the new buffer
        assert not bucket.flat.eq(7.0).any()


@pytest.mark.parametrize("backend, order", [("gloo", ["works let go", "parked"]), ("nccl", ["parked", "works let go"])])
def test_a_gloo_step_lets_go_of_its_works_before_the_group_is_parked(backend, order):
    """Once parked, the graveyard may drop a broken Gloo group at once; a work dropped after that
    holds the last reference to its context, whose destructor waited 20 s on Gloo's threads in
    the join. NCCL keeps abort-then-renew (the aborted work lets go of its GPU buffers first)."""
    from unbroken.worker.runtime import Job

    seen = []
    job = Job.__new__(Job)
    job._joiner = types.SimpleNamespace(group=types.SimpleNamespace(backend=backend),
                                        abandon=lambda reason: seen.append("parked"))
    job._reducer = types.SimpleNamespace(renew_buffers=lambda: seen.append("works let go"))
    job._abandon("a peer was lost")
    assert seen == order


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_control_slots_sum_exactly_whatever_the_parameters_dtype(dtype):
    """Two members reduce a token-style count and loss sum: the sums are exact, as a single
    process would count them. In the first bucket's dtype, float16 made a count of 100,003 inf
    and bfloat16 rounded it to 99,840."""
    from tests.unit.worker.test_rendezvous import _form

    master, groups, _ = _form(2, prefix="control")
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def member(group):
        try:
            m = model().to(dtype)
            reducer = GradientReducer(list(m.parameters()), bucket_cap_bytes=1 << 20)
            for p in m.parameters():
                p.grad = torch.ones_like(p)
            reducer.arm(group, reconfigure=group.rank == 1, weighted_loss=torch.tensor(70000.25 + group.rank, dtype=dtype),
                        count=100003.0 + group.rank)
            results[group.rank] = (reducer.finish(), [p.grad.float().unique().tolist() for p in m.parameters()])
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    try:
        _run_members(member, groups, errors)
        loss = float(torch.tensor(70000.25, dtype=dtype).double() + torch.tensor(70001.25, dtype=dtype).double())
        for rank in (0, 1):
            (flag, loss_sum, count, counting, stop), grads = results[rank]
            assert (flag, count, counting, stop) == (1.0, 200007.0, 2.0, 0.0), (rank, flag, count, counting)
            assert loss_sum == loss, (rank, loss_sum, loss)  # each member's loss as given, summed exactly
            assert all(g == [2.0] for g in grads), grads  # the gradients still reduce in their own dtype
    finally:
        for g in groups:
            g.pg = None


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("pace_float64", [False, True])
def test_the_pace_exchange_rides_with_the_control_slots_exactly_and_costs_no_collective_of_its_own(dtype, pace_float64):
    """Each member's pace and its split's digest (below 2**40) come back exactly as that member
    wrote them, on every member; without ``pace_float64`` (a replica group's power means) they
    take no allreduce of their own: an extra collective every step made a healthy 6 ms step on 3
    CPU workers 1.5x plain DDP's. Two steps with different member counts (pace widths) in a row."""
    from tests.unit.worker.test_rendezvous import _form

    master, groups, _ = _form(2, prefix=f"pace{dtype}{pace_float64}")
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    digest = (1 << 40) - 12345  # what data_plan.Split.digest() can be: up to 40 bits

    def member(group):
        try:
            calls = []
            start = group.start_allreduce
            group.start_allreduce = lambda t: calls.append(t.numel()) or start(t)
            m = model().to(dtype)
            reducer = GradientReducer(list(m.parameters()), bucket_cap_bytes=1 << 20)
            seen = []
            for width in (2, 3, 2):  # members in the exchange (a third slot: a member that measured nothing)
                for p in m.parameters():
                    p.grad = torch.ones_like(p)
                pace = [0.0] * (2 * width)
                pace[group.rank] = 0.000123456789 * (group.rank + 1)
                pace[width + group.rank] = float(digest)
                calls.clear()
                reducer.arm(group, reconfigure=False, weighted_loss=None, count=7.0, pace=pace, pace_float64=pace_float64)
                sums = reducer.finish()
                seen.append((list(reducer.paces), sums[2], len(calls), [p.grad.float().unique().tolist() for p in m.parameters()]))
            results[group.rank] = seen
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    try:
        _run_members(member, groups, errors)
        assert results[0] == results[1]  # every member takes the same numbers
        buckets = len(GradientReducer(list(model().to(dtype).parameters()), bucket_cap_bytes=1 << 20).buckets)
        own_control = dtype == torch.float16
        for (paces, count, collectives, grads), width in zip(results[0], (2, 3, 2)):
            wanted = [0.0] * (2 * width)
            for rank in (0, 1):
                wanted[rank] = 0.000123456789 * (rank + 1)
                wanted[width + rank] = float(digest)
            if dtype == torch.float32 and not pace_float64:  # the paces in float32, the digests exact
                wanted[:width] = [float(torch.tensor(v, dtype=torch.float32)) for v in wanted[:width]]
            assert paces == wanted
            assert count == 14.0 and all(g == [2.0] for g in grads)
            assert collectives == buckets + own_control + (pace_float64 and not own_control)
    finally:
        for g in groups:
            g.pg = None
