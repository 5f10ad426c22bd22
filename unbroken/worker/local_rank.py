"""This worker's local rank: ``LOCAL_RANK`` as ``unbroken run`` sets it, or where an integration
kept it when it had to hide it.

The Hugging Face Trainer's ``TrainingArguments`` hands ``LOCAL_RANK`` to Accelerate, which then
starts a torchrun-style process group of its own; under unbroken every worker is one process to
them, so :mod:`unbroken.integrations.transformers` moves the value to :data:`KEPT`. unbroken's own
readers (devices, chaos) find it in either place.
"""

from __future__ import annotations

import os

KEPT = "UNBROKEN_LOCAL_RANK"


def local_rank() -> int | None:
    """The local rank ``unbroken run`` gave this worker; None outside ``unbroken run``."""
    value = os.environ.get("LOCAL_RANK") or os.environ.get(KEPT)
    return int(value) if value else None


def hide_from_frameworks() -> None:
    """Move ``LOCAL_RANK`` to :data:`KEPT`, for frameworks that would take it for torchrun's."""
    if "LOCAL_RANK" in os.environ:
        os.environ[KEPT] = os.environ.pop("LOCAL_RANK")
