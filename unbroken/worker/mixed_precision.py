"""Mixed precision: a ``torch.amp.GradScaler`` driven by the step protocol.

With ``Job(scaler=torch.amp.GradScaler(...))`` each micro-batch's share-weighted loss is scaled
before its backward, the scaled gradients are allreduced, and :meth:`Step.commit
<unbroken.worker.step.Step.commit>` unscales them, looks for inf/nan, steps the optimizer unless it found
any, and updates the scale. The check runs on the *reduced* gradients, which are bit for bit the
same on every member, so every member skips the same steps and keeps the same scale without a
collective of its own. A loop that clips calls ``scaler.unscale_(job.optimizer)`` between
``step.reduce()`` and ``step.commit()``, as under DDP.

The scaler's state (scale, growth tracker, factors) is part of the training state: healed to a
member that rejoins and saved in checkpoints. A step that fails after an ``unscale_`` forgets it
(:func:`forget_step`), so that the redo starts clean. bf16 autocast needs no scaler and nothing
from unbroken.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from unbroken.errors import ConfigError


def check_scaler(scaler: Any, model: torch.nn.Module) -> None:
    """Refuse a scaler that cannot work with ``model``: ConfigError naming what is wrong."""
    if scaler is None:
        return
    for name in ("scale", "unscale_", "step", "update", "state_dict", "load_state_dict"):
        if not callable(getattr(scaler, name, None)):
            raise ConfigError(f"scaler must be a torch.amp.GradScaler (it has no {name}()), got {type(scaler).__name__}")
    floating = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    if not floating:
        raise ConfigError("a scaler was passed but the model has no floating-point parameters that require gradients")
    scaler_device = getattr(scaler, "_device", None)
    if scaler_device is not None and getattr(scaler, "is_enabled", lambda: True)():
        kinds = {p.device.type for p in floating}
        if kinds != {torch.device(scaler_device).type}:
            raise ConfigError(
                f"the scaler is for {scaler_device!r} but the model's parameters are on {sorted(kinds)}:"
                f" use torch.amp.GradScaler({sorted(kinds)[0]!r})"
            )


def step(scaler: Any, optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Unscale (unless done already), step unless a gradient is inf/nan, update the scale.

    Returns True if the optimizer stepped, False if the step was skipped."""
    if not scaler.is_enabled():
        optimizer.step()
        return True
    if getattr(scaler, "_scale", None) is None:
        # A member whose share was empty scaled no loss; initialise the scale as scale() would.
        scaler.scale(torch.zeros((), device=device))
    state = scaler._per_optimizer_states[id(optimizer)]
    if state.get("stage") is OptState.READY:  # not unscaled by the loop (to clip)
        scaler.unscale_(optimizer)
    found = state.get("found_inf_per_device") or {}
    stepped = not any(float(v) for v in found.values())
    scaler.step(optimizer)
    scaler.update()
    return stepped


def forget_step(scaler: Any) -> None:
    """Forget an ``unscale_`` done in a step that then failed: the redo unscales afresh."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is not None:
        from torch.amp.grad_scaler import _refresh_per_optimizer_state

        scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
