"""LaunchSettings: what ``unbroken run`` refuses before it starts anything."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from unbroken.errors import ConfigError
from unbroken.launch.launcher import LaunchSettings


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


def test_defaults_are_valid_and_documented_values(script):
    s = LaunchSettings(script=script)
    assert (s.nproc_per_node, s.max_restarts, s.restart_backoff, s.max_restart_backoff) == (1, 5, 0.1, 10.0)
    assert (s.restart_window, s.quarantine_cooloff) == (300.0, 600.0)
    assert (s.heartbeat_interval, s.heartbeat_timeout, s.collective_timeout, s.shutdown_grace) == (0.5, 3.0, 30.0, 5.0)
    assert (s.coordinator, s.coordinator_host, s.coordinator_port, s.run_dir, s.console_ranks, s.tee, s.chaos) == (None, "127.0.0.1", 0, None, None, 3, None)
    assert s.script_args == () and s.record_samples is False
    assert (s.group_size, s.slots) == (1, 1)
    assert isinstance(s.node, str) and s.node


def test_settings_are_frozen(script):
    s = LaunchSettings(script=script)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.nproc_per_node = 2


@pytest.mark.parametrize("bad", [0, -1, True, "2", 2.0, None])
def test_a_bad_process_count_is_refused(script, bad):
    with pytest.raises(ConfigError, match="--nproc-per-node must be a positive integer"):
        LaunchSettings(script=script, nproc_per_node=bad)


def test_a_negative_restart_limit_is_refused_and_zero_is_allowed(script):
    with pytest.raises(ConfigError, match="--max-restarts must be 0 or more, got -1"):
        LaunchSettings(script=script, max_restarts=-1)
    assert LaunchSettings(script=script, max_restarts=0).max_restarts == 0


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"restart_window": 0.0}, "--restart-window must be positive"),
        ({"quarantine_cooloff": -1.0}, "--quarantine-cooloff must be positive"),
        ({"max_restart_backoff": -1.0}, "--max-restart-backoff must be 0 or more"),
        ({"restart_backoff": -1.0}, "--restart-backoff must be 0 or more"),
        ({"shutdown_grace": -1.0}, "--shutdown-grace must not be negative"),
    ],
)
def test_bad_restart_and_shutdown_settings_are_refused_naming_the_flag(script, fields, message):
    with pytest.raises(ConfigError, match=message):
        LaunchSettings(script=script, **fields)


def test_the_restart_policy_comes_from_the_settings(script):
    policy = LaunchSettings(script=script, max_restarts=2, restart_window=30.0, quarantine_cooloff=9.0, restart_backoff=0.5).restart_policy()
    assert (policy.max_restarts, policy.window, policy.cooloff, policy.backoff, policy.max_backoff) == (2, 30.0, 9.0, 0.5, 10.0)


@pytest.mark.parametrize(
    "interval, timeout, collective",
    [(0.0, 5.0, 30.0), (-1.0, 5.0, 30.0), (5.0, 5.0, 30.0), (6.0, 5.0, 30.0)],
)
def test_the_heartbeat_interval_must_be_positive_and_below_the_heartbeat_timeout(script, interval, timeout, collective):
    with pytest.raises(ConfigError, match="need 0 < --heartbeat-interval < --heartbeat-timeout"):
        LaunchSettings(script=script, heartbeat_interval=interval, heartbeat_timeout=timeout, collective_timeout=collective)


@pytest.mark.parametrize("collective", [5.0, 4.0])
def test_the_heartbeat_timeout_must_be_below_the_collective_timeout(script, collective):
    with pytest.raises(ConfigError, match="need --heartbeat-timeout < --collective-timeout"):
        LaunchSettings(script=script, heartbeat_interval=1.0, heartbeat_timeout=5.0, collective_timeout=collective)


def test_timeouts_in_the_required_order_are_accepted(script):
    s = LaunchSettings(script=script, heartbeat_interval=0.09, heartbeat_timeout=0.2, progress_timeout=0.25, collective_timeout=0.3)
    assert (s.heartbeat_interval, s.heartbeat_timeout, s.collective_timeout) == (0.09, 0.2, 0.3)


def test_a_progress_timeout_not_below_the_collective_timeout_is_refused(script):
    with pytest.raises(ConfigError, match="--progress-timeout < --collective-timeout"):
        LaunchSettings(script=script, progress_timeout=30.0, collective_timeout=30.0)


@pytest.mark.parametrize("rank", [-1, 2, 5])
def test_local_ranks_filter_must_name_local_ranks(script, rank):
    with pytest.raises(ConfigError, match=r"--local-ranks-filter must name a local rank in 0\.\.1, got " + str(rank)):
        LaunchSettings(script=script, nproc_per_node=2, console_ranks=(0, rank))


def test_local_ranks_filter_may_name_any_local_ranks(script):
    assert LaunchSettings(script=script, nproc_per_node=3, console_ranks=(0, 2)).console_ranks == (0, 2)


@pytest.mark.parametrize("tee", [-1, 4])
def test_tee_takes_torchruns_streams(script, tee):
    assert [LaunchSettings(script=script, nproc_per_node=2, tee=t).tee for t in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match=r"--tee takes torchrun's streams.*--local-ranks-filter"):
        LaunchSettings(script=script, nproc_per_node=2, tee=tee)


def test_a_missing_script_is_refused_naming_it(tmp_path):
    missing = str(tmp_path / "missing.py")
    with pytest.raises(ConfigError, match="training script not found") as caught:
        LaunchSettings(script=missing)
    assert repr(missing) in str(caught.value)


def test_a_directory_is_not_a_training_script(tmp_path):
    with pytest.raises(ConfigError, match="training script not found"):
        LaunchSettings(script=str(tmp_path))


def test_a_bad_chaos_schedule_is_refused_at_launch(script):
    with pytest.raises(ConfigError, match="bad condition 'rank=x'"):
        LaunchSettings(script=script, chaos="kill@step,rank=x")
    assert LaunchSettings(script=script, chaos="kill@step,rank=0").chaos == "kill@step,rank=0"


def test_the_process_count_is_checked_before_the_script(tmp_path):
    with pytest.raises(ConfigError, match="--nproc-per-node"):
        LaunchSettings(script=str(tmp_path / "missing.py"), nproc_per_node=0)


@pytest.mark.parametrize("bad", [0, -2, True, "2", 2.0, None])
def test_a_bad_group_size_is_refused(script, bad):
    with pytest.raises(ConfigError, match="--group-size must be a positive integer"):
        LaunchSettings(script=script, nproc_per_node=4, group_size=bad)


@pytest.mark.parametrize("nproc, k", [(3, 2), (4, 3), (1, 2), (6, 4)])
def test_the_process_count_must_be_a_multiple_of_the_group_size(script, nproc, k):
    with pytest.raises(ConfigError, match=f"--nproc-per-node {nproc} is not a multiple of --group-size {k}: "):
        LaunchSettings(script=script, nproc_per_node=nproc, group_size=k)


@pytest.mark.parametrize("nproc, k, slots", [(1, 1, 1), (4, 1, 4), (4, 2, 2), (8, 8, 1), (8, 4, 2), (6, 3, 2)])
def test_a_node_runs_one_slot_per_replica_group(script, nproc, k, slots):
    s = LaunchSettings(script=script, nproc_per_node=nproc, group_size=k)
    assert (s.nproc_per_node, s.group_size, s.slots) == (nproc, k, slots)


def test_with_groups_local_ranks_filter_names_a_slot_not_a_process(script):
    assert LaunchSettings(script=script, nproc_per_node=4, group_size=2, console_ranks=(1,)).console_ranks == (1,)
    with pytest.raises(ConfigError, match=r"--local-ranks-filter must name a slot \(replica group\) in 0\.\.1, got 2"):
        LaunchSettings(script=script, nproc_per_node=4, group_size=2, console_ranks=(2,))


def test_the_launcher_has_one_worker_slot_per_group(script, tmp_path):
    from unbroken.launch.launcher import Launcher

    launcher = Launcher(LaunchSettings(script=script, nproc_per_node=6, group_size=3, run_dir=str(tmp_path / "run")))
    assert [w.local_rank for w in launcher.workers] == [0, 1]


def test_checking_the_flags_imports_no_torch_so_the_zygote_starts_at_once(script):
    # the launcher checks its settings before it starts the zygote (which imports torch for the
    # workers): a check that imported torch in the launcher held the zygote's start back 1.5 s
    code = (
        "import sys\n"
        "from unbroken.launch.launcher import LaunchSettings\n"
        f"LaunchSettings(script={script!r}, backend='gloo', checkpoint_dir='/tmp/ckpt', checkpoint_every=5)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    with pytest.raises(ConfigError, match="backend must be one of"):
        LaunchSettings(script=script, backend="mpi")
