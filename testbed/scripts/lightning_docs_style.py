"""A Lightning script the way Lightning's docs write one: a CSVLogger, ModelCheckpoint keeping the
best two by validation loss, EarlyStopping, validation every few steps, epochs, and the final
model saved by rank zero. The strategy is unbroken's; nothing else is.

    python lightning_docs_style.py --root DIR --steps 40 --out model.pt
    unbroken run --nproc-per-node 2 lightning_docs_style.py --root DIR --steps 40 --out model.pt
"""

import argparse
import os
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from unbroken.integrations.lightning import UnbrokenStrategy

parser = argparse.ArgumentParser()
parser.add_argument("--root", required=True, help="the logger's and checkpoints' directory")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--out", default=None)
parser.add_argument("--step-delay", type=float, default=0.0)
args = parser.parse_args()
torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
L.seed_everything(0, verbose=False)

x = torch.randn(256, 8)
y = torch.sin(x @ torch.randn(8, 1))


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        time.sleep(args.step_delay)

    def validation_step(self, batch, batch_idx):
        inputs, targets = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(inputs), targets), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


model = Regression()
train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)
val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:64], y[:64]), batch_size=16)
checkpoints = ModelCheckpoint(dirpath=os.path.join(args.root, "checkpoints"), monitor="val_loss", save_top_k=2,
                              filename="{step}-{val_loss:.4f}")
trainer = L.Trainer(
    strategy=UnbrokenStrategy(), accelerator="cpu", devices=1, max_steps=args.steps, accumulate_grad_batches=2,
    val_check_interval=5, logger=CSVLogger(args.root, name="logs"), log_every_n_steps=2,
    callbacks=[checkpoints, EarlyStopping(monitor="val_loss", patience=50)],
    enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(model, train, val)
if trainer.is_global_zero and args.out:
    torch.save(model.state_dict(), args.out)
print(f"done: {trainer.global_step} steps, best {checkpoints.best_model_path}", flush=True)
