"""Per-member random streams (issue 11: correlated randomness after a heal)."""

import random

import torch

from unbroken.worker.randomness import member_seed, seed_member


def test_members_get_different_streams_and_the_same_inputs_give_the_same_stream():
    draws = {}
    for index in range(4):
        seed_member(7, 12, index)
        draws[index] = (torch.rand(8).tolist(), random.random())
    assert len({str(d) for d in draws.values()}) == 4
    seed_member(7, 12, 2)
    assert (torch.rand(8).tolist(), random.random()) == draws[2]


def test_seeds_differ_for_every_step_and_index_and_fit_in_63_bits():
    seeds = {member_seed(0, step, index) for step in range(50) for index in range(50)}
    assert len(seeds) == 2500 and all(0 <= s < 1 << 63 for s in seeds)
