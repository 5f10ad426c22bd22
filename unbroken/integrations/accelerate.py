"""Hugging Face Accelerate scripts under unbroken: change the import, keep the loop.

::

    from unbroken.integrations.accelerate import Accelerator   # was: from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = loss_fn(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

:class:`Accelerator` keeps Accelerate's names for what a training script calls, and runs them on
unbroken's step protocol (:class:`~unbroken.integrations.driven_loop.DrivenLoop`): the prepared
training loader yields this member's share of each step, whose global batch is
``batch_size * gradient_accumulation_steps`` samples whatever the number of workers (Accelerate
multiplies it by ``num_processes``; pass ``global_batch_size=`` to choose another), so the model
is the single process's. ``backward`` weights each batch's loss by its share, ``optimizer.step()``
commits after this member's last batch of the step (``sync_gradients``), ``clip_grad_norm_``
clips the reduced gradients, and the prepared scheduler and ``zero_grad`` leave their work to the
commit. A step whose reduce failed is redone: the loader yields its batches again. Evaluation
loaders are not sharded (every member evaluates all of it, so ``gather_for_metrics`` returns its
input): correct whoever is lost. What Accelerate offers that would change the model or cannot
survive a lost member (mixed precision through Accelerate, DeepSpeed, FSDP, trackers, several
optimizers) is refused with an error naming it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Any

import torch

from unbroken.errors import ConfigError
from unbroken.integrations.driven_loop import (
    CommittedScheduler,
    CommittingOptimizer,
    DrivenLoop,
    EvaluationBatches,
    TrainingBatches,
    UnsupportedFeature,
    default_collate_or,
    job_total,
    plan_steps,
    refuse,
)

REFUSED = {
    "mixed_precision": "mixed precision through Accelerate (pass a torch.amp.GradScaler to unbroken.Job instead, or train in"
                       " the model's dtype)",
    "deepspeed_plugin": "DeepSpeed", "deepspeed_plugins": "DeepSpeed", "fsdp_plugin": "FSDP through Accelerate (use"
    " unbroken's replica groups, docs/guide/replica-groups.md)", "megatron_lm_plugin": "Megatron-LM",
    "torch_tp_plugin": "tensor parallelism", "parallelism_config": "parallelism configs", "log_with": "trackers (log on the"
    " leader: if accelerator.is_main_process)", "dynamo_backend": "torch.compile through Accelerate (compile the model"
    " yourself)", "split_batches": "split_batches (the global batch is fixed: global_batch_size=)",
}
"""Accelerator arguments that cannot keep unbroken's guarantees -> what to do instead."""


def _refuse(feature: str) -> UnsupportedFeature:
    return refuse("unbroken's Accelerator", feature, "docs/guide/accelerate.md")


