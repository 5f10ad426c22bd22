"""The restart budget of a worker slot: restarts per window, backoff, quarantine and its end."""

from __future__ import annotations

import pytest

from unbroken.errors import ConfigError
from unbroken.launch.restarts import RestartPolicy, SlotBudget, Verdict


def test_the_defaults_allow_five_restarts_within_five_minutes_and_cool_off_ten_minutes():
    p = RestartPolicy()
    assert (p.max_restarts, p.window, p.backoff, p.max_backoff, p.cooloff) == (5, 300.0, 0.1, 10.0, 600.0)


def test_twenty_failures_spread_over_a_long_run_are_all_restarted_with_the_defaults():
    budget = SlotBudget(RestartPolicy())
    now = 1000.0
    for _ in range(20):
        now += 400.0  # one failure every few minutes, for more than two hours
        verdict = budget.failed(now)
        assert verdict == Verdict(True, 0.1, 1)
    assert budget.quarantines == 0 and not budget.quarantined(now)


def test_failures_a_minute_apart_still_fit_the_default_budget_forever():
    budget = SlotBudget(RestartPolicy())
    verdicts = [budget.failed(61.0 * i) for i in range(100)]
    assert all(v.restart for v in verdicts)
    assert max(v.failures for v in verdicts) == 5  # (t - 300, t] holds five of them at most


def test_one_failure_more_than_the_budget_within_the_window_quarantines_the_slot():
    budget = SlotBudget(RestartPolicy(max_restarts=3, window=60.0, cooloff=120.0))
    assert [budget.failed(t).restart for t in (0.0, 10.0, 20.0)] == [True, True, True]
    verdict = budget.failed(30.0)
    assert verdict == Verdict(False, 120.0, 4)
    assert budget.quarantined(30.0) and budget.quarantined(149.9) and not budget.quarantined(150.0)
    assert budget.quarantined_until == 150.0 and budget.quarantines == 1


def test_zero_restarts_quarantines_at_the_first_failure():
    budget = SlotBudget(RestartPolicy(max_restarts=0, cooloff=5.0))
    assert budget.failed(1.0) == Verdict(False, 5.0, 1)


def test_failures_older_than_the_window_do_not_count():
    budget = SlotBudget(RestartPolicy(max_restarts=2, window=10.0))
    assert budget.failed(0.0).restart and budget.failed(5.0).restart
    assert budget.failed(10.0).restart  # the one at 0.0 is out of (0, 10]
    assert budget.failures_within_window(10.0) == 2
    assert not budget.failed(12.0).restart  # 5, 10, 12: three within 10 s


def test_the_slot_comes_back_after_the_cool_off_with_a_fresh_budget():
    budget = SlotBudget(RestartPolicy(max_restarts=2, window=100.0, cooloff=50.0))
    for t in (0.0, 1.0):
        assert budget.failed(t).restart
    assert not budget.failed(2.0).restart
    assert budget.quarantined(51.0) and not budget.quarantined(52.0)
    budget.release()
    assert not budget.quarantined(52.0) and budget.failures_within_window(52.0) == 0
    # within the old window, yet the full budget and the first backoff again
    assert budget.failed(53.0) == Verdict(True, 0.1, 1)
    assert budget.failed(54.0).restart
    assert not budget.failed(55.0).restart
    assert budget.quarantines == 2


def test_the_backoff_doubles_within_a_burst_up_to_its_cap_and_resets_after_a_quiet_window():
    budget = SlotBudget(RestartPolicy(max_restarts=10, window=60.0, backoff=0.5, max_backoff=3.0))
    delays = [budget.failed(float(t)).delay for t in range(6)]
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    # a minute without failures: the backoff is back to its start
    assert budget.failed(70.0).delay == 0.5
    assert budget.failed(71.0).delay == 1.0


def test_a_zero_backoff_restarts_at_once():
    budget = SlotBudget(RestartPolicy(backoff=0.0))
    assert [budget.failed(float(t)).delay for t in range(3)] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"max_restarts": -1}, "--max-restarts must be 0 or more, got -1"),
        ({"max_restarts": 1.5}, "--max-restarts must be 0 or more"),
        ({"window": 0.0}, "--restart-window must be positive seconds, got 0.0"),
        ({"window": -3.0}, "--restart-window must be positive"),
        ({"cooloff": 0.0}, "--quarantine-cooloff must be positive"),
        ({"cooloff": float("inf")}, "--quarantine-cooloff must be positive"),
        ({"backoff": -0.1}, "--restart-backoff must be 0 or more seconds"),
        ({"max_backoff": -1.0}, "--max-restart-backoff must be 0 or more seconds"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(fields, message):
    with pytest.raises(ConfigError, match=message):
        RestartPolicy(**fields)
