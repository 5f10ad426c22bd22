"""Hugging Face ``transformers.Trainer`` scripts under unbroken: change the import, keep the script.

::

    from transformers import TrainingArguments
    from unbroken.integrations.transformers import Trainer   # was: from transformers import Trainer

    args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             max_steps=1000, eval_strategy="steps", eval_steps=100, save_steps=200, logging_steps=10)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=valid)
    trainer.train()
    trainer.save_model("final")

:meth:`Trainer.train` runs the Trainer's training on unbroken's step protocol (a
:class:`~unbroken.Job`): a step is ``per_device_train_batch_size * gradient_accumulation_steps``
samples whatever the number of workers (the single process's step: the Trainer multiplies it by
the world size), split among the live members in micro-batches of ``per_device_train_batch_size``;
``compute_loss`` gives each micro-batch's loss, the gradients are reduced, clipped to
``max_grad_norm``, and the optimizer and the ``TrainingArguments`` scheduler step once per
committed step. A lost member's step is redone by the others; a member that comes back is healed,
the Trainer's record with it (log history, best metric, stateful callbacks such as
``EarlyStoppingCallback``), so every member takes the same decisions. Evaluation
(``eval_strategy="steps"``) runs on every member over the whole evaluation set, so its metrics
and what the callbacks do with them are the same everywhere whoever is lost; the callbacks print
on the leader only (``state.is_world_process_zero``). ``save_steps`` writes unbroken's durable
checkpoints (under ``output_dir/unbroken-checkpoints`` unless ``--checkpoint-dir`` is given),
which a restarted job resumes from by itself; ``save_model`` writes on the leader alone.

What would change the model or cannot survive a lost member (mixed precision through the
Trainer, DeepSpeed, FSDP, ``group_by_length``, ``auto_find_batch_size``, resuming from a
Trainer checkpoint) is refused with an error naming it (docs/guide/transformers.md).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch

from unbroken.errors import ConfigError
from unbroken.integrations.driven_loop import UnsupportedFeature, refuse


def _one_process_to_accelerate() -> None:
    """Make every worker one process to Accelerate before ``TrainingArguments`` asks it.

    ``unbroken run`` sets ``LOCAL_RANK`` (its workers pick their GPU by it); ``TrainingArguments``
    hands it to Accelerate, which takes it for torchrun's and calls ``init_process_group`` (it fails
    without ``MASTER_ADDR``). unbroken makes the process groups itself, so the value moves to
    ``UNBROKEN_LOCAL_RANK`` (:mod:`unbroken.worker.local_rank`) and Accelerate is told this
    worker's device instead."""
    if "LOCAL_RANK" not in os.environ or "WORLD_SIZE" in os.environ or "UNBROKEN_MEMBER_ID" not in os.environ:
        return  # not a worker of `unbroken run` (torchrun sets WORLD_SIZE): leave Accelerate alone
    from unbroken.worker import local_rank

    if torch.cuda.is_available() and "ACCELERATE_TORCH_DEVICE" not in os.environ:
        os.environ["ACCELERATE_TORCH_DEVICE"] = f"cuda:{int(os.environ['LOCAL_RANK']) % torch.cuda.device_count()}"
    local_rank.hide_from_frameworks()


_one_process_to_accelerate()

import transformers  # noqa: E402 - after LOCAL_RANK is hidden from Accelerate
from transformers.trainer_callback import ExportableState, ProgressCallback, TrainerState  # noqa: E402
from transformers.trainer_utils import TrainOutput  # noqa: E402

GUIDE = "docs/guide/transformers.md"
REFUSED_ARGS = {
    "fp16": "fp16 mixed precision through the Trainer (train in the model's dtype)",
    "bf16": "bf16 mixed precision through the Trainer (train in the model's dtype, or load it in bfloat16)",
    "deepspeed": "DeepSpeed", "fsdp": "FSDP through the Trainer (use unbroken's replica groups, docs/guide/replica-groups.md)",
    "group_by_length": "group_by_length (unbroken orders the samples: the order must not depend on the members)",
    "auto_find_batch_size": "auto_find_batch_size (the global batch is fixed: per_device_train_batch_size *"
                            " gradient_accumulation_steps)",
}
"""TrainingArguments that cannot keep unbroken's guarantees -> what they are, what to do instead."""


