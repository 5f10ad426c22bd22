"""The ``unbroken`` command line: parsing only; nothing is launched."""

from __future__ import annotations

import argparse
import gc
import logging

import pytest

from unbroken.launch import run_flags
from unbroken.cli import build_parser, main
from unbroken.launch.run_flags import launch_settings
from unbroken.errors import ConfigError
from unbroken.launch.launcher import LaunchSettings

# Changing this list changes the user-facing interface: do it deliberately, with the docs.
RUN_FLAGS = [
    ["-h", "--help"],
    ["--nproc-per-node", "--nproc_per_node"],
    ["--group-size", "--group_size"],
    ["--max-restarts", "--max_restarts"],
    ["--restart-window", "--restart_window"],
    ["--quarantine-cooloff", "--quarantine_cooloff"],
    ["--run-dir", "--run_dir"],
    ["--stragglers"],
    ["--shard-optimizer", "--shard_optimizer"],
    ["--backend"],
    ["--coordinator"],
    ["--rdzv-endpoint", "--rdzv_endpoint"],
    ["--coordinator-host", "--coordinator_host"],
    ["--coordinator-advertise", "--coordinator_advertise"],
    ["--coordinator-port", "--coordinator_port"],
    ["--node-name", "--node_name"],
    ["--heartbeat-interval", "--heartbeat_interval"],
    ["--heartbeat-timeout", "--heartbeat_timeout"],
    ["--collective-timeout", "--collective_timeout"],
    ["--checkpoint-dir", "--checkpoint_dir"],
    ["--checkpoint-every", "--checkpoint_every"],
    ["--checkpoint-keep", "--checkpoint_keep"],
    ["--nnodes"],
    ["--min-members", "--min_members"],
    ["--max-members", "--max_members"],
    ["--progress-timeout", "--progress_timeout"],
    ["--warmup-timeout", "--warmup_timeout"],
    ["--busy-timeout", "--busy_timeout"],
    ["--quorum-timeout", "--quorum_timeout"],
    ["--start-grace", "--start_grace"],
    ["--restart-backoff", "--restart_backoff"],
    ["--max-restart-backoff", "--max_restart_backoff"],
    ["--shutdown-grace", "--shutdown_grace", "--shutdown-timeout", "--shutdown_timeout"],
    ["--local-ranks-filter", "--local_ranks_filter"],
    ["--tee", "-t"],
    ["--progress-interval", "--progress_interval"],
    ["--chaos"],
    ["--record-samples", "--record_samples"],
    ["--no-zygote", "--no_zygote"],
    ["--token"],
    ["--etcd"],
    ["--job-id", "--job_id"],
    ["--leader-lease", "--leader_lease"],
    ["--ha"],
    ["--etcd-port", "--etcd_port"],
    ["-m", "--module"],
    ["--log-level"],
    ["--standalone"],
    ["--run-path", "--run_path"],
]


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


@pytest.fixture(autouse=True)
def _no_logging_setup(monkeypatch):
    # main() configures the root logger; keep the test process's logging as pytest set it.
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('never run by these tests')\n")
    return str(path)


def test_the_run_command_has_exactly_the_pinned_flags():
    run = _subparser("run")
    shown = [a.option_strings for a in run._actions if a.option_strings and a.help is not argparse.SUPPRESS]
    assert shown == RUN_FLAGS
    assert [a.dest for a in run._actions if not a.option_strings] == ["script", "script_args"]


def test_the_subcommands_are_run_coordinator_status_report_and_demo():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert sorted(sub.choices) == ["coordinator", "demo", "report", "run", "status"]


