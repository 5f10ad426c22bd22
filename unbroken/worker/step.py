"""One training step, as the user's loop sees it: its micro-batches, its backward, its reduce and
its commit.

A :class:`Step` checks the loop as it goes (one ``step.backward`` per micro-batch, no gradient
computed outside it), weights each micro-batch's loss by its share of the global batch (step 4
of the protocol), and ends in one of two ways: committed (the allreduce succeeded, the optimizer stepped)
or failed (a peer failed: the gradients and buffers are put back as they were and the step is
redone by the next generation). The :class:`~unbroken.worker.runtime.Job` that yields it holds the
model, the group and the step counter.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterator

import torch

from unbroken.worker import mixed_precision
from unbroken.worker.script_collectives import for_group
from unbroken.errors import GenerationFailed, LoopMisuse

if TYPE_CHECKING:
    from unbroken.worker.job_parts import SteppingJob


class Step:
    """One training step: its micro-batches, its backward, its reduce and its commit."""

    def __init__(self, job: SteppingJob, index: int) -> None:
        self.job = job
        self.index = index
        self.generation = job.generation
        self.rank = job.member_index
        self.members = job.member_count
        self.split = job._pacing.count(self.generation, self.members) if job._reducer is not None else self.members
        """The member count, or the unequal shares that follow the members' paces (:mod:`unbroken.data.balance`)."""
        self.positions = job.plan.share(index, self.rank, self.split)
        self._micro = job.plan.micro_batches(index, self.rank, self.split)
        self._backwards = 0
        self._taken = 0  # micro-batches yielded
        self._loss_sum: torch.Tensor | None = None
        self._armed = False
        self._stale: str | None = None
        self._reduced: bool | None = None
        self.reconfigure = False
        self.loss: float | None = None
        self.committed = False
        self.skipped = False
        """True once committed if a GradScaler found inf/nan gradients and skipped the optimizer
        step (the same on every member: they all see the same reduced gradients)."""
        self.failed = False
        self.stopped = False
        """True if a member asked to stop the job (:meth:`~unbroken.Job.stop`) before this step's
        reduce: the step is not committed, and the job ends at the boundary before it."""
        self.error: Exception | None = None
        self.started = time.monotonic()
        self.paused = 0.0
        """Seconds of this step's body spent in ``job.on_leader`` calls: not this member's pace."""
        job._pacing.start(job._device)
        self._grads_at_start = job._grad_count()
        self._grads_in_backward = 0
        self._counting: bool | None = None  # backward(count=...) used in this step
        self._count = 0.0
        self._tracker: Any = None  # follows this process's first micro-batch into the model
        # Buffers (BatchNorm statistics) change in the forward pass: keep a copy so that a failed
        # attempt leaves them as they were, like the parameters.
        self._saved_buffers = [b.detach().clone() for b in job._buffers] if job._reducer is not None else []

    @property
    def untouched(self) -> bool:
        """True while nothing of this step was done: no micro-batch taken, no backward, no reduce
        (a ``break`` now leaves the loop at the boundary before it)."""
        return not self._taken and not self._backwards and self._reduced is None

    @property
    def samples(self) -> int:
        """Samples this member processes in this step (its share)."""
        return len(self.positions)

    def micro_batches(self) -> Iterator[Any]:
        """This member's share of the step's global batch, in micro-batches.

        Stops early when the generation broke meanwhile (a peer failed): :meth:`reduce` then
        returns False at once, so a long step is left within one micro-batch, not at its end."""
        job = self.job
        # The processes of a replica group must run the same number of backward passes (each is
        # a collective of the group): none of them leaves early on its own view of the generation.
        early = job._reducer is not None and (job._group is None or not job._group.grouped)
        try:
            for micro in range(len(self._micro)):
                if early and not self._stale:
                    self._stale = job._abandon_reason(self.generation)
                if self._stale:
                    return
                job._chaos.point("micro", self.index)
                batch = job._batch(self, micro)
                self._taken += 1
                job._ticks += 1
                self._follow(batch)
                yield batch
        finally:
            self.untrack()

    def untrack(self) -> None:
        """Stop following the first micro-batch, however the step ends."""
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None

    def _follow(self, batch: Any) -> None:
        """This process's first micro-batch: follow it into the model (:mod:`unbroken.worker.input_check`)."""
        self.untrack()  # the last micro-batch had no backward: _check_loop says so
        job = self.job
        if job._inputs_checked or hasattr(job.model, "_orig_mod"):  # not through a compiled model's guards
            return
        from unbroken.worker.input_check import InputTracker

        job._inputs_checked = True
        self._tracker = InputTracker(job.model, batch, self.index)

    def backward(self, loss: torch.Tensor, count: float | torch.Tensor | None = None) -> None:
        """Backpropagate a micro-batch's loss.

        Without ``count``, ``loss`` is the mean over the micro-batch's samples; it is weighted by
        the micro-batch's share of the global batch. With ``count`` (say, the number of tokens
        that are not padding), ``loss`` is the *sum* of the per-item losses over ``count`` items:
        the counts of every member are summed with the gradients, which are then divided by that
        global count, so a token-normalised loss gives the same model at any member count. Use
        one form for every micro-batch of a job."""
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.check()
        if self._backwards >= len(self._micro):
            raise LoopMisuse(f"step {self.index}: backward called more times than there are micro-batches ({len(self._micro)})")
        counting = count is not None
        if self._counting is None:
            self._counting = counting
        elif self._counting != counting:
            raise LoopMisuse(f"step {self.index}: step.backward was called with and without count= in one step; use one form")
        if counting:
            value = float(count.detach().sum()) if isinstance(count, torch.Tensor) else float(count)
            if not value >= 0:
                raise LoopMisuse(f"step {self.index}: count must be a non-negative number of items, got {count!r}")
            self._count += value
            weight = 1.0
        else:
            weight = len(self._micro[self._backwards]) / self.job.plan.global_batch_size
        self._backwards += 1
        self.job._ticks += 1
        weighted = loss * weight
        detached = weighted.detach().to(torch.float64)  # summed in float64 whatever the model's dtype
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        if self._backwards == len(self._micro):
            self._arm()
        before = self.job._grad_count()
        # With a GradScaler the gradients are of the scaled loss; commit() unscales them.
        (weighted if self.job.scaler is None else self.job.scaler.scale(weighted)).backward()
        self._grads_in_backward += self.job._grad_count() - before

    def _check_loop(self) -> None:
        """Refuse a step whose gradients are not the share-weighted sum the protocol needs."""
        self.untrack()
        if self._stale:
            return  # left early because the generation broke: redone anyway
        outside = self.job._grad_count() - self._grads_at_start - self._grads_in_backward
        if outside:
            raise LoopMisuse(
                f"step {self.index}: gradients were computed outside step.backward ({outside} gradient"
                " update(s), e.g. loss.backward()); pass each micro-batch's loss to step.backward, which"
                " weights it by its share of the global batch so that the model does not depend on the"
                " number of members"
            )
        if self._backwards != len(self._micro):
            raise LoopMisuse(
                f"step {self.index}: step.backward was called {self._backwards} time(s) for {len(self._micro)}"
                " micro-batch(es); call it exactly once per micro-batch that step.micro_batches() yields"
                " (a skipped micro-batch would leave its samples out of the global batch)"
            )

    def _arm(self) -> None:
        job = self.job
        if job._reducer is None or self._armed:
            return
        self._armed = True
        # A member that was stopped while its generation moved on must not send anything into
        # that generation (its peers' abandoned collectives would complete with it).
        self._stale = self._stale or job._abandon_reason(self.generation)
        if self._stale:
            return
        job._samples.attempt(self, job._group)
        job._reducer.arm(job._joiner.group, job._joiner.reconfigure_wanted(), self._loss_sum, self._count if self._counting else None,
                         stop=job.stop_reason is not None, pace=job._pacing.slots(self.rank, self.members),
                         pace_float64=job._pacing.group_size > 1)

    def reduce(self) -> bool:
        """Allreduce the gradients; afterwards ``.grad`` holds the global-batch gradient on every member.

        Returns False if a peer failed: the gradients are then zeroed and the step will be
        redone by the next generation, so skip straight to the next iteration.
        """
        if self._reduced is not None:
            return self._reduced
        self._check_loop()
        job = self.job
        if job._reducer is None:
            if job.stop_reason is not None:
                return self._stop()
            loss = float(self._loss_sum) if self._loss_sum is not None else 0.0
            self.loss = self._normalise(loss, self._count, 1.0 if self._counting else 0.0)
            self._reduced = True
            return True
        group = job._joiner.group
        if job._default_group is not None and group is not None:
            # a member that waits here while another waits in a collective of the script's own
            # that this member never made: both learn it (unbroken.worker.script_collectives)
            script = for_group(group, job._joiner.report_job_failure)
            group.also_check = lambda: script.in_exchange(self.index)
        try:
            flag, loss, count, counting, stop = self._reduce_shared()
            if stop > 0:
                return self._stop()
            self.reconfigure = flag > 0
            self.loss = self._normalise(loss, count, counting)
            self._reduced = True
        except GenerationFailed as exc:
            job._reducer.disarm()
            # without its traceback, whose frames hold the failed collectives (and through them
            # the abandoned group's sockets) in a cycle with this step
            self.failed, self.error, self._reduced = True, exc.with_traceback(None), False
            self._discard()
        finally:
            if group is not None:
                group.also_check = None
        return self._reduced

    def _stop(self) -> bool:
        """A member asked to stop the job: every member sees it in the same reduce, so none
        commits this step and all end at the boundary before it."""
        self.stopped, self._reduced = True, False
        if self.job._reducer is not None:
            self.job._reducer.disarm()
        self._discard()
        if self.job.stop_reason is None:
            self.job.stop_reason = "another member stopped the job"
        return False

    def _reduce_shared(self) -> tuple[float, float, float, float, float]:
        """Allreduce this member's gradients (its shard's, in a replica group) and return the summed
        control slots; raises :class:`GenerationFailed` if the generation broke. In a replica group
        every process then votes: the step goes on only if every process reduced its shard, and
        the control slots are summed over the group's processes too."""
        job = self.job
        error: GenerationFailed | None = None
        sums = [0.0] * 5
        job._pacing.measured(self.started + self.paused, self.samples)
        try:
            self._arm()
            if self._stale:
                raise GenerationFailed(f"step {self.index} not sent: {self._stale}")
            sums = list(job._reducer.finish(lambda: job._chaos.point("allreduce", self.index)))
            job._pacing.exchanged()
            self._sync_buffers()
        except GenerationFailed as exc:
            error = exc
        width = job._pacing.width(self.members)  # the same for every process of a group
        paces = job._reducer.paces if error is None and len(job._reducer.paces) == width else [0.0] * width
        ok, sums = job._vote(error is None, self.generation, sums + paces)
        if error is None and not ok:
            error = GenerationFailed(f"step {self.index}: another process of this replica group could not reduce its shard")
        if error is None:
            disagree = job._pacing.take(sums[5:], self.index)
            if disagree:
                error = GenerationFailed(disagree)
        if error is not None:
            raise error
        self._report_pace()
        flag, loss, count, counting, stop = sums[:5]
        return flag, loss, count, counting, stop

    def _report_pace(self) -> None:
        """The leader names stragglers and new splits; a member to evict learns it (:mod:`unbroken.worker.pacing`)."""
        job = self.job
        group = job._joiner.group
        names = list(group.members) if group is not None and len(group.members) == self.members else [f"rank{i}" for i in range(self.members)]
        leader = self.rank == 0 and (job._group is None or job._group.leader)
        job._pacing.report(self.index, self.rank, names, leader)

    def _sync_buffers(self) -> None:
        """Give every member the buffers (BatchNorm statistics, ...) of the generation's rank 0,
        as DDP does, so that replicas stay identical."""
        buffers = self.job._buffers
        if not buffers:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        for dtype, group in by_dtype.items():
            flat = torch.cat([b.detach().reshape(-1) for b in group])
            if self.job.member_index != 0:
                flat.zero_()
            self.job._joiner.group.allreduce(flat, "buffer broadcast")
            offset = 0
            with torch.no_grad():
                for b in group:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()

    def _normalise(self, loss: float, count: float, counting: float) -> float:
        """Divide the summed gradients and loss by the global count when backward(count=) was
        used (by any member: those with an empty share follow the others)."""
        if not counting:
            return loss
        if count <= 0:
            raise LoopMisuse(f"step {self.index}: the counts passed to step.backward sum to {count} over the global batch; nothing to normalise by")
        with torch.no_grad():
            for p in self.job.optimizer.param_groups:
                for param in p["params"]:
                    if param.grad is not None:
                        param.grad.div_(count)
        return loss / count

    def _discard(self) -> None:
        """Undo what a failed attempt changed: gradients, buffers and the scaler's record of
        this step (an ``unscale_`` between reduce and a commit that failed)."""
        self.job.optimizer.zero_grad(set_to_none=True)
        if self.job.scaler is not None:
            mixed_precision.forget_step(self.job.scaler)
        with torch.no_grad():
            for buffer, saved in zip(self.job._buffers, self._saved_buffers):
                buffer.copy_(saved)

    def commit(self) -> bool:
        """Reduce if not done yet, then apply the optimizer (and scheduler). True if committed.

        With ``Job(scaler=...)``: unscale the reduced gradients (unless the loop already called
        ``scaler.unscale_(job.optimizer)`` to clip them), skip the optimizer step if any is inf
        or nan, and update the scale; the step still counts as committed (``step.skipped``)."""
        if self.committed:
            return True
        if not self.reduce():
            return False
        job = self.job
        if job._reducer is not None:
            reason = None
            try:
                job._chaos.point("commit", self.index)
            except GenerationFailed as exc:
                reason = str(exc)
            reason = reason or self._stale or job._joiner.commit_reason(self.generation)
            ok, _ = job._vote(reason is None, self.generation)
            if not ok and reason is None:
                reason = f"step {self.index} not committed: another process of this replica group may not commit it"
            if reason:
                self.failed, self.error = True, GenerationFailed(reason if reason.startswith("step ") else f"step {self.index} not committed: {reason}")
                self._discard()
                return False
        if job._reducer is not None:
            try:
                job._donor.before_step(self)  # a newcomer catching up from this member gets this step too
            except GenerationFailed as exc:  # fail@donate: this member leaves the generation uncommitted
                self.failed, self.error = True, exc
                self._discard()
                return False
        job._committing = True  # the optimizer's step and zero_grad are this method's to call
        try:
            if job._sharded is not None:
                job._sharded.arm(job._joiner.group, self.index, job._chaos.point, lambda: job._checkpointing.due_after(self.index))
            if job.scaler is None:
                job.optimizer.step()
                stepped = True
            else:
                stepped = mixed_precision.step(job.scaler, job.optimizer, job._device)
            if job.scheduler is not None:
                job.scheduler.step()
            job.optimizer.zero_grad(set_to_none=True)
        except GenerationFailed as exc:  # the sharded optimizer's barrier or gather: the next generation decides
            if job._sharded is None or job._sharded.pending is None:
                raise
            self.failed, self.error, job._sharded.pending.step = True, exc.with_traceback(None), self
            job.optimizer.zero_grad(set_to_none=True)
            return False
        finally:
            job._committing = False
        self.skipped = not stepped
        job._committed(self)
        self.committed = True
        return True

