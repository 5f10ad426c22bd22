"""The data plan: a pure map from (seed, step, member index, member count) to sample indices."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.data.data_plan import DataPlan
from unbroken.errors import ConfigError

torch.set_num_threads(1)

FAST = settings(max_examples=60, deadline=None)

plans = st.builds(
    DataPlan,
    dataset_len=st.integers(1, 120),
    global_batch_size=st.integers(1, 48),
    micro_batch_size=st.integers(1, 48),
    seed=st.integers(-(2**40), 2**40),
)


def _positions(ranges) -> list[int]:
    return [p for r in ranges for p in r]


# -- shares and micro-batches ----------------------------------------------------------------------


@FAST
@given(plan=plans, step=st.integers(0, 10_000), count=st.integers(1, 70))
def test_shares_partition_the_global_batch(plan, step, count):
    g = plan.global_batch_size
    shares = [plan.share(step, i, count) for i in range(count)]
    assert _positions(shares) == list(range(step * g, (step + 1) * g))


@FAST
@given(plan=plans, step=st.integers(0, 10_000), count=st.integers(1, 70))
def test_share_sizes_differ_by_at_most_one_and_never_grow_with_the_index(plan, step, count):
    sizes = [len(plan.share(step, i, count)) for i in range(count)]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert sum(sizes) == plan.global_batch_size


@FAST
@given(plan=plans, step=st.integers(0, 10_000), count=st.integers(1, 70), data=st.data())
def test_micro_batches_never_exceed_the_micro_size_and_concatenate_to_the_share(plan, step, count, data):
    index = data.draw(st.integers(0, count - 1))
    share = plan.share(step, index, count)
    micro = plan.micro_batches(step, index, count)
    assert all(0 < len(m) <= plan.micro_batch_size for m in micro)
    assert _positions(micro) == list(share)
    # Only the last micro-batch may be short: no more micro-batches than needed.
    assert len(micro) == -(-len(share) // plan.micro_batch_size)


@FAST
@given(plan=plans, counts=st.lists(st.integers(1, 9), min_size=1, max_size=12))
def test_steps_cover_every_stream_position_exactly_once_whatever_the_member_count_per_step(plan, counts):
    # A different generation size for every step, as after failures and rejoins.
    seen = []
    for step, count in enumerate(counts):
        for index in range(count):
            seen.extend(plan.share(step, index, count))
    assert seen == list(range(len(counts) * plan.global_batch_size))


def test_a_member_index_outside_the_generation_is_rejected():
    plan = DataPlan(10, 8, 4)
    for index, count in [(-1, 2), (2, 2), (0, 0), (0, -1)]:
        with pytest.raises(ValueError, match="not in a generation"):
            plan.share(0, index, count)


def test_more_members_than_samples_leaves_the_last_members_an_empty_share():
    plan = DataPlan(100, 3, 2)
    shares = [plan.share(4, i, 5) for i in range(5)]
    assert shares == [range(12, 13), range(13, 14), range(14, 15), range(15, 15), range(15, 15)]
    assert plan.micro_batches(4, 4, 5) == []


# -- indices ---------------------------------------------------------------------------------------


@FAST
@given(plan=plans, epoch=st.integers(0, 50))
def test_indices_of_one_epoch_are_a_permutation_of_the_data_set(plan, epoch):
    n = plan.dataset_len
    indices = plan.indices(range(epoch * n, (epoch + 1) * n))
    assert indices.dtype == torch.long
    assert sorted(indices.tolist()) == list(range(n))


@FAST
@given(plan=plans, start=st.integers(0, 2_000), length=st.integers(0, 300), data=st.data())
def test_indices_of_a_range_are_the_indices_of_its_pieces_even_across_epochs(plan, start, length, data):
    cut = data.draw(st.integers(start, start + length))
    whole = plan.indices(range(start, start + length))
    left = plan.indices(range(start, cut))
    right = plan.indices(range(cut, start + length))
    assert whole.tolist() == left.tolist() + right.tolist()
    assert len(whole) == length
    assert all(0 <= i < plan.dataset_len for i in whole.tolist())


@FAST
@given(plan=plans, step=st.integers(0, 500), count=st.integers(1, 9))
def test_members_of_a_generation_together_process_the_samples_of_the_single_process_batch(plan, step, count):
    g = plan.global_batch_size
    together = [i for m in range(count) for i in plan.indices(plan.share(step, m, count)).tolist()]
    assert together == plan.indices(range(step * g, (step + 1) * g)).tolist()


@FAST
@given(
    fields=st.tuples(st.integers(1, 120), st.integers(1, 48), st.integers(1, 48), st.integers(-(2**40), 2**40)),
    positions=st.tuples(st.integers(0, 2_000), st.integers(0, 200)),
    noise=st.lists(st.tuples(st.integers(0, 1_000), st.integers(0, 30)), min_size=5, max_size=8),
)
def test_the_plan_is_a_pure_function_of_its_settings(fields, positions, noise):
    n, g, m, seed = fields
    start, length = positions
    first = DataPlan(n, g, m, seed).indices(range(start, start + length)).tolist()
    # Other plans in between (other seeds and epochs) must not change the answer: caches evict.
    for other_seed, epoch in noise:
        DataPlan(n + 1, g, m, other_seed).indices(range(epoch * (n + 1), epoch * (n + 1) + 1))
    again = DataPlan(n, g, m, seed)
    assert again.indices(range(start, start + length)).tolist() == first
    assert [again.share(start, i, 3) for i in range(3)] == [DataPlan(n, g, m, seed).share(start, i, 3) for i in range(3)]


def test_each_epoch_and_each_seed_draw_a_different_permutation():
    n = 100
    plan = DataPlan(n, 10, 10, seed=0)
    epoch0 = plan.indices(range(0, n)).tolist()
    epoch1 = plan.indices(range(n, 2 * n)).tolist()
    other_seed = DataPlan(n, 10, 10, seed=1).indices(range(0, n)).tolist()
    assert epoch0 != epoch1
    assert epoch0 != other_seed
    assert epoch0 != list(range(n))


def test_an_empty_range_has_no_indices():
    indices = DataPlan(7, 3, 2).indices(range(5, 5))
    assert indices.dtype == torch.long
    assert indices.numel() == 0


def test_changing_returned_indices_in_place_does_not_change_later_plans():
    plan = DataPlan(10, 4, 2, seed=3)
    expected = plan.indices(range(0, 4)).tolist()
    plan.indices(range(0, 4)).add_(100)
    assert plan.indices(range(0, 4)).tolist() == expected


# -- settings --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8", True, None])
def test_a_bad_global_batch_size_is_a_config_error_naming_it(bad):
    with pytest.raises(ConfigError, match="global_batch_size"):
        DataPlan(10, bad, 4)


@pytest.mark.parametrize("bad", [0, -3, 1.0, "4", False])
def test_a_bad_micro_batch_size_is_a_config_error_naming_it(bad):
    with pytest.raises(ConfigError, match="micro_batch_size"):
        DataPlan(10, 8, bad)


@pytest.mark.parametrize("bad", [0, -5, 3.0])
def test_a_bad_dataset_length_is_a_config_error_naming_it(bad):
    with pytest.raises(ConfigError, match="dataset length"):
        DataPlan(bad, 8, 4)


@pytest.mark.parametrize("bad", ["1", 1.5, True, None])
def test_a_seed_that_is_not_an_integer_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="seed"):
        DataPlan(10, 8, 4, seed=bad)


def test_a_negative_seed_is_accepted_and_gives_a_valid_permutation():
    plan = DataPlan(13, 4, 4, seed=-7)
    assert sorted(plan.indices(range(13, 26)).tolist()) == list(range(13))
