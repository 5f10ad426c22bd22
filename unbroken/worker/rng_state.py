"""The RNG states a training state carries: torch's (CPU and the CUDA device), ``random``'s, numpy's.

:func:`rng_state` takes them for the state that heals and checkpoints; :func:`set_rng_state` puts
them back. Kept apart from :mod:`unbroken.worker.healing` (which offers these names too): they
are part of the state, not of its transfer. (:mod:`unbroken.worker.randomness` then reseeds each
member for itself.)
"""

from __future__ import annotations

import random
from typing import Any

import torch


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """The RNG states of torch (CPU, and the CUDA device ``device`` when it is one), ``random``
    and numpy (if imported)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    import sys

    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(device)
    if "numpy" in sys.modules:
        import numpy

        name, keys, position, has_gauss, cached = numpy.random.get_state()
        # plain values, so that checkpoints load with torch.load(weights_only=True)
        state["numpy"] = (str(name), keys.tolist(), int(position), int(has_gauss), float(cached))
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Put back what :func:`rng_state` took. A CUDA state goes to ``device`` if it is a CUDA
    device; a state without one (taken on a CPU member) leaves the CUDA RNG as it is."""
    torch.set_rng_state(state["torch"].cpu())  # a state healed over NCCL may arrive on a GPU
    random.setstate(state["python"])
    if state.get("cuda") is not None and device is not None and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    if "numpy" in state:
        import numpy

        name, keys, position, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), position, has_gauss, cached))
