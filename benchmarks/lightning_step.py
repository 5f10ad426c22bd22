"""The Lightning workload of bench_integrations.py: a LightningModule MLP with a Trainer, under
DDP (``--real``, run by torchrun) or UnbrokenStrategy (run by ``unbroken run``). Prints the mean
seconds of the steps after the first five as ``STEP_SECONDS x``."""

import argparse
import time

import lightning as L
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--real", action="store_true", help="Lightning's DDP strategy (run under torchrun)")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--workers", type=int, default=2)
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)


class MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        w = args.width
        self.net = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, 1))
        self.stamps: list[float] = []

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.stamps.append(time.perf_counter())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


x = torch.randn(16 * 2 * args.workers * (args.steps + 2), args.width)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.randn(len(x), 1)), batch_size=16)
common = dict(accelerator="cpu", max_steps=args.steps, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
if args.real:
    trainer = L.Trainer(strategy="ddp", devices=args.workers, **common)
else:
    from unbroken.integrations.lightning import UnbrokenStrategy

    # the same work per worker as DDP's: its global batch is batch x accumulation x world size
    trainer = L.Trainer(strategy=UnbrokenStrategy(global_batch_size=16 * 2 * args.workers), devices=1, **common)
model = MLP()
trainer.fit(model, loader)
stamps = model.stamps[1::2] if args.real else model.stamps  # DDP: one batch end per micro-batch; unbroken: per step
if trainer.is_global_zero:
    print(f"STEP_SECONDS {(stamps[-1] - stamps[4]) / (len(stamps) - 5):.6f}", flush=True)
