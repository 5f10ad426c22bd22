"""A process's place in its replica group: settings from the launcher, the group's vote, and the
plain single-process group that makes a sharded script its own reference."""

import subprocess
import sys
import textwrap

import pytest

from unbroken.errors import ConfigError
from unbroken.group_member import GroupSettings, unanimous


def _env(monkeypatch, **values):
    for name in ("UNBROKEN_GROUP_SIZE", "UNBROKEN_RANK_IN_GROUP", "UNBROKEN_GROUP_STORE", "UNBROKEN_GROUP_PREFIX", "UNBROKEN_GROUP_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(f"UNBROKEN_{name.upper()}", value)


def test_without_the_launcher_a_process_is_a_group_of_one(monkeypatch):
    _env(monkeypatch)
    assert GroupSettings.from_env() == GroupSettings()


def test_the_launcher_s_variables_are_read(monkeypatch):
    _env(monkeypatch, group_size="2", rank_in_group="1", group_store="127.0.0.1:1234", group_prefix="unbroken/group/a.w0/0/", group_timeout="4.5")
    assert GroupSettings.from_env() == GroupSettings(2, 1, "127.0.0.1:1234", "unbroken/group/a.w0/0/", 4.5)


@pytest.mark.parametrize(
    "values, words",
    [
        ({"group_size": "2", "rank_in_group": "2", "group_store": "h:1", "group_prefix": "p/"}, "not in 0..1"),
        ({"group_size": "two"}, "UNBROKEN_GROUP_SIZE='two' is not a number"),
        ({"group_size": "2", "rank_in_group": "0"}, "needs UNBROKEN_GROUP_STORE"),
    ],
)
def test_bad_variables_are_refused_with_what_to_do(monkeypatch, values, words):
    _env(monkeypatch, **values)
    with pytest.raises(ConfigError, match=words):
        GroupSettings.from_env()


def test_the_vote_is_unanimous_only_when_nobody_failed_in_the_same_generation():
    # sums over 2 processes of [failed, generation, generation**2]
    assert unanimous([0, 14, 98], 2)  # both in generation 7
    assert not unanimous([1, 14, 98], 2)  # one failed
    assert not unanimous([0, 15, 113], 2)  # generations 7 and 8: the same sum of failures, another variance
    assert unanimous([0, 7, 49], 1)


def _run(code: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, env=env)


def test_a_sharded_script_run_alone_is_a_group_of_one_and_votes_alone():
    result = _run(
        """
        import torch.distributed as dist
        import unbroken
        from unbroken import group_member
        mesh = unbroken.group_mesh()
        group = group_member.current()
        assert mesh.size() == 1 and dist.get_world_size() == 1
        assert not group.grouped and group.leader
        assert group.vote(True, 3) == (True, [])
        assert group.agree([1.5, 2.0]) == [1.5, 2.0]
        assert unbroken.group_mesh().size() == 1  # a second call: the same group
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_a_process_of_a_group_that_never_made_its_mesh_is_told_to_call_group_mesh():
    result = _run(
        """
        import os
        import torch
        os.environ.update(UNBROKEN_COORDINATOR="127.0.0.1:9", UNBROKEN_GROUP_SIZE="2", UNBROKEN_RANK_IN_GROUP="0",
                          UNBROKEN_GROUP_STORE="127.0.0.1:9", UNBROKEN_GROUP_PREFIX="p/")
        import unbroken
        from unbroken.errors import ConfigError
        model = torch.nn.Linear(2, 1)
        try:
            unbroken.Job(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.TensorDataset(torch.zeros(4, 2)), global_batch_size=2)
        except ConfigError as exc:
            print(exc)
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "did not call unbroken.group_mesh()" in result.stdout


def test_close_destroys_only_the_process_groups_the_group_made():
    result = _run(
        """
        import torch.distributed as dist
        import unbroken
        from unbroken import group_member
        unbroken.group_mesh()
        group = group_member.current()
        group.close()  # what the runtime does at a clean exit
        assert not dist.is_initialized() and group_member.current() is None
        # a script that made torch.distributed's group itself keeps it
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        unbroken.group_mesh()
        group_member.current().close()
        assert dist.is_initialized()
        dist.destroy_process_group()
        print("ok")
        """
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
