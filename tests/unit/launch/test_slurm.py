"""SLURM: host lists and what `unbroken run` takes from SLURM's environment."""

import pytest

from unbroken.launch import slurm
from unbroken.cli import build_parser
from unbroken.launch.run_flags import launch_settings
from unbroken.errors import ConfigError


@pytest.mark.parametrize(
    "text, names",
    [
        ("node1", ["node1"]),
        ("gpu[01-03]", ["gpu01", "gpu02", "gpu03"]),
        ("gpu[01-02,07],login1", ["gpu01", "gpu02", "gpu07", "login1"]),
        ("a[8-11]-ib", ["a8-ib", "a9-ib", "a10-ib", "a11-ib"]),
        ("x[1],y[2-3]", ["x1", "y2", "y3"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ],
)
def test_slurm_host_lists_expand_to_node_names(text, names, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: python-hostlist reads it
    assert slurm.expand_hostlist(text) == names


def test_scontrol_expands_the_host_list_where_slurm_is_installed(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "from-scontrol-%s\\n" "$3"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert slurm.expand_hostlist("gpu[01-02]") == ["from-scontrol-gpu[01-02]"]


@pytest.mark.parametrize("text", ["gpu[01-", "gpu[a-b]", "gpu]1[", " "])
def test_an_unreadable_host_list_is_a_clear_error(text, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match="SLURM host list"):
        slurm.expand_hostlist(text)


ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_NODEID": "1", "SLURMD_NODENAME": "gpu02"}


def test_outside_slurm_nothing_is_taken_from_the_environment():
    assert slurm.from_env({}) is None


def test_a_node_learns_its_name_and_the_first_node_as_coordinator():
    node = slurm.from_env(ENV)
    assert node.node == "gpu02" and node.node_index == 1 and not node.hosts_coordinator
    assert node.coordinator == "gpu01:29400"
    assert slurm.from_env({**ENV, "SLURM_NODEID": "0", "UNBROKEN_COORDINATOR_PORT": "31000"}).coordinator == "gpu01:31000"


@pytest.mark.parametrize("env, message", [({"SLURM_JOB_ID": "1"}, "SLURM_JOB_NODELIST"), ({**ENV, "SLURM_NODEID": "9"}, "SLURM_NODEID=9")])
def test_inconsistent_slurm_variables_are_clear_errors(env, message):
    with pytest.raises(ConfigError, match=message):
        slurm.from_env(env)


def _args(tmp_path, *extra):
    script = tmp_path / "train.py"
    script.write_text("")
    return build_parser().parse_args(["run", "--nproc-per-node", "4", *extra, str(script)])


def test_under_srun_the_first_node_hosts_the_coordinator_for_every_node(tmp_path):
    first = launch_settings(_args(tmp_path), {**ENV, "SLURM_NODEID": "0", "SLURMD_NODENAME": "gpu01"})
    assert first.coordinator is None and first.coordinator_host == "0.0.0.0" and first.coordinator_port == 29400
    assert first.coordinator_advertise == "gpu01" and first.expected_members == 12 and first.node == "gpu01"
    other = launch_settings(_args(tmp_path), ENV)
    assert other.coordinator == "gpu01:29400" and other.node == "gpu02"


def test_explicit_flags_beat_slurm(tmp_path):
    settings = launch_settings(_args(tmp_path, "--coordinator", "head:1234", "--node-name", "mine"), ENV)
    assert settings.coordinator == "head:1234" and settings.node == "mine"


def test_with_ha_the_first_three_nodes_run_etcd_and_every_node_a_coordinator_candidate(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    env = {**ENV, "SLURM_JOB_NODELIST": "gpu[01-04]"}
    second = launch_settings(_args(tmp_path, "--ha"), env)
    assert second.etcd == "gpu01:2379,gpu02:2379,gpu03:2379" and second.job_id == "slurm-42"
    assert second.etcd_member.name == "m1" and second.etcd_member.host == "gpu02" and second.etcd_member.listen_host == "0.0.0.0"
    assert "m0=http://gpu01:2380" in second.etcd_member.initial_cluster
    assert second.coordinator == "gpu01:29400,gpu02:29400,gpu03:29400,gpu04:29400"
    assert second.coordinator_host == "0.0.0.0" and second.coordinator_advertise == "gpu02" and second.expected_members == 16
    fourth = launch_settings(_args(tmp_path, "--ha", "--etcd-port", "3000"), {**env, "SLURM_NODEID": "3", "SLURMD_NODENAME": "gpu04"})
    assert fourth.etcd_member is None and fourth.etcd == "gpu01:3000,gpu02:3000,gpu03:3000"


@pytest.mark.parametrize(
    "env, which, message",
    [
        ({**ENV, "SLURM_JOB_NODELIST": "gpu[01-02]"}, "/usr/bin/etcd", "at least 3 nodes"),
        (ENV, None, "etcd binary on PATH"),
        ({}, "/usr/bin/etcd", "under SLURM"),
    ],
)
def test_ha_without_three_nodes_etcd_or_slurm_is_a_clear_error(tmp_path, monkeypatch, env, which, message):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: which)
    with pytest.raises(ConfigError, match=message):
        launch_settings(_args(tmp_path, "--ha"), env)


def test_etcd_outside_slurm_binds_every_interface_and_needs_a_job_id(tmp_path):
    settings = launch_settings(_args(tmp_path, "--etcd", "e1:2379,e2:2379", "--job-id", "j", "--node-name", "n1"), {})
    assert settings.coordinator_host == "0.0.0.0" and settings.coordinator_advertise == "n1" and settings.coordinator is None
    pod = launch_settings(_args(tmp_path, "--etcd", "e1:2379", "--job-id", "j", "--coordinator-advertise", "10.0.0.7"), {})
    assert pod.coordinator_advertise == "10.0.0.7" and pod.coordinator_host == "0.0.0.0"
    with pytest.raises(ConfigError, match="--job-id"):
        launch_settings(_args(tmp_path, "--etcd", "e1:2379"), {})