class Accelerator:
    """Accelerate's ``Accelerator`` for a script that survives lost workers (see the module's docstring).

    Args:
        gradient_accumulation_steps: micro-batches per step as a single process sees them; a
            step's global batch is ``batch_size`` times this (default 1).
        global_batch_size: samples per step over all workers (default: the loader's batch size
            times ``gradient_accumulation_steps``).
        num_epochs: passes over the training loader the script makes; the job ends after them.
            Default: the script's own epoch loop decides (each pass over the prepared loader is
            one epoch of the job's steps), and the job ends where every worker stops iterating.
        max_steps: the job's steps instead of ``num_epochs`` passes.
        seed: seeds the sample order.
        cpu: train on the CPU even where a GPU is.
        **accelerate_args: Accelerate arguments unbroken does not support are refused, naming them;
            others that do not change training (``device_placement``, ``project_dir``, ...) are accepted.
    """

    def __init__(self, gradient_accumulation_steps: int = 1, *, global_batch_size: int | None = None, num_epochs: int | None = None,
                 max_steps: int | None = None, seed: int = 0, cpu: bool = False, **accelerate_args: Any) -> None:
        for name, value in accelerate_args.items():
            if name in REFUSED and value not in (None, False, "no", [], {}):
                raise _refuse(REFUSED[name])
        if isinstance(gradient_accumulation_steps, bool) or not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ConfigError(f"gradient_accumulation_steps must be a positive integer, got {gradient_accumulation_steps!r}")
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self._global_batch_size, self._num_epochs, self._max_steps, self._seed = global_batch_size, num_epochs, max_steps, seed
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cpu") if cpu or not torch.cuda.is_available() else torch.device("cuda", local)
        self._loop: DrivenLoop | None = None

    # -- preparing ---------------------------------------------------------------------------

    def prepare(self, *objects: Any) -> Any:
        """Prepare the model, the optimizer, the training loader (the first), evaluation loaders
        and a scheduler, in any order; returns them in the same order."""
        models = [o for o in objects if isinstance(o, torch.nn.Module)]
        optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        loaders = [o for o in objects if isinstance(o, torch.utils.data.DataLoader)]
        schedulers = [o for o in objects if hasattr(o, "step") and hasattr(o, "get_last_lr")]
        if self._loop is not None:
            raise _refuse("a second call to prepare() (prepare the model, optimizer, loaders and scheduler in one call)")
        if len(models) != 1 or len(optimizers) != 1 or not loaders:
            raise ConfigError("unbroken's Accelerator prepares one model, one optimizer and the training data loader (then"
                              f" evaluation loaders and a scheduler) in one call; got {len(models)} model(s),"
                              f" {len(optimizers)} optimizer(s), {len(loaders)} data loader(s)")
        if len(schedulers) > 1:
            raise _refuse("several schedulers")
        model = models[0].to(self.device)
        train = loaders[0]
        if train.batch_size is None:
            raise _refuse("a batch sampler (unbroken plans the samples of each step: give the DataLoader a batch_size)")
        micro = train.batch_size
        global_batch = self._global_batch_size or micro * self.gradient_accumulation_steps
        steps_per_epoch = plan_steps(train, global_batch)
        total = job_total(self._max_steps, self._num_epochs, steps_per_epoch)
        self._loop = DrivenLoop(
            total, model=model, optimizer=optimizers[0], dataset=train.dataset, global_batch_size=global_batch,
            micro_batch_size=micro, seed=self._seed, scheduler=schedulers[0] if schedulers else None,
            collate_fn=default_collate_or(train),
            scheduler_hint="Prepare it with the model and optimizer: accelerator.prepare(model, optimizer, loader, scheduler)",
        )
        prepared: dict[int, Any] = {
            id(model): model,
            id(optimizers[0]): CommittingOptimizer(optimizers[0], lambda: self._loop),
            id(train): TrainingBatches(self._loop, steps_per_epoch, math.ceil(global_batch / micro), self.device),
        }
        for loader in loaders[1:]:
            prepared[id(loader)] = EvaluationBatches(loader, self.device)
        for scheduler in schedulers:
            prepared[id(scheduler)] = CommittedScheduler(scheduler)
        out = tuple(prepared.get(id(o), o) for o in objects)
        return out[0] if len(out) == 1 else out

    @property
    def job(self) -> Any:
        """The :class:`~unbroken.Job` behind the loop (``on_leader``, ``stop``, ``next_step``)."""
        if self._loop is None:
            raise ConfigError("call accelerator.prepare(model, optimizer, train_loader, ...) first")
        return self._loop.job

    # -- the step ----------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The batch's mean loss, weighted by its share of the step (not divided by the accumulation steps)."""
        self._loop.backward(loss)

    @property
    def sync_gradients(self) -> bool:
        """True on this member's last batch of the step: ``optimizer.step()`` then commits it."""
        return self._loop is not None and self._loop.sync

    def accumulate(self, *models: Any) -> contextlib.AbstractContextManager:
        """Nothing to do: the step knows its batches (kept so that scripts run unchanged)."""
        return contextlib.nullcontext()

    def no_sync(self, model: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Reduce the step's gradients over every member, then clip them (as DDP clips reduced ones)."""
        if not self._loop.reduce():
            return None  # a member was lost: the step is redone, and so is this
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        if self._loop.reduce():
            torch.nn.utils.clip_grad_value_(parameters, clip_value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        step = self._loop.step if self._loop is not None else None
        return step is None or not step.committed

    # -- who is who ----------------------------------------------------------------------------

    @property
    def is_main_process(self) -> bool:
        """True on the leader of the current generation (it changes when workers come and go)."""
        return self._loop is None or self._loop.job.is_leader

    is_local_main_process = is_main_process

    @property
    def process_index(self) -> int:
        return 0 if self._loop is None else self._loop.job.member_index

    @property
    def num_processes(self) -> int:
        return 1 if self._loop is None else self._loop.job.member_count

    @property
    def use_distributed(self) -> bool:
        return self._loop is not None and self._loop.job.distributed

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def unwrap_model(self, model: Any, **kwargs: Any) -> Any:
        return model

    def wait_for_everyone(self) -> None:
        """Nothing: a worker never needs to wait for the others here (the leader's work goes
        through :meth:`on_main_process`-guarded code or ``accelerator.job.on_leader``)."""

    # -- metrics and saving --------------------------------------------------------------------

    def gather_for_metrics(self, value: Any, use_gather_object: bool = False) -> Any:
        """Evaluation loaders are not sharded: every member holds every result already."""
        return value

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every member's ``tensor``, concatenated (over the current generation)."""
        import torch.distributed as dist

        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        if not dist.is_initialized():
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor)
        return torch.cat(parts)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        gathered = self.gather(tensor).reshape(-1, *tensor.shape) if tensor.dim() else self.gather(tensor)
        return gathered.sum(0) if reduction == "sum" else gathered.mean(0)

    def save(self, obj: Any, f: Any, **kwargs: Any) -> None:
        """``torch.save`` on the leader."""
        if self.is_main_process:
            torch.save(obj, f)

    def save_state(self, output_dir: str, safe_serialization: bool = True, **kwargs: Any) -> None:
        """The leader saves the model, optimizer and scheduler in ``output_dir`` in Accelerate's own
        layout (``model.safetensors`` or ``pytorch_model.bin``, ``optimizer.bin``,
        ``scheduler.bin``), which :meth:`load_state`, and Accelerate's, read back. Call it on every
        worker at the same point (every worker's state is the same). Durable checkpoints that a
        restarted job resumes from by itself are ``unbroken run --checkpoint-dir``'s."""
        job = self.job

        def save() -> None:
            from accelerate.utils import OPTIMIZER_NAME, SCHEDULER_NAME

            os.makedirs(output_dir, exist_ok=True)
            _save_weights(job.model.state_dict(), output_dir, safe_serialization)
            torch.save(job.optimizer.state_dict(), os.path.join(output_dir, f"{OPTIMIZER_NAME}.bin"))
            if job.scheduler is not None:
                torch.save(job.scheduler.state_dict(), os.path.join(output_dir, f"{SCHEDULER_NAME}.bin"))

        self._on_leader_or_last_leader(save)

    def load_state(self, input_dir: str, **kwargs: Any) -> None:
        """Load what :meth:`save_state` (or Accelerate's) wrote into the prepared model, optimizer
        and scheduler, on every worker, before the training loop: every worker then starts from
        the same state. The job's step count starts at 0 as with Accelerate (its loader is not
        moved on either)."""
        from accelerate.utils import OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, SCHEDULER_NAME, WEIGHTS_NAME

        job = self.job
        if job.total is not None:
            raise _refuse("load_state() inside the training loop (call it after prepare(), before the loop)")
        safe = os.path.join(input_dir, SAFE_WEIGHTS_NAME)
        if os.path.exists(safe):
            from safetensors.torch import load_file

            weights = load_file(safe)
        else:
            weights = torch.load(os.path.join(input_dir, WEIGHTS_NAME), weights_only=True)
        job.model.load_state_dict(weights)
        job.optimizer.load_state_dict(torch.load(os.path.join(input_dir, f"{OPTIMIZER_NAME}.bin"), weights_only=True))
        scheduler = os.path.join(input_dir, f"{SCHEDULER_NAME}.bin")
        if job.scheduler is not None and os.path.exists(scheduler):
            job.scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def save_model(self, model: Any, save_directory: str, safe_serialization: bool = True, **kwargs: Any) -> None:
        """The model's weights in ``save_directory``, as Accelerate writes them, by the leader."""
        def save() -> None:
            os.makedirs(save_directory, exist_ok=True)
            _save_weights(model.state_dict(), save_directory, safe_serialization)

        self._on_leader_or_last_leader(save)

    def _on_leader_or_last_leader(self, fn: Any) -> None:
        job = self.job
        if self._loop.finished:  # after the job's end: every member holds the final model; its last leader saves
            if job.is_leader:
                fn()
            return
        job.on_leader(fn)

    # -- harmless: what Accelerate's examples call that changes nothing here ---------------------

    mixed_precision = "no"
    """Always ``"no"``: mixed precision through Accelerate is refused (a GradScaler goes to unbroken.Job)."""

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, Any]:
        return model.state_dict()

    @contextlib.contextmanager
    def main_process_first(self) -> Any:
        """Every worker runs the block (as Accelerate's does, the main process first there): each
        prepares its own data; nothing here waits for another worker."""
        yield

    local_main_process_first = main_process_first

    def on_main_process(self, function: Any) -> Any:
        """A decorator: ``function`` runs on the leader alone (the current one), as :meth:`print` does."""
        @functools.wraps(function)
        def on_leader(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if self.is_main_process else None

        return on_leader

    on_local_main_process = on_main_process

    def free_memory(self, *objects: Any) -> list[None]:
        """Collect garbage (and the CUDA cache); like Accelerate's, returns ``None`` for each object."""
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)

    release_memory = free_memory

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        """Nothing: no tracker is initialised (``log_with`` is refused), as Accelerate's does then."""

    def end_training(self) -> None:
        """End the job here, for every worker that ends it at the same step (idempotent; also at exit)."""
        if self._loop is not None:
            self._loop.finish()

    def __getattr__(self, name: str) -> Any:
        reason = REFUSED_METHODS.get(name)
        raise _refuse(f"Accelerator.{name}" + (f" ({reason})" if reason else ""))


