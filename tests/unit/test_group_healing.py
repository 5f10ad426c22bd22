"""Shard-by-shard healing of replica groups (issue 18): the manifest comparison and its refusals
(pure), and transfers through a loopback: the sender and the receiver are two threads of this
process, each with its rank of a Gloo channel over one in-memory store."""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from unbroken import group_healing, healing
from unbroken.errors import ConfigError
from unbroken.group import GenerationGroup
from unbroken.group_healing import (
    ShardCorrupt,
    ShardManifest,
    check_manifests,
    differences,
    fan_out,
    manifest_of,
    recv_shard,
    send_shard,
)
from unbroken.replica_groups import GroupMismatch, local_state_shards

torch.set_num_threads(1)

THREAD_TIMEOUT_S = 30.0


def _manifest(**changes) -> ShardManifest:
    base = ShardManifest(
        shard=1, group_size=2, sharding="abc", param_groups=(4,),
        layout=(("model/0.weight", (3, 4), "torch.float64"), ("model/0.bias", (3,), "torch.float64"),
                ("optim/0.weight/exp_avg", (3, 4), "torch.float64")),
    )
    return replace(base, **changes)


# -- the manifest (pure) -----------------------------------------------------------------------------


def test_equal_manifests_have_no_differences_and_pass():
    assert differences(_manifest(), _manifest()) == []
    check_manifests(_manifest(), _manifest())


def test_a_group_of_another_size_is_refused_naming_both_sizes():
    with pytest.raises(GroupMismatch, match="the sending group has 2 processes but the receiving group has 1") as caught:
        check_manifests(_manifest(), _manifest(group_size=1, shard=0))
    assert isinstance(caught.value, ConfigError) and "--group-size" in str(caught.value)


def test_another_shard_index_another_sharding_or_optimizer_is_named():
    assert differences(_manifest(), _manifest(shard=0)) == [
        "process 1 of the sending group cannot heal process 0 (shard indices differ)"]
    [sharding] = differences(_manifest(), _manifest(sharding="xyz"))
    assert "fingerprint abc sent, xyz here" in sharding
    [groups] = differences(_manifest(), _manifest(param_groups=(2, 2)))
    assert "parameter groups of [4] parameters sent, [2, 2] here" in groups


def test_different_tensors_are_named_missing_unexpected_or_by_shape():
    layout = _manifest().layout
    [text] = differences(_manifest(), _manifest(layout=layout[:2]))
    assert "unexpected ['optim/0.weight/exp_avg']" in text
    [text] = differences(_manifest(layout=layout[:2]), _manifest())
    assert "missing ['optim/0.weight/exp_avg']" in text
    wider = (("model/0.weight", (3, 5), "torch.float64"),) + layout[1:]
    [text] = differences(_manifest(), _manifest(layout=wider))
    assert "model/0.weight [3, 4] torch.float64 sent, [3, 5] torch.float64 here" in text
    [text] = differences(_manifest(), _manifest(layout=(layout[1], layout[0], layout[2])))
    assert "another order" in text


def test_the_model_part_alone_ignores_the_optimizer():
    layout = _manifest().layout
    fresh = _manifest(layout=layout[:2], param_groups=(3,))
    assert differences(_manifest(), fresh, model_only=True) == []
    assert len(differences(_manifest(), fresh)) == 2


def test_a_sender_of_another_version_is_refused_alone():
    assert differences(_manifest(version=99), _manifest(group_size=5)) == [
        "the sender speaks shard-healing version 99, this process 1 (the groups run different versions of unbroken)"]


def test_the_manifest_travels_as_json_and_back():
    m = _manifest()
    assert ShardManifest.from_bytes(m.to_bytes()) == m


def test_a_shard_index_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="shard index 2"):
        manifest_of(torch.nn.Linear(2, 2), None, 2, 2)


# -- loopback transfers ------------------------------------------------------------------------------


