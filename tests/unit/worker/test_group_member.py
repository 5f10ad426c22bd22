"""A process's place in its replica group: settings from the launcher, the group's vote, and the
plain single-process group that makes a sharded script its own reference."""

import subprocess
import sys
import textwrap

import pytest

from unbroken.errors import ConfigError
from unbroken.worker.group_member import GroupSettings, unanimous


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
        from unbroken.worker import group_member
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
        from unbroken.worker import group_member
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


def _ballots(states, oks=None, extras=None):
    """What each of a group's processes' ballot finds, its ``agree`` summing every process's
    values as the group's all_reduce does."""
    from unbroken.worker.group_member import GroupMember

    size = len(states)
    oks = oks or [True] * size
    sent = []

    class Recording(GroupMember):
        def __init__(self):  # noqa: D107 - no process group: agree() is the stand-in below
            self.size = size

        def agree(self, values):
            sent.append(values)
            return values

    for state, ok, extra in zip(states, oks, extras or [None] * size):
        Recording().ballot(ok, 5, extra, state)
    summed = [sum(column) for column in zip(*sent)]

    class Summing(Recording):
        def agree(self, values):
            return summed

    return [Summing().ballot(ok, 5, extra, state) for state, ok, extra in zip(states, oks, extras or [None] * size)]


def test_a_groups_processes_at_different_steps_or_lineages_do_not_agree():
    """After a heal that failed part-way, process 0 of a group held step 10 and process 1 step 0;
    the vote compared only ok and the generation, and the two trained different steps."""
    digest = (1 << 62) + 12345  # a 63-bit lineage digest: compared exactly, not rounded
    same = _ballots([(10, digest, False), (10, digest, False)])
    assert all(b.ok and b.same_state for b in same)
    for states in ([(10, digest, False), (0, digest, False)],      # the next step
                   [(10, digest, False), (10, digest + 1, False)],  # the lineage, by its last bit
                   [(10, digest, False), (10, digest, True)]):      # freshness
        ballots = _ballots(states)
        assert all(b.ok and not b.same_state for b in ballots), states
    assert [b.sums for b in _ballots([(1, 2, False)] * 2, extras=[[1.0, 0.0], [1.0, 1.0]])] == [[2.0, 1.0]] * 2
    assert not _ballots([(1, 2, False)] * 2, oks=[True, False])[0].ok
