"""An Accelerate script written the way Accelerate's own docs write one, with the one changed line
of unbroken (the import): an epoch loop over a prepared loader with gradient accumulation, a
scheduler stepped beside the optimizer, `main_process_first` around the data, `save_state` at each
epoch's end, `wait_for_everyone` and `save_model` at the end. No `max_steps=` or `num_epochs=`:
the job's length is the loop's (3 epochs of the loader).

    python accelerate_docs_style.py --out DIR                      # alone
    unbroken run --nproc-per-node 2 accelerate_docs_style.py --out DIR
"""

import argparse
import os

import torch
from accelerate.utils import set_seed

from unbroken.integrations.accelerate import Accelerator  # was: from accelerate import Accelerator

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True, help="save_state directories and the final model go here")
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()
torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
set_seed(0)

accelerator = Accelerator(gradient_accumulation_steps=2)
with accelerator.main_process_first():
    x = torch.randn(96, 8)
    y = torch.sin(x @ torch.randn(8, 1))
    dataset = torch.utils.data.TensorDataset(x, y)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
train_dataloader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.05 * s))
model, optimizer, train_dataloader, scheduler = accelerator.prepare(model, optimizer, train_dataloader, scheduler)

for epoch in range(args.epochs):
    model.train()
    for batch in train_dataloader:
        with accelerator.accumulate(model):
            inputs, targets = batch
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    accelerator.save_state(os.path.join(args.out, f"epoch_{epoch}"))
    accelerator.print(f"epoch {epoch} done at step {accelerator.job.next_step}")

accelerator.wait_for_everyone()
accelerator.save_model(model, os.path.join(args.out, "final"))
accelerator.end_training()
