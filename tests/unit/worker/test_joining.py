"""The joiner's refusals in a replica group: process 0's refusal reaches processes 1..K-1, which
exit with the same status, so the launcher stops the group whichever process exits first."""

from __future__ import annotations

import types

import pytest
import torch.distributed as dist

from unbroken.errors import EXIT_MISMATCH
from unbroken.observe import refusal_mark
from unbroken.replica_groups.group_relay import GroupRelay
from unbroken.worker.joining import Joiner


def _process(relay: GroupRelay, run_dir: str) -> Joiner:
    stopped: list[bool] = []
    group = types.SimpleNamespace(grouped=True, leader=relay.rank == 0, relay=relay)
    job = types.SimpleNamespace(_group=group, member_id="b.w0.r0", _stop=lambda finished: stopped.append(finished),
                                settings=types.SimpleNamespace(join_timeout=5.0), run_dir=run_dir)
    joiner = Joiner(job)
    joiner.stopped = stopped
    return joiner


def test_a_refusal_of_process_0_ends_every_process_of_its_group_with_the_same_status(capsys, tmp_path):
    (tmp_path / "workers").mkdir()
    store = dist.HashStore()
    first, second = (_process(GroupRelay(store, r, 2, prefix="g/0/", peer_timeout=1.0), str(tmp_path)) for r in range(2))
    with pytest.raises(SystemExit) as ended:
        first._refuse_on({"status": "mismatch", "reason": "group size: 3 here, 2 in the job"})
    assert ended.value.code == EXIT_MISMATCH and first.stopped == [False]
    # the launcher reads the refusal whichever process of the group exits first
    assert refusal_mark.read(str(tmp_path), "b.w0.r0") == EXIT_MISMATCH
    with pytest.raises(SystemExit) as followed:
        second._join_relayed(second.job._group, deadline=0.0)
    assert followed.value.code == EXIT_MISMATCH and second.stopped == [False]
    assert capsys.readouterr().err.count("group size: 3 here, 2 in the job") == 2
