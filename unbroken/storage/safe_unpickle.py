"""A restricted unpickler for healing manifests: plain data only, never a callable to run.

A healing manifest (:mod:`unbroken.worker.healing`) is a pickle that a peer sent. It is read with
:class:`SafeUnpickler`, which accepts only plain containers, numbers, strings, torch dtypes and
sizes, numpy arrays and the healing module's own types; any other global is refused with an
error that names it. (Checkpoints load with ``torch.load(weights_only=True)`` for the same reason.)
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

_SAFE_BUILTINS = frozenset(
    ("dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str", "bytes", "bytearray", "bool", "slice", "range")
)
_SAFE_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("unbroken.worker.healing", "TensorSpec"),  # the manifest's own types, under the module that defines them
    ("unbroken.worker.healing", "Skeleton"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
}


class SafeUnpickler(pickle.Unpickler):
    """Unpickles only plain data: a healing payload can never name a callable to run."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _SAFE_GLOBALS or module == "numpy.dtypes":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"the healing state holds a {module}.{name}, which is not plain data; state_dicts healed"
            " between members (model, optimizer, scheduler, extra_state) may hold only containers,"
            " numbers, strings, tensors and numpy arrays"
        )


def safe_loads(data: bytes) -> Any:
    return SafeUnpickler(io.BytesIO(data)).load()