def test_run_defaults_come_from_the_launch_settings():
    args = build_parser().parse_args(["run", "train.py"])
    fields = LaunchSettings.__dataclass_fields__
    for name in (
        "max_restarts", "restart_window", "quarantine_cooloff", "coordinator_port", "heartbeat_interval", "leader_lease",
        "heartbeat_timeout", "collective_timeout", "restart_backoff", "max_restart_backoff", "shutdown_grace",
    ):
        assert getattr(args, name) == fields[name].default, name
    assert args.nproc_per_node == "1" and args.group_size == "1"
    assert args.coordinator_host is None  # 127.0.0.1 alone, 0.0.0.0 with --etcd or --ha (launch_settings)
    assert (args.run_dir, args.coordinator, args.node_name, args.console_ranks, args.tee, args.chaos, args.record_samples) == (None, None, None, None, 3, None, False)
    assert (args.script, args.script_args) == ("train.py", [])


def test_torchrun_style_underscore_aliases_parse_like_the_dashed_flags():
    underscored = build_parser().parse_args(
        ["run", "--nproc_per_node", "4", "--max_restarts", "2", "--heartbeat_timeout", "7.5", "--record_samples", "t.py"]
    )
    dashed = build_parser().parse_args(
        ["run", "--nproc-per-node", "4", "--max-restarts", "2", "--heartbeat-timeout", "7.5", "--record-samples", "t.py"]
    )
    assert underscored == dashed
    assert (underscored.nproc_per_node, underscored.max_restarts, underscored.heartbeat_timeout) == ("4", 2, 7.5)
    assert underscored.record_samples is True


def test_everything_after_the_script_belongs_to_the_script():
    args = build_parser().parse_args(["run", "--local-ranks-filter", "1", "train.py", "--lr", "3e-4", "--nproc-per-node", "9"])
    assert args.script == "train.py"
    assert args.script_args == ["--lr", "3e-4", "--nproc-per-node", "9"]
    assert args.nproc_per_node == "1"
    assert args.coordinator_host is None  # 127.0.0.1 alone, 0.0.0.0 with --etcd or --ha (launch_settings)
    assert args.console_ranks == (1,)


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as exited:
        main([])
    assert exited.value.code == 2
    assert "required" in capsys.readouterr().err


@pytest.mark.parametrize("value, shown", [("0", "got 0"), ("-2", "got -2"), ("four", "got 'four'"), ("1.5", "got '1.5'")])
def test_a_bad_process_count_exits_2_with_a_clear_message(capsys, value, shown):
    assert main(["run", "--nproc-per-node", value, "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unbroken: error: ")
    assert "--nproc-per-node must be a positive integer" in err
    assert shown in err
    assert "Traceback" not in err


def test_a_missing_training_script_exits_2_naming_it(capsys, tmp_path):
    missing = str(tmp_path / "nope.py")
    assert main(["run", "--nproc-per-node", "2", missing]) == 2
    err = capsys.readouterr().err
    assert "training script not found" in err and missing in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-restarts", "-1"], "--max-restarts must be 0 or more"),
        (["--restart-window", "0"], "--restart-window must be positive"),
        (["--quarantine-cooloff", "-5"], "--quarantine-cooloff must be positive"),
        (["--max-restart-backoff", "-1"], "--max-restart-backoff must be 0 or more"),
        (["--shutdown-grace", "-1"], "--shutdown-grace must not be negative"),
        (["--heartbeat-interval", "6"], "need 0 < --heartbeat-interval < --heartbeat-timeout"),
        (["--heartbeat-timeout", "40"], "need --heartbeat-timeout < --collective-timeout"),
        (["--nproc-per-node", "2", "--local-ranks-filter", "0,2"], "--local-ranks-filter must name a local rank in 0..1"),
        (["--nproc-per-node", "3", "--group-size", "2"], "--nproc-per-node 3 is not a multiple of --group-size 2: "),
        (["--nproc-per-node", "8", "--group-size", "4", "--local-ranks-filter", "2"], "--local-ranks-filter must name a slot (replica group) in 0..1, got 2"),
        (["--chaos", "kill@nowhere"], "bad fault 'kill@nowhere'"),
    ],
)
def test_invalid_run_settings_exit_2_before_anything_starts(capsys, monkeypatch, script, flags, message):
    def launcher_must_not_start(*args, **kwargs):
        raise AssertionError("the launcher was started")

    monkeypatch.setattr("unbroken.launch.launcher.Launcher", launcher_must_not_start)
    assert main(["run", *flags, script]) == 2
    assert message in capsys.readouterr().err


