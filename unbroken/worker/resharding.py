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

from unbroken.errors import GenerationFailed
from unbroken.worker import state_digests
from unbroken.worker.shard_plan import Span, buddy_shift, cover, held_spans
from unbroken.worker.sharded_optimizer import APPLIED, READY, Holding, ShardedOptimizer

log = logging.getLogger("unbroken.worker.runtime")

MAX_SPANS = 8
"""Spans per parameter group a member reports holding (its plan's two, and those of a re-partition
that failed after it received them)."""


class ShardedStateLost(Exception):
    """No survivor holds some span of the optimizer state at the job's step."""


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
    if mine is not None and (job.next_step, made_in) != (step, made_in_ref):
        _drop_stale(job, sharded)  # from an older generation: healed like any member behind
        mine = None
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
    _exchange_parameters(job, sharded, group, step + 1, needy=mine is not None)
    if mine is not None:
        sharded.pending = None
        _commit_late(job, mine.step)
        job._events.emit("roll_forward", generation=group.number, step=step, of_generation=made_in_ref,
                         pending="ready" if mine.kind == READY else "applied")


def _drop_stale(job: Any, sharded: ShardedOptimizer) -> None:
    job.fresh = True  # healed whole: its parameters may be half of a step nobody else took
    _drop(sharded)


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


def _holdings_table(sharded: ShardedOptimizer, group: Any, what: str) -> list[tuple[int, Span]]:
    """Every member's holdings at the step each is at: [(rank, shard step, span)]."""
    width = MAX_SPANS * max(1, len(sharded.sizes))
    row = torch.full((2 + 3 * width,), -1, dtype=torch.int64)
    row[0], row[1] = sharded.shard_step, len(sharded.holdings)
    spans = [h.span for h in sharded.holdings][:width]
    for i, span in enumerate(spans):
        row[2 + 3 * i : 5 + 3 * i] = torch.tensor([span.group, span.start, span.end])
    table = group.allgather_rows(row, what).tolist()
    out = []
    for rank, r in enumerate(table):
        for i in range(min(int(r[1]), width)):
            out.append((rank, int(r[0]), Span(int(r[2 + 3 * i]), int(r[3 + 3 * i]), int(r[4 + 3 * i]))))
    return out


def _exchange_parameters(job: Any, sharded: ShardedOptimizer, group: Any, at: int, needy: bool) -> None:
    """Give every member the parameters at step ``at`` of every span, each broadcast by a member
    that holds it at ``at``; a member that is not ``needy`` (it holds them, or is healed next)
    takes part without writing them."""
    table = _holdings_table(sharded, group, "sharded state: who holds what")
    holders = [(rank, span) for rank, step, span in table if step == at]
    for g, size in enumerate(sharded.sizes):
        pieces = cover(Span(g, 0, size), holders, -1) if size else []
        if pieces is None:
            _lost(job, f"no member holds the parameters of parameter group {g} at step {at}")
        for span, src in pieces:
            buf = sharded.read(span) if src == group.rank else torch.empty(span.size, dtype=sharded.dtype(g), device=sharded.device(g))
            _broadcast(group, buf, src, "sharded state: parameters of a rolled-forward step")
            if needy and src != group.rank:
                sharded.write(span, buf)


def _broadcast(group: Any, tensor: torch.Tensor, src: int, what: str) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = src
    try:
        work = group._issued(group.pg.broadcast([tensor], options))
    except Exception as exc:
        raise GenerationFailed(f"generation {group.number}: {what} failed to start: {exc}") from None
    group.wait(work, what)


def _lost(job: Any, why: str) -> None:
    del job
    raise ShardedStateLost(f"the sharded optimizer state is lost: {why} (both holders of a partition died)")


def template(sharded: ShardedOptimizer, g: int) -> list[tuple[str, bool, torch.dtype]]:
    """The optimizer state's entries for parameter group ``g``: (name, per element?, dtype), from a
    step of the same optimizer over one element (the receiver of a span may hold nothing yet)."""
    face = sharded.face
    probe = torch.nn.Parameter(torch.zeros(1, dtype=sharded.dtype(g), device=sharded.device(g)))
    hyper = {k: v for k, v in face.param_groups[g].items() if k != "params"}
    inner = type(face)([{**hyper, "params": [probe]}])
    probe.grad = torch.zeros_like(probe)
    inner.step()
    return [(k, v.dim() > 0, v.dtype) for k, v in sorted(inner.state[probe].items()) if isinstance(v, torch.Tensor)]


