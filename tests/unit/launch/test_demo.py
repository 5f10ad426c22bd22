"""``unbroken demo``: what it launches and reports (the launcher is replaced), and the example."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest

from unbroken.worker import chaos

from unbroken.launch import demo
from unbroken.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(autouse=True)
def _no_logging_setup(monkeypatch):
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)
    coordinator_log = logging.getLogger("unbroken.coordinator.server")
    level = coordinator_log.level
    yield
    coordinator_log.setLevel(level)  # the demo quiets it


@pytest.fixture
def launched(monkeypatch):
    """Replace the launcher and the report; record what the demo asked of them."""
    seen: dict = {}

    class FakeLauncher:
        def __init__(self, settings):
            seen["settings"] = settings

        def run(self):
            return seen.get("code", 0)

    monkeypatch.setattr("unbroken.launch.launcher.Launcher", FakeLauncher)
    monkeypatch.setitem(sys.modules, "sklearn", types.ModuleType("sklearn"))  # its import is slow
    monkeypatch.setattr("unbroken.observe.report.main", lambda dirs, **kw: seen.setdefault("reported", dirs) and 0)
    return seen


def test_the_demo_runs_the_example_with_four_workers_and_the_schedule(launched, tmp_path, capsys):
    run_dir = str(tmp_path / "demo")
    assert main(["demo", "--run-dir", run_dir]) == 0
    s = launched["settings"]
    assert s.script == os.path.join(ROOT, "examples", "train_digits.py")
    assert (s.nproc_per_node, s.script_args, s.run_dir, s.chaos) == (4, ("--steps", "400"), run_dir, demo.SCHEDULE)
    assert s.heartbeat_timeout == 2.0
    assert launched["reported"] == [run_dir]
    out = capsys.readouterr().out
    assert f"timeline picture: {os.path.join(run_dir, 'timeline.png')}" in out


def test_the_schedule_has_two_kills_and_a_three_second_hang_at_different_steps():
    faults = chaos.parse(demo.FAULTS)
    assert sorted(f.kind for f in faults) == ["hang", "kill", "kill"]
    assert len({f.step for f in faults}) == 3 and len({f.rank for f in faults}) == 3
    (hang,) = [f for f in faults if f.kind == "hang"]
    assert hang.duration == 3.0 > demo.HEARTBEAT_TIMEOUT
    assert max(f.step for f in faults) < demo.STEPS
    assert demo.SCHEDULE.startswith(demo.FAULTS)


def test_the_exit_status_is_the_runs(launched, tmp_path):
    launched["code"] = 1
    assert main(["demo", "--run-dir", str(tmp_path)]) == 1


def test_without_the_examples_folder_a_runner_of_the_shipped_example_is_written(monkeypatch, tmp_path):
    monkeypatch.setattr(demo.os.path, "isfile", lambda path: False)
    script = demo.example_script(str(tmp_path / "run"))
    assert script == str(tmp_path / "run" / "train_digits.py")
    with open(script) as f:
        assert 'run_module("unbroken.launch.demo_train"' in f.read()


def test_without_scikit_learn_the_demo_says_what_to_install(monkeypatch, capsys, launched):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn now raises ImportError
    assert main(["demo"]) == 2
    assert "pip install 'unbroken[examples]'" in capsys.readouterr().err
    assert "settings" not in launched


def test_the_example_runs_as_a_single_process():
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_digits.py"), "--steps", "2", "--log-every", "1"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "step    1  loss" in done.stdout and "test accuracy" in done.stdout