def test_a_non_numeric_timeout_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["run", "--heartbeat-timeout", "soon", "x.py"])
    assert exited.value.code == 2
    assert "--heartbeat-timeout" in capsys.readouterr().err


def test_valid_run_flags_become_the_launch_settings(launched, script):
    seen = launched
    code = main(
        ["run", "--nproc_per_node", "3", "--max-restarts", "1", "--node-name", "n7", "--local-ranks-filter", "2", "-t", "1",
         "--chaos", "kill@step,rank=1", "--record-samples", script, "--epochs", "2"]
    )
    assert code == 0
    s = seen["settings"]
    assert (s.nproc_per_node, s.max_restarts, s.node, s.console_ranks, s.tee, s.chaos, s.record_samples) == (3, 1, "n7", (2,), 1, "kill@step,rank=1", True)
    assert (s.script, s.script_args) == (script, ("--epochs", "2"))


def test_workers_are_forked_from_the_zygote_unless_no_zygote_or_unbroken_zygote_0(launched, script, monkeypatch):
    assert main(["run", script]) == 0 and launched["settings"].zygote is True
    assert main(["run", "--no-zygote", script]) == 0 and launched["settings"].zygote is False
    monkeypatch.setenv("UNBROKEN_ZYGOTE", "0")
    assert main(["run", script]) == 0 and launched["settings"].zygote is False


def test_the_restart_and_shutdown_flags_become_the_launch_settings(launched, script):
    seen = launched
    assert main(
        ["run", "--max-restarts", "2", "--restart-window", "30", "--quarantine_cooloff", "45", "--restart-backoff", "0.5",
         "--max-restart-backoff", "4", "--shutdown-grace", "12", script]
    ) == 0
    s = seen["settings"]
    assert (s.max_restarts, s.restart_window, s.quarantine_cooloff) == (2, 30.0, 45.0)
    assert (s.restart_backoff, s.max_restart_backoff, s.shutdown_grace) == (0.5, 4.0, 12.0)
    policy = s.restart_policy()
    assert (policy.max_restarts, policy.window, policy.cooloff, policy.backoff, policy.max_backoff) == (2, 30.0, 45.0, 0.5, 4.0)


def test_the_coordinator_and_status_commands_parse_their_options():
    args = build_parser().parse_args(["coordinator", "--port", "1234", "--expected-members", "8", "--heartbeat-timeout", "3"])
    assert (args.command, args.port, args.expected_members, args.heartbeat_timeout, args.host) == ("coordinator", 1234, 8, 3.0, "0.0.0.0")
    args = build_parser().parse_args(["status", "h:1", "--json"])
    assert (args.command, args.address, args.json, args.timeout) == ("status", "h:1", True, 5.0)


def test_positive_int_helper_names_the_flag():
    with pytest.raises(ConfigError, match="--x must be a positive integer, got 0"):
        run_flags._positive_int("--x", "0")
    assert run_flags._positive_int("--x", "12") == 12


def test_nnodes_in_torchrun_spelling_sets_the_member_bounds():
    assert run_flags._nnodes("2:4", 3) == (6, 12)
    assert run_flags._nnodes("2", 4) == (8, 8)
    for bad in ("0:2", "3:2", "x", "1:y"):
        with pytest.raises(ConfigError, match="--nnodes"):
            run_flags._nnodes(bad, 1)


def test_the_scripts_own_flags_are_never_taken_for_abbreviations_of_ours(script):
    # --warmup is a prefix of --warmup-timeout and its --warmup_timeout alias: argparse used to
    # refuse it as ambiguous although it follows the script
    args = build_parser().parse_args(["run", "--heartbeat-timeout", "3", script, "--warmup", "20", "--heart", "1"])
    assert args.script_args == ["--warmup", "20", "--heart", "1"] and args.heartbeat_timeout == 3


