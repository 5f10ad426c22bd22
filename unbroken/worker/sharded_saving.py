"""Durable checkpoints of a sharded optimizer's state (``shard_optimizer`` with ``--checkpoint-dir``).

A checkpoint of a job whose optimizer state is sharded is the same plain checkpoint as without
sharding (the optimizer's ``state_dict`` in torch's own format, per parameter), so that it resumes
at any member count, sharded or not, and in a single process. To write it, the checkpoint's writer
(rank 0) needs every span: the generation's rank 0 decides at a step's barrier, in the same
collective, that a checkpoint follows the step (:meth:`ShardedOptimizer.save_due`), so that every
member knows it at the same step without a collective of its own; after the commit every member
sends its owned spans to rank 0 (:func:`collect`, a move like a re-partition's), rank 0 puts them
into the optimizer for the snapshot and takes them out again once the snapshot (a copy) is made.
Rank 0 briefly holds the whole optimizer state, the one moment it does.

Resuming: rank 0 loads the checkpoint as always (the whole state into the script's optimizer);
:func:`adopt_loaded` turns that into holdings of whole parameter groups, from which the
re-partition gives every member its spans. The same happens to a checkpoint written without sharding.
"""

from __future__ import annotations

from typing import Any

import torch

from unbroken.worker.shard_moves import move
from unbroken.worker.shard_plan import Span
from unbroken.worker.sharded_optimizer import Holding, ShardedOptimizer


def whole(sharded: ShardedOptimizer) -> list[Span]:
    """Every parameter group's whole flat vector."""
    return [Span(g, 0, size) for g, size in enumerate(sharded.sizes) if size]


def collect(sharded: ShardedOptimizer, group: Any, at: int) -> list[Holding]:
    """Every member: give rank 0 every span at step ``at``; rank 0 gets them back as holdings of
    whole groups (the others: nothing). Raises :class:`GenerationFailed` if the group breaks."""
    holdings, _ = move(sharded, group, {0: whole(sharded)}, at, "sharded state: checkpoint")
    return holdings


def install(sharded: ShardedOptimizer, holdings: list[Holding]) -> None:
    """Put whole-group holdings into the script's optimizer, per parameter, as its own state would be."""
    face = sharded.face
    for h in holdings:
        for p, offset in sharded.layout[h.span.group]:
            face.state[p] = {k: (v[offset : offset + p.numel()].view_as(p) if v.dim() else v.clone())
                             for k, v in h.state.items()}


def release(sharded: ShardedOptimizer) -> None:
    """Take the installed state out of the script's optimizer again."""
    sharded.face.state.clear()


def adopt_loaded(sharded: ShardedOptimizer, at: int) -> bool:
    """The script's optimizer was loaded with a whole state (a checkpoint, at step ``at``): hold it as
    whole-group spans, and take it out of the optimizer. False if it holds no state."""
    face = sharded.face
    if not any(face.state.get(p) for entries in sharded.layout for p, _ in entries):
        return False
    holdings = []
    for g, entries in enumerate(sharded.layout):
        states = [face.state.get(p) or {} for p, _ in entries]
        first = next((s for s in states if s), None)
        if first is None or not entries:
            continue
        state: dict[str, Any] = {}
        for key, value in first.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.dim():
                state[key] = torch.cat([(s[key] if s else torch.zeros_like(p)).detach().reshape(-1)
                                        for s, (p, _) in zip(states, entries)])
            else:
                state[key] = value.detach().clone()
        holdings.append(Holding(Span(g, 0, sharded.sizes[g]), torch.empty(0), state))
    face.state.clear()
    sharded.holdings, sharded.shard_step, sharded.pending = holdings, at, None
    return True
