"""Sharded checkpoints in one process: the DCP round trip, publishing by the manifest, skipping and
refusing what does not verify, refusing another model, retention (the multi-process resharding is
in tests/integration/test_sharded_checkpoint.py)."""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch
import torch.distributed as dist

from unbroken.storage.checkpoint import CheckpointStore
from unbroken.storage.sharded_checkpoint import (
    FORMAT,
    CheckpointCorrupt,
    CheckpointMismatch,
    ShardedSaver,
    TrainingState,
    load_sharded,
    save_sharded,
)

torch.set_num_threads(1)


def _model(seed: int = 0, hidden: int = 6) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden, dtype=torch.float64), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 2, dtype=torch.float64))


def _trained(seed: int = 0, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.ones(3, 4, dtype=torch.float64)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(seed=99)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out += [v.clone() for _, v in sorted(opt.state[p].items())]
    return out


def test_a_saved_state_loads_back_bit_for_bit_with_its_manifest(tmp_path):
    model, opt = _trained()
    where = save_sharded(str(tmp_path), 7, {"train": TrainingState(model, opt), "extra": {"epoch": 3}},
                         meta={"generation": 4}, model=model)
    assert where == f"{tmp_path}/step-00000007"
    assert sorted(os.listdir(where)) == [".metadata", "__0_0.distcp", "manifest.json"]  # no staging left
    fresh, fresh_opt = _fresh()
    state = {"train": TrainingState(fresh, fresh_opt), "extra": {"epoch": 0}}
    manifest = load_sharded(str(tmp_path), state)
    assert manifest is not None
    assert manifest["format"] == FORMAT and manifest["step"] == 7 and manifest["generation"] == 4
    assert manifest["group"]["size"] == 1 and len(manifest["group"]["sharding"]) == 16
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp"]
    assert all(e["bytes"] == os.path.getsize(f"{where}/{f}") for f, e in manifest["files"].items())
    assert state["extra"] == {"epoch": 3}
    for a, b in zip(_flat(fresh, fresh_opt), _flat(model, opt), strict=True):
        assert torch.equal(a, b)
    # the same next step: the optimizer's state (step count, moments) came back too
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(torch.ones(3, 4, dtype=torch.float64)).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_users_dcp_tools_read_it_without_unbroken(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    model, _ = _trained()
    where = save_sharded(str(tmp_path), 1, {"model": model.state_dict()})
    target = {"model": _model(seed=5).state_dict()}
    dcp.load(target, checkpoint_id=where, no_dist=True)
    assert all(torch.equal(target["model"][k], v) for k, v in model.state_dict().items())
    dcp_to_torch_save(where, str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert all(torch.equal(whole["model"][k], v) for k, v in model.state_dict().items())


def test_an_empty_directory_has_nothing_to_load(tmp_path):
    assert load_sharded(str(tmp_path / "none"), {"model": _model().state_dict()}) is None


def test_a_save_cut_short_is_invisible_and_retention_removes_it(tmp_path, monkeypatch):
    url = str(tmp_path)
    model, opt = _trained()
    save_sharded(url, 1, {"model": model.state_dict()})

    def dies(self, name, manifest):
        raise OSError("storage went away")

    with monkeypatch.context() as m:  # data moved into place, manifest never written
        m.setattr(CheckpointStore, "publish", dies)
        with pytest.raises(OSError, match="storage went away"):
            save_sharded(url, 2, {"model": model.state_dict()})
    with monkeypatch.context() as m:  # cut short before the rename: a staging directory remains
        m.setattr(CheckpointStore, "move_into_place", lambda self, tmp, name: (_ for _ in ()).throw(OSError("killed")))
        with pytest.raises(OSError, match="killed"):
            save_sharded(url, 3, {"model": model.state_dict()})
    assert os.path.isdir(tmp_path / "step-00000002")
    assert any(n.startswith(".step-00000003.tmp-") for n in os.listdir(tmp_path))
    manifest = load_sharded(url, {"model": _model(seed=5).state_dict()})
    assert manifest is not None and manifest["step"] == 1
    save_sharded(url, 4, {"model": model.state_dict()}, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["step-00000004"]


def test_retention_keeps_the_newest_by_write_time(tmp_path):
    model, _ = _trained()
    for step in (1, 2, 3, 4):
        save_sharded(str(tmp_path), step, {"model": model.state_dict()}, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000004"]


def _corrupt(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda p: _corrupt(p), "does not match its checksum"),
    (lambda p: os.truncate(p, os.path.getsize(p) - 7), "bytes, the manifest says"),
    (lambda p: os.remove(p), "is missing"),
], ids=["flipped-byte", "truncated", "missing"])
def test_a_damaged_shard_is_skipped_for_the_previous_checkpoint_or_refused_when_asked_for(tmp_path, damage, message, capsys):
    url = str(tmp_path)
    old, _ = _trained(steps=1)
    new, _ = _trained(steps=2)
    save_sharded(url, 1, {"model": old.state_dict()})
    save_sharded(url, 2, {"model": new.state_dict()})
    damage(str(tmp_path / "step-00000002" / "__0_0.distcp"))
    target = {"model": _model(seed=5).state_dict()}
    with pytest.raises(CheckpointCorrupt, match=message):
        load_sharded(url, target, step=2)
    manifest = load_sharded(url, target)
    assert manifest is not None and manifest["step"] == 1
    assert "skipping checkpoint" in capsys.readouterr().out
    assert all(torch.equal(target["model"][k], v) for k, v in old.state_dict().items())


def test_a_manifest_that_is_not_a_sharded_checkpoints_is_refused(tmp_path):
    model, _ = _trained()
    save_sharded(str(tmp_path), 1, {"model": model.state_dict()})
    path = tmp_path / "step-00000001" / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "format": 1}))
    with pytest.raises(CheckpointCorrupt, match="not a sharded checkpoint's"):
        load_sharded(str(tmp_path), {"model": model.state_dict()}, step=1)
    path.write_text("{not json")
    with pytest.raises(CheckpointCorrupt, match="manifest unreadable"):
        load_sharded(str(tmp_path), {"model": model.state_dict()}, step=1)


