"""bench_rejoin's training script: a float64 stack of Linear layers with AdamW whose training state
(parameters and two moments) is about ``--state-gb``; every commit's time goes to ``--commits``.

Runs under ``unbroken run`` or alone (the single process the model is compared with)."""

import argparse
import json
import os
import time

import torch

import unbroken

parser = argparse.ArgumentParser()
parser.add_argument("--state-gb", type=float, default=1.0)
parser.add_argument("--width", type=int, default=2048)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--global-batch-size", type=int, default=6)
parser.add_argument("--commits", default=None, help="append one JSON line per commit here")
parser.add_argument("--out", default=None, help="write the final parameters to OUT/<member>.pt")
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
params = args.state_gb * 1e9 / (3 * 8)  # parameters, exp_avg, exp_avg_sq; float64
layers = max(1, round(params / (args.width * args.width + args.width)))
model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(layers)])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
data = torch.utils.data.TensorDataset(torch.randn(64, args.width), torch.randn(64, args.width))
job = unbroken.Job(model, optimizer, data, global_batch_size=args.global_batch_size, micro_batch_size=1, seed=7)
member = os.environ.get("UNBROKEN_MEMBER_ID", "single")
for step in job.steps(total=args.steps):
    for xb, yb in step.micro_batches():
        step.backward(torch.nn.functional.mse_loss(model(xb), yb))
    if step.commit() and args.commits:
        with open(args.commits, "a") as f:
            f.write(json.dumps({"member": member, "step": step.index, "generation": step.generation,
                                "members": step.members, "t": time.time()}) + "\n")
if args.out:
    os.makedirs(args.out, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(args.out, f"{member}.pt"))
