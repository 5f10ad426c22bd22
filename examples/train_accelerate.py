"""Accelerate's own minimal example, on a small regression problem, run by unbroken.

    python examples/train_accelerate.py --steps 40 --out model.pt
    unbroken run --nproc-per-node 2 examples/train_accelerate.py --steps 40 --out model.pt

The loop is Accelerate's, epochs and all; the one changed line is the import of ``Accelerator``
(here with ``max_steps=``, so that ``--steps`` can end the job inside an epoch). Under ``unbroken
run`` a killed worker costs the others a redone step, a restarted one rejoins in the job's epoch,
and the model is the single process's.
"""

import argparse
import math

import torch
from accelerate.utils import set_seed

from unbroken.integrations.accelerate import Accelerator  # was: from accelerate import Accelerator

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--out", default=None, help="the leader saves the final model's state_dict here")
parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
args = parser.parse_args()
torch.set_num_threads(1)
torch.set_default_dtype(getattr(torch, args.dtype))
set_seed(0)

x = torch.randn(512, 8)
y = torch.sin(x @ torch.randn(8, 1))
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
training_dataloader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.05 * s))
loss_function = torch.nn.MSELoss()

accelerator = Accelerator(gradient_accumulation_steps=2, max_steps=args.steps)
model, optimizer, training_dataloader, scheduler = accelerator.prepare(model, optimizer, training_dataloader, scheduler)

num_epochs = math.ceil(args.steps * accelerator.gradient_accumulation_steps / len(training_dataloader))
for epoch in range(num_epochs):
    for batch in training_dataloader:
        with accelerator.accumulate(model):
            optimizer.zero_grad()
            inputs, targets = batch
            outputs = model(inputs)
            loss = loss_function(outputs, targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()

accelerator.end_training()
if args.out:
    accelerator.save(accelerator.unwrap_model(model).state_dict(), args.out)
accelerator.print(f"done: {accelerator.job.next_step} steps")