@pytest.mark.parametrize("value, shown", [("0", "got 0"), ("-1", "got -1"), ("two", "got 'two'")])
def test_a_bad_group_size_exits_2_with_a_clear_message(capsys, value, shown):
    assert main(["run", "--nproc-per-node", "4", "--group-size", value, "x.py"]) == 2
    err = capsys.readouterr().err
    assert "--group-size must be a positive integer" in err and shown in err


def test_group_size_becomes_the_launch_settings_and_the_default_is_one(launched, script):
    assert main(["run", "--nproc-per-node", "8", "--group_size", "4", "--local-ranks-filter", "1", script]) == 0
    s = launched["settings"]
    assert (s.nproc_per_node, s.group_size, s.slots, s.console_ranks) == (8, 4, 2, (1,))
    assert main(["run", "--nproc-per-node", "3", script]) == 0
    assert (launched["settings"].group_size, launched["settings"].slots) == (1, 3)


def test_nnodes_counts_replica_groups_not_processes(launched, script):
    # 2..3 nodes of 8 processes in groups of 4: 2 members per node
    assert main(["run", "--nproc-per-node", "8", "--group-size", "4", "--nnodes", "2:3", script]) == 0
    s = launched["settings"]
    assert (s.min_members, s.max_members) == (4, 6)
    assert main(["run", "--nproc-per-node", "8", "--nnodes", "2:3", script]) == 0
    assert (launched["settings"].min_members, launched["settings"].max_members) == (16, 24)


def test_under_srun_the_expected_members_count_replica_groups(script):
    from unbroken.launch.run_flags import launch_settings

    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_NODEID": "0", "SLURMD_NODENAME": "gpu01"}
    args = build_parser().parse_args(["run", "--nproc-per-node", "4", "--group-size", "2", script])
    assert launch_settings(args, env).expected_members == 6  # 3 nodes x 2 groups


def test_a_generated_token_can_be_passed_back_on_the_command_line(script):
    # A token the launcher makes is copied into other nodes' `--token TOKEN`; one starting with
    # "-" was taken by argparse for a flag (exit 2), one time in 64 with URL-safe tokens.
    from unbroken.launch.launcher import new_token

    tokens = {new_token() for _ in range(2000)}
    assert len(tokens) == 2000 and min(map(len, tokens)) >= 32
    parser = build_parser()
    for token in tokens:
        assert parser.parse_args(["run", "--token", token, script]).token == token
        assert parser.parse_args(["status", "h:1", "--token", token]).token == token


def _placed(*flags: str, warned: list | None = None):
    from unbroken.launch.placement import placement

    args = build_parser().parse_args(["run", *flags, "train.py"])
    return placement(args, {}, 1, warn=(warned.append if warned is not None else None))


def test_rdzv_endpoint_on_the_node_it_names_hosts_the_coordinator_there():
    import socket

    with socket.socket() as s:  # a free port, found by binding port 0
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    place = _placed("--rdzv-endpoint", f"127.0.0.1:{port}")
    assert (place.coordinator, place.host, place.port, place.advertise) == (None, "0.0.0.0", port, "127.0.0.1")


def test_rdzv_endpoint_joins_when_another_launcher_here_holds_the_port_or_the_host_is_elsewhere():
    import socket

    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        assert _placed("--rdzv-endpoint", f"127.0.0.1:{port}").coordinator == f"127.0.0.1:{port}"
    warned: list = []
    place = _placed("--rdzv-endpoint", "192.0.2.7:29400", "--min-members", "4", "--busy-timeout", "60", warned=warned)
    assert place.coordinator == "192.0.2.7:29400"  # TEST-NET-1: never an address of this machine
    assert len(warned) == 2 and "--min-members 4 is ignored on this node" in warned[0] and "--busy-timeout" in warned[1], warned


