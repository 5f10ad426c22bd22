"""A Lightning Fabric loop on a small regression problem, run by unbroken.

    python examples/train_fabric.py --steps 40 --out model.pt
    unbroken run --nproc-per-node 2 examples/train_fabric.py --steps 40 --out model.pt

The loop is Fabric's; the changed lines are where ``Fabric`` comes from and its arguments
(``accumulate=`` instead of counting batches, ``max_steps=``). The scheduler goes to
``fabric.setup(..., scheduler=)``, as Fabric's own API takes it: unbroken steps it once per
committed step and heals it (the loop's ``scheduler.step()`` then does nothing).
"""

import argparse

import torch

from unbroken.integrations.fabric import Fabric  # was: from lightning.fabric import Fabric

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--out", default=None, help="the leader saves the final model's state_dict here")
parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
args = parser.parse_args()
torch.set_num_threads(1)
torch.set_default_dtype(getattr(torch, args.dtype))

fabric = Fabric(accumulate=2, max_steps=args.steps, accelerator="cpu")  # was: Fabric(accelerator="cpu", devices=2)
fabric.launch()
fabric.seed_everything(0)

x = torch.randn(512, 8)
y = torch.sin(x @ torch.randn(8, 1))
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True))

for inputs, targets in loader:
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()

fabric.end()
if args.out and fabric.is_global_zero:
    torch.save(model.state_dict(), args.out)
fabric.print(f"done: {fabric.job.next_step} steps")
