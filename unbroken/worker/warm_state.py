"""Warm memory for a newcomer's heal: its optimizer state allocated and touched before it joins.

A process that joins a running job holds its model's parameters (built and initialized, so
touched) but no optimizer state yet: optimizers create it lazily, in their first step. Healing
would then allocate the optimizer state (for Adam twice the parameters) as new memory while the
bytes arrive, and on Linux the first touch of each new page costs about as much as the transfer
(benchmarks/bench_heal.py). So before it asks to join, while the others still train without
waiting for it, a newcomer runs its optimizer once over zero gradients with the learning rate
and weight decay at zero: the optimizer allocates and writes its whole state, and the
parameters do not change. The state tensors are then taken out of the optimizer (which is left
as it was built, with no state) and kept, by their place in the optimizer's ``state_dict``, for
the heal to receive into (:func:`unbroken.worker.healing.recv_state`'s ``into``); loading the
healed state then puts those same tensors into the optimizer without a copy.

Only for ``torch.optim.SGD``, ``Adam`` and ``AdamW``, where a zero learning rate and weight decay
provably leave the parameters as they were; other optimizers are left alone (healed into new
memory, as before). A member that never needs a heal (the job's start) does not warm up.

The parameters too: tensors like them are allocated and touched next to the model
(:func:`warm_model`), the heal receives the peer's parameters into them, and once the heal is
complete they become the parameters' memory (:func:`adopt_parameters`) instead of being copied
into it. A heal cut part way changes nothing of the model.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Any

import torch

log = logging.getLogger("unbroken")

WARMABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose step with a zero learning rate and weight decay changes no parameter."""

RELEASE_THREAD = "unbroken-release"
"""The name of the thread that frees parameters' replaced memory (:func:`release_in_background`)."""

Place = tuple[Any, ...]
"""Where a tensor sits in a member's state: the keys from the state's root, e.g.
``("optimizer", "state", 3, "exp_avg")``."""


def warm_optimizer(optimizer: Any) -> dict[Place, torch.Tensor]:
    """Allocate and touch ``optimizer``'s state, then take it out again (see the module's
    docstring); returns the state tensors by place, or ``{}`` where that cannot be done safely.
    The optimizer is left with no state and its own settings; the parameters are not changed."""
    if type(optimizer) not in WARMABLE or any(optimizer.state.values()):
        return {}
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if not params or any(p.grad is not None for p in params):
        return {}
    saved = [(group, group["lr"], group.get("weight_decay", 0)) for group in optimizer.param_groups]
    try:
        for group, lr, _ in saved:
            group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        with torch.no_grad():
            optimizer.step()
        places = {("optimizer", "state", index, key): value
                  for index, state in optimizer.state_dict()["state"].items()
                  for key, value in state.items() if isinstance(value, torch.Tensor)}
    except Exception as exc:  # an optimizer configured in a way this does not foresee: heal as before
        log.info("optimizer state not warmed before the heal: %s", exc)
        places = {}
    finally:
        for group, lr, weight_decay in saved:
            group["lr"] = lr
            if "weight_decay" in group:
                group["weight_decay"] = weight_decay
        for p in params:
            p.grad = None
        optimizer.state = defaultdict(dict)
    return places


def warm_model(model: torch.nn.Module) -> dict[Place, torch.Tensor]:
    """Allocate and touch, next to the model, one tensor like each of its parameters, by place in
    the state (``("model", name)``), for a heal to receive the peer's parameters into; the
    model itself is not changed. :func:`adopt_parameters` then makes them the parameters' memory,
    so the parameters arrive in warm memory and are never copied."""
    places: dict[Place, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("model", name) not in places:
                places[("model", name)] = torch.zeros_like(p, memory_format=torch.contiguous_format)
    return places


def adopt_parameters(model: torch.nn.Module, received: dict[str, Any]) -> int:
    """Make each received parameter tensor (a complete heal's ``state["model"]``: tensors this
    process owns, nobody else holds) the memory of the model's parameter of that name, instead of
    copying it there: the Parameter objects stay the same (the optimizer and hooks keep theirs),
    their old memory is freed on a thread of its own (:func:`release_in_background`), and
    ``load_state_dict`` then finds nothing to copy. Only where the
    received tensor fits exactly (shape, dtype, device, contiguous, owning all of its storage);
    the rest is copied by ``load_state_dict`` as before. Returns the bytes adopted."""
    adopted = 0
    replaced: list[torch.Tensor] = []
    owners = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in received.items():
            p = owners.get(name)
            if (
                p is None or not isinstance(tensor, torch.Tensor) or tensor.shape != p.shape or tensor.dtype != p.dtype
                or tensor.device != p.device or not tensor.is_contiguous() or tensor.storage_offset() != 0
                or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or tensor.requires_grad
            ):
                continue
            if p.data_ptr() != tensor.data_ptr():
                replaced.append(p.detach())  # the old memory, kept until the release below
                p.data = tensor
                adopted += tensor.numel() * tensor.element_size()
    release_in_background(replaced)
    return adopted


def release_in_background(tensors: list[torch.Tensor]) -> threading.Thread | None:
    """Free the memory of ``tensors`` (each holding the last reference to it) on a thread of its
    own, so that the heal does not wait for it. Freeing touched pages back to the system is not
    free: 22-27 ms for 0.4 GB on this project's machines, on the critical path of every heal
    (every member waits for the newcomer) when the parameters were adopted on the main thread.
    ``Tensor.set_()`` drops a tensor's storage inside a torch operator, which runs without the
    GIL: the main thread goes on with Python meanwhile. On a GPU the caching allocator keeps the
    memory: nothing to wait for either way. Returns the thread (None if there was nothing)."""
    if not tensors:
        return None

    def release() -> None:
        with torch.no_grad():
            for tensor in tensors:
                tensor.set_()
        tensors.clear()

    thread = threading.Thread(target=release, name=RELEASE_THREAD, daemon=True)
    thread.start()
    return thread