def test_a_node_joining_with_coordinator_is_told_which_flags_it_ignores():
    warned: list = []
    _placed("--coordinator", "h:1", "--start-grace", "5", "--nnodes", "2", warned=warned)
    assert [w.split()[2] for w in warned] == ["--nnodes", "--start-grace"], warned
    warned.clear()
    _placed("--coordinator", "h:1", "--heartbeat-timeout", "5", warned=warned)  # read by every launcher
    assert warned == []


@pytest.mark.parametrize("endpoint, message", [
    ("node0", "must be HOST:PORT"), ("node0:0", "must be HOST:PORT"), (":29400", "must be HOST:PORT"),
    ("no-such-host.invalid:29400", "cannot resolve"),
])
def test_a_bad_rdzv_endpoint_is_a_config_error_naming_it(endpoint, message):
    with pytest.raises(ConfigError, match=message):
        _placed("--rdzv-endpoint", endpoint)


def test_rdzv_endpoint_with_another_way_to_name_the_coordinator_is_refused():
    with pytest.raises(ConfigError, match="drop --coordinator"):
        _placed("--rdzv-endpoint", "h:1", "--coordinator", "h:2")


@pytest.mark.parametrize("flag", ["-r", "--rdzv-backend=c10d", "--rdzv_id", "--node_rank=1", "--master-port", "--log-dir"])
def test_a_torchrun_flag_unbroken_does_not_take_is_refused_with_ours(capsys, flag):
    with pytest.raises(SystemExit) as exited:
        main(["run", flag, "train.py"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    name = flag.split("=")[0]
    assert f"{name} is torchrun's flag, not unbroken's: " in err and "Traceback" not in err
    ours = {"-r": "its own log", "--rdzv-backend": "--rdzv-endpoint", "--rdzv_id": "--job-id",
            "--node_rank": "--node-name", "--master-port": "--rdzv-endpoint", "--log-dir": "--run-dir"}[name]
    assert ours in err


def test_torchruns_single_node_line_runs_as_it_is(script):
    """`torchrun --standalone --nproc-per-node 2 --shutdown-timeout 5 --local-ranks-filter 1 train.py`."""
    args = build_parser().parse_args(["run", "--standalone", "--run-path", "--nproc-per-node", "2", "--shutdown-timeout", "5",
                                      "--local-ranks-filter", "1", script])
    settings = launch_settings(args, {})
    assert (settings.nproc_per_node, settings.shutdown_grace, settings.console_ranks) == (2, 5.0, (1,))


def test_after_the_script_a_torchrun_flag_is_the_scripts():
    args = build_parser().parse_args(["run", "train.py", "--standalone", "--node_rank", "1"])
    assert args.script_args == ["--standalone", "--node_rank", "1"]


@pytest.mark.parametrize("word, gpus, cpus, expected", [("gpu", 4, 16, 4), ("auto", 4, 16, 4), ("auto", 0, 16, 16), ("cpu", 8, 16, 16)])
def test_nproc_per_node_reads_torchruns_words(monkeypatch, word, gpus, cpus, expected):
    from unbroken.launch import torchrun_habits

    monkeypatch.setattr(torchrun_habits, "_visible_gpus", lambda: gpus)
    monkeypatch.setattr(torchrun_habits.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert torchrun_habits.nproc_per_node(word) == expected


def test_nproc_per_node_gpu_without_a_gpu_says_so(capsys, monkeypatch):
    from unbroken.launch import torchrun_habits

    monkeypatch.setattr(torchrun_habits, "_visible_gpus", lambda: 0)
    assert main(["run", "--nproc-per-node", "gpu", "x.py"]) == 2
    assert "--nproc-per-node gpu: this node has no visible GPU" in capsys.readouterr().err


def test_the_log_level_may_follow_the_command():
    assert build_parser().parse_args(["run", "--log-level", "INFO", "t.py"]).log_level == "INFO"
    assert build_parser().parse_args(["--log-level", "DEBUG", "run", "t.py"]).log_level == "DEBUG"
    assert build_parser().parse_args(["run", "t.py"]).log_level == "WARNING"
    assert build_parser().parse_args(["coordinator", "--log-level", "INFO"]).log_level == "INFO"


def test_a_module_is_run_with_dash_m_and_an_unknown_one_is_refused(capsys, monkeypatch, tmp_path):
    (tmp_path / "mytrain.py").write_text("pass\n")
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["run", "-m", "mytrain", "--lr", "1"])
    settings = run_flags.launch_settings(args, {})  # validated: the module is found from the current directory
    assert (settings.module, settings.script, settings.script_args) == (True, "mytrain", ("--lr", "1"))
    assert main(["run", "-m", "not_a_module_here"]) == 2
    assert "-m not_a_module_here: no module of that name" in capsys.readouterr().err


def test_the_coordinators_defaults_are_the_settings_own():
    from unbroken.coordinator.membership import MembershipSettings
    from unbroken.coordinator.replicated import LeadershipSettings

    args = build_parser().parse_args(["coordinator"])
    fields = MembershipSettings.__dataclass_fields__
    for name in ("min_members", "max_members", "start_grace", "progress_timeout", "warmup_timeout", "busy_timeout",
                 "quorum_timeout", "heartbeat_timeout"):
        assert getattr(args, name) == fields[name].default, name
    assert args.leader_lease == LeadershipSettings.__dataclass_fields__["lease"].default


def test_unbroken_run_freezes_its_heap_before_the_interpreter_exits(tmp_path, capsys):
    # the interpreter's last collection would walk torch's objects (0.2-0.4 s of every run's end)
    gc.unfreeze()
    try:
        assert main(["run", "--run-dir", str(tmp_path / "run"), str(tmp_path / "missing.py")]) == 2
        assert gc.get_freeze_count() > 0
        gc.unfreeze()
        assert main(["report", str(tmp_path / "nothing")]) == 2  # another command: no run directory there
        assert gc.get_freeze_count() == 0  # only `run` freezes
    finally:
        gc.unfreeze()
    assert "training script not found" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["run", "--coordinator-port", "70000", "--nproc-per-node", "1", "train.py"], "a port must be from 0 to 65535, got 70000"),
    (["run", "--coordinator-port", "-1", "--nproc-per-node", "1", "train.py"], "got -1"),
    (["run", "--log-level", "LOUD", "--nproc-per-node", "1", "train.py"], "the log level must be one of"),
    (["--log-level", "LOUD", "status", "127.0.0.1:1"], "the log level must be one of"),
    (["coordinator", "--port", "99999"], "a port must be from 0 to 65535"),
])
def test_bad_ports_and_log_levels_are_refused_with_exit_2_and_one_line(argv, says, capsys):
    from unbroken.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_a_run_directory_that_cannot_be_made_is_refused_with_exit_2(capsys, tmp_path):
    from unbroken.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["run", "--run-dir", str(blocker / "x"), "--nproc-per-node", "1", str(script)]) == 2
    assert "cannot make the run directory" in capsys.readouterr().err


def test_run_help_is_in_sections_with_each_flag_once(capsys):
    """One flat list of 44 flags, each twice (its underscore spelling), was 185 lines."""
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: unbroken run [flags] SCRIPT [script args]")
    assert "workers (torchrun's" in out and "durable checkpoints:" in out
    invocations = [line.split("  ")[1] for line in out.splitlines() if line.startswith("  -")]
    assert "--nproc-per-node NPROC_PER_NODE" in invocations and "--shutdown-grace SHUTDOWN_GRACE" in invocations
    assert not [i for i in invocations if "_" in i.split()[0] or i.split()[0].endswith(",") and i.split()[0] not in ("-h,", "-m,")]
