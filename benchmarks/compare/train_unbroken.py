"""The workload under ``unbroken run``: the plain training loop with unbroken's Job."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import StepLog, arguments, setup  # noqa: E402

import torch  # noqa: E402

import unbroken  # noqa: E402

args = arguments()
log = StepLog(args.step_log)
x, y, model, optimizer = setup(args.width)
dataset = torch.utils.data.TensorDataset(x, y)
job = unbroken.Job(model, optimizer, dataset, global_batch_size=args.global_batch, seed=0)
loss_fn = torch.nn.CrossEntropyLoss()
for step in job.steps(total=args.steps if args.steps else 10**9):
    for xb, yb in step.micro_batches():
        step.backward(loss_fn(model(xb), yb))
    if step.commit():
        log.step(step.index, step.rank, step.members, [(step.positions.start, step.positions.stop)])
log.write("done")
