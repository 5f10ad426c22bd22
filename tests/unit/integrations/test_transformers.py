"""unbroken's Hugging Face ``Trainer`` in a single process: the Trainer's training on a Job, its
record in the healed state, the arguments it refuses."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import EarlyStoppingCallback, GPT2Config, GPT2LMHeadModel, TrainingArguments

from unbroken.integrations.driven_loop import UnsupportedFeature
from unbroken.integrations.transformers import Trainer
from unbroken.worker.job_state import check_sendable

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_unbroken_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("UNBROKEN_"):
            monkeypatch.delenv(name)


class Counting(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        start = torch.randint(0, 32, (n, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (start + torch.arange(8)) % 32

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(tmp_path, **overrides) -> Trainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                                       eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    arguments = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=3,
                     max_steps=6, logging_steps=2, eval_strategy="steps", eval_steps=3, save_strategy="no",
                     metric_for_best_model="eval_loss", report_to="none", use_cpu=True, disable_tqdm=True)
    arguments.update(overrides)
    return Trainer(model=model, args=TrainingArguments(**arguments), train_dataset=Counting(40, 1),
                   eval_dataset=Counting(8, 2), callbacks=[EarlyStoppingCallback(early_stopping_patience=5)])


def test_train_commits_one_step_per_global_batch_and_logs_and_evaluates_on_schedule(tmp_path):
    trainer = _trainer(tmp_path)
    result = trainer.train()
    job = trainer.job
    assert result.global_step == job.next_step == 6 and job.plan.global_batch_size == 6 and job.plan.micro_batch_size == 2
    assert trainer.lr_scheduler.last_epoch == 6, "the scheduler steps once per committed step"
    history = trainer.state.log_history
    assert [e["step"] for e in history if "loss" in e] == [2, 4, 6]
    assert [e["step"] for e in history if "eval_loss" in e] == [3, 6]
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in history if "loss" in e)


def test_the_trainers_record_is_part_of_the_state_a_peer_receives(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train()
    state = trainer.job._state()
    check_sendable(state)  # plain data: a heal, a catch-up and a checkpoint carry it
    record = state["extra"]
    assert record["log_history"] == trainer.state.log_history
    early = "EarlyStoppingCallback"
    assert early in record["callbacks"]
    fresh = _trainer(tmp_path)
    fresh._make_job()
    record["callbacks"][early]["attributes"]["early_stopping_patience_counter"] = 4
    fresh.job = None
    fresh_record = fresh._make_job().extra_state
    fresh_record.load_state_dict(record)
    stopping = [c for c in fresh.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback)][0]
    assert stopping.early_stopping_patience_counter == 4 and fresh.state.log_history == trainer.state.log_history


@pytest.mark.parametrize("overrides, named", [
    ({"bf16": True}, "bf16 mixed precision through the Trainer"),
    ({"auto_find_batch_size": True}, "auto_find_batch_size"),
])
def test_arguments_that_would_change_the_model_are_refused_by_name(tmp_path, overrides, named):
    with pytest.raises(UnsupportedFeature, match=named):
        _trainer(tmp_path, **overrides)


def test_resuming_from_a_trainer_checkpoint_is_refused_saying_how_unbroken_resumes(tmp_path):
    with pytest.raises(UnsupportedFeature, match="resumes from its own durable checkpoints"):
        _trainer(tmp_path).train(resume_from_checkpoint=True)