def test_another_model_is_refused_before_anything_is_loaded(tmp_path):
    model, opt = _trained()
    save_sharded(str(tmp_path), 1, {"train": TrainingState(model, opt)})
    wider = _model(seed=5, hidden=8)
    before = [p.detach().clone() for p in wider.parameters()]
    with pytest.raises(CheckpointMismatch, match="Size mismatch.*group size and the number of groups may differ"):
        load_sharded(str(tmp_path), {"train": TrainingState(wider, torch.optim.AdamW(wider.parameters()))})
    assert all(torch.equal(a, b) for a, b in zip(before, wider.parameters()))
    with pytest.raises(CheckpointMismatch, match="Missing key"):
        load_sharded(str(tmp_path), {"train": TrainingState(model, opt), "scheduler": {"last_epoch": 0}})


def test_meta_may_not_overwrite_the_manifests_own_keys(tmp_path):
    with pytest.raises(ValueError, match=r"\['files', 'step'\]"):
        save_sharded(str(tmp_path), 1, {"model": _model().state_dict()}, meta={"step": 2, "files": {}})
    assert not os.path.exists(tmp_path / "step-00000001")


def test_an_fsdp2_state_in_a_one_process_group_round_trips(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def sharded(seed):
            model = _model(seed)
            fully_shard(model[0], mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

        model, opt = sharded(0)
        for _ in range(2):
            model(torch.ones(3, 4, dtype=torch.float64)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        save_sharded(str(tmp_path / "ckpt"), 2, {"train": TrainingState(model, opt)}, mesh.get_group(), model=model)
        fresh, fresh_opt = sharded(7)
        manifest = load_sharded(str(tmp_path / "ckpt"), {"train": TrainingState(fresh, fresh_opt)}, mesh.get_group())
        assert manifest is not None and manifest["step"] == 2
        for a, b in zip(_flat(fresh, fresh_opt), _flat(model, opt), strict=True):
            assert torch.equal(a.full_tensor() if hasattr(a, "full_tensor") else a, b.full_tensor() if hasattr(b, "full_tensor") else b)
    finally:
        dist.destroy_process_group()
        gc.collect()  # the FSDP models' cycles hold the groups: destroy them here, not in a later test's fork


def test_the_background_saver_writes_the_state_of_its_step_while_training_goes_on(tmp_path, monkeypatch):
    import threading

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from unbroken.storage import sharded_checkpoint

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = _model(0)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def train():
            model(torch.ones(3, 4, dtype=torch.float64)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()

        train()
        at_save = [p.full_tensor().clone() for p in model.parameters()]
        trained_on = threading.Event()
        real_save = sharded_checkpoint.save_sharded

        def held_until_training_went_on(*args, **kwargs):
            assert trained_on.wait(30)
            return real_save(*args, **kwargs)

        monkeypatch.setattr(sharded_checkpoint, "save_sharded", held_until_training_went_on)
        done = []
        saver = ShardedSaver(CheckpointStore(str(tmp_path / "ckpt")), 2, done.append, dist.new_group(backend="gloo"), model)
        stall = saver.save(1, {"train": TrainingState(model, opt)}, {"generation": 3})
        assert stall is not None and saver.busy()
        assert saver.save(2, {"train": TrainingState(model, opt)}, {}) is None  # one write in flight
        train()  # the next step changes the parameters in place while the write waits
        trained_on.set()
        saver.wait(60)
        assert not saver.busy() and saver.error is None
        assert [(d["step"], d["processes"]) for d in done] == [(1, 1)] and done[0]["location"].endswith("step-00000001")
        fresh = _model(9)
        fully_shard(fresh, mesh=mesh)
        manifest = load_sharded(str(tmp_path / "ckpt"), {"train": TrainingState(fresh)})
        assert manifest is not None and manifest["generation"] == 3
        assert all(torch.equal(p.full_tensor(), q) for p, q in zip(fresh.parameters(), at_save, strict=True))
        assert not all(torch.equal(p.full_tensor(), q) for p, q in zip(model.parameters(), at_save))
    finally:
        dist.destroy_process_group()
        gc.collect()  # the FSDP models' cycles hold the groups: destroy them here, not in a later test's fork


def test_any_fsspec_url_works_with_the_manifest_written_last(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    url = f"memory://sharded-{os.getpid()}/run"
    try:
        model, opt = _trained()
        save_sharded(url, 3, {"train": TrainingState(model, opt)})
        save_sharded(url, 5, {"train": TrainingState(model, opt)}, keep=1)
        names = sorted(p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1] for p in fs.find(f"/sharded-{os.getpid()}"))
        assert names == ["step-00000005/.metadata", "step-00000005/__0_0.distcp", "step-00000005/manifest.json"]
        fresh, fresh_opt = _fresh()
        manifest = load_sharded(url, {"train": TrainingState(fresh, fresh_opt)})
        assert manifest is not None and manifest["step"] == 5
        assert all(torch.equal(a, b) for a, b in zip(_flat(fresh, fresh_opt), _flat(model, opt), strict=True))
    finally:
        fs.rm(f"/sharded-{os.getpid()}", recursive=True)
