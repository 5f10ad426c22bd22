"""unbroken's step protocol driven from a framework's own loop.

Frameworks do not write ``for step in job.steps()``: the script iterates a data loader, calls
``backward`` per batch and ``optimizer.step()`` when gradients are accumulated. A
:class:`DrivenLoop` turns that shape into unbroken's steps. Its :meth:`batches` is what the
framework's data loader yields: the micro-batches of this member's share of each step, then those
of the next step; after a step whose reduce failed (a member was lost), the micro-batches of the
same step again, as the new generation splits it, so the framework's loop redoes it without
noticing. :meth:`optimizer_step` commits the step when the last micro-batch of this member's
share was backpropagated, and does nothing before (gradient accumulation). :meth:`finish` ends the
job at the boundary where the script stopped iterating, as a ``break`` taken by every member does.
"""

from __future__ import annotations

import atexit
import sys
from typing import Any, Callable, Iterator

import torch

from unbroken.errors import LoopMisuse
from unbroken.runtime import Job
from unbroken.step import Step


class DrivenLoop:
    """A :class:`~unbroken.Job` whose steps a framework's loop drives (see the module's docstring).

    Args:
        total: steps of the whole job (the last one ends the job as at a normal end).
        job_args: the :class:`~unbroken.Job`'s arguments.
    """

    def __init__(self, total: int, **job_args: Any) -> None:
        self.job = Job(**job_args)
        self.total = total
        self._steps: Iterator[Step] | None = None
        self.step: Step | None = None
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
        and checkpoint), with every member."""
        if self.job.next_step >= self.total and not self._finished:
            self._finished = next(self._steps, None) is None

    def batches(self, steps: int | None = None) -> Iterator[Any]:
        """The micro-batches of the next ``steps`` steps (all that remain if None), redoing a failed one."""
        end = self.total if steps is None else min(self.total, self.job.next_step + steps)
        while self.job.next_step < end:
            step = self.next()
            if step is None:
                return
            for self._micro, batch in enumerate(step.micro_batches()):
                yield batch
            self.step = None
        self.after_commit()

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
        if not self.sync:
            return False
        return self.step.commit()

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
            from unbroken.lifetime import ExitGuard

            if sys.exc_info()[0] is not None or ExitGuard.crashed:
                self.job._left_on_error = True
            self._steps.close()
