"""Fault schedules: parsing, and which process a fault fires in (without sending any signal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from unbroken.worker import chaos
from unbroken.worker.chaos import KINDS, POINTS, Chaos, Fault, parse
from unbroken.errors import ConfigError
from unbroken.observe.events import read_events

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


# -- the extended language: for=, slow, at=, rank=random --------------------------------------------


def test_the_extended_options_parse():
    assert parse("hang@step,rank=1,step=4,for=3") == [Fault("hang", "step", rank=1, step=4, duration=3.0)]
    assert parse("slow@step,sleep=0.25,for=10") == [Fault("slow", "step", sleep=0.25, duration=10.0)]
    assert parse("slow@commit,by=3") == [Fault("slow", "commit", by=3.0)]
    assert parse("kill@step,at=12.5,step=3") == [Fault("kill", "step", step=3, at=12.5)]
    assert parse("kill@step,rank=random,seed=4") == [Fault("kill", "step", rank="random", seed=4)]


def test_slow_without_a_rate_is_twice_as_slow():
    (fault,) = parse("slow@step")
    assert (fault.by, fault.sleep, fault.duration) == (2.0, None, None)


@pytest.mark.parametrize(
    "schedule, message",
    [
        ("kill@step,for=3", "for=SECONDS applies to hang and slow only"),
        ("spin@step,for=3", "for=SECONDS applies to hang and slow only"),
        ("hang@step,by=2", "sleep= and by= apply to slow only"),
        ("kill@step,sleep=1", "sleep= and by= apply to slow only"),
        ("slow@step,sleep=1,by=2", "either sleep=SECONDS or by=FACTOR"),
        ("slow@step,by=0.5", "by=FACTOR must be at least 1"),
    ],
)
def test_options_that_do_not_fit_the_kind_are_config_errors(schedule, message):
    with pytest.raises(ConfigError, match="bad fault") as caught:
        parse(schedule)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "condition", ["for=-1", "for=inf", "for=nan", "for=", "at=x", "at= 3", "sleep=1s", "by=", "seed=-1", "seed=1.5", "rank=rand", "rank=Random"]
)
def test_bad_values_of_the_extended_options_are_config_errors(condition):
    kind = "slow" if condition.split("=")[0] in ("sleep", "by") else "hang"
    with pytest.raises(ConfigError, match="bad condition") as caught:
        parse(f"{kind}@step,{condition}")
    assert "rank=random with seed=N" in str(caught.value)


def test_rank_random_picks_exactly_one_local_rank_the_same_in_every_worker():
    def takers(schedule: str, index: int) -> list[int]:
        # each worker parses the schedule for itself, as under `unbroken run`
        return [r for r in range(4) if index in [i for i, _ in Chaos(parse(schedule), r, 0, local_world_size=4).faults]]

    drawn = set()
    for seed in range(20):
        schedule = f"kill@step,rank=random,seed={seed};kill@commit,rank=random,seed={seed}"
        for index in range(2):
            chosen = takers(schedule, index)
            assert len(chosen) == 1, (seed, index, chosen)
            assert takers(schedule, index) == chosen
            drawn.add(chosen[0])
    assert len(drawn) > 1  # the seed and the position matter


def test_rank_random_with_one_local_worker_is_that_worker():
    assert [i for i, _ in Chaos(parse("kill@step,rank=random,seed=9"), 0, 0).faults] == [0]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(chaos.time, "monotonic", c.monotonic)
    monkeypatch.setattr(chaos.time, "sleep", c.sleep)
    return c


def test_at_counts_seconds_from_the_first_step(signals, clock):
    c = Chaos(parse("kill@commit,at=5,step=2"), local_rank=0, restart=0)
    c.point("commit", 9)  # no step yet: the clock has not started
    c.point("step", 0)
    clock.now += 4.9
    c.point("commit", 9)
    assert signals == []
    clock.now += 0.1
    c.point("commit", 1)  # late enough, but the step condition still holds it back
    assert signals == []
    c.point("commit", 2)
    assert signals == [(os.getpid(), signal.SIGKILL)]


def test_a_hang_for_a_while_starts_a_helper_that_wakes_the_process(signals, monkeypatch, tmp_path):
    woken: list[tuple[int, float]] = []
    monkeypatch.setattr(chaos, "wake_later", lambda pid, seconds: woken.append((pid, seconds)))
    monkeypatch.setenv("UNBROKEN_MEMBER_ID", "n.w0.r0")
    Chaos(parse("hang@step,for=3"), local_rank=0, restart=0, run_dir=str(tmp_path)).point("step", 0)
    assert woken == [(os.getpid(), 3.0)]
    assert signals == [(os.getpid(), signal.SIGSTOP)]
    (event,) = read_events(str(tmp_path / "events.jsonl"))[0]
    assert (event["kind"], event["fault"], event["for"], event["member"]) == ("fault", "hang", 3.0, "n.w0.r0")


def test_the_wake_up_helper_continues_a_stopped_process_and_shares_our_process_group():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    helper = None
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        wait_for_state(sleeper.pid, "T")
        helper = chaos.wake_later(sleeper.pid, 0.2)
        assert os.getpgid(helper.pid) == os.getpgid(0)
        wait_for_state(sleeper.pid, "S")
        assert helper.wait(timeout=10) == 0
    finally:
        sleeper.kill()
        sleeper.wait()
        if helper is not None and helper.poll() is None:
            helper.kill()
            helper.wait()


def wait_for_state(pid: int, state: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == state:
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not reach state {state}")


def test_slow_sleeps_at_its_point_on_every_visit_while_it_lasts(signals, clock, tmp_path):
    c = Chaos(parse("slow@step,step=2,sleep=0.5,for=10"), local_rank=0, restart=0, run_dir=str(tmp_path))
    c.point("step", 1)
    assert clock.slept == []
    c.point("step", 2)
    clock.now += 5
    c.point("step", 3)
    c.point("commit", 3)  # another point: not slowed
    clock.now += 5.1
    c.point("step", 4)  # past for=10
    assert clock.slept == [0.5, 0.5]
    assert signals == []
    assert [e["fault"] for e in read_events(str(tmp_path / "events.jsonl"))[0]] == ["slow"]


def test_slow_by_a_factor_stretches_the_time_between_visits(clock):
    c = Chaos(parse("slow@step,by=3"), local_rank=0, restart=0)
    c.point("step", 0)  # fires; no earlier visit to measure
    clock.now += 1.0
    c.point("step", 1)
    clock.now += 0.5
    c.point("step", 2)
    assert clock.slept == [2.0, 1.0]


def test_a_slowdown_fires_in_only_one_process_of_the_job(clock, tmp_path):
    first = Chaos(parse("slow@step,sleep=1"), local_rank=0, restart=0, run_dir=str(tmp_path))
    second = Chaos(parse("slow@step,sleep=1"), local_rank=1, restart=0, run_dir=str(tmp_path))
    first.point("step", 0)
    second.point("step", 0)
    second.point("step", 1)
    assert clock.slept == [1]


def test_rank_leader_fires_in_whichever_process_leads_when_the_point_is_reached(signals, tmp_path):
    faults = "kill@allreduce,rank=leader,step=3"
    first = Chaos(parse(faults), local_rank=0, restart=0, run_dir=str(tmp_path))
    second = Chaos(parse(faults), local_rank=1, restart=0, run_dir=str(tmp_path))
    leader = {"who": first}
    first.leading, second.leading = (lambda: leader["who"] is first), (lambda: leader["who"] is second)
    first.point("allreduce", 2)
    leader["who"] = second  # local rank 1 leads by the time the step is reached
    first.point("allreduce", 3)
    assert signals == []
    second.point("allreduce", 3)
    assert signals == [(os.getpid(), signal.SIGKILL)]


def test_a_fault_aimed_at_a_local_rank_the_node_does_not_run_is_refused():
    chaos.check_reachable(parse("kill@step,rank=1;kill@step,rank=random;kill@step,rank=leader;kill@step"), 2)
    with pytest.raises(ConfigError, match=r"kill@step,rank=7 can never fire: this node runs local ranks 0..1"):
        chaos.check_reachable(parse("kill@step,rank=7"), 2)
