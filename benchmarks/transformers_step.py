"""The Hugging Face Trainer workload of bench_integrations.py: an MLP trained by a
``transformers.Trainer``, the Trainer's own (``--real``, run by torchrun: DDP) or unbroken's
(``unbroken.integrations.transformers.Trainer``, run by ``unbroken run``). Prints the mean seconds
of the steps after the first five as ``STEP_SECONDS x``."""

import argparse
import os
import tempfile
import time

import torch
import transformers

parser = argparse.ArgumentParser()
parser.add_argument("--real", action="store_true", help="the Trainer's own distribution (run under torchrun)")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--workers", type=int, default=2)
args = parser.parse_args()
if not args.real:  # before TrainingArguments: it reads LOCAL_RANK, which unbroken's import takes for its own
    from unbroken.integrations.transformers import Trainer
torch.set_num_threads(1)
torch.manual_seed(0)


class MLP(torch.nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, 1))

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, w: int) -> None:
        self.x, self.y = torch.randn(n, w), torch.randn(n, 1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Stamps(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_step_end(self, arguments, state, control, **kwargs):
        self.stamps.append(time.perf_counter())


# the same work per worker: DDP's global batch is batch x accumulation x processes; unbroken's
# is batch x accumulation whatever the members, so it accumulates over every worker's batches
accumulation = 2 if args.real else 2 * args.workers
stamps = Stamps()
with tempfile.TemporaryDirectory() as out:
    arguments = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=16, gradient_accumulation_steps=accumulation, max_steps=args.steps,
        learning_rate=1e-4, max_grad_norm=1.0, logging_steps=10_000, save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True, seed=0)
    if args.real:
        Trainer = transformers.Trainer
    trainer = Trainer(model=MLP(args.width), args=arguments, train_dataset=Rows(16 * 2 * args.workers * (args.steps + 2), args.width),
                      callbacks=[stamps])
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0 and (args.real or trainer.is_world_process_zero()):
        s = stamps.stamps
        print(f"STEP_SECONDS {(s[-1] - s[4]) / (len(s) - 5):.6f}", flush=True)
