"""A small GPT on a byte-level corpus, written the way DDP scripts are (nanoGPT's shape): the
"before" of docs/guide/porting.md. Run with torchrun:

    torchrun --nproc-per-node 2 examples/porting/train_gpt_ddp.py --steps 200

examples/train_gpt.py is the same script ported to unbroken; `diff` the two to see the port.
"""

import argparse
import math
import os
import sys
import sysconfig

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch-size", type=int, default=32, help="windows per step over all workers")
parser.add_argument("--micro-batch-size", type=int, default=8, help="windows per forward/backward")
parser.add_argument("--block", type=int, default=64, help="bytes per window")
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--width", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--warmup", type=int, default=20, help="steps of linear warm-up before the cosine decay")
parser.add_argument("--eval-every", type=int, default=50)
parser.add_argument("--eval-seconds", type=float, default=0.0, help="sleep this long in each evaluation (a long one)")
parser.add_argument("--patience", type=int, default=3, help="stop after this many evaluations without improvement")
parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
parser.add_argument("--data-dir", default="data/gpt")
parser.add_argument("--out", default="gpt.pt", help="the final model's state_dict (and the best one, .best)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.set_default_dtype(getattr(torch, args.dtype))


def corpus(data_dir: str) -> str:
    """Bytes of some of Python's own library sources: a corpus every machine has."""
    path = os.path.join(data_dir, "corpus.bin")
    if not os.path.exists(path):
        os.makedirs(data_dir, exist_ok=True)
        stdlib = sysconfig.get_paths()["stdlib"]
        text = b"".join(open(os.path.join(stdlib, f"{m}.py"), "rb").read() for m in ("argparse", "textwrap", "string", "fractions"))
        with open(f"{path}.{os.getpid()}", "wb") as f:
            f.write(text)
        os.replace(f"{path}.{os.getpid()}", path)
    return path


class Block(nn.Module):
    def __init__(self, width: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).transpose(1, 3).unbind(2)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, block: int, layers: int, width: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, width), nn.Embedding(block, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.ln(self.blocks(x)) @ self.tok.weight.T  # logits over the 256 byte values


ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
else:
    rank, world = 0, 1
master = rank == 0
torch.manual_seed(1337)
data = np.memmap(corpus(args.data_dir), dtype=np.uint8, mode="r")
train, val = data[: int(0.9 * len(data))], data[int(0.9 * len(data)):]
model = GPT(args.block, args.layers, args.width)
raw = model
if ddp:
    model = DDP(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(
    optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
accum = args.batch_size // (args.micro_batch_size * world)


def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    source = train if split == "train" else val
    ix = torch.randint(len(source) - args.block - 1, (args.micro_batch_size,))
    windows = torch.stack([torch.from_numpy(source[i: i + args.block + 1].astype(np.int64)) for i in ix.tolist()])
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def estimate_loss() -> float:
    """The loss on 16 fixed validation windows."""
    import time

    time.sleep(args.eval_seconds)
    raw.eval()
    starts = torch.linspace(0, len(val) - args.block - 2, 16).long().tolist()
    windows = torch.stack([torch.from_numpy(val[i: i + args.block + 1].astype(np.int64)) for i in starts])
    loss = F.cross_entropy(raw(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten())
    raw.train()
    return loss.item()


best, bad = float("inf"), 0
for it in range(args.steps):
    for micro in range(accum):
        if ddp:
            model.require_backward_grad_sync = micro == accum - 1
        x, y = get_batch("train")
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / accum
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if master and it % 10 == 0:
        print(f"step {it}: loss {loss.item() * accum:.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
    if it % args.eval_every == 0 and master:
        val_loss = estimate_loss()
        print(f"step {it}: val loss {val_loss:.4f}", flush=True)
        if val_loss < best:
            best, bad = val_loss, 0
            torch.save(raw.state_dict(), args.out + ".best")
        else:
            bad += 1
    if it % args.eval_every == 0 and ddp:
        stop = torch.tensor([float(bad >= args.patience)])
        dist.broadcast(stop, 0)
        bad = args.patience if stop.item() else bad
    if bad >= args.patience:
        break
if master:
    torch.save(raw.state_dict(), args.out)
if ddp:
    dist.destroy_process_group()
    # torch 2.13 on Python 3.11: destroy_process_group() leaves Gloo's worker threads running, and
    # one that drops the last backward's allreduce while the interpreter shuts down aborts this
    # finished process (SIGABRT, "terminate called without an active exception"; 1 run in 10 on a
    # busy machine). Leaving without the interpreter's teardown avoids it.
    sys.stdout.flush()
    os._exit(0)
