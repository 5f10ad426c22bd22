"""The rules the script's training loop must keep, checked where the script breaks them.

Inside a step's body only :meth:`Step.commit <unbroken.worker.step.Step.commit>` may step the
optimizer (an update before the reduce applies one member's share of the gradients, and the
replicas drift apart), nothing may zero the gradients between a step's first ``step.backward`` and
its commit (the reduce needs them), and a collective of the script's own that fails can be redone
only inside the step, before its commit. :class:`LoopGuard` knows where the loop stands (in a
step's body, and which step) and refuses the rest with :class:`~unbroken.errors.LoopMisuse`; the
:class:`~unbroken.worker.runtime.Job` that runs the loop keeps it up to date and passes in the
little else it reads.
"""

from __future__ import annotations

from typing import Any, Callable

from unbroken.errors import GenerationFailed, LoopMisuse


class LoopGuard:
    """Where the script's loop stands, and the checks of its rules on the script's own calls.

    Args:
        optimizer: the job's optimizer; its ``step`` and ``zero_grad`` are watched from now on.
        committing: whether :meth:`Step.commit` is stepping the optimizer (its only rightful caller).
        next_step: the job's next step (named in the refusal of an optimizer step).
    """

    def __init__(self, optimizer: Any, committing: Callable[[], bool], next_step: Callable[[], int]) -> None:
        self._committing = committing
        self._next_step = next_step
        self.in_body = False
        """True while the script's loop body runs a step: there, only :meth:`Step.commit` may step
        the optimizer (unbroken's own loads may, between steps: DCP initialises optimizer state
        with a step of zero gradients)."""
        self.step: Any = None
        """The :class:`~unbroken.worker.step.Step` the loop yielded last, or None before the first."""
        self.leader_call: str | None = None
        """The function a :meth:`~unbroken.Job.on_leader` call runs, while it runs (None otherwise)."""
        previous = getattr(optimizer, "_unbroken_step_hook", None)
        if previous is not None:  # one job at a time watches an optimizer: the newest
            previous.remove()
        optimizer._unbroken_step_hook = optimizer.register_step_pre_hook(self.check_optimizer_step)
        self._watch_zero_grad(optimizer)

    def check_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Refuse ``optimizer.step()`` called by the script: the update must wait for the reduce,
        or members apply their own share's gradients and the replicas drift apart."""
        if self.in_body and not self._committing():
            raise LoopMisuse(
                f"step {self._next_step()}: optimizer.step() was called by the script; step.commit() steps the optimizer"
                " (and the scheduler, and zero_grad) once the gradients are reduced over every member: call"
                " step.commit() instead")

    def _watch_zero_grad(self, optimizer: Any) -> None:
        """Refuse ``optimizer.zero_grad()`` between a step's first ``step.backward`` and its
        commit: it would drop gradients the reduce needs (torch has no hook for it, so the
        optimizer's own method is wrapped, once)."""
        original = getattr(optimizer, "_unbroken_zero_grad", None) or optimizer.zero_grad
        optimizer._unbroken_zero_grad = original

        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            step = self.step
            if (self.in_body and step is not None and step._backwards and not self._committing()
                    and not (step.committed or step.failed or step.stopped)):
                raise LoopMisuse(
                    f"step {step.index}: optimizer.zero_grad() was called by the script after step.backward and before"
                    " step.commit(); it would drop gradients the reduce needs. step.commit() zeroes them after the"
                    " optimizer step: remove the call (or make it before the step's first step.backward)")
            return original(*args, **kwargs)

        optimizer.zero_grad = zero_grad

    def check_script_collective(self, op: str) -> None:
        """Refuse a collective of the script's own inside ``job.on_leader(fn)``: only the leader
        runs ``fn``, and the others wait for its result without any collective, so none would
        ever join it (it would hang to the collective timeout, and the call be retried)."""
        if self.leader_call is not None:
            raise LoopMisuse(
                f"torch.distributed {op} inside job.on_leader({self.leader_call}): only the leader runs it, so no other"
                " member joins the collective. Make collectives in the loop body on every member (before step.commit()),"
                " and keep on_leader's function to the leader's own work (evaluate, log, save)")

    def script_collective_failed(self, error: GenerationFailed) -> None:
        """A collective of the script's own on torch.distributed's default group failed (a member
        was lost): inside a step, before its reduce, the step is redone in the next generation
        (the collective returns, its output undefined, and the reduce fails); elsewhere, raise."""
        step = self.step
        if self.in_body and step is not None and not step.committed:
            step._stale = step._stale or str(error)  # the reduce (or the commit) fails on it
            return
        where = f"after step {step.index}'s commit" if step is not None else "outside the training loop"
        raise GenerationFailed(
            f"{error}: a collective of the script's own on torch.distributed's default group failed {where}, where it"
            " cannot be redone; make it inside the step, before step.commit(), where a failure is redone"
            " with the step, or use job.on_leader for work the leader does alone") from None
