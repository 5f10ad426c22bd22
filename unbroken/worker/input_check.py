"""Refuse a loop whose model does not eat the batches that ``step.micro_batches()`` yields.

A ported script may keep its own batch function (nanoGPT's ``get_batch``) inside the loop:
``for _ in step.micro_batches(): X, Y = get_batch(); step.backward(model(X, Y))``. The loop
checks pass (one backward per micro-batch), but the samples are not the data plan's, so
exactly-once and the same-model guarantee are gone without a word. On the first micro-batch that
this process runs, :class:`InputTracker` follows the yielded batch's tensors through every torch
operation the script applies (``.to(device)``, normalisation, indexing: a ``TorchFunctionMode``
marks each result of an operation on a marked tensor) until ``step.backward``; if the job's
model was called and none of its tensor inputs came from the batch, the step is refused with
:class:`~unbroken.errors.LoopMisuse`. A batch without tensors (strings tokenised by the script)
cannot be followed and is not checked; nor is a step where the model was not called directly.
The tracking runs for one micro-batch per process, so it costs nothing afterwards.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_flatten

from unbroken.errors import LoopMisuse


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


class _Marking(TorchFunctionMode):
    """Marks every tensor computed from a marked tensor."""

    def __init__(self, marked: dict[int, weakref.ref]) -> None:
        super().__init__()
        self.marked = marked
        self.disabled = False

    def is_marked(self, tensor: torch.Tensor) -> bool:
        ref = self.marked.get(id(tensor))
        return ref is not None and ref() is tensor

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self.disabled and any(self.is_marked(t) for t in _tensors((args, kwargs))):
            for t in _tensors(result):
                self.marked[id(t)] = weakref.ref(t)
        return result


class InputTracker:
    """Follows one micro-batch into the model (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, batch: Any, step: int) -> None:
        tensors = _tensors(batch)
        self.step = step
        self.active = bool(tensors)
        self.model_called = False
        self.fed = False
        if not self.active:
            return
        self._mode = _Marking({id(t): weakref.ref(t) for t in tensors})
        self._hook = model.register_forward_pre_hook(self._forward, with_kwargs=True)
        self._mode.__enter__()

    def _forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.model_called = True
        if any(self._mode.is_marked(t) for t in _tensors((args, kwargs))):
            self.fed = True

    def close(self) -> None:
        """Stop following (idempotent)."""
        if not self.active:
            return
        self.active = False
        self._hook.remove()
        self._mode.disabled = True
        stack = _get_current_function_mode_stack()
        if stack and stack[-1] is self._mode:  # a mode the script pushed since stays: ours then only passes through
            self._mode.__exit__(None, None, None)

    def check(self) -> None:
        """Stop following, and refuse the step if the model ate something else than the batch."""
        was_active = self.active
        self.close()
        if was_active and self.model_called and not self.fed:
            raise LoopMisuse(
                f"step {self.step}: the model was called on tensors that did not come from step.micro_batches()"
                " (a batch function of the script's own, like nanoGPT's get_batch?); such samples are not the data"
                " plan's, so no sample would be seen exactly once and the model would depend on the number of"
                " workers. Use the batch that step.micro_batches() yields (move it to the device, transform it),"
                " and draw random windows or crops per sample inside the data set, seeded by unbroken.sample_rng"
                " (see docs/guide/input-pipelines.md)")