def reshard(job: Any, group: Any) -> None:
    """Step 3 of the module's docstring; raises :class:`GenerationFailed` if the group breaks."""
    sharded: ShardedOptimizer = job._sharded
    started = time.monotonic()
    at = job.next_step
    n, rank, shift = group.size, group.rank, buddy_shift(list(group.members))
    table = _holdings_table(sharded, group, "sharded state: who holds what")
    holders = [(r, span) for r, step, span in table if step == at]
    wanted = {r: held_spans(sharded.sizes, n, r, shift) for r in range(n)}
    plan: dict[int, list[tuple[Span, list[tuple[Span, int]]]]] = {}
    for r, spans in wanted.items():
        plan[r] = []
        for span in spans:
            pieces = cover(span, holders, r) if at > 0 else [(span, r)]
            if pieces is None:
                _lost(job, f"no member holds span {span.start}..{span.end} of parameter group {span.group} at step {at}")
            plan[r].append((span, pieces))
    templates = {g: template(sharded, g) for g in range(len(sharded.sizes))} if at > 0 else {}
    works, received, moved = [], {}, 0
    tag = 0
    for r in range(n):
        for span, pieces in plan[r]:
            for piece, src in pieces:
                tag += 1
                if src == r or rank not in (src, r):
                    continue
                parts = _piece_tensors(sharded, piece, templates[piece.group], mine=src == rank)
                for t in parts:
                    op = group.pg.send if src == rank else group.pg.recv
                    works.append(group._issued(op([t], r if src == rank else src, tag)))
                    moved += t.numel() * t.element_size()
                if r == rank:
                    received[piece] = parts
    job._chaos.point("reshard", at)
    for work in works:
        group.wait(work, "sharded state: re-partition")
    new = [Holding(span, torch.empty(0), _assemble(sharded, span, pieces, received, templates, at))
           for span, pieces in plan[rank]]
    barrier = torch.ones(1, dtype=torch.float64, device=group.device)
    try:
        group.allreduce(barrier, "sharded state: re-partition barrier")
    except GenerationFailed:
        # keep every copy at the job's step: what it held (if at this step) and what it received
        kept = sharded.holdings if sharded.shard_step == at else []
        sharded.holdings, sharded.shard_step = kept + new, at
        for h in new:
            h.master = sharded.read(h.span)
        raise
    sharded.hold(new)
    sharded.shard_step = at
    job._events.emit("reshard", generation=group.number, step=at, members=n, spans=len(new), bytes_received=moved,
                     state_bytes=sharded.state_bytes(), seconds=round(time.monotonic() - started, 6))


def _piece_tensors(sharded: ShardedOptimizer, piece: Span, entries: list[tuple[str, bool, torch.dtype]],
                   mine: bool) -> list[torch.Tensor]:
    """The tensors of one piece, in the template's order: views of this member's holding (to
    send), or new memory (to receive); the scalars go as one float64 tensor."""
    if mine:
        source = next(h for h in sharded.holdings if h.span.group == piece.group and h.span.start <= piece.start
                      and piece.end <= h.span.end)
        offset = piece.start - source.span.start
        vectors = [source.state[k][offset : offset + piece.size].contiguous() for k, vec, _ in entries if vec]
        scalars = torch.tensor([float(source.state[k]) for k, vec, _ in entries if not vec], dtype=torch.float64)
    else:
        device = sharded.device(piece.group)
        vectors = [torch.empty(piece.size, dtype=dtype, device=device) for _, vec, dtype in entries if vec]
        scalars = torch.empty(sum(1 for _, vec, _ in entries if not vec), dtype=torch.float64)
    return vectors + ([scalars] if scalars.numel() else [])


def _assemble(sharded: ShardedOptimizer, span: Span, pieces: list[tuple[Span, int]], received: dict[Span, list[torch.Tensor]],
              templates: dict[int, list[tuple[str, bool, torch.dtype]]], at: int) -> dict[str, Any]:
    """The state of ``span`` from its pieces (this member's own holdings, or received)."""
    if at == 0:
        return {}
    entries = templates[span.group]
    columns: list[list[torch.Tensor]] = []
    scalars: torch.Tensor | None = None
    for piece, _ in pieces:
        parts = received.get(piece) or _piece_tensors(sharded, piece, entries, mine=True)
        columns.append(parts)
        if scalars is None and sum(1 for _, vec, _ in entries if not vec):
            scalars = parts[-1]
    state: dict[str, Any] = {}
    v = s = 0
    for key, vec, dtype in entries:
        if vec:
            state[key] = torch.cat([parts[v] for parts in columns])
            v += 1
        else:
            state[key] = torch.tensor(float(scalars[s]), dtype=dtype)
            s += 1
    return state
