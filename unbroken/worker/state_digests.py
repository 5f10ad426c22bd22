"""Digests that tell whether two members hold the same training state, without sending it.

The lineage digest folds in the generation of every committed step (:func:`extend_digest`,
:func:`lineage_digest`): members at one step by different histories hold results equal only up to
rounding, and the heal plan (:mod:`unbroken.worker.heal_plan`) heals them. The state digest
(:func:`state_digest`) hashes a state's values, so that fresh members that built the same state
copy nothing. Kept apart from :mod:`unbroken.worker.healing` (which offers these names too): the
runtime, checkpoints and catch-up keep the lineage digest up to date without the wire format.
"""

from __future__ import annotations

from typing import Any

import torch

_DIGEST_MOD = (1 << 61) - 1


def extend_digest(digest: int, generation: int) -> int:
    """The lineage digest after one more step committed in ``generation``."""
    return (digest * 1_000_003 + generation + 1) % _DIGEST_MOD


def lineage_digest(lineage: list[int]) -> int:
    digest = 0
    for generation in lineage:
        digest = extend_digest(digest, generation)
    return digest


_NOT_STATE = ("rng", "checkpoint_schedule")
"""Keys of a state that :func:`state_digest` leaves out: the RNG states (every member is reseeded
after a heal) and the checkpoint schedule's history (seconds trained, which no two processes
count alike)."""


def state_digest(state: Any) -> int:
    """A 63-bit digest of a training state's values (tensors bit for bit, the rest by value),
    :data:`_NOT_STATE` left out: members whose digests agree hold the same state, so a heal between them
    would copy nothing (every member is reseeded after a heal anyway)."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
            h.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
            if tensor.numel():
                flat = tensor.cpu().contiguous().reshape(-1)
                h.update(flat.view(torch.uint8).numpy().data if flat.dtype != torch.bool else flat.numpy().tobytes())
        elif isinstance(value, dict):
            h.update(b"D")
            for key in sorted(value, key=repr):
                if key not in _NOT_STATE:
                    h.update(repr(key).encode())
                    walk(value[key])
        elif isinstance(value, (list, tuple)):
            h.update(b"L")
            for item in value:
                walk(item)
        else:
            h.update(repr(value).encode())

    walk(state)
    return int.from_bytes(h.digest(), "little") >> 1
