"""The sharded optimizer's plan: partitions, buddies on other nodes, and covering a span from holdings."""

import pytest

from unbroken.worker.shard_plan import Span, buddy_shift, cover, held_partitions, held_spans, node_of, partition_spans


def test_partitions_split_every_group_into_equal_contiguous_slices_that_cover_it_once():
    sizes = [10, 3, 0, 7]
    for n in (1, 2, 3, 4, 5):
        covered = {g: [] for g in range(len(sizes))}
        for k in range(n):
            for span in partition_spans(sizes, n, k):
                covered[span.group].extend(range(span.start, span.end))
        assert {g: sorted(c) for g, c in covered.items()} == {g: list(range(s)) for g, s in enumerate(sizes)}


def test_every_partition_is_held_by_two_members_on_different_nodes_where_the_nodes_allow():
    two_nodes = ["a.w0.r0", "a.w1.r0", "b.w0.r0", "b.w1.r3"]
    shift = buddy_shift(two_nodes)
    assert shift == 2
    holders = {k: [r for r in range(4) if k in held_partitions(r, 4, shift)] for k in range(4)}
    assert all(len(h) == 2 and node_of(two_nodes[h[0]]) != node_of(two_nodes[h[1]]) for h in holders.values()), holders
    assert buddy_shift(["a.w0.r0", "a.w1.r0", "a.w2.r0"]) == 1  # one node: the next member
    assert held_partitions(0, 1, 1) == [0]


def test_losing_any_one_member_leaves_a_copy_of_every_span_and_two_neighbours_do_not():
    sizes, n = [11, 5], 4
    held = {r: held_spans(sizes, n, r, 1) for r in range(n)}
    whole = [Span(0, 0, 11), Span(1, 0, 5)]
    for dead in range(n):
        holdings = [(r, s) for r in range(n) if r != dead for s in held[r]]
        assert all(cover(span, holdings, -1) is not None for span in whole)
    holdings = [(r, s) for r in (2, 3) for s in held[r]]  # members 0 and 1 both held partition 0
    assert cover(Span(0, 0, 11), holdings, -1) is None


@pytest.mark.parametrize("me", [0, 1, 2])
def test_cover_takes_this_members_own_pieces_first_then_the_longest(me):
    holdings = [(0, Span(0, 0, 6)), (1, Span(0, 4, 10)), (2, Span(0, 2, 8))]
    pieces = cover(Span(0, 3, 9), holdings, me)
    assert [p for p, _ in pieces][0].start == 3 and pieces[-1][0].end == 9
    assert all(a.end == b.start for (a, _), (b, _) in zip(pieces, pieces[1:]))
    # 0 and 2 hold element 3: their own first; for 1, the one that reaches furthest (2), then its own
    assert [rank for _, rank in pieces] == {0: [0, 1], 1: [2, 1], 2: [2, 1]}[me]
    for piece, rank in pieces:
        held = dict((r, s) for r, s in holdings)[rank]
        assert held.start <= piece.start and piece.end <= held.end
