"""The straggler balancer: splits are partitions of the global batch in whole micro-batches,
follow measured paces, do not oscillate on noise, and flag and evict as documented."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.data.balance import SustainedSlowdowns, Balancer, BalanceSettings, equal_sizes, proportional_split
from unbroken.data.data_plan import DataPlan, Split
from unbroken.errors import ConfigError


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 400), st.integers(1, 16), st.lists(st.floats(0.05, 20.0), min_size=1, max_size=12))
def test_a_proportional_split_is_a_partition_in_whole_micro_batches(total, unit, paces):
    split = proportional_split(total, unit, paces)
    if total // unit < len(paces):
        assert split is None
        return
    assert sum(split.sizes) == total and len(split) == len(paces)
    fastest = max(range(len(paces)), key=lambda i: (paces[i], -i))
    for i, size in enumerate(split.sizes):
        whole = size - (total % unit if i == fastest else 0)
        assert whole >= unit and whole % unit == 0
    plan = DataPlan(dataset_len=1000, global_batch_size=total, micro_batch_size=unit)
    covered = [p for i in range(len(paces)) for p in plan.share(3, i, split)]
    assert covered == list(range(3 * total, 4 * total)), "every sample once, in the plan's order"


def test_a_member_at_half_pace_gets_about_half_the_micro_batches():
    split = proportional_split(48, 2, [1.0, 0.5, 1.0])
    assert split.sizes == (20, 10, 18) or split.sizes == (20, 8, 20) or sorted(split.sizes) == [10, 18, 20]
    assert split.sizes[1] < min(split.sizes[0], split.sizes[2])


def test_a_split_that_is_not_a_partition_is_refused():
    plan = DataPlan(dataset_len=100, global_batch_size=10, micro_batch_size=2)
    with pytest.raises(ValueError, match="not a partition"):
        plan.share(0, 0, Split((4, 4)))


def _feed(balancer, rows):
    for row in rows:
        balancer.observe(row)


def test_a_slowed_member_is_flagged_and_given_fewer_micro_batches():
    b = Balancer(BalanceSettings(window=5), total=48, unit=2, members=3)
    _feed(b, [[0.01, 0.01, 0.01]] * 6)
    assert b.split is None and not b.flagged()
    steps = 0
    while not b.flagged():
        b.observe([0.01, 0.02, 0.01])
        steps += 1
    assert 5 <= steps <= 5 + 3 + 5, "flagged once the median of its window has been slow for a window"
    assert b.newly_flagged() == [1]
    for _ in range(5):
        b.observe([0.01, 0.02, 0.01])
    assert b.split is not None and b.split.sizes[1] < b.split.sizes[0]
    assert b.digest() == b.split.digest() != 0


def test_noisy_equal_paces_never_change_the_split():
    rng = random.Random(4)
    b = Balancer(BalanceSettings(window=5), total=48, unit=2, members=3)
    for _ in range(500):
        b.observe([0.01 * rng.uniform(0.8, 1.25) for _ in range(3)])
        assert b.split is None, "equal members, within 25 % noise, keep equal shares"
    assert not b.flagged()


def test_a_recovered_member_gets_its_share_back_and_a_changing_pace_does_not_oscillate():
    b = Balancer(BalanceSettings(window=5), total=48, unit=2, members=3)
    changes = 0
    for _ in range(60):
        b.observe([0.01, 0.02, 0.01])
        changes += b.changed
    assert changes == 1, "one change for one slowdown"
    for _ in range(60):
        b.observe([0.01, 0.01, 0.01])
        changes += b.changed
    assert b.split is None and changes == 2 and not b.flagged()


def test_one_slow_step_moves_nothing():
    b = Balancer(BalanceSettings(window=5), total=48, unit=2, members=3)
    for i in range(100):
        b.observe([0.01, 0.5 if i % 10 == 0 else 0.01, 0.01])  # a collection pause every tenth step
    assert b.split is None and not b.flagged()


def test_report_mode_flags_without_rebalancing_and_evict_mode_evicts_after_its_window():
    report = Balancer(BalanceSettings(mode="report", window=3), total=48, unit=2, members=3)
    _feed(report, [[0.01, 0.05, 0.01]] * 30)
    assert report.flagged() == [1] and report.split is None and report.evicted() == []
    evict = Balancer(BalanceSettings(mode="evict", window=3, evict_after=10), total=48, unit=2, members=3)
    _feed(evict, [[0.01, 0.05, 0.01]] * 11)
    assert evict.evicted() == []
    _feed(evict, [[0.01, 0.05, 0.01]] * 2)
    assert evict.evicted() == [1]


def test_unknown_measurements_are_left_out():
    b = Balancer(BalanceSettings(window=2), total=12, unit=2, members=2)
    _feed(b, [[0.0, 0.01], [0.0, 0.01], [0.0, 0.01]])
    assert b.relative_paces() == [None, 1.0] and b.split is None


@pytest.mark.parametrize("field,value", [("mode", "fast"), ("window", 0), ("gain", 1.5), ("evict_after", 0),
                                         ("announce_after", 0), ("announce_after_s", -1.0)])
def test_bad_settings_are_refused(field, value):
    with pytest.raises(ConfigError, match=field.split("_")[0] if field != "mode" else "stragglers"):
        BalanceSettings(**{field: value})


def test_equal_sizes_are_the_plain_plans_shares():
    plan = DataPlan(dataset_len=100, global_batch_size=11, micro_batch_size=2)
    assert equal_sizes(11, 3) == tuple(len(plan.share(0, i, 3)) for i in range(3))


def test_members_that_take_turns_being_slow_are_never_flagged_and_a_borderline_one_is_flagged_once():
    # an oversubscribed host (4 workers on 2 cores): every member is slow for a few steps in turn
    rng = random.Random(7)
    b = Balancer(BalanceSettings(mode="report", window=5), total=48, unit=2, members=4)
    slow, left = 0, 0
    for _ in range(300):
        if left == 0:
            slow, left = (slow + 1) % 4, rng.randint(2, 4)  # a few steps each, in turn
        left -= 1
        b.observe([0.02 if i == slow else 0.01 * rng.uniform(0.9, 1.1) for i in range(4)])
        assert not b.flagged(), "members taking turns are not stragglers"
    # a member hovering at the threshold is flagged once, not at every dip
    b = Balancer(BalanceSettings(mode="report", window=5), total=48, unit=2, members=3)
    flags = 0
    for i in range(200):
        b.observe([0.01, 0.01 / (0.7 if (i // 6) % 2 else 0.82), 0.01])  # 70 % for 6 steps, then 82 %
        flags += len(b.newly_flagged())
    assert flags == 1 and b.flagged() == [1]
    for _ in range(10):
        b.observe([0.01, 0.01, 0.01])
    assert b.flagged() == []


def _watch(settings: BalanceSettings, paces_by_step, seconds_per_step: float = 0.1, names=("a", "b", "c", "d"),
           new_generation_every: int | None = None) -> list[tuple[int, list[str]]]:
    """Feed a generation's balancers (a new one every ``new_generation_every`` steps) and the
    leader's SustainedSlowdowns; the (step, names) announced."""
    watch = SustainedSlowdowns(settings)
    said = []
    b = None
    for step, paces in enumerate(paces_by_step):
        if b is None or (new_generation_every and step % new_generation_every == 0):
            b = Balancer(settings, total=48, unit=2, members=len(names))
        b.observe(paces)
        found = watch.update(step, step * seconds_per_step, set(names), {names[i] for i in b.flagged()}, {names[i] for i in b.at_pace()})
        if found:
            said.append((step, found))
    return said


