"""Moving parts of the sharded optimizer state between members (``shard_optimizer``).

A member's holdings are spans of the parameter groups' flat vectors, each with its optimizer state
at one step (:mod:`unbroken.worker.sharded_optimizer`). :func:`holdings_table` tells every member
what every member holds; :func:`move` assembles, for each member, the spans it wants from the pieces
others hold at the job's step (:func:`unbroken.worker.shard_plan.cover`), point to point over the
generation's group: each piece's per-element entries (Adam's two moments, say) go as views of the
holder's memory, its per-span entries (the step count) as one small tensor. Used by a re-partition
(:func:`unbroken.worker.resharding.reshard`) and by a checkpoint, whose writer assembles every span
(:mod:`unbroken.worker.sharded_saving`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from unbroken.worker.shard_plan import Span, cover
from unbroken.worker.sharded_optimizer import Holding, ShardedOptimizer, issue

MAX_SPANS = 8
"""Spans per parameter group a member reports holding (its plan's two, and those of a re-partition
that failed after it received them, or a checkpoint's whole groups)."""

Entries = list[tuple[str, bool, torch.dtype]]


class ShardedStateLost(Exception):
    """No survivor holds some span of the optimizer state at the job's step."""


def holdings_table(sharded: ShardedOptimizer, group: Any, what: str) -> list[tuple[int, int, Span]]:
    """Every member's holdings, with the step its state is at: [(rank, step, span)]."""
    counts = group.allgather_rows(torch.tensor([len(sharded.holdings)], dtype=torch.int64), what)
    width = max(MAX_SPANS * max(1, len(sharded.sizes)), int(counts.max()))
    row = torch.full((2 + 3 * width,), -1, dtype=torch.int64)
    spans = [h.span for h in sharded.holdings]
    row[0], row[1] = sharded.shard_step, len(spans)
    for i, span in enumerate(spans):
        row[2 + 3 * i : 5 + 3 * i] = torch.tensor([span.group, span.start, span.end])
    out = []
    for rank, r in enumerate(group.allgather_rows(row, what).tolist()):
        for i in range(int(r[1])):
            out.append((rank, int(r[0]), Span(int(r[2 + 3 * i]), int(r[3 + 3 * i]), int(r[4 + 3 * i]))))
    return out


def template(sharded: ShardedOptimizer, g: int) -> Entries:
    """The optimizer state's entries for parameter group ``g``: (name, per element?, dtype), from a
    step of the same optimizer over one element (the receiver of a span may hold nothing yet)."""
    face = sharded.face
    probe = torch.nn.Parameter(torch.zeros(1, dtype=sharded.dtype(g), device=sharded.device(g)))
    hyper = {k: v for k, v in face.param_groups[g].items() if k != "params"}
    inner = type(face)([{**hyper, "params": [probe]}])
    probe.grad = torch.zeros_like(probe)
    inner.step()
    return [(k, v.dim() > 0, v.dtype) for k, v in sorted(inner.state[probe].items()) if isinstance(v, torch.Tensor)]


def move(sharded: ShardedOptimizer, group: Any, wanted: dict[int, list[Span]], at: int, what: str,
         chaos: Callable[[], None] = lambda: None) -> tuple[list[Holding], int]:
    """Give each rank of ``wanted`` the state of its spans at step ``at``; returns this member's new
    holdings (masters not made yet) and the bytes it received. Every member calls it with the same
    ``wanted``. Raises :class:`ShardedStateLost` (before moving anything) if some span is held by
    nobody at ``at``, :class:`~unbroken.errors.GenerationFailed` if the group breaks."""
    rank = group.rank
    plan: dict[int, list[tuple[Span, list[tuple[Span, int]]]]] = {}
    if at > 0:
        holders = [(r, span) for r, step, span in holdings_table(sharded, group, f"{what}: who holds what") if step == at]
    for r, spans in sorted(wanted.items()):
        plan[r] = []
        for span in spans:
            pieces = cover(span, holders, r) if at > 0 else [(span, r)]
            if pieces is None:
                raise ShardedStateLost(f"the sharded optimizer state is lost: no member holds elements {span.start}..{span.end}"
                                       f" of parameter group {span.group} at step {at} (both holders of a partition died)")
            plan[r].append((span, pieces))
    entries = {g: template(sharded, g) for g, size in enumerate(sharded.sizes) if size} if at > 0 else {}
    works, received, landing, moved, tag = [], {}, [], 0, 0
    for r, spans in plan.items():
        for _, pieces in spans:
            for piece, src in pieces:
                if src == r or rank not in (src, r):
                    tag += 16
                    continue
                parts = _piece_tensors(sharded, piece, entries[piece.group], mine=src == rank)
                for i, t in enumerate(parts):
                    wire = group.staged(t.contiguous(), sending=src == rank)  # on the group's device (Gloo: CPU, NCCL: its GPU)
                    op = group.pg.send if src == rank else group.pg.recv
                    peer = r if src == rank else src
                    works.append(issue(group, lambda: op([wire], peer, tag + i), what))  # started at once
                    if wire is not t and src != rank:
                        landing.append((wire, t))
                    moved += t.numel() * t.element_size() if r == rank else 0
                tag += 16
                if r == rank:
                    received[piece] = parts
    chaos()
    for work in works:
        group.wait(work, what)
    for wire, t in landing:
        t.copy_(wire)
    mine = [Holding(span, torch.empty(0), _assemble(sharded, pieces, received, entries.get(span.group, [])) if at else {})
            for span, pieces in plan.get(rank, [])]
    return mine, moved


def _piece_tensors(sharded: ShardedOptimizer, piece: Span, entries: Entries, mine: bool) -> list[torch.Tensor]:
    """The tensors of one piece, in ``entries``' order: views of this member's holding (to send),
    or new memory (to receive); the per-span entries go as one float64 tensor."""
    if mine:
        source = next(h for h in sharded.holdings
                      if h.span.group == piece.group and h.span.start <= piece.start and piece.end <= h.span.end)
        at = piece.start - source.span.start
        vectors = [source.state[k][at : at + piece.size] for k, per_element, _ in entries if per_element]
        scalars = torch.tensor([float(source.state[k]) for k, per_element, _ in entries if not per_element], dtype=torch.float64)
    else:
        device = sharded.device(piece.group)
        vectors = [torch.empty(piece.size, dtype=dtype, device=device) for _, per_element, dtype in entries if per_element]
        scalars = torch.empty(sum(1 for _, per_element, _ in entries if not per_element), dtype=torch.float64)
    return vectors + ([scalars] if scalars.numel() else [])


def _assemble(sharded: ShardedOptimizer, pieces: list[tuple[Span, int]], received: dict[Span, list[torch.Tensor]],
              entries: Entries) -> dict[str, Any]:
    """The state of one span from its pieces (this member's own holdings, or received)."""
    span_group = pieces[0][0].group
    columns = [received[piece] if piece in received else _piece_tensors(sharded, piece, entries, mine=True) for piece, _ in pieces]
    state: dict[str, Any] = {}
    v = s = 0
    for key, per_element, dtype in entries:
        if per_element:
            state[key] = torch.cat([parts[v] for parts in columns])
            v += 1
        else:
            state[key] = torch.tensor(float(columns[0][-1][s]), dtype=dtype, device=sharded.device(span_group))
            s += 1
    return state
