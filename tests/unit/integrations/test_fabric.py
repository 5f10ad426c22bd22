"""unbroken's Fabric in a single process: a Fabric loop trains on unbroken's steps (the model of
plain SGD on each step's global batch), and what it cannot support is refused by name."""

import copy
import os

import pytest
import torch

from unbroken.errors import ConfigError
from unbroken.integrations.fabric import Fabric, UnsupportedFeature
from unbroken.worker.job_state import check_sendable


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in list(os.environ):
        if name.startswith("UNBROKEN_"):
            monkeypatch.delenv(name)


def _objects(n: int = 64):
    torch.manual_seed(0)
    x = torch.randn(n, 3, dtype=torch.float64)
    model = torch.nn.Linear(3, 1).double()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)),
                                         batch_size=4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loader


def test_a_fabric_loop_commits_one_step_per_accumulation_and_equals_sgd_on_the_global_batch():
    model, optimizer, loader = _objects()
    reference = copy.deepcopy(model)
    fabric = Fabric(accumulate=2, max_steps=3, accelerator="cpu")
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    batches = []
    for x, y in loader:
        batches.append((x, y))
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        fabric.clip_gradients(model, optimizer, max_norm=100.0)
        optimizer.step()
        optimizer.zero_grad()
    fabric.end()
    assert len(batches) == 6 and fabric.job.next_step == 3 and fabric.is_global_zero and fabric.world_size == 1
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for s in range(3):
        ref_opt.zero_grad()
        xs = torch.cat([batches[2 * s][0], batches[2 * s + 1][0]])
        ys = torch.cat([batches[2 * s][1], batches[2 * s + 1][1]])
        torch.nn.functional.mse_loss(reference(xs), ys).backward()
        ref_opt.step()
    assert torch.allclose(model.weight, reference.weight, rtol=1e-12, atol=0)


@pytest.mark.parametrize("argument, named", [({"devices": 2}, "devices=2"), ({"strategy": "ddp"}, "strategy='ddp'"),
                                             ({"precision": "bf16-mixed"}, "precision")])
def test_fabric_features_unbroken_cannot_keep_are_refused_by_name(argument, named):
    with pytest.raises(UnsupportedFeature, match=named):
        Fabric(**argument)


def test_loaders_before_the_model_and_unsupported_methods_say_what_to_do():
    model, optimizer, loader = _objects()
    fabric = Fabric(accelerator="cpu")
    with pytest.raises(ConfigError, match=r"call fabric.setup\(model, optimizer\) before"):
        fabric.setup_dataloaders(loader)
    with pytest.raises(UnsupportedFeature, match="Fabric.sharded_model"):
        fabric.sharded_model


def _train(fabric, model, optimizer, loader, scheduler=None):
    for x, y in loader:
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()  # next to optimizer.step(), on every batch, as Fabric loops do
        optimizer.zero_grad()
    fabric.end()


def test_a_scheduler_given_to_setup_is_stepped_once_per_committed_step_and_is_in_the_healed_state():
    model, optimizer, loader = _objects()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))
    fabric = Fabric(accumulate=2, max_steps=3, accelerator="cpu")
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
    loader = fabric.setup_dataloaders(loader)
    _train(fabric, model, optimizer, loader, scheduler)
    assert scheduler.last_epoch == 3, "once per committed step, not once per batch (6)"
    assert fabric.job.scheduler is scheduler and fabric.job._state()["scheduler"]["last_epoch"] == 3
    # what a heal or a catch-up sends: the scheduler's state_dict once held the adopted step, a
    # closure, and every transfer of the state failed to pickle (the survivor died mid-heal)
    assert "step" not in fabric.job._state()["scheduler"]
    check_sendable(fabric.job._state())


def test_a_scheduler_on_the_optimizer_but_not_given_to_setup_is_refused():
    from unbroken.errors import LoopMisuse

    model, optimizer, loader = _objects()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))
    fabric = Fabric(accumulate=2, max_steps=3, accelerator="cpu")
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    with pytest.raises(LoopMisuse, match=r"fabric.setup\(model, optimizer, scheduler=scheduler\)"):
        _train(fabric, model, optimizer, loader, scheduler)
