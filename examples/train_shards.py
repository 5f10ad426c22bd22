"""Train a small next-token model on tokenised text kept in memory-mapped shard files, with loader
worker processes that prepare the micro-batches of the next steps::

    unbroken run --nproc-per-node 2 examples/train_shards.py      # distributed
    python examples/train_shards.py                               # a single process, the reference

The shards stand in for a corpus larger than memory: ``--shards`` ``.npy`` files of fixed-length
token sequences (made on the first run in ``--data``). Stream position -> data set index is the
data plan's; data set index -> (shard, offset) is ``ShardedArrays``'s; the record is read from that
shard's memory map, so a member reads only the records of its share. The augmentation (a random
window of each record) is drawn from torch's global generator, which unbroken seeds per stream
position: a redone step sees the same windows, at any member count.
"""

import argparse
import os
import tempfile

import numpy as np
import torch

import unbroken
from unbroken.data.shards import ShardedArrays

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "unbroken-shards-example"), help="where the shards are (made if missing)")
parser.add_argument("--shards", type=int, default=4)
parser.add_argument("--records-per-shard", type=int, default=5000)
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--global-batch-size", type=int, default=128)
parser.add_argument("--micro-batch-size", type=int, default=32)
parser.add_argument("--num-workers", type=int, default=2, help="loader worker processes per training process")
parser.add_argument("--log-every", type=int, default=20)
args = parser.parse_args()

VOCAB, RECORD, WINDOW = 256, 40, 32  # a record holds 40 tokens; a sample is a window of 33 of them


def make_shards(folder: str, count: int, records: int) -> list[str]:
    """Token sequences from a fixed rule with noise (so there is something to learn), one file per
    shard. Every process makes the same bytes and renames its file into place: several workers
    starting at once do not clash."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for shard in range(count):
        path = os.path.join(folder, f"tokens-{shard:05d}.npy")
        paths.append(path)
        if os.path.exists(path):
            continue
        rng = np.random.default_rng(shard)
        tokens = np.empty((records, RECORD), dtype=np.uint16)
        tokens[:, 0] = rng.integers(0, VOCAB, records)
        for k in range(1, RECORD):
            noise = rng.integers(0, 4, records) * (rng.random(records) < 0.2)
            tokens[:, k] = (tokens[:, k - 1] * 5 + 3 + noise) % VOCAB
        tmp = f"{path}.{os.getpid()}.tmp.npy"
        np.save(tmp, tokens)
        os.replace(tmp, path)
    return paths


def window(record: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A random window of the record (the augmentation): inputs and next-token targets."""
    start = int(torch.randint(0, RECORD - WINDOW, ()))
    tokens = torch.from_numpy(record[start : start + WINDOW + 1].astype(np.int64))
    return tokens[:-1], tokens[1:]


torch.set_num_threads(1)
torch.manual_seed(0)
dataset = ShardedArrays(make_shards(args.data, args.shards, args.records_per_shard), transform=window)
model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 64), torch.nn.ReLU(), torch.nn.Linear(64, VOCAB))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

job = unbroken.Job(
    model, optimizer, dataset,
    global_batch_size=args.global_batch_size,
    micro_batch_size=args.micro_batch_size,
    seed=0,
    num_workers=args.num_workers,      # loader processes: the next steps' micro-batches are built meanwhile
    prefetch=2 if args.num_workers else None,   # micro-batches in flight per loader process
)

loss = None
for step in job.steps(total=args.steps):
    for inputs, targets in step.micro_batches():
        logits = model(inputs)
        step.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)))
    if not step.commit():
        continue  # a peer failed: this step is redone with the same samples and the same windows
    loss = step.loss
    if step.index % args.log_every == 0:  # every member's loss is the global batch's
        print(f"step {step.index}  loss {step.loss:.4f}  members {step.members}", flush=True)
if loss is not None:
    print(f"done: {len(dataset)} records in {args.shards} shards, last loss {loss:.4f}", flush=True)
