"""unbroken's step protocol driven from a framework's own loop.

Frameworks do not write ``for step in job.steps()``: the script iterates a data loader, calls
``backward`` per batch and ``optimizer.step()`` when gradients are accumulated. A
:class:`DrivenLoop` turns that shape into unbroken's steps. Its :meth:`batches` is what the
framework's data loader yields: the micro-batches of this member's share of each step, then those
of the next step; after a step whose reduce failed (a member was lost), the micro-batches of the
same step again, as the new generation splits it, so the framework's loop redoes it without
noticing. Each pass over the loader is an epoch counted in the job's steps, so a restarted
process's epoch loop catches up with the job's. :meth:`optimizer_step` commits the step when the
last micro-batch of this member's share was backpropagated, and does nothing before (gradient
accumulation). :meth:`finish` ends the job at the boundary where the script stopped iterating, as
a ``break`` taken by every member does: after the last step of its total, or earlier (a clean stop,
said on the console), and after whatever the script does after its loop (saving, evaluating).
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Any, Callable, Iterator

import torch

from unbroken.errors import ConfigError, LoopMisuse
from unbroken.worker.runtime import Job
from unbroken.worker.step import Step
from unbroken.worker.step_loop import OPEN_ENDED


class UnsupportedFeature(ConfigError):
    """A framework feature that unbroken cannot keep its guarantees with; the message names it."""


def refuse(who: str, feature: str, guide: str) -> UnsupportedFeature:
    """The error for ``feature`` of ``who`` (unbroken's Accelerator, Fabric, UnbrokenStrategy)."""
    return UnsupportedFeature(f"{who} does not support {feature}: it would train a different model than a single process,"
                              f" or not survive a lost worker (see {guide})")




class DrivenLoop:
    """A :class:`~unbroken.Job` whose steps a framework's loop drives (see the module's docstring).

    Args:
        total: steps of the whole job (the last one ends the job as at a normal end).
        job_args: the :class:`~unbroken.Job`'s arguments.
    """

    def __init__(self, total: int, scheduler_hint: str | None = None, **job_args: Any) -> None:
        self.job = Job(**job_args)
        self.total = total
        self._scheduler_hint = scheduler_hint
        """Where the framework takes a scheduler; with it, a scheduler attached to the optimizer
        but not given to the job is refused at the first commit (:meth:`optimizer_step`)."""
        self._steps: Iterator[Step] | None = None
        self.step: Step | None = None
        self._pending: Step | None = None
        """A step taken from the job but belonging to a later pass over the loader (this process
        joined a job already past its current pass): the next pass starts with it."""
        self._micro = 0
        self._finished = False
        atexit.register(self.finish)

    @property
    def finished(self) -> bool:
        """True once the job ended for this member."""
        return self._finished

    @property
    def sync(self) -> bool:
        """True while the current micro-batch is the last of this member's share of its step: its
        backward completes the step's gradients (Accelerate's ``sync_gradients``)."""
        return self.step is not None and self._micro == len(self.step._micro) - 1

    def next(self) -> Step | None:
        """The next step to run (the same one again after a failure); None once the job ended."""
        if self._finished:
            return None
        if self._steps is None:
            self._steps = self.job.steps(total=self.total)
        self.step = next(self._steps, None)
        if self.step is None:  # the job ended (a member stopped it, or it finished without us)
            self._finished = True
        return self.step

    def after_commit(self) -> None:
        """After the last step's commit: end the job as at a normal end (the final replica check
        and checkpoint), with every member (Lightning's loop, which has no end of its own to call)."""
        if self.job.next_step >= self.total and not self._finished:
            self._finished = next(self._steps, None) is None

    def batches(self, index: int, steps_per_pass: int) -> Iterator[Any]:
        """The micro-batches of pass ``index`` over the training loader: the steps
        ``[index * steps_per_pass, (index + 1) * steps_per_pass)`` of the job (up to its total),
        a failed one redone. Passes are counted in the job's steps, not in this process's
        iterations: a process that joined (or was healed) past the steps of the pass it begins
        gets nothing from it, so that its script's epoch loop catches up with the job's epochs
        and every member ends its passes at the same step."""
        end = min(self.total, (index + 1) * steps_per_pass)
        while not self._finished:
            if self._pending is not None:
                step, self._pending = self._pending, None
                self.step = step
            elif self.job.next_step >= end and self._steps is not None:
                break  # the pass is done (known without taking the next step from the job)
            else:
                step = self.next()  # the first one joins the job and heals this process
                if step is None:
                    return
            if step.index >= end:  # the job is past this pass: the next one starts with this step
                self._pending, self.step = step, None
                break
            for self._micro, batch in enumerate(step.micro_batches()):
                yield batch
            self.step = None

    def backward(self, loss: torch.Tensor) -> None:
        if self.step is None:
            raise LoopMisuse("backward was called outside the training data loader's iteration; unbroken weights each"
                             " micro-batch's loss by its share of the step: call it on the loss of a batch the prepared"
                             " data loader yielded")
        self.step.backward(loss)

    def reduce(self) -> bool:
        """Before clipping: reduce the step's gradients over every member (once; False if a member was lost)."""
        return self.step is not None and self.sync and self.step.reduce()

    def optimizer_step(self) -> bool:
        """Commit the step after its last micro-batch; before it, nothing (gradients accumulate)."""
        self._check_scheduler()
        if not self.sync:
            return False
        return self.step.commit()

    def _check_scheduler(self) -> None:
        """A torch learning-rate scheduler on the optimizer that the job was not given would be
        stepped by the script as often as it calls it: once per batch, so with this member's
        share of each step (the schedule would depend on the number of members), and it would
        be neither committed nor healed. Refused, naming where it belongs."""
        if self._scheduler_hint is None or self.job.scheduler is not None:
            return
        if getattr(self.job.optimizer.step, "_wrapped_by_lr_sched", False):
            raise LoopMisuse(
                "a learning-rate scheduler is attached to the optimizer but was not given to unbroken: stepped by the loop"
                " next to optimizer.step(), it would advance with each worker's batches (a schedule that depends on the"
                f" number of workers) and never be healed. {self._scheduler_hint}; it is then stepped once per committed"
                " step and healed with the model, and the loop's own scheduler.step() calls do nothing")

    def on_leader(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.job.on_leader(fn, *args, **kwargs)

    def finish(self) -> None:
        """End the job where the script stopped iterating: every member at the same boundary ends
        it as finished (a ``break`` by every member); idempotent, and run at exit. With an
        exception in flight (or one that ended the script), leave the job unfinished instead:
        an error is never a decision to stop training."""
        if self._finished:
            return
        self._finished = True
        if self._steps is not None:
            from unbroken.worker.lifetime import ExitGuard

            if sys.exc_info()[0] is not None or ExitGuard.crashed:
                self.job._left_on_error = True
            elif 0 < self.job.next_step < self.total < OPEN_ENDED and self.job.is_leader:
                print(f"unbroken: the script stopped iterating after step {self.job.next_step - 1}, before the job's"
                      f" {self.total} steps: the job ends there, for every member", file=sys.stderr, flush=True)
            self._steps.close()


# -- what a framework's prepare/setup returns ---------------------------------------------------


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of ``batch`` on ``device``."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


class TrainingBatches:
    """The prepared training loader: this member's micro-batches of each step, on ``device``, one
    epoch (``steps_per_epoch`` steps of the job: the n-th pass is epoch n) per pass; ``len()`` is
    the batches of an epoch as a single process sees them."""

    def __init__(self, loop: DrivenLoop, steps_per_epoch: int, micro_per_step: int, device: torch.device) -> None:
        self._loop, self._device = loop, device
        self.steps_per_epoch = steps_per_epoch
        self._len = steps_per_epoch * micro_per_step
        self._passes = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Any]:
        index, self._passes = self._passes, self._passes + 1
        for batch in self._loop.batches(index, self.steps_per_epoch):
            yield to_device(batch, self._device)


class EvaluationBatches:
    """A prepared evaluation loader: all of it, on every member (no sharding, so the result is
    right whoever is lost, and a metric needs no gathering)."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self._loader, self._device = loader, device

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self._loader:
            yield to_device(batch, self._device)


class CommittingOptimizer:
    """The prepared optimizer: ``step()`` commits the step after this member's last batch of it
    (before, nothing: gradients accumulate); ``zero_grad()`` is the commit's; the rest is the optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, loop: Callable[[], DrivenLoop]) -> None:
        self.optimizer, self._loop = optimizer, loop

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise LoopMisuse("optimizer.step(closure) cannot be redone after a lost worker: call step() without a closure")
        self._loop().optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the commit zeroes the gradients after the optimizer step."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def adopt_scheduler(scheduler: Any, committing: Callable[[], bool]) -> Any:
    """Make ``scheduler.step()`` the commit's alone: the job steps it once per committed step
    (and a catch-up's replay the same), while the loop's own calls, however many per step, do
    nothing. Returns ``scheduler``, the same object (a script that kept its own name for it calls
    the same ``step``).

    The object's class becomes a subclass whose ``step`` asks ``committing``, kept outside the
    object: an attribute would be part of ``scheduler.state_dict()`` (torch's is the object's
    ``__dict__``) and a closure there makes every heal and catch-up of the state fail to pickle."""
    cls = type(scheduler)
    if cls not in _ADOPTED_CLASSES:
        if cls in _ADOPTED_CLASSES.values():  # adopted already (a second setup of the same scheduler)
            _COMMITTING[scheduler] = committing
            return scheduler
        _ADOPTED_CLASSES[cls] = type(cls.__name__, (cls,), {"step": _committed_step, "__module__": cls.__module__,
                                                             "__qualname__": cls.__qualname__})
    scheduler.__class__ = _ADOPTED_CLASSES[cls]
    _COMMITTING[scheduler] = committing
    return scheduler


_ADOPTED_CLASSES: dict[type, type] = {}
_COMMITTING: "weakref.WeakKeyDictionary[Any, Callable[[], bool]]" = weakref.WeakKeyDictionary()


def _committed_step(self: Any, *args: Any, **kwargs: Any) -> Any:
    if _COMMITTING[self]():
        return super(type(self), self).step(*args, **kwargs)
    return None  # the loop's own call: the commit steps it


class CommittedScheduler:
    """The prepared scheduler: the commit steps it, once per committed step."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the commit steps the scheduler."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


def job_total(max_steps: int | None, num_epochs: int | None, steps_per_epoch: int) -> int:
    """The job's steps: ``max_steps``, or ``num_epochs`` passes of ``steps_per_epoch``; with
    neither, :data:`OPEN_ENDED` (the script's epoch loop decides where the job ends)."""
    if max_steps is not None:
        return max_steps
    if num_epochs is not None:
        return steps_per_epoch * num_epochs
    return OPEN_ENDED


def plan_steps(loader: torch.utils.data.DataLoader, global_batch: int) -> int:
    """Steps per epoch of a map-style training loader at ``global_batch`` samples per step."""
    if isinstance(loader.dataset, torch.utils.data.IterableDataset) or loader.batch_size is None:
        raise ConfigError("a training loader with an IterableDataset or a batch sampler cannot be planned: unbroken plans"
                          " the samples of each step; give the DataLoader a map-style data set and a batch_size")
    steps = len(loader.dataset) // global_batch
    if steps < 1:
        raise ConfigError(f"the training data set holds {len(loader.dataset)} samples, fewer than one step's global batch of {global_batch}")
    return steps


def default_collate_or(loader: torch.utils.data.DataLoader) -> Any:
    """The loader's collate function, or None for torch's default (unbroken's own, which indexes
    a TensorDataset in one go)."""
    return None if loader.collate_fn is torch.utils.data.default_collate else loader.collate_fn
