"""unbroken's Accelerator in a single process: Accelerate's loop shape trains on unbroken's steps
(the model of plain SGD on the global batch), and what it cannot support is refused by name."""

import copy
import os

import pytest
import torch

from unbroken.errors import ConfigError
from unbroken.integrations.accelerate import Accelerator, UnsupportedFeature


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in list(os.environ):
        if name.startswith("UNBROKEN_"):
            monkeypatch.delenv(name)


def _objects(n: int = 64, batch_size: int = 4):
    torch.manual_seed(0)
    x = torch.randn(n, 3, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)
    model = torch.nn.Linear(3, 1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size, shuffle=True)
    return model, optimizer, loader


def test_accelerates_loop_shape_makes_one_step_per_accumulation_and_equals_sgd_on_the_global_batch():
    model, optimizer, loader = _objects()
    reference = copy.deepcopy(model)
    accelerator = Accelerator(gradient_accumulation_steps=2, max_steps=3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    syncs, batches = [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            optimizer.zero_grad()  # where Accelerate's examples put it: harmless, the commit zeroes
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            syncs.append(accelerator.sync_gradients)
            batches.append((x, y))
            optimizer.step()
    accelerator.end_training()
    assert syncs == [False, True] * 3 and accelerator.job.next_step == 3
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for s in range(3):  # plain SGD on each step's global batch of 8: the two micro-batches together
        x = torch.cat([batches[2 * s][0], batches[2 * s + 1][0]])
        y = torch.cat([batches[2 * s][1], batches[2 * s + 1][1]])
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    assert torch.allclose(model.weight, reference.weight, rtol=1e-12, atol=0)
    assert len(loader) == (64 // 8) * 2 and accelerator.is_main_process and accelerator.num_processes == 1


def test_one_pass_and_the_scheduler_steps_once_per_committed_step():
    model, optimizer, loader = _objects(n=32)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        if accelerator.sync_gradients:
            assert accelerator.clip_grad_norm_(model.parameters(), 1.0) is not None
        optimizer.step()
        scheduler.step()  # the script's call does nothing: the commit stepped it
    assert accelerator.job.next_step == 4  # 32 samples, a global batch of 8
    assert scheduler.get_last_lr()[0] == pytest.approx(0.1 * 0.5**4)


def _epochs(accelerator, model, optimizer, loader, epochs, seen):
    for epoch in range(epochs):  # the usual epoch loop, its count never told to the Accelerator
        for x, y in loader:
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            if accelerator.sync_gradients:
                seen.append((epoch, accelerator._loop.step.index))


def test_an_epoch_loop_trains_every_epoch_and_a_process_that_joins_late_catches_up_with_the_jobs_epoch(tmp_path):
    model, optimizer, loader = _objects(n=32)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen = []
    _epochs(accelerator, model, optimizer, loader, 3, seen)
    accelerator.save_state(str(tmp_path / "state"))  # after the last epoch, before the end: works
    accelerator.end_training()
    assert [s for _, s in seen] == list(range(12)) and [e for e, _ in seen] == [0] * 4 + [1] * 4 + [2] * 4
    assert {"model.safetensors", "optimizer.bin"} <= set(os.listdir(tmp_path / "state"))  # Accelerate's own layout
    # a restarted process runs the script from epoch 0 while the job stands at step 6 (epoch 1):
    # its first pass gives nothing, its second the rest of epoch 1, its third epoch 2
    first = accelerator.job._state()
    model2, optimizer2, loader2 = _objects(n=32)
    late = Accelerator(gradient_accumulation_steps=2)
    model2, optimizer2, loader2 = late.prepare(model2, optimizer2, loader2)
    first["runtime"]["next_step"], first["runtime"]["lineage"] = 6, first["runtime"]["lineage"][:6]
    late.job._load(first)  # as a heal would
    late.job.fresh = False
    seen = []
    _epochs(late, model2, optimizer2, loader2, 3, seen)
    late.end_training()
    assert seen == [(1, 6), (1, 7), (2, 8), (2, 9), (2, 10), (2, 11)]
    late.save_state(str(tmp_path / "after"))  # after the job's end: the last leader saves
    assert (tmp_path / "after" / "model.safetensors").exists()


@pytest.mark.parametrize("argument, named", [
    ({"mixed_precision": "fp16"}, "mixed precision"), ({"log_with": "wandb"}, "trackers"),
    ({"fsdp_plugin": object()}, "FSDP"), ({"split_batches": True}, "split_batches"),
])
def test_accelerate_features_that_would_change_the_model_are_refused_by_name(argument, named):
    with pytest.raises(UnsupportedFeature, match=named):
        Accelerator(**argument)


def test_unsupported_methods_and_a_second_prepare_are_refused_by_name():
    accelerator = Accelerator()
    with pytest.raises(UnsupportedFeature, match=r"Accelerator.skip_first_batches \(unbroken plans the samples"):
        accelerator.skip_first_batches
    with pytest.raises(UnsupportedFeature, match=r"Accelerator.set_trigger \(.*accelerator.job.stop\(\)"):
        accelerator.set_trigger
    accelerator.prepare(*_objects())
    with pytest.raises(UnsupportedFeature, match="a second call to prepare"):
        accelerator.prepare(*_objects())


def test_prepare_without_a_training_loader_or_with_a_too_small_data_set_says_what_is_missing():
    model, optimizer, loader = _objects(n=4, batch_size=4)
    with pytest.raises(ConfigError, match="got 1 model.*0 data loader"):
        Accelerator().prepare(model, optimizer)
    with pytest.raises(ConfigError, match="holds 4 samples, fewer than one step's global batch of 8"):
        Accelerator(gradient_accumulation_steps=2).prepare(model, optimizer, loader)


def test_save_state_and_load_state_round_trip_in_accelerates_layout_readable_by_accelerate(tmp_path):
    model, optimizer, loader = _objects(n=32)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    accelerator = Accelerator(gradient_accumulation_steps=2, max_steps=5)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    _epochs(accelerator, model, optimizer, loader, 2, [])
    accelerator.save_state(str(tmp_path / "state"))
    saved = copy.deepcopy(model.state_dict())
    # the names and the format Accelerate's own load_state reads
    from safetensors.torch import load_file
    assert all(torch.equal(load_file(str(tmp_path / "state" / "model.safetensors"))[k], v) for k, v in saved.items())
    model2, optimizer2, loader2 = _objects(n=32)
    scheduler2 = torch.optim.lr_scheduler.StepLR(optimizer2, step_size=2, gamma=0.5)
    again = Accelerator(gradient_accumulation_steps=2, max_steps=5)
    model2, optimizer2, loader2, scheduler2 = again.prepare(model2, optimizer2, loader2, scheduler2)
    again.load_state(str(tmp_path / "state"))
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in saved.items())
    assert scheduler2.last_epoch == scheduler.last_epoch and optimizer2.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()


def test_the_harmless_methods_of_accelerates_examples_work():
    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(*_objects())
    assert accelerator.mixed_precision == "no"
    with accelerator.main_process_first():
        ran = True
    assert ran and accelerator.on_main_process(lambda: 3)() == 3  # a single process leads
    assert accelerator.free_memory(model, optimizer) == [None, None]
    accelerator.log({"loss": 1.0}, step=0)
    assert accelerator.get_state_dict(model).keys() == model.state_dict().keys()
