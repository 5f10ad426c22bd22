"""Healing: bring members behind the highest committed step up to date from a live peer.

After a generation forms, its members exchange (next step, fresh, lineage digest) over the new
group. The source is the lowest-ranked member at the highest step that holds real state; every
other member that is behind it, at the same step by another history, or has never been healed
nor committed (a fresh joiner), receives the full training
state point to point: a length, then the bytes of a ``torch.save`` of the state, in chunks. No
checkpoint is read. A receiver loads nothing until every byte has arrived, so a transfer cut by a
failure leaves it as it was.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from typing import Any, Callable

import torch

from unbroken.group import GenerationGroup

STATE_VERSION = 1
CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class HealPlan:
    source: int
    receivers: tuple[int, ...]
    step: int


def plan(statuses: list[tuple[int, ...]]) -> HealPlan:
    """Who sends and who receives, from each rank's (next step, fresh[, lineage digest]). Pure.

    The source is the lowest rank at the highest step, preferring real state to fresh. A member
    receives if it is behind, fresh, or at the same step by another history: a step that some
    member committed in one generation and the others redid in the next gives results equal only
    up to rounding, and replicas must be bit-identical.
    """
    rows = [(row[0], bool(row[1]), row[2] if len(row) > 2 else 0) for row in statuses]
    best = max(range(len(rows)), key=lambda r: (rows[r][0], not rows[r][1], -r))
    top_step, top_fresh, top_digest = rows[best]
    receivers = tuple(
        r
        for r, (step, fresh, digest) in enumerate(rows)
        if r != best and (step < top_step or fresh or top_fresh or digest != top_digest)
    )
    return HealPlan(best, receivers, top_step)


_DIGEST_MOD = (1 << 61) - 1


def extend_digest(digest: int, generation: int) -> int:
    """The lineage digest after one more step committed in ``generation``."""
    return (digest * 1_000_003 + generation + 1) % _DIGEST_MOD


def lineage_digest(lineage: list[int]) -> int:
    digest = 0
    for generation in lineage:
        digest = extend_digest(digest, generation)
    return digest


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    import sys

    if "numpy" in sys.modules:
        import numpy

        state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def serialize(state: dict[str, Any]) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save({"version": STATE_VERSION, **state}, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def deserialize(payload: torch.Tensor) -> dict[str, Any]:
    state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"healing state version {state.get('version')} is not {STATE_VERSION}")
    return state


def send_state(group: GenerationGroup, payload: torch.Tensor, dst: int, on_started: Callable[[], None]) -> None:
    group.send(torch.tensor([payload.numel()], dtype=torch.int64), dst, 1, "healing transfer (length)")
    on_started()
    for start in range(0, payload.numel(), CHUNK_BYTES):
        group.send(payload[start : start + CHUNK_BYTES], dst, 2, "healing transfer")


def recv_state(group: GenerationGroup, src: int) -> torch.Tensor:
    length = torch.zeros(1, dtype=torch.int64)
    group.recv(length, src, 1, "healing transfer (length)")
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    for start in range(0, payload.numel(), CHUNK_BYTES):
        group.recv(payload[start : start + CHUNK_BYTES], src, 2, "healing transfer")
    return payload
