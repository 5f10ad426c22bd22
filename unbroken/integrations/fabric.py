"""Lightning Fabric loops under unbroken: change where ``Fabric`` comes from, keep the loop.

::

    from unbroken.integrations.fabric import Fabric   # was: fabric = L.Fabric(accelerator=..., devices=N)

    fabric = Fabric(accumulate=2)
    fabric.launch()
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
    loader = fabric.setup_dataloaders(loader)
    for batch in loader:
        loss = loss_fn(model(batch[0]), batch[1])
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        scheduler.step()    # does nothing: the commit steps it once per step
        optimizer.zero_grad()

:class:`Fabric` keeps Fabric's names for what a training loop calls and runs them on unbroken's
steps, as :mod:`unbroken.integrations.accelerate` does for Accelerate (the same
:class:`~unbroken.integrations.driven_loop.DrivenLoop`): the prepared training loader yields this
worker's batches of each step, whose global batch is ``batch_size * accumulate`` samples
whatever the number of workers; ``backward`` weights each batch's loss by its share;
``clip_gradients`` reduces the gradients over every worker before it clips them;
``optimizer.step()`` commits the step after this worker's last batch of it and does nothing
before (so call it on every batch, and let ``accumulate`` do the accumulation: a loop that counts
batches itself would count a worker's share, which changes with the number of workers). A
scheduler given to ``setup`` is stepped once per committed step and healed; one on the optimizer
that is not given there is refused, since the loop would step it once per batch of this worker's
share. A step
whose reduce failed comes again. ``launch``, ``barrier`` and ``no_backward_sync`` do nothing;
``is_global_zero`` follows the current leader.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import torch

from unbroken.errors import ConfigError
from unbroken.integrations.driven_loop import (
    CommittingOptimizer,
    DrivenLoop,
    adopt_scheduler,
    EvaluationBatches,
    TrainingBatches,
    UnsupportedFeature,
    default_collate_or,
    job_total,
    plan_steps,
    refuse,
)


def _refuse(feature: str) -> UnsupportedFeature:
    return refuse("unbroken's Fabric", feature, "docs/guide/lightning.md")


class Fabric:
    """Lightning Fabric for a loop that survives lost workers (see the module's docstring).

    Args:
        accumulate: batches per step as a single process sees them (default 1).
        global_batch_size: samples per step over all workers (default: the loader's batch size
            times ``accumulate``).
        num_epochs: passes over the training loader the loop makes. Default: the loop's own epoch
            loop decides, and the job ends where every worker stops iterating.
        max_steps: the job's steps instead of ``num_epochs`` passes.
        seed: seeds the sample order.
        accelerator: ``"cpu"`` trains on the CPU; otherwise a GPU where there is one (``cuda:LOCAL_RANK``).
        **fabric_args: Fabric's other arguments; ``devices`` and ``num_nodes`` other than 1,
            ``strategy``, ``precision`` and ``plugins`` are refused (``unbroken run`` starts the
            workers; mixed precision goes through ``unbroken.Job(scaler=...)``).
    """

    def __init__(self, accumulate: int = 1, *, global_batch_size: int | None = None, num_epochs: int | None = None,
                 max_steps: int | None = None, seed: int = 0, accelerator: str = "auto", **fabric_args: Any) -> None:
        for name, value in fabric_args.items():
            if name in ("devices", "num_nodes") and value not in (1, "1", "auto", None):
                raise _refuse(f"{name}={value!r} (one device per worker: unbroken run --nproc-per-node starts the workers)")
            if name in ("strategy", "precision", "plugins") and value not in (None, "auto", "32-true", "64-true", 32, 64):
                raise _refuse(f"{name}={value!r}")
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ConfigError(f"accumulate must be a positive integer, got {accumulate!r}")
        self.accumulate = accumulate
        self._global_batch_size, self._num_epochs, self._max_steps, self._seed = global_batch_size, num_epochs, max_steps, seed
        cuda = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._loop: DrivenLoop | None = None

    def launch(self, function: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Nothing to launch: ``unbroken run`` started this worker. Calls ``function(self, ...)`` if given."""
        return function(self, *args, **kwargs) if function is not None else None

    # -- setting up ------------------------------------------------------------------------------

    def setup(self, module: torch.nn.Module, *optimizers: torch.optim.Optimizer, scheduler: Any = None,
              move_to_device: bool = True) -> Any:
        """The model (moved to this worker's device), its optimizer (whose ``step()`` commits) and,
        as Fabric's ``setup(..., scheduler=)``, its learning-rate scheduler: stepped once per
        committed step and healed with the model (the loop's own ``scheduler.step()`` calls then
        do nothing). A scheduler on the optimizer that is not given here is refused at the first
        ``optimizer.step()``."""
        if len(optimizers) != 1:
            raise _refuse(f"{len(optimizers)} optimizers (one optimizer, set up with its model)")
        if self._model is not None:
            raise _refuse("a second call to setup()")
        self._model, self._optimizer = module.to(self.device) if move_to_device else module, optimizers[0]
        wrapped = CommittingOptimizer(optimizers[0], lambda: self._require_loop())
        if scheduler is None:
            return self._model, wrapped
        self._scheduler = adopt_scheduler(scheduler, lambda: self._loop is not None and self._loop.job._committing)
        return self._model, wrapped, self._scheduler

    def setup_dataloaders(self, *loaders: torch.utils.data.DataLoader, **kwargs: Any) -> Any:
        """The training loader (the first: this worker's batches of each step) and evaluation
        loaders (all of it, on every worker)."""
        if self._model is None:
            raise ConfigError("call fabric.setup(model, optimizer) before fabric.setup_dataloaders(...)")
        if self._loop is not None:
            raise _refuse("a second training loader (set up the training and evaluation loaders in one call)")
        train = loaders[0]
        if train.batch_size is None:
            raise _refuse("a batch sampler (unbroken plans the samples of each step: give the DataLoader a batch_size)")
        global_batch = self._global_batch_size or train.batch_size * self.accumulate
        steps_per_epoch = plan_steps(train, global_batch)
        total = job_total(self._max_steps, self._num_epochs, steps_per_epoch)
        self._loop = DrivenLoop(total, model=self._model, optimizer=self._optimizer, dataset=train.dataset,
                                global_batch_size=global_batch, micro_batch_size=train.batch_size, seed=self._seed,
                                collate_fn=default_collate_or(train), scheduler=self._scheduler,
                                scheduler_hint="Give it to fabric.setup(model, optimizer, scheduler=scheduler)")
        out = [TrainingBatches(self._loop, steps_per_epoch, math.ceil(global_batch / train.batch_size), self.device)]
        out += [EvaluationBatches(loader, self.device) for loader in loaders[1:]]
        return out[0] if len(out) == 1 else out

    def _require_loop(self) -> DrivenLoop:
        if self._loop is None:
            raise ConfigError("call fabric.setup_dataloaders(train_loader) before training: the job's steps come from it")
        return self._loop

    @property
    def job(self) -> Any:
        """The :class:`~unbroken.Job` behind the loop (``on_leader``, ``stop``, ``next_step``)."""
        return self._require_loop().job

    # -- the step --------------------------------------------------------------------------------

    def backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The batch's mean loss, weighted by its share of the step."""
        self._require_loop().backward(tensor)

    def clip_gradients(self, module: Any, optimizer: Any, clip_val: float | None = None, max_norm: float | None = None,
                       norm_type: float = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor | None:
        """Reduce the step's gradients over every worker, then clip them (nothing before the
        step's last batch: its gradients are not all there yet)."""
        if not self._require_loop().reduce():
            return None
        if max_norm is not None:
            return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, norm_type=norm_type,
                                                  error_if_nonfinite=error_if_nonfinite)
        if clip_val is not None:
            torch.nn.utils.clip_grad_value_(module.parameters(), clip_val)
        return None

    def no_backward_sync(self, module: Any = None, enabled: bool = True) -> contextlib.AbstractContextManager:
        """Nothing: the step knows which batch completes its gradients."""
        return contextlib.nullcontext()

    # -- who is who ------------------------------------------------------------------------------

    @property
    def is_global_zero(self) -> bool:
        """True on the leader of the current generation (it changes when workers come and go)."""
        return self._loop is None or self._loop.job.is_leader

    @property
    def global_rank(self) -> int:
        return 0 if self._loop is None else self._loop.job.member_index

    @property
    def world_size(self) -> int:
        return 1 if self._loop is None else self._loop.job.member_count

    local_rank = property(lambda self: int(os.environ.get("LOCAL_RANK", "0")))

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_global_zero:
            print(*args, **kwargs)

    def barrier(self, name: str | None = None) -> None:
        """Nothing: no worker needs to wait for the others (the leader saves alone)."""

    def to_device(self, obj: Any) -> Any:
        from unbroken.integrations.driven_loop import to_device

        return obj.to(self.device) if isinstance(obj, torch.nn.Module) else to_device(obj, self.device)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = True) -> int:
        seed = 0 if seed is None else seed
        torch.manual_seed(seed)
        return seed

    def save(self, path: str, state: dict[str, Any], filter: Any = None) -> None:  # noqa: A002 - Fabric's name
        """``torch.save`` on the leader of the state's state_dicts (modules and optimizers as theirs)."""
        if not self.is_global_zero:
            return
        torch.save({k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}, path)

    def end(self) -> None:
        """End the job here, for every worker that ends it at the same step (idempotent; also at exit)."""
        if self._loop is not None:
            self._loop.finish()

    def __getattr__(self, name: str) -> Any:
        raise _refuse(f"Fabric.{name}")
