"""Per-sample randomness: the seed of each stream position, and the sample being loaded.

While a sample is loaded, torch's default CPU generator, Python's ``random`` and numpy's global
generator are seeded from (job seed, stream position) (:func:`sample_seed_for`), in a loader
worker process as in the training thread, so that an augmentation drawn from them depends only on
the sample's position (see :mod:`unbroken.data.loader`). :func:`current_sample`,
:func:`sample_rng` and :func:`sample_seed` give a data set's ``__getitem__`` the sample it loads
and a dedicated generator or seed for it.

Kept apart from the loader so that the public names (``unbroken.sample_rng``, ...) and
:mod:`unbroken.data.windows` need only this. :mod:`unbroken.data.planned_samples` sets the sample
being loaded (``_current``) around each ``__getitem__``.
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any, NamedTuple

import torch

__all__ = ["SampleInfo", "current_sample", "sample_rng", "sample_seed", "sample_seed_for"]


def sample_seed_for(seed: int, position: int) -> int:
    """The 63-bit seed of the sample at stream ``position`` of a job seeded with ``seed``."""
    return _mix(f"unbroken:sample:{seed}:{position}")


def _batch_seed(seed: int, start: int, size: int) -> int:
    """The seed of a micro-batch's collate function: its first position and its size."""
    return _mix(f"unbroken:batch:{seed}:{start}:{size}")


def _mix(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class SampleInfo(NamedTuple):
    """The sample being loaded: where it is in the stream and in the data set."""

    position: int
    """Its stream position (step ``s`` holds positions ``[s*G, (s+1)*G)``)."""
    index: int
    """Its index in the data set."""
    step: int
    """The step it belongs to."""
    seed: int
    """Its seed, :func:`sample_seed_for` (job seed, position)."""


_current: SampleInfo | None = None


def current_sample() -> SampleInfo:
    """The sample being loaded, for a data set's ``__getitem__`` (in a loader worker or not).

    Raises:
        RuntimeError: outside the loading of a sample by a :class:`~unbroken.Job`.
    """
    if _current is None:
        raise RuntimeError("no sample is being loaded: current_sample(), sample_seed() and sample_rng() work inside a data set's __getitem__ called by unbroken")
    return _current


def sample_seed() -> int:
    """The seed of the sample being loaded: a function of (job seed, stream position) only."""
    return current_sample().seed


def sample_rng() -> torch.Generator:
    """A fresh CPU generator seeded for the sample being loaded (see :func:`sample_seed`)."""
    return torch.Generator().manual_seed(current_sample().seed)


def _seed_globals(seed: int) -> None:
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % (1 << 32))


def _rng_state() -> tuple[Any, ...]:
    numpy = sys.modules.get("numpy")
    return torch.default_generator.get_state(), random.getstate(), numpy.random.get_state() if numpy else None


def _set_rng_state(state: tuple[Any, ...]) -> None:
    torch.default_generator.set_state(state[0])
    random.setstate(state[1])
    if state[2] is not None:
        sys.modules["numpy"].random.set_state(state[2])

