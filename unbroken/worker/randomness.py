"""Per-member random streams: independent across members, reproducible from the seed.

Healing copies the source's RNG states to every receiver, so without more every member would draw
the same dropout masks and augmentations for its own share of the batch: correlated noise that a
single process over the whole batch never has. So whenever a generation forms, each member
reseeds torch, ``random`` and numpy (if imported) from (seed, step, member index). The streams
then differ between members, and a run is reproducible from its seed and its generations.
"""

from __future__ import annotations

import hashlib
import random
import sys

import torch


def member_seed(seed: int, step: int, index: int) -> int:
    """A 63-bit seed for member ``index`` from ``step`` on, well mixed (nearby inputs give
    unrelated streams)."""
    digest = hashlib.sha256(f"unbroken:{seed}:{step}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_member(seed: int, step: int, index: int) -> int:
    """Reseed every RNG this process uses; returns the seed."""
    value = member_seed(seed, step, index)
    torch.manual_seed(value)  # also seeds every CUDA device
    random.seed(value)
    if "numpy" in sys.modules:
        import numpy

        numpy.random.seed(value % (1 << 32))
    return value
