"""The gradient reducer's buckets: order, presence, control slots, and fresh buffers after an
abandoned generation."""

import torch

from unbroken.gradients import GradientReducer


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
