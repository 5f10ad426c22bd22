"""A Hugging Face Trainer script on a tiny GPT-2 built from a config (no download), run by unbroken.

    python examples/train_transformers.py --steps 40 --out model.pt
    unbroken run --nproc-per-node 2 examples/train_transformers.py --steps 40 --out model.pt

The script is the Trainer's as its docs write it (TrainingArguments with gradient accumulation, a
linear schedule with warm-up, evaluation and logging every few steps, checkpoints, an early-stopping
callback); the changed line is where ``Trainer`` comes from.
"""

import argparse
import os
import tempfile

import torch
from transformers import EarlyStoppingCallback, GPT2Config, GPT2LMHeadModel, TrainingArguments

from unbroken.integrations.transformers import Trainer  # was: from transformers import Trainer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--out", default=None, help="the final model's state_dict is saved here")
parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
parser.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default: a temporary directory)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.set_default_dtype(getattr(torch, args.dtype))


class Sequences(torch.utils.data.Dataset):
    """Token sequences that count up from a random start: a pattern a tiny model learns in a few steps."""

    def __init__(self, n: int, seed: int, length: int = 16, vocab: int = 64) -> None:
        start = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (start + torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: the model is the single process's
model = GPT2LMHeadModel(config)
training_args = TrainingArguments(
    output_dir=args.output_dir or tempfile.mkdtemp(prefix="trainer-"),
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=args.steps,
    learning_rate=3e-3,
    lr_scheduler_type="linear",
    warmup_steps=5,
    eval_strategy="steps",
    eval_steps=10,
    save_steps=10,
    logging_steps=5,
    per_device_eval_batch_size=16,
    load_best_model_at_end=False,
    metric_for_best_model="eval_loss",
    report_to="none",
    use_cpu=True,
    seed=0,
)
trainer = Trainer(model=model, args=training_args, train_dataset=Sequences(512, seed=1), eval_dataset=Sequences(64, seed=2),
                  callbacks=[EarlyStoppingCallback(early_stopping_patience=100)])
result = trainer.train()
if args.out:
    trainer.save_model(os.path.join(training_args.output_dir, "final"))
    if trainer.is_world_process_zero():
        torch.save(trainer.model.state_dict(), args.out)
print(f"done: {result.global_step} steps, eval loss {trainer.evaluate()['eval_loss']:.4f}")
