"""A model and its optimizer as torch's distributed checkpoint (DCP) should see them:
:class:`TrainingState`, the ``Stateful`` value put in the state that
:func:`~unbroken.storage.sharded_checkpoint.save_sharded` writes and
:func:`~unbroken.storage.sharded_checkpoint.load_sharded` fills.

Kept apart from :mod:`unbroken.storage.sharded_checkpoint` (which writes, publishes and loads the
files, and offers this name too): this is only what a model and optimizer hand DCP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["TrainingState"]


class TrainingState(Stateful):
    """A model and its optimizer as DCP should see them, torch's recommended way: ``state_dict()``
    is :func:`~torch.distributed.checkpoint.state_dict.get_state_dict` (keys by parameter name,
    DTensor shards under FSDP2, the optimizer's own tensors, no copies) and ``load_state_dict``
    sets the loaded values back with ``set_state_dict``. Put it in the state given to
    :func:`save_sharded` and :func:`load_sharded`, e.g. ``{"train": TrainingState(model, opt)}``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])
