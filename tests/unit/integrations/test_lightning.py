"""UnbrokenStrategy in a single process: Lightning's Trainer trains on unbroken's steps (the
model of plain SGD on each step's global batch), and what it cannot support is refused by name."""

import copy
import os

import pytest
import torch

from tests.needs import module

L = module("lightning")

from unbroken.integrations.lightning import UnbrokenStrategy, UnsupportedFeature  # noqa: E402


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in list(os.environ):
        if name.startswith("UNBROKEN_"):
            monkeypatch.delenv(name)


class Linear(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1).double()
        self.automatic_optimization = not manual
        self.batches: list = []

    def training_step(self, batch, batch_idx):
        self.batches.append(batch)
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(n: int = 64) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)),
                                       batch_size=4)


def _trainer(**kwargs) -> "L.Trainer":
    return L.Trainer(strategy=UnbrokenStrategy(), accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


def test_each_lightning_batch_is_one_step_of_the_global_batch_and_equals_sgd_on_it():
    model = Linear()
    reference = copy.deepcopy(model.net)
    trainer = _trainer(max_steps=3, accumulate_grad_batches=2)
    trainer.fit(model, _loader())
    assert trainer.global_step == 3 and len(model.batches) == 6  # two micro-batches of 4 per step of 8
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for s in range(3):
        x = torch.cat([model.batches[2 * s][0], model.batches[2 * s + 1][0]])
        y = torch.cat([model.batches[2 * s][1], model.batches[2 * s + 1][1]])
        opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
    assert torch.allclose(model.net.weight, reference.weight, rtol=1e-12, atol=0)
    assert trainer.strategy.job.next_step == 3


class Scaled(Linear):
    """A module whose ``on_before_batch_transfer`` transforms the batch (doubles the inputs), and
    that records each batch hook's call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def on_before_batch_transfer(self, batch, dataloader_idx):
        self.calls.append(("before", batch))
        x, y = batch
        return 2 * x, y

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.calls.append(("transfer", batch))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.calls.append(("after", batch))
        return batch

    def training_step(self, batch, batch_idx):
        self.calls.append(("training_step", batch))
        return super().training_step(batch, batch_idx)


def test_the_batch_transfer_hooks_run_on_every_real_micro_batch_and_training_step_sees_their_result():
    model = Scaled()
    reference = copy.deepcopy(model.net)
    trainer = _trainer(max_steps=3, accumulate_grad_batches=2)
    trainer.fit(model, _loader())
    names = [name for name, _ in model.calls]
    assert names == ["before", "transfer", "after", "training_step"] * 6, names  # per micro-batch, as Lightning calls them
    raw = [batch for name, batch in model.calls if name == "before"]
    seen = [batch for name, batch in model.calls if name == "training_step"]
    for before, trained in zip(raw, seen):
        assert isinstance(before, (list, tuple)) and torch.equal(trained[0], 2 * before[0]) and torch.equal(trained[1], before[1])
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for s in range(3):  # SGD on each step's transformed global batch
        x, y = (torch.cat([seen[2 * s][i], seen[2 * s + 1][i]]) for i in range(2))
        opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        opt.step()
    assert torch.allclose(model.net.weight, reference.weight, rtol=1e-12, atol=0)


class LoggedPerEpoch(Linear):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append((loss.item(), len(batch[0])))
        self.log("loss", loss, on_step=True, on_epoch=True)  # an epoch mean: Lightning weighs it by the batch's size
        return loss


def test_a_training_loss_logged_per_epoch_is_weighted_by_each_real_micro_batchs_size():
    model = LoggedPerEpoch()
    trainer = _trainer(max_epochs=1, accumulate_grad_batches=2)
    trainer.fit(model, _loader(60))  # 7 steps of 8, micro-batches of 4
    assert len(model.losses) == 14
    mean = sum(loss * n for loss, n in model.losses) / sum(n for _, n in model.losses)
    assert trainer.callback_metrics["loss_epoch"].item() == pytest.approx(mean, rel=1e-12)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([])


@pytest.mark.parametrize("model, loader, named", [
    (Linear(manual=True), _loader(), "manual optimization"),
    (Linear(), torch.utils.data.DataLoader(Stream(), batch_size=4), "not a torch DataLoader over a map-style data set"),
])
def test_what_unbroken_cannot_keep_is_refused_by_name(model, loader, named):
    with pytest.raises(UnsupportedFeature, match=named):
        _trainer(max_steps=2).fit(model, loader)


class Validated(Linear):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))


def test_callback_state_is_part_of_the_healed_state_and_loads_back():
    from lightning.pytorch.callbacks import EarlyStopping

    model = Validated()
    stopper = EarlyStopping(monitor="val_loss", patience=50)
    trainer = _trainer(max_steps=6, val_check_interval=2, callbacks=[stopper])
    trainer.fit(model, _loader(), _loader(16))
    state = trainer.strategy.job._state()["extra"]
    saved = state["callbacks"][stopper.state_key]
    assert saved["best_score"] == stopper.best_score and saved["patience"] == 50
    fresh = EarlyStopping(monitor="val_loss", patience=50)
    trainer.callbacks[trainer.callbacks.index(stopper)] = fresh
    trainer.strategy.job.extra_state.load_state_dict(state)  # as a heal loads it into a restarted worker
    assert fresh.best_score == stopper.best_score and fresh.wait_count == stopper.wait_count


def test_a_new_leaders_csv_writer_continues_its_predecessors_metrics_file(tmp_path):
    from lightning.fabric.loggers.csv_logs import _ExperimentWriter

    from unbroken.integrations.lightning import _continue_csv_logs

    _continue_csv_logs()
    first = _ExperimentWriter(str(tmp_path))
    first.log_metrics({"train_loss": 1.0, "val_loss": 2.0}, step=0)
    first.save()
    second = _ExperimentWriter(str(tmp_path))  # the next leader, in the same version directory
    second.log_metrics({"train_loss": 0.5}, step=1)
    second.save()
    second.log_metrics({"lr": 0.1}, step=2)
    second.save()
    first.log_metrics({"val_loss": 1.5}, step=3)  # (a writer that lived on writes after it)
    first.save()
    import csv

    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"] and rows[0]["val_loss"] == "2.0" and rows[2]["lr"] == "0.1"


class Float32(L.LightningModule):
    """A module written as Lightning's docs write one: float32 layers, float32 data; the Trainer's
    ``precision`` chooses the dtype it trains in."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(3, 1)
        self.seen: set = set()

    def training_step(self, batch, batch_idx):
        self.seen.add(batch[0].dtype)
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.seen.add(batch[0].dtype)
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _float32_loader(n: int = 64) -> torch.utils.data.DataLoader:
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]])), batch_size=4)


