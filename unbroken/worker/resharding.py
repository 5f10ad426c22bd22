"""A new generation's sharded optimizer state: finish the step the old one left half done, then
re-partition among the new members (``shard_optimizer``; :mod:`unbroken.worker.sharded_optimizer`).

Run by every member of a newly formed generation, around the heal (:class:`~unbroken.worker.healer.Healer`):

1. :func:`roll_forward`, before it. The members exchange their step and what is pending. If some
   member applied step s (its gather failed after the apply), or committed it (its gather
   completed), every member left pending at s completes it: one that kept its gradients applies
   them now, and each then receives the parameters it lacks from the members that hold them at
   s+1 (broadcasts over the new group, span by span) and commits s as a step of the generation that
   began it. If nobody applied s, nobody did, and the pending members drop it: s is redone.
2. The heal (unchanged): every member behind is brought to the newest step, parameters included.
3. :func:`reshard`, after it. Every member computes the new plan (:mod:`unbroken.worker.shard_plan`),
   the spans it must hold, and where each piece is held at the job's step; pieces move point to
   point. A member drops what it held only once a barrier shows that every member received its
   part, so a failure meanwhile leaves every copy in place for the next try.

A span that no survivor holds at the job's step (both holders of a partition died) is the
unhealable loss: with durable checkpoints the generation goes on from the newest one (every
member forgets its state, the heal's rank 0 reads it); without, the job cannot go on, and says why.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from unbroken.errors import GenerationFailed, JobCannotGoOn
from unbroken.worker import sharded_saving, state_digests
from unbroken.worker.shard_moves import ShardedStateLost, holdings_table, move
from unbroken.worker.shard_plan import Span, buddy_shift, cover, held_spans
from unbroken.worker.sharded_optimizer import APPLIED, READY, Pending, ShardedOptimizer, issue

__all__ = ["ShardedStateLost", "forget_progress", "reshard", "roll_forward"]

log = logging.getLogger("unbroken.worker.runtime")

def roll_forward(job: Any, group: Any) -> None:
    """Step 1 of the module's docstring; raises :class:`GenerationFailed` if the group breaks."""
    sharded: ShardedOptimizer = job._sharded
    mine = sharded.pending
    kind = mine.kind if mine is not None else 0
    made_in = mine.step.generation if mine is not None else 0
    expected = state_digests.extend_digest(job._digest, made_in) if mine is not None else 0
    row = torch.tensor([job.next_step, int(job.fresh), job._digest, kind, made_in, expected], dtype=torch.int64)
    rows = [tuple(int(v) for v in r) for r in group.allgather_rows(row, "sharded state: pending steps").tolist()]
    pending = [r for r in rows if r[3]]
    if not pending:
        return
    step, made_in_ref, expected_ref = max((r[0], r[4], r[5]) for r in pending)
    # the job went on without this step (some member is past it, or at s+1 by another history):
    # every pending member is of a generation gone by
    gone = any(not r[1] and (r[0] > step + 1 or (r[0] == step + 1 and r[2] != expected_ref)) for r in rows)
    if mine is not None and (gone or (job.next_step, made_in) != (step, made_in_ref)):
        _drop_stale(job, sharded)  # healed like any member behind
        mine = None
    if gone:
        return
    ref = [r for r in pending if (r[0], r[4]) == (step, made_in_ref)]
    rolled = any(r[3] == APPLIED for r in ref) or any(
        r[0] == step + 1 and not r[1] and r[2] == expected_ref for r in rows)
    if not rolled:
        if mine is not None:
            log.info("%s: nobody applied step %d: it is redone", job.member_id, step)
            _drop(sharded)
        return
    if mine is not None and mine.kind == READY:
        sharded.apply()  # the gradients it kept: the step every holder applied
        sharded.pending = mine = Pending(APPLIED, mine.step, was=READY)  # never applied twice, whatever fails next
    _exchange_parameters(job, sharded, group, step + 1, needy=mine is not None)
    if mine is not None:
        sharded.pending = None
        _commit_late(job, mine.step)
        job._events.emit("roll_forward", generation=group.number, step=step, of_generation=made_in_ref,
                         pending="ready" if mine.was == READY else "applied")


def _drop_stale(job: Any, sharded: ShardedOptimizer) -> None:
    """A pending step of an older generation: the others went on without it. One it had applied
    left its parameters half a step ahead, which no one can finish or undo: it holds nothing of
    value any more, as a new process (never a heal's source, whoever else is left)."""
    applied = sharded.pending is not None and sharded.pending.kind == APPLIED
    _drop(sharded)
    if applied:
        forget_progress(job)
    job.fresh = True  # healed whole


def forget_progress(job: Any) -> None:
    """This member holds no state of value: no step, no lineage, no optimizer state, as a new process."""
    job._sharded.forget()
    job.next_step, job.lineage, job._digest, job.fresh = 0, [], 0, True
    if job._joiner.heartbeat is not None:
        job._joiner.heartbeat.step = 0


