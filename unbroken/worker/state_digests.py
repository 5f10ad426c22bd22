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


def tensor_words(tensor: torch.Tensor) -> int:
    """A tensor's 64-bit words summed (wrapping), where it lives, at memory speed: one pass, no
    host copy of a GPU tensor. Any view is read as its own bytes (a view at an odd storage offset
    or of a length not a multiple of 8 is copied into an aligned buffer first)."""
    flat = tensor.detach().reshape(-1)
    if not flat.numel():
        return 0
    raw = flat.contiguous().view(torch.uint8)
    if raw.numel() % 8 or raw.data_ptr() % 8:
        padded = raw.new_zeros((raw.numel() + 7) // 8 * 8)
        padded[: raw.numel()] = raw
        raw = padded
    return int(raw.view(torch.int64).sum().item())


class WholeStateDigest:
    """A digest of a whole training state (parameters, buffers, optimizer state and its
    param_groups' hyper-parameters, scheduler, scaler, extra state, the runtime's record; not
    :data:`_NOT_STATE`), taken in two halves so that the expensive one can leave the critical path.

    :meth:`__init__` walks the state at once: every non-tensor value and every tensor that
    ``deferred(path)`` does not name (buffers: a forward pass changes them) is read now. The named
    tensors (parameters, the optimizer's moments: only an optimizer step changes them) are read by
    :meth:`value`, which may run on another thread, any time before they next change. Both halves
    read tensors by :func:`tensor_words` (memory speed); two members with equal digests hold the
    same state up to the word sums' collisions: a check of a replay, not a defence against an
    adversary."""

    def __init__(self, state: Any, deferred: Any = lambda path: False) -> None:
        self._parts: list[Any] = []

        def walk(value: Any, path: tuple) -> None:
            if isinstance(value, torch.Tensor):
                self._parts.append(f"T{value.dtype}{tuple(value.shape)}".encode())
                self._parts.append(value if deferred(path) else tensor_words(value))
            elif isinstance(value, dict):
                self._parts.append(b"D")
                for key in sorted(value, key=repr):
                    if key not in _NOT_STATE:
                        self._parts.append(repr(key).encode())
                        walk(value[key], path + (key,))
            elif isinstance(value, (list, tuple)):
                self._parts.append(b"L")
                for index, item in enumerate(value):
                    walk(item, path + (index,))
            else:
                self._parts.append(repr(value).encode())

        walk(state, ())

    def value(self) -> int:
        """The 63-bit digest (reads the deferred tensors now)."""
        import hashlib

        h = hashlib.blake2b(digest_size=8)
        for part in self._parts:
            if isinstance(part, torch.Tensor):
                part = tensor_words(part)
            h.update(part if isinstance(part, bytes) else part.to_bytes(8, "little", signed=True))
        self._parts = []
        return int.from_bytes(h.digest(), "little") >> 1


def training_state_digest(state: dict[str, Any], parameter_names: set[str]) -> WholeStateDigest:
    """:class:`WholeStateDigest` of a state of :func:`~unbroken.worker.job_state.gather_state`,
    deferring the tensors only an optimizer step changes: the model's parameters (named
    ``parameter_names`` in its ``state_dict``) and the optimizer's per-parameter state."""

    def deferred(path: tuple) -> bool:
        return (len(path) == 2 and path[0] == "model" and path[1] in parameter_names) or path[:2] == ("optimizer", "state")

    return WholeStateDigest(state, deferred)