def _refuse(feature: str) -> UnsupportedFeature:
    return refuse("unbroken's Trainer", feature, GUIDE)


class _TrainerRecord:
    """What of the Trainer is part of the healed and checkpointed state: its log history, best
    metric, the loss summed since the last log, and the stateful callbacks' states."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer
        self.loss_sum, self.loss_steps = 0.0, 0

    def _stateful(self) -> dict[str, Any]:
        return {type(c).__name__: c for c in self.trainer.callback_handler.callbacks if isinstance(c, ExportableState)}

    def state_dict(self) -> dict[str, Any]:
        state = self.trainer.state
        return {"log_history": [dict(e) for e in state.log_history], "best_metric": state.best_metric,
                "best_global_step": state.best_global_step, "best_model_checkpoint": state.best_model_checkpoint,
                "total_flos": state.total_flos, "loss": [self.loss_sum, self.loss_steps],
                "callbacks": {name: c.state() for name, c in self._stateful().items()}}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state = self.trainer.state
        state.log_history = [dict(e) for e in saved["log_history"]]
        state.best_metric, state.best_global_step = saved["best_metric"], saved["best_global_step"]
        state.best_model_checkpoint, state.total_flos = saved["best_model_checkpoint"], saved["total_flos"]
        self.loss_sum, self.loss_steps = saved["loss"]
        for name, callback in self._stateful().items():
            if name in saved["callbacks"]:
                for key, value in saved["callbacks"][name].get("attributes", {}).items():
                    setattr(callback, key, value)


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose :meth:`train` survives lost workers (see the module's docstring)."""

    job: Any = None
    """The :class:`~unbroken.Job` of the last :meth:`train` (``on_leader``, ``stop``, ``next_step``)."""
    _trained = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name, what in REFUSED_ARGS.items():
            if getattr(self.args, name, None) not in (None, False, "", [], {}):
                raise _refuse(what)

    # -- training ----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> TrainOutput:
        """Train on unbroken's step protocol; returns the Trainer's ``TrainOutput``."""
        if resume_from_checkpoint not in (None, False):
            raise _refuse("resume_from_checkpoint (unbroken resumes from its own durable checkpoints, written every"
                          " save_steps, when the job is started again)")
        if trial is not None:
            raise _refuse("hyper-parameter search")
        if self.train_dataset is None:
            raise ConfigError("Trainer.train() needs a train_dataset")
        job, self._trained = self._make_job(), False
        self.job = job
        total = self.state.max_steps
        args, record = self.args, job.extra_state
        started = time.monotonic()
        begun = False
        for step in job.steps(total=total):
            leading = self.state.is_world_process_zero
            self.state.is_world_process_zero = self.state.is_local_process_zero = job.is_leader
            if not begun:  # the leader is known once the first generation formed
                self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
                begun = True
            elif leading != job.is_leader:
                self._hand_over_progress(job.is_leader)
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            self.model.train()
            for inputs in step.micro_batches():
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(self.model, self._prepare_inputs(inputs))
                step.backward(loss)
            grad_norm = None
            if args.max_grad_norm and args.max_grad_norm > 0 and step.reduce():
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)  # read when logged
            if not step.commit():
                continue  # a member was lost: the step is redone
            self.state.global_step = job.next_step
            self.state.epoch = job.next_step / self._steps_per_epoch
            record.loss_sum += float(step.loss or 0.0)
            record.loss_steps += 1
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self._log_evaluate(grad_norm, ignore_keys_for_eval)
            if self.control.should_training_stop:
                job.stop("a Trainer callback stopped the training")
        self._trained = True
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        history = [e["loss"] for e in self.state.log_history if "loss" in e]
        metrics = {"train_runtime": time.monotonic() - started, "epoch": self.state.epoch}
        return TrainOutput(self.state.global_step, sum(history) / len(history) if history else 0.0, metrics)

    def _hand_over_progress(self, leading: bool) -> None:
        """The leader changed: the progress bars move to the new one (its bar starts at the step the
        job reached), so a callback never finds the bar that only the first leader made missing."""
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, ProgressCallback):
                if leading:
                    callback.on_train_begin(self.args, self.state, self.control)
                elif callback.training_bar is not None:
                    callback.training_bar.close()
                    callback.training_bar = None

    def _make_job(self) -> Any:
        from unbroken.storage.checkpoint_settings import CheckpointSettings
        from unbroken.worker.runtime import Job

        args = self.args
        micro = args.per_device_train_batch_size
        global_batch = micro * args.gradient_accumulation_steps
        dataset = self.train_dataset
        collator = self._get_collator_with_removed_columns(self.data_collator, description="training")
        self._steps_per_epoch = len(dataset) / global_batch
        total = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * self._steps_per_epoch)
        self.create_optimizer_and_scheduler(num_training_steps=total)
        checkpoint = CheckpointSettings.from_env()
        if checkpoint.directory is None and args.save_strategy == "steps" and args.save_steps:
            every = int(args.save_steps) if args.save_steps >= 1 else max(1, math.ceil(args.save_steps * total))
            checkpoint = CheckpointSettings(os.path.join(args.output_dir, "unbroken-checkpoints"), every,
                                            args.save_total_limit or checkpoint.keep)
        self.state = TrainerState(stateful_callbacks=[c for c in self.callback_handler.callbacks if isinstance(c, ExportableState)])
        self.state.max_steps, self.state.train_batch_size = total, global_batch
        self.state.logging_steps, self.state.eval_steps, self.state.save_steps = args.logging_steps, args.eval_steps, args.save_steps
        self.state.num_train_epochs = math.ceil(total / self._steps_per_epoch)
        job = Job(self.model, self.optimizer, dataset, global_batch_size=global_batch, micro_batch_size=micro, seed=args.seed,
                  scheduler=self.lr_scheduler, collate_fn=collator, num_workers=args.dataloader_num_workers,
                  extra_state=_TrainerRecord(self), checkpoint=checkpoint)
        return job

    def _log_evaluate(self, grad_norm: torch.Tensor | None, ignore_keys: list[str] | None) -> None:
        """The Trainer's logging and evaluation at this step, the same on every member."""
        args, step, record = self.args, self.state.global_step, self.job.extra_state
        if args.logging_strategy == "steps" and args.logging_steps and step % _every(args.logging_steps, self.state.max_steps) == 0:
            logs = {"loss": round(record.loss_sum / max(record.loss_steps, 1), 6),
                    "learning_rate": self.lr_scheduler.get_last_lr()[0]}
            if grad_norm is not None:
                logs["grad_norm"] = float(grad_norm)
            record.loss_sum, record.loss_steps = 0.0, 0
            self.log(logs)
        if args.eval_strategy == "steps" and self.eval_dataset is not None and args.eval_steps \
                and step % _every(args.eval_steps, self.state.max_steps) == 0:
            self.evaluate(ignore_keys=ignore_keys)  # every member, the whole set: the same metrics everywhere

    # -- what only the leader does ---------------------------------------------------------------

    def is_world_process_zero(self) -> bool:
        job = self.job
        return job.is_leader if job is not None and job.distributed else super().is_world_process_zero()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model on the leader alone (every member holds the same one)."""
        job = self.job
        if job is None or not job.distributed:
            return super().save_model(output_dir, _internal_call)
        if self._trained:  # after the job's end every member holds the final model: its last leader saves
            if job.is_leader:
                super().save_model(output_dir, _internal_call)
            return None
        job.on_leader(super().save_model, output_dir, _internal_call)
        return None


def _every(interval: float, total: int) -> int:
    """An interval of the TrainingArguments in steps (below 1: a fraction of the total)."""
    return int(interval) if interval >= 1 else max(1, math.ceil(interval * total))
