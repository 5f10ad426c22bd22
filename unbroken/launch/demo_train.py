"""Train a small classifier on scikit-learn's digits (no download), surviving failed workers.

This is the example of the README (``examples/train_digits.py`` runs this module) and the script
of ``unbroken demo``. Run it distributed, then kill a worker (``kill -9 <pid>``) and watch it
carry on::

    unbroken run --nproc-per-node 4 examples/train_digits.py

or, unchanged, as a single process (the reference a distributed run must match)::

    python examples/train_digits.py
"""

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

import unbroken

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
parser.add_argument("--global-batch-size", type=int, default=128, help="samples per step, all workers together (default 128)")
parser.add_argument("--micro-batch-size", type=int, default=32, help="largest batch of one forward pass (default 32)")
parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
parser.add_argument("--seed", type=int, default=0, help="seeds the model and the sample order (default 0)")
parser.add_argument("--log-every", type=int, default=25, help="print the loss every this many steps (default 25)")
args = parser.parse_args()

torch.set_num_threads(1)  # several workers share the CPU cores
torch.manual_seed(args.seed)  # every member builds the same initial model (peers also heal it)

# 1797 8x8 images of digits; the last 297 are held out for the test accuracy.
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
train = torch.utils.data.TensorDataset(x[:1500], y[:1500])
x_test, y_test = x[1500:], y[1500:]

model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps)
loss_fn = nn.CrossEntropyLoss()

job = unbroken.Job(
    model,
    optimizer,
    train,
    global_batch_size=args.global_batch_size,
    micro_batch_size=args.micro_batch_size,
    seed=args.seed,
    scheduler=scheduler,
)

for step in job.steps(total=args.steps):
    for xb, yb in step.micro_batches():
        step.backward(loss_fn(model(xb), yb))
    if not step.reduce():
        continue  # a peer failed: this step is redone by the next generation
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # on the global gradient
    if not step.commit():
        continue
    if step.index % args.log_every == 0 or step.index == args.steps - 1:
        print(f"step {step.index:4d}  loss {step.loss:.4f}  members {step.members}", flush=True)

with torch.no_grad():
    accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
print(f"test accuracy {accuracy:.3f}", flush=True)