def _save_weights(state: dict[str, Any], directory: str, safe_serialization: bool) -> None:
    from accelerate.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

    if safe_serialization:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(directory, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
    else:
        torch.save(state, os.path.join(directory, WEIGHTS_NAME))


REFUSED_METHODS = {
    "skip_first_batches": "unbroken plans the samples: a worker that comes back resumes in the job's step by itself",
    "autocast": "mixed precision through Accelerate; pass a torch.amp.GradScaler to unbroken.Job, or train in the model's dtype",
    "init_trackers": "trackers; log on the leader: if accelerator.is_main_process",
    "get_tracker": "trackers; log on the leader: if accelerator.is_main_process",
    "register_for_checkpointing": "objects of your own in save_state; give them to unbroken.Job(extra_state=...) to heal them",
    "set_trigger": "a flag set on one process; stop every worker at one step with accelerator.job.stop()",
    "check_trigger": "a flag set on one process; stop every worker at one step with accelerator.job.stop()",
    "prepare_model": "preparing objects one by one; prepare the model, optimizer, loaders and scheduler in one prepare() call",
    "prepare_optimizer": "preparing objects one by one; prepare them in one prepare() call",
    "prepare_data_loader": "preparing objects one by one; prepare them in one prepare() call",
    "prepare_scheduler": "preparing objects one by one; prepare them in one prepare() call",
    "split_between_processes": "splitting work among the current processes, which change when workers come and go",
    "pad_across_processes": "evaluation loaders are not sharded: every worker holds all of it already",
}
"""Accelerator methods that cannot keep unbroken's guarantees -> why, and what to do instead."""