def _run_ranks(*bodies, timeout: float = 10.0) -> list:
    """Run each body(channel) on a thread of its own with rank i of one Gloo channel; results or
    exceptions by rank. Fails the test if a thread is still running after THREAD_TIMEOUT_S."""
    store = dist.HashStore()
    results: list = [None] * len(bodies)

    def run(rank: int) -> None:
        try:
            channel = GenerationGroup(7, rank, len(bodies), [f"g{i}" for i in range(len(bodies))], lambda: None,
                                      threading.Event(), timeout)
            channel.connect(store, "gen7/heal/shard0/", "127.0.0.1")
            results[rank] = bodies[rank](channel)
        except BaseException as exc:  # noqa: BLE001  (handed to the test)
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(THREAD_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a loopback rank did not finish"
    return results


def _plain(seed: int, hidden: int = 6):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden, dtype=torch.float64), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, 2, dtype=torch.float64), torch.nn.BatchNorm1d(2, dtype=torch.float64))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)


def _step(model, opt, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(5, 4, generator=g, dtype=torch.float64)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _copy(model, opt) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in local_state_shards(model, opt).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _live_and_fresh(make=_plain):
    live, live_opt = make(0)
    for s in range(3):
        _step(live, live_opt, s)
    live_opt.param_groups[0]["lr"] = 0.0123  # as a scheduler would have set it
    fresh, fresh_opt = make(1)
    return live, live_opt, fresh, fresh_opt


def test_a_fresh_replica_is_healed_bit_for_bit_and_steps_as_the_live_one():
    live, live_opt, fresh, fresh_opt = _live_and_fresh()
    extra = {"step": 3, "rng": healing.rng_state(), "scheduler": {"last_epoch": 3}}
    sent, (got, received) = _run_ranks(
        lambda ch: send_shard(ch, 1, live, live_opt, shard=0, group_size=1, extra=extra),
        lambda ch: recv_shard(ch, 0, fresh, fresh_opt, shard=0, group_size=1),
    )
    assert sent.bytes == received.bytes > 0 and received.role == "receive"
    assert got["step"] == 3 and got["scheduler"] == {"last_epoch": 3} and torch.equal(got["rng"]["torch"], extra["rng"]["torch"])
    assert _same(_copy(fresh, fresh_opt), _copy(live, live_opt))
    assert fresh_opt.param_groups[0]["lr"] == 0.0123
    _step(live, live_opt, 9)
    _step(fresh, fresh_opt, 9)
    assert _same(_copy(fresh, fresh_opt), _copy(live, live_opt))


def test_large_and_non_contiguous_tensors_are_received_in_place(monkeypatch):
    monkeypatch.setattr(healing, "LARGE_BYTES", 64)  # every tensor of 8 doubles or more goes as slices
    monkeypatch.setattr(healing, "MESSAGE_BYTES", 40)  # of 5 doubles: many slices per tensor
    live, live_opt, fresh, fresh_opt = _live_and_fresh()
    weight = fresh[0].weight
    fresh[0].weight.data = weight.data.t().contiguous().t()  # same shape, not contiguous
    assert not fresh[0].weight.is_contiguous()
    _run_ranks(lambda ch: send_shard(ch, 1, live, live_opt, shard=0, group_size=1),
               lambda ch: recv_shard(ch, 0, fresh, fresh_opt, shard=0, group_size=1))
    assert _same(_copy(fresh, fresh_opt), _copy(live, live_opt))


def test_an_fsdp2_shard_is_healed_through_the_loopback(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.FileStore(os.fspath(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))

        def sharded(seed: int):
            model, _ = _plain(seed)
            fully_shard(model[0], mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)

        live, live_opt, fresh, fresh_opt = _live_and_fresh(sharded)
        assert type(live[0].weight).__name__ == "DTensor"
        _run_ranks(lambda ch: send_shard(ch, 1, live, live_opt, shard=0, group_size=1),
                   lambda ch: recv_shard(ch, 0, fresh, fresh_opt, shard=0, group_size=1))
        assert _same(_copy(fresh, fresh_opt), _copy(live, live_opt))
        _step(live, live_opt, 9)
        _step(fresh, fresh_opt, 9)
        assert _same(_copy(fresh, fresh_opt), _copy(live, live_opt))
    finally:
        dist.destroy_process_group()


def test_a_different_model_is_refused_on_both_sides_before_anything_is_written():
    live, live_opt = _plain(0)
    _step(live, live_opt)
    other, other_opt = _plain(1, hidden=7)
    before = _copy(other, other_opt)
    sent, received = _run_ranks(lambda ch: send_shard(ch, 1, live, live_opt, shard=0, group_size=1),
                                lambda ch: recv_shard(ch, 0, other, other_opt, shard=0, group_size=1))
    for outcome in (sent, received):
        assert isinstance(outcome, GroupMismatch), outcome
        assert "sharded differently" in str(outcome) and "0.weight [6, 4] torch.float64 sent, [7, 4] torch.float64 here" in str(outcome)
    assert _same(_copy(other, other_opt), before) and not other_opt.state  # not even the optimizer's lazy state


def test_a_group_of_another_size_is_refused_through_the_channel():
    live, live_opt = _plain(0)
    _step(live, live_opt)
    fresh, fresh_opt = _plain(1)
    sent, received = _run_ranks(lambda ch: send_shard(ch, 1, live, live_opt, shard=0, group_size=2),
                                lambda ch: recv_shard(ch, 0, fresh, fresh_opt, shard=0, group_size=1))
    assert isinstance(sent, GroupMismatch) and isinstance(received, GroupMismatch)
    assert "the sending group has 2 processes but the receiving group has 1" in str(received)


def test_a_shard_corrupted_on_the_way_fails_verification_on_both_sides_naming_the_tensor():
    live, live_opt, fresh, fresh_opt = _live_and_fresh()

    def receive_through_a_faulty_link(channel):
        recv = channel.recv
        flipped = []

        def faulty(tensor, src, tag, what):
            recv(tensor, src, tag, what)
            if tag == group_healing.TAG_PACK and not flipped:  # one bit of the first pack of tensors
                tensor.view(torch.uint8)[3] ^= 1
                flipped.append(tag)

        channel.recv = faulty
        return recv_shard(channel, 0, fresh, fresh_opt, shard=0, group_size=1)

    sent, received = _run_ranks(lambda ch: send_shard(ch, 1, live, live_opt, shard=0, group_size=1),
                                receive_through_a_faulty_link)
    assert isinstance(sent, ShardCorrupt) and isinstance(received, ShardCorrupt), (sent, received)
    assert "['model/0.weight'] differ from the sender's" in str(received)


def test_the_fan_out_schedule_drives_shard_healing_over_the_groups_ranks():
    live, live_opt, fresh1, opt1 = _live_and_fresh()
    fresh2, opt2 = _plain(2)
    fresh3, opt3 = _plain(3)
    plan = healing.plan([(3, False, 5), (0, True, 0), (0, True, 0), (0, True, 0)])
    assert healing.rounds(plan, 4) == [[(0, 1)], [(0, 2), (1, 3)]]  # rank 1 sends on once healed
    models = [(live, live_opt), (fresh1, opt1), (fresh2, opt2), (fresh3, opt3)]
    results = _run_ranks(*[
        (lambda ch, m=m, o=o: fan_out(ch, plan, m, o, shard=0, group_size=1, extra={"step": 3})) for m, o in models
    ])
    assert [received for received, _ in results] == [None, {"step": 3}, {"step": 3}, {"step": 3}]
    assert [[r.role for r in reports] for _, reports in results] == [["send", "send"], ["receive", "send"], ["receive"], ["receive"]]
    for model, opt in models[1:]:
        assert _same(_copy(model, opt), _copy(live, live_opt))
