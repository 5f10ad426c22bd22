"""Healing: who sends the training state to whom, and the state's wire format."""

from __future__ import annotations

import io
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken import healing
from unbroken.healing import HealPlan, plan

torch.set_num_threads(1)


# -- plan ------------------------------------------------------------------------------------------


def test_at_the_start_all_members_are_fresh_so_rank_zero_sends_to_everyone():
    assert plan([(0, True)] * 4) == HealPlan(source=0, receivers=(1, 2, 3), step=0)


def test_a_single_fresh_member_has_nobody_to_heal():
    assert plan([(0, True)]) == HealPlan(source=0, receivers=(), step=0)


def test_members_in_step_need_no_healing():
    assert plan([(12, False)] * 3) == HealPlan(source=0, receivers=(), step=12)


def test_a_fresh_joiner_behind_the_others_receives_from_the_lowest_rank_at_the_top():
    assert plan([(7, False), (0, True), (7, False)]) == HealPlan(source=0, receivers=(1,), step=7)


def test_a_member_that_rejoins_behind_receives_even_if_it_is_not_fresh():
    assert plan([(3, False), (9, False), (9, False)]) == HealPlan(source=1, receivers=(0,), step=9)


def test_the_highest_committed_step_wins_when_some_members_committed_a_step_others_did_not():
    # Ranks 2 and 3 committed step 5 (next step 6); ranks 0 and 1 saw the allreduce fail.
    assert plan([(5, False), (5, False), (6, False), (6, False)]) == HealPlan(source=2, receivers=(0, 1), step=6)


def test_ties_at_the_highest_step_choose_the_lowest_rank():
    assert plan([(2, False), (4, False), (4, False), (4, False)]).source == 1


def test_a_member_holding_real_state_is_preferred_over_a_fresh_one_at_the_same_step():
    assert plan([(0, True), (0, False), (0, True)]) == HealPlan(source=1, receivers=(0, 2), step=0)


statuses = st.lists(st.tuples(st.integers(0, 6), st.booleans()), min_size=1, max_size=10)


@settings(max_examples=200, deadline=None)
@given(statuses)
def test_the_plan_heals_exactly_the_members_behind_or_fresh_from_the_lowest_rank_at_the_top(table):
    result = plan(table)
    top = max(step for step, _ in table)
    best_fresh = all(fresh for step, fresh in table if step == top)
    candidates = [r for r, (step, fresh) in enumerate(table) if step == top and (best_fresh or not fresh)]
    assert result.step == top
    assert result.source == min(candidates)
    assert result.source not in result.receivers
    assert list(result.receivers) == sorted(result.receivers)
    for rank, (step, fresh) in enumerate(table):
        if rank == result.source:
            continue
        must_receive = step < top or fresh or best_fresh
        assert (rank in result.receivers) is must_receive
    # After healing every member holds the source's state: nobody is left behind.
    assert {table[r][0] for r in range(len(table)) if r not in result.receivers} == {top}


# -- wire format -----------------------------------------------------------------------------------


def _state() -> dict:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "runtime": {"next_step": 17, "lineage": [1, 1, 2, 3]},
        "rng": healing.rng_state(),
    }


def test_serialized_state_is_a_flat_byte_tensor_that_deserializes_to_an_equal_state():
    state = _state()
    payload = healing.serialize(state)
    assert payload.dtype == torch.uint8 and payload.dim() == 1 and payload.numel() > 0
    back = healing.deserialize(payload)
    assert back["version"] == healing.STATE_VERSION
    assert back["runtime"] == {"next_step": 17, "lineage": [1, 1, 2, 3]}
    assert back["model"].keys() == state["model"].keys()
    for name, tensor in state["model"].items():
        assert torch.equal(back["model"][name], tensor)
    moments = back["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(moments, state["optimizer"]["state"][0]["exp_avg"])
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]


def test_a_payload_survives_being_cut_into_chunks_and_reassembled():
    payload = healing.serialize({"x": torch.arange(1000, dtype=torch.float64)})
    received = torch.empty_like(payload)
    for start in range(0, payload.numel(), 64):
        received[start : start + 64] = payload[start : start + 64].clone()
    assert torch.equal(healing.deserialize(received)["x"], torch.arange(1000, dtype=torch.float64))


def test_a_payload_of_another_state_version_is_refused():
    buffer = io.BytesIO()
    torch.save({"version": healing.STATE_VERSION + 1, "model": {}}, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"version {healing.STATE_VERSION + 1} is not {healing.STATE_VERSION}"):
        healing.deserialize(payload)


def test_a_payload_without_a_version_is_refused():
    buffer = io.BytesIO()
    torch.save({"model": {}}, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    with pytest.raises(ValueError, match="version None"):
        healing.deserialize(payload)


def test_rng_state_travels_with_the_state_and_restores_the_random_streams():
    torch.manual_seed(1)
    random.seed(2)
    payload = healing.serialize({"rng": healing.rng_state()})
    expected = (torch.rand(3).tolist(), random.random())
    torch.manual_seed(99)
    random.seed(99)
    healing.set_rng_state(healing.deserialize(payload)["rng"])
    assert (torch.rand(3).tolist(), random.random()) == expected


def test_a_member_at_the_same_step_with_another_history_receives_the_state():
    from unbroken.healing import extend_digest, lineage_digest

    ours = lineage_digest([1, 1, 2])
    theirs = lineage_digest([1, 1, 3])  # step 2 committed in generation 3, not 2
    assert ours != theirs and extend_digest(lineage_digest([1, 1]), 2) == ours
    plan_ = plan([(3, False, ours), (3, False, theirs), (3, False, ours)])
    assert plan_.source == 0 and plan_.receivers == (1,)
