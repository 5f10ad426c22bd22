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
