"""A LightningModule and Trainer on a small regression problem, run by unbroken.

    python examples/train_lightning.py --steps 40 --out model.pt
    unbroken run --nproc-per-node 2 examples/train_lightning.py --steps 40 --out model.pt

The module and the loop are Lightning's; the changed line is the Trainer's ``strategy=``. Under
``unbroken run`` a killed worker costs the others a redone step, and the model is the single
process's (``trainer.global_step`` counts committed steps only).
"""

import argparse
import time

import lightning as L
import torch

from unbroken.integrations.lightning import UnbrokenStrategy

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--out", default=None, help="the leader saves the final model's state_dict here")
parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
parser.add_argument("--step-delay", type=float, default=0.0, help="sleep this long per step, standing in for a larger model")
args = parser.parse_args()
torch.set_num_threads(1)
torch.set_default_dtype(getattr(torch, args.dtype))
L.seed_everything(0, verbose=False)

x = torch.randn(512, 8)
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
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.05 * s))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


model = Regression()
train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)
val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:64], y[:64]), batch_size=16)
trainer = L.Trainer(
    strategy=UnbrokenStrategy(),  # was: strategy="ddp", devices=N (unbroken run starts the workers)
    accelerator="cpu", devices=1, max_steps=args.steps, accumulate_grad_batches=2, gradient_clip_val=1.0,
    val_check_interval=10, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(model, train, val)
if trainer.is_global_zero and args.out:
    torch.save(model.state_dict(), args.out)
print(f"done: {trainer.global_step} steps, val_loss {float(trainer.callback_metrics['val_loss']):.4f}", flush=True)