@pytest.mark.parametrize("precision, dtype", [("64-true", torch.float64), ("bf16-true", torch.bfloat16)])
def test_a_true_precision_converts_the_model_and_every_micro_batch_it_trains_and_validates_on(precision, dtype):
    model = Float32()
    before = model.net.weight.detach().clone()
    trainer = _trainer(max_steps=3, accumulate_grad_batches=2, precision=precision, val_check_interval=2)
    trainer.fit(model, _float32_loader(), _float32_loader(16))
    assert trainer.global_step == 3 and model.seen == {dtype} and "val_loss" in trainer.callback_metrics
    assert all(p.dtype == dtype for p in model.parameters())
    assert not torch.equal(model.net.weight.detach().to(before.dtype), before)  # it trained


def test_fp16_mixed_precision_with_a_grad_scaler_is_refused_before_training():
    from lightning.pytorch.plugins import MixedPrecision

    model = Float32()  # (on a GPU, precision="16-mixed" makes this plugin; on the CPU it takes a scaler given)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(UnsupportedFeature, match="bf16-mixed"):
        _trainer(max_steps=2, plugins=[plugin]).fit(model, _float32_loader())
    assert model.seen == set()


def test_a_gradient_accumulation_scheduler_is_refused_before_training_saying_what_to_set_instead():
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    model = Linear()
    with pytest.raises(UnsupportedFeature, match=r"GradientAccumulationScheduler.*global_batch_size"):
        _trainer(max_steps=2, callbacks=[GradientAccumulationScheduler({0: 2, 1: 4})]).fit(model, _loader())
    assert model.batches == []


@pytest.mark.parametrize("devices, num_nodes, named", [
    (2, 1, r"devices=2.*unbroken run --nproc-per-node 2"),
    ("2", 1, r"devices='2'.*unbroken run --nproc-per-node 2"),
    (1, 2, r"num_nodes=2.*unbroken run --nnodes 2"),
])
def test_more_than_one_device_or_node_per_trainer_is_refused_naming_the_unbroken_run_flag(devices, num_nodes, named):
    model = Linear()
    trainer = L.Trainer(strategy=UnbrokenStrategy(), accelerator="cpu", devices=devices, num_nodes=num_nodes, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(UnsupportedFeature, match=named):
        trainer.fit(model, _loader())
    assert model.batches == []


def test_devices_auto_is_one_device_per_worker_even_where_lightning_would_take_several(monkeypatch):
    from lightning.pytorch.accelerators import CPUAccelerator

    # as on a node of four GPUs, where "auto" (the Trainer's default) resolves to all four
    monkeypatch.setattr(CPUAccelerator, "auto_device_count", staticmethod(lambda: 4))
    model = Linear()
    trainer = L.Trainer(strategy=UnbrokenStrategy(), accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, _loader())
    assert trainer.global_step == 2


def test_a_healed_logger_version_moves_an_experiment_made_before_to_that_version(tmp_path):
    """A fresh launch resuming from a checkpoint made its CSVLogger's experiment in the next free
    version at setup; the checkpoint's version then comes with the state: the metrics must go to
    the directory the version names, not the one made before."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger

    from unbroken.integrations.lightning import _LightningState

    (tmp_path / "logs" / "version_0").mkdir(parents=True)  # the first launch's
    logger = CSVLogger(str(tmp_path), name="logs")
    assert logger.version == 1 and logger.experiment.log_dir.endswith("version_1")  # made at setup
    state = _LightningState(SimpleNamespace(lr_scheduler_configs=[], loggers=[logger]))
    state.load_state_dict({"schedulers": [], "callbacks": {}, "logger_versions": [0]})
    assert logger.version == 0 and logger.experiment.log_dir.endswith("version_0")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.save()
    assert (tmp_path / "logs" / "version_0" / "metrics.csv").exists()
