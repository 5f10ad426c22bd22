"""Fault schedules: parsing, and which process a fault fires in (without sending any signal)."""

from __future__ import annotations

import os
import signal

import pytest

from unbroken import chaos
from unbroken.chaos import KINDS, POINTS, Chaos, Fault, parse
from unbroken.errors import ConfigError

# -- parse -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["", "   ", ";", " ; ; "])
def test_an_empty_schedule_has_no_faults(schedule):
    assert parse(schedule) == []


def test_the_documented_example_parses_into_two_faults():
    assert parse("kill@allreduce,rank=2,step=5;kill@heal,rank=0,step=8") == [
        Fault("kill", "allreduce", rank=2, step=5),
        Fault("kill", "heal", rank=0, step=8),
    ]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("point", POINTS)
def test_every_kind_parses_at_every_point_with_default_conditions(kind, point):
    (fault,) = parse(f"{kind}@{point}")
    assert (fault.kind, fault.point, fault.rank, fault.step, fault.restart, fault.fired) == (kind, point, None, 0, 0, False)


def test_spaces_around_faults_and_a_trailing_separator_are_ignored():
    assert parse("  hang@commit,restart=1,step=12 ; kill@step ;") == [
        Fault("hang", "commit", rank=None, step=12, restart=1),
        Fault("kill", "step"),
    ]


def test_a_later_condition_overrides_an_earlier_one_of_the_same_name():
    assert parse("kill@step,step=3,step=4")[0].step == 4


@pytest.mark.parametrize(
    "schedule",
    ["kill", "kill@", "@step", "explode@step", "kill@nowhere", "KILL@step", "kill@step@step", "kill @step", "kill@step;hang"],
)
def test_a_fault_without_a_known_kind_and_point_is_a_config_error_naming_it(schedule):
    with pytest.raises(ConfigError, match="bad fault") as caught:
        parse(schedule)
    message = str(caught.value)
    assert "KIND@POINT" in message
    assert all(k in message for k in KINDS) and all(p in message for p in POINTS)


@pytest.mark.parametrize(
    "condition",
    ["rank", "rank=", "rank=x", "rank=1.5", "color=1", "step=3s", "=3", "restart=one", " rank=1"],
)
def test_a_bad_condition_is_a_config_error_naming_it(condition):
    with pytest.raises(ConfigError, match="bad condition") as caught:
        parse(f"kill@step,{condition}")
    assert repr(condition) in str(caught.value)
    assert "rank=N, step=N or restart=N" in str(caught.value)


@pytest.mark.parametrize("condition", ["step=--5", "rank=\u00b2"])
def test_a_condition_value_that_is_not_an_integer_is_always_a_config_error(condition):
    with pytest.raises(ConfigError, match="bad condition"):
        parse(f"kill@step,{condition}")


# -- Chaos: which faults apply and when they fire --------------------------------------------------


@pytest.fixture
def signals(monkeypatch):
    """Record the signals Chaos would send to this process instead of sending them."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(chaos.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    return sent


def test_only_faults_for_this_local_rank_and_restart_apply():
    faults = parse("kill@step,rank=1;kill@step,rank=0;hang@commit;kill@heal,restart=2;kill@commit,rank=1,restart=2")
    mine = Chaos(faults, local_rank=1, restart=0)
    assert [i for i, _ in mine.faults] == [0, 2]
    restarted = Chaos(faults, local_rank=1, restart=2)
    assert [i for i, _ in restarted.faults] == [3, 4]


def test_a_fault_fires_once_at_its_point_from_its_step_on(signals):
    c = Chaos(parse("kill@commit,step=5"), local_rank=0, restart=0)
    c.point("step", 9)
    c.point("commit", 4)
    assert signals == []
    c.point("commit", 6)
    assert signals == [(os.getpid(), signal.SIGKILL)]
    c.point("commit", 7)
    assert len(signals) == 1


def test_a_hang_stops_the_process_instead_of_killing_it(signals):
    Chaos(parse("hang@allreduce"), local_rank=0, restart=0).point("allreduce", 0)
    assert signals == [(os.getpid(), signal.SIGSTOP)]


def test_a_fault_fires_in_only_one_process_of_the_job(signals, tmp_path):
    faults = "kill@step,step=2;hang@heal"
    first = Chaos(parse(faults), local_rank=0, restart=0, run_dir=str(tmp_path))
    second = Chaos(parse(faults), local_rank=1, restart=0, run_dir=str(tmp_path))
    second.point("step", 2)
    first.point("step", 3)
    assert signals == [(os.getpid(), signal.SIGKILL)]
    assert sorted(os.listdir(tmp_path / "chaos")) == ["fault-0"]
    first.point("heal", 0)
    second.point("heal", 0)
    assert len(signals) == 2
    assert sorted(os.listdir(tmp_path / "chaos")) == ["fault-0", "fault-1"]


def test_chaos_from_env_reads_the_schedule_rank_restart_and_run_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("UNBROKEN_CHAOS", "kill@step,rank=3;hang@step,rank=2,restart=1")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("UNBROKEN_RESTART_COUNT", "1")
    monkeypatch.setenv("UNBROKEN_RUN_DIR", str(tmp_path))
    c = Chaos.from_env()
    assert [(i, f.kind) for i, f in c.faults] == [(1, "hang")]
    assert c.run_dir == str(tmp_path)


def test_chaos_from_an_empty_environment_has_no_faults(monkeypatch):
    for name in ("UNBROKEN_CHAOS", "LOCAL_RANK", "UNBROKEN_RESTART_COUNT", "UNBROKEN_RUN_DIR"):
        monkeypatch.delenv(name, raising=False)
    c = Chaos.from_env()
    assert c.faults == [] and c.run_dir is None
