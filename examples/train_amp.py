"""Mixed precision with unbroken: bf16 autocast on the CPU, fp16 with a GradScaler on a GPU.

A small regression model trained under autocast. On a GPU each worker takes its own device
(``cuda:LOCAL_RANK``), runs its forward in float16 and passes ``scaler=`` to the job: each loss
is scaled before its backward, and ``step.commit()`` unscales the allreduced gradients, skips a
step whose gradients overflowed (on every worker alike) and updates the scale. Between
``step.reduce()`` and ``step.commit()`` the loop unscales to clip by the true gradient norm, as
under DDP. On the CPU the forward runs in bfloat16, which needs no scaler::

    unbroken run --nproc-per-node 2 examples/train_amp.py            # distributed (CPU: Gloo)
    unbroken run --nproc-per-node 2 --backend nccl examples/train_amp.py   # one GPU per worker
    python examples/train_amp.py                                      # a single process
"""

import argparse

import torch

import unbroken
from unbroken.worker.devices import local_device

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--global-batch-size", type=int, default=64)
parser.add_argument("--micro-batch-size", type=int, default=16)
args = parser.parse_args()

device = local_device()  # cuda:LOCAL_RANK when there are GPUs, else the CPU
on_gpu = device.type == "cuda"
# fp16 needs a scaler (its range is small); bf16 has float32's range and needs none
amp_dtype = torch.float16 if on_gpu else torch.bfloat16

torch.manual_seed(0)  # every worker builds the same model and data
x = torch.randn(2048, 32)
y = torch.tanh(x @ torch.randn(32, 4) / 4)
dataset = torch.utils.data.TensorDataset(x, y)
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 4)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

job = unbroken.Job(
    model,
    optimizer,
    dataset,
    global_batch_size=args.global_batch_size,
    micro_batch_size=args.micro_batch_size,
    scaler=torch.amp.GradScaler("cuda") if on_gpu else None,
    pin_memory=on_gpu,
)

for step in job.steps(total=args.steps):
    for xb, yb in step.micro_batches():
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype):
            prediction = model(xb)
        # the loss in float32; pass it unscaled: with a scaler, step.backward scales it
        step.backward(torch.nn.functional.mse_loss(prediction.float(), yb))
    if not step.reduce():
        continue  # a peer failed: this step is redone by the next generation
    if job.scaler is not None:
        job.scaler.unscale_(job.optimizer)  # clip the true gradients, not the scaled ones
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    step.commit()
    if job.is_leader and step.index % 10 == 0:
        scale = f" scale {job.scaler.get_scale():g}" if job.scaler is not None else ""
        note = " (skipped: inf/nan gradients)" if step.skipped else ""
        print(f"step {step.index} loss {step.loss:.4f} members {step.members}{scale}{note}", flush=True)