def _drop(sharded: ShardedOptimizer) -> None:
    """Forget the pending step: the gradients it kept, and its buffers' update (restored)."""
    if sharded.pending is not None and sharded.pending.step is not None:
        sharded.pending.step._discard()
    for h in sharded.holdings:
        h.master.grad = None
    sharded.pending = None


def _commit_late(job: Any, step: Any) -> None:
    """Finish the commit of ``step`` as :meth:`Step.commit` would have (scale, schedule, record)."""
    job._committing = True
    try:
        if job.scaler is not None and job.scaler.is_enabled():
            job.scaler.update()
        if job.scheduler is not None:
            job.scheduler.step()
        job.optimizer.zero_grad(set_to_none=True)
    finally:
        job._committing = False
    step.failed, step.error = False, None
    job._committed(step)
    step.committed = True


def _exchange_parameters(job: Any, sharded: ShardedOptimizer, group: Any, at: int, needy: bool) -> None:
    """Give every member the parameters at step ``at`` of every span, each broadcast by a member
    that holds it at ``at``; a member that is not ``needy`` (it holds them, or is healed next)
    takes part without writing them."""
    table = holdings_table(sharded, group, "sharded state: who holds what")
    holders = [(rank, span) for rank, step, span in table if step == at]
    for g, size in enumerate(sharded.sizes):
        pieces = cover(Span(g, 0, size), holders, -1) if size else []
        if pieces is None:
            raise ShardedStateLost(f"the sharded optimizer state is lost: no member holds the parameters of parameter"
                                   f" group {g} at step {at} (both holders of a partition died)")
        for span, src in pieces:
            buf = sharded.read(span) if src == group.rank else torch.empty(span.size, dtype=sharded.dtype(g), device=sharded.device(g))
            _broadcast(group, buf, src, "sharded state: parameters of a rolled-forward step")
            if needy and src != group.rank:
                sharded.write(span, buf)


def _broadcast(group: Any, tensor: torch.Tensor, src: int, what: str) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = src
    group.wait(issue(group, lambda: group.pg.broadcast([tensor], options), what), what)


READ_TRIES = 3
"""Generations in a row in which a member may fail to read its spans from a checkpoint before the job
ends saying why (a store that comes back is read in the next one)."""


def _unreadable(job: Any, sharded: ShardedOptimizer, group: Any, reason: str) -> None:
    sharded.read_failures += 1
    if sharded.read_failures >= READ_TRIES:
        job._joiner.report_job_failure(reason)
        raise JobCannotGoOn(f"the job cannot go on: {reason} ({READ_TRIES} times; the checkpoint stays: fix the store,"
                            " or move that checkpoint away to go on from an older one)")
    raise GenerationFailed(f"generation {group.number}: {reason}")


def reshard(job: Any, group: Any) -> None:
    """Step 3 of the module's docstring; raises :class:`GenerationFailed` if the group breaks."""
    sharded: ShardedOptimizer = job._sharded
    started = time.monotonic()
    at, n = job.next_step, group.size
    shift = buddy_shift(list(group.members))
    wanted = {r: held_spans(sharded.sizes, n, r, shift) for r in range(n)}
    flags = group.allgather_rows(torch.tensor([int(sharded.in_checkpoint)], dtype=torch.int64), "sharded state: resumed?")
    from_checkpoint = at > 0 and bool(int(flags.max()))
    if from_checkpoint:  # the job resumed from a checkpoint whose optimizer state is in parts
        try:
            new, moved = sharded_saving.read_parts(sharded, job.checkpoint.directory, at, wanted[group.rank])
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            _unreadable(job, sharded, group, f"reading this member's optimizer state from the checkpoint of step {at} failed: {exc}")
        job._chaos.point("reshard", at)
    else:
        new, moved = move(sharded, group, wanted, at, "sharded state: re-partition", lambda: job._chaos.point("reshard", at))
    barrier = torch.ones(1, dtype=torch.float64, device=group.device)
    try:
        group.allreduce(barrier, "sharded state: re-partition barrier")
    except GenerationFailed:
        # keep every copy at the job's step: what it held (if at this step) and what it received
        kept = [h for h in sharded.holdings if not any(n.span.group == h.span.group and n.span.start <= h.span.start
                                                        and h.span.end <= n.span.end for n in new)] if sharded.shard_step == at else []
        sharded.holdings, sharded.shard_step = kept + new, at
        for h in new:
            h.master = sharded.read(h.span)
        raise
    sharded.hold(new)
    sharded.shard_step, sharded.in_checkpoint, sharded.read_failures = at, False, 0
    job._events.emit("reshard", generation=group.number, step=at, members=n, spans=len(new), bytes_received=moved,
                     from_checkpoint=from_checkpoint, state_bytes=sharded.state_bytes(), seconds=round(time.monotonic() - started, 6))