def test_only_a_sustained_slowdown_of_one_member_is_announced_once():
    settings = BalanceSettings(mode="report", window=3, announce_after=10, announce_after_s=2.0)
    slow_b = [[0.01, 0.03, 0.01, 0.01]] * 60
    said = _watch(settings, slow_b)
    flagged_at = next(n for n in range(60) if _watch_flags(settings, slow_b[:n + 1]))
    assert said == [(flagged_at + 20, ["b"])]  # 10 steps would do, 2 s take 20; once
    assert _watch(settings, slow_b[:flagged_at + 19]) == []


def _watch_flags(settings, paces_by_step):
    b = Balancer(settings, total=48, unit=2, members=4)
    for paces in paces_by_step:
        b.observe(paces)
    return b.flagged()


def test_a_slow_member_stays_slow_across_generations():
    # a new generation every 8 steps (members killed and back): each balancer flags b only after a
    # few steps, but the leader counts b's slowdown from its first flag
    settings = BalanceSettings(mode="report", window=3, announce_after=10, announce_after_s=2.0)
    said = _watch(settings, [[0.01, 0.03, 0.01, 0.01]] * 60, new_generation_every=8)
    assert said and said[0][1] == ["b"] and said[0][0] < 30


def test_members_slow_in_turn_are_never_announced_until_one_stays_slow():
    settings = BalanceSettings(mode="report", window=3, announce_after=10, announce_after_s=0.0)
    turns = [[0.03 if i == 1 + (step // 6) % 3 else 0.01 for i in range(4)] for step in range(60)]
    assert _watch(settings, turns) == []
    said = _watch(settings, turns + [[0.01, 0.01, 0.01, 0.03]] * 40)
    assert [names for _, names in said] == [["d"]] and said[0][0] >= 60 + 10


def test_a_slow_member_that_left_is_never_announced_and_starts_again_under_its_new_name():
    settings = BalanceSettings(mode="report", window=3, announce_after=10, announce_after_s=0.0)
    watch = SustainedSlowdowns(settings)
    b = Balancer(settings, total=48, unit=2, members=4)
    for step in range(8):  # "b" is flagged, then killed before its slowdown is sustained
        b.observe([0.01, 0.03, 0.01, 0.01])
        assert watch.update(step, float(step), {"a", "b", "c", "d"}, {("a", "b", "c", "d")[i] for i in b.flagged()}, set()) == []
    assert b.flagged() == [1]
    for step in range(8, 40):  # the others go on without it: "b" is never said
        assert watch.update(step, float(step), {"a", "c", "d"}, set(), {"a", "c", "d"}) == []


def test_an_oversubscribed_hosts_noise_is_never_announced():
    # 4 members on 2 cores: each member in turn dips to 30-60 % for up to 8 steps of 10 ms
    rng = random.Random(3)
    steps = []
    for step in range(3000):
        dip = (step // 8) % 4 if rng.random() < 0.8 else None
        steps.append([0.01 / rng.uniform(0.3, 0.6) if i == dip else 0.01 * rng.uniform(0.9, 1.1) for i in range(4)])
    assert _watch(BalanceSettings(mode="report"), steps, seconds_per_step=0.01) == []
