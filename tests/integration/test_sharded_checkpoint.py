"""Sharded checkpoints with real processes (issue 18): the 2 processes of one replica group (FSDP2,
Gloo) save after 3 AdamW steps; the checkpoint then loads, bit for bit, into other layouts (2
groups of 1 process, 1 group of 3, one plain unsharded process), and 2 more steps there give what
one process computes for the same 5 steps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from testbed import harness
from unbroken.data.data_plan import DataPlan

pytestmark = pytest.mark.slow

IN, HIDDEN, OUT = 5, 7, 3  # odd sizes: shards of 7 rows are uneven over 2 and 3 processes
DATASET, GLOBAL, MICRO = 40, 12, 4
SAVED_AT, MORE = 3, 2
PHASE_TIMEOUT_S = 90.0
TOLERANCE = 1e-12


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(DATASET, IN, generator=g, dtype=torch.float64),
            torch.randn(DATASET, OUT, generator=g, dtype=torch.float64))


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN, dtype=torch.float64), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUT, dtype=torch.float64))


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _loss(model, x, y) -> torch.Tensor:
    return (model(x) - y).pow(2).mean(dim=1).sum() / GLOBAL  # share-weighted (DESIGN step 4)


def _full_state(model, opt) -> dict[str, torch.Tensor]:
    """Parameters and optimizer state, whole (gathered over the group), by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model/{k}": v.detach().clone() for k, v in model_sd.items()}
    for name, state in optim_sd["state"].items():
        out.update({f"optim/{name}/{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    return out


def _single_process(steps: int, model=None, opt=None, start: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """One plain process on the whole global batch of steps [start, start + steps)."""
    x, y = _data()
    plan = DataPlan(DATASET, GLOBAL, MICRO)
    if model is None:
        model = _model()
        opt = _optimizer(model)
    for step in range(start, start + steps):
        for mb in plan.micro_batches(step, 0, 1):
            idx = plan.indices(mb)
            _loss(model, x[idx], y[idx]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _worker(rank: int, world: int, groups: int, init: str, save: bool, ckpt: str, out: str) -> None:
    """One process of ``groups`` replica groups of ``world // groups``: saves after SAVED_AT steps
    (``save``, one group) or loads and trains MORE steps; writes its whole state to ``out``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from unbroken.replica_groups.sharding import local_gradient_shards, process_micro_batches, sum_gradients
    from unbroken.storage.sharded_checkpoint import TrainingState, load_sharded, save_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        size = world // groups
        group, process = divmod(rank, size)
        mesh2d = init_device_mesh("cpu", (groups, size), mesh_dim_names=("replicate", "shard"))
        mesh = mesh2d["shard"]  # the group's own mesh: FSDP inside the group only
        model = _model()
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sum_gradients(model)
        opt = _optimizer(model)
        state = {"train": TrainingState(model, opt)}
        x, y = _data()
        plan = DataPlan(DATASET, GLOBAL, MICRO)

        def train(start: int, steps: int) -> None:
            for step in range(start, start + steps):
                for mb in process_micro_batches(plan, step, group, groups, process, size):
                    idx = plan.indices(mb)
                    _loss(model, x[idx], y[idx]).backward()
                if groups > 1:  # across groups: shard j with shard j, as the runtime will
                    for shard in local_gradient_shards(model):
                        dist.all_reduce(shard, group=mesh2d["replicate"].get_group())
                opt.step()
                opt.zero_grad()

        report: dict = {"rank": rank}
        if save:
            train(0, SAVED_AT)
            report["location"] = save_sharded(ckpt, SAVED_AT, state, mesh.get_group(), {"note": "test"}, model=model, keep=2)
            report["saved"] = _full_state(model, opt)
        else:
            report["manifest"] = load_sharded(ckpt, state, mesh.get_group())
            report["loaded"] = _full_state(model, opt)
            train(SAVED_AT, MORE)
            report["trained"] = _full_state(model, opt)
        torch.save(report, os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(tmp: Path, phase: str, world: int, groups: int, ckpt: str) -> list[dict]:
    """Start ``world`` processes; wait for all within PHASE_TIMEOUT_S; kill whatever is left."""
    out = tmp / phase
    out.mkdir()
    init = f"file://{tmp / (phase + '.store')}"
    args = [(r, world, groups, init, phase == "save", ckpt, str(out)) for r in range(world)]
    harness.spawn_all(_worker, args, PHASE_TIMEOUT_S, phase)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(((a[k] - b[k]).norm() / max(b[k].norm(), 1e-300)).item() for k in b)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)


def test_one_groups_shards_resume_in_other_group_counts_and_sizes_with_the_same_model(tmp_path):
    import torch.distributed.checkpoint  # noqa: F401  (the pytest process loads a plain model below)
    from unbroken.storage.sharded_checkpoint import TrainingState, load_sharded

    torch.set_num_threads(1)
    ckpt = str(tmp_path / "ckpt")
    reference = _full_state(*_single_process(SAVED_AT))
    reference_after = _full_state(*_single_process(SAVED_AT + MORE))

    # 1 group of 2 processes saves at step 3
    saved = _run(tmp_path, "save", world=2, groups=1, ckpt=ckpt)
    assert saved[0]["location"] == f"{ckpt}/step-{SAVED_AT:08d}"
    assert _same(saved[0]["saved"], saved[1]["saved"])
    assert _relative(saved[0]["saved"], reference) < TOLERANCE
    assert sorted(os.listdir(saved[0]["location"])) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]

    # 2 groups of 1 (more groups, smaller), then 1 group of 3 (larger, uneven shards)
    for phase, world, groups in (("groups-2x1", 2, 2), ("groups-1x3", 3, 1)):
        for report in _run(tmp_path, phase, world=world, groups=groups, ckpt=ckpt):
            manifest = report["manifest"]
            assert manifest["step"] == SAVED_AT and manifest["group"]["size"] == 2 and manifest["note"] == "test", phase
            assert _same(report["loaded"], saved[0]["saved"]), f"{phase}: the loaded state is not the saved one"
            assert _relative(report["trained"], reference_after) < TOLERANCE, phase

    # one plain process without torch.distributed, as a user's own tool would read it
    model = _model()
    opt = _optimizer(model)
    manifest = load_sharded(ckpt, {"train": TrainingState(model, opt)})
    assert manifest is not None and manifest["step"] == SAVED_AT
    assert _same(_full_state(model, opt), saved[0]["saved"])
    _single_process(MORE, model, opt, start=SAVED_AT)
    assert _relative(_full_state(model, opt), reference_after) < TOLERANCE
