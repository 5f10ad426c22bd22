"""The workload of bench_integrations.py: Accelerate's loop on an MLP, with Accelerate's own
``Accelerator`` (under torchrun) or unbroken's (under ``unbroken run``). Prints the mean seconds
of the steps after the first five as ``STEP_SECONDS x``."""

import argparse
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--real", action="store_true", help="Accelerate's own Accelerator (run under torchrun)")
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--workers", type=int, default=2, help="with unbroken: the global batch covers this many workers")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
if args.real:
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
else:
    from unbroken.integrations.accelerate import Accelerator

    # the same work per worker as Accelerate's: its global batch is batch x accumulation x processes
    accelerator = Accelerator(gradient_accumulation_steps=2, global_batch_size=16 * 2 * args.workers, max_steps=args.steps)

x = torch.randn(16 * 2 * args.workers * args.steps, args.width)
y = torch.randn(len(x), 1)
model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, args.width),
                            torch.nn.ReLU(), torch.nn.Linear(args.width, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
stamps = []
for batch in loader:
    with accelerator.accumulate(model):
        inputs, targets = batch
        accelerator.backward(torch.nn.functional.mse_loss(model(inputs), targets))
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if accelerator.sync_gradients:
            stamps.append(time.perf_counter())
    if len(stamps) >= args.steps:
        break
if not args.real:
    accelerator.end_training()
if accelerator.is_main_process:
    print(f"STEP_SECONDS {(stamps[-1] - stamps[4]) / (len(stamps) - 5):.6f}", flush=True)
