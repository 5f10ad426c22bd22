"""A small GPT on a byte-level corpus, written the way DDP scripts are (nanoGPT's shape), ported
to unbroken: the "after" of docs/guide/porting.md. Run it alone, or survive kills under the launcher:

    python examples/train_gpt.py --steps 200
    unbroken run --nproc-per-node 2 examples/train_gpt.py --steps 200

examples/porting/train_gpt_ddp.py is the DDP script it was ported from; `diff` the two to see the port.
"""

import argparse
import math
import os
import sysconfig

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import unbroken

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


torch.manual_seed(1337)
data = np.memmap(corpus(args.data_dir), dtype=np.uint8, mode="r")
train, val = data[: int(0.9 * len(data))], data[int(0.9 * len(data)):]
model = GPT(args.block, args.layers, args.width)
raw = model
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(
    optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

windows = unbroken.RandomWindows(train, args.block, length=args.steps * args.batch_size)  # get_batch, exactly once

progress = unbroken.ScriptState(best=float("inf"), bad=0)  # healed with the model: a restarted worker has it too
job = unbroken.Job(model, optimizer, windows, global_batch_size=args.batch_size, micro_batch_size=args.micro_batch_size,
                   scheduler=scheduler, seed=1337, extra_state=progress)


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


for step in job.steps(total=args.steps):
    it = step.index
    for x, y in step.micro_batches():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        step.backward(loss)
    if not step.reduce():
        continue
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if not step.commit():
        continue
    if job.is_leader and it % 10 == 0:
        print(f"step {it}: loss {step.loss:.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
    if it % args.eval_every == 0:
        val_loss = job.on_leader(estimate_loss)  # the leader evaluates; every worker gets its result
        print(f"step {it}: val loss {val_loss:.4f}", flush=True)
        if val_loss < progress.best:
            progress.best, progress.bad = val_loss, 0
            job.on_leader(torch.save, raw.state_dict(), args.out + ".best")
        else:
            progress.bad += 1
    if progress.bad >= args.patience:
        break
if job.is_leader:
    torch.save(raw.state_dict(), args.out)
