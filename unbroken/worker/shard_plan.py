"""Who holds which part of the optimizer state when it is sharded (``shard_optimizer``): pure functions.

Each parameter group of the optimizer is seen as one flat vector (its parameters concatenated in
order). With ``n`` members, partition ``k`` is the ``k``-th of ``n`` equal contiguous slices of every
group's vector (:func:`partition_spans`). Member ``k`` owns partition ``k``; the partition is also
held by its *buddy*, member ``(k + shift) % n``, where ``shift`` is the smallest step that puts every
buddy on another node than the owner (:func:`buddy_shift`; 1 when all members share a node). So every
member holds two partitions, its own and one it is the buddy of, and computes both updates from the
same reduced gradients: the two copies stay bit-equal with no transfer, and losing any one member
(any one node, where the nodes allow) leaves a copy of every partition.

When the members change, each member's new partitions are assembled from the spans that the
survivors hold at the job's step (:func:`cover`); a span that no survivor holds is lost, and the job
goes on from its newest durable state. Nothing here moves data: :mod:`unbroken.worker.resharding` does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Span:
    """Elements ``[start, end)`` of parameter group ``group``'s flat vector."""

    group: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def chunk(size: int, n: int) -> int:
    """Elements per partition of a group of ``size`` elements among ``n`` members (the last may be short)."""
    return -(-size // n) if size else 0


def partition_spans(sizes: list[int], n: int, k: int) -> list[Span]:
    """Partition ``k`` of ``n``: its span of every group (empty spans left out)."""
    spans = []
    for g, size in enumerate(sizes):
        step = chunk(size, n)
        start, end = min(size, k * step), min(size, (k + 1) * step)
        if end > start:
            spans.append(Span(g, start, end))
    return spans


def node_of(member: str) -> str:
    """The node a member runs on, from the launcher's name ``<node>.w<local rank>.r<restarts>``
    (any other name is a node of its own)."""
    parts = member.rsplit(".", 2)
    if len(parts) == 3 and parts[1].startswith("w") and parts[2].startswith("r"):
        return parts[0]
    return member


def buddy_shift(members: list[str]) -> int:
    """The smallest shift ``s >= 1`` such that member ``(i + s) % n`` runs on another node than
    member ``i`` for every ``i``; 1 if there is none (one node, or nodes of unequal sizes that no
    shift separates)."""
    n = len(members)
    nodes = [node_of(m) for m in members]
    for s in range(1, n):
        if all(nodes[i] != nodes[(i + s) % n] for i in range(n)):
            return s
    return 1


def held_partitions(rank: int, n: int, shift: int) -> list[int]:
    """The partitions member ``rank`` of ``n`` holds: its own, and the one it is the buddy of."""
    if n == 1:
        return [0]
    return [rank, (rank - shift) % n]


def held_spans(sizes: list[int], n: int, rank: int, shift: int) -> list[Span]:
    """Every span member ``rank`` holds in the plan of ``n`` members."""
    return [span for k in held_partitions(rank, n, shift) for span in partition_spans(sizes, n, k)]


def cover(span: Span, holdings: list[tuple[int, Span]], me: int) -> list[tuple[Span, int]] | None:
    """Pieces of ``span`` with the rank to take each from, out of ``holdings`` (rank, span held);
    this member (``me``) first, then the holding that reaches furthest (the lowest rank of those).
    None if some element of ``span`` is held by nobody."""
    pieces: list[tuple[Span, int]] = []
    at = span.start
    while at < span.end:
        here = [(rank, held) for rank, held in holdings if held.group == span.group and held.start <= at < held.end]
        if not here:
            return None
        mine = [h for h in here if h[0] == me]
        rank, held = mine[0] if mine else min(here, key=lambda h: (-h[1].end, h[0]))
        end = min(span.end, held.end)
        pieces.append((Span(span.group, at, end), rank))
        at = end
    return pieces
