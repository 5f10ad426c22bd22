"""What a peer's or a file's bytes may hold: plain data only, never a callable to run. One
allow-list for both readers.

A healing manifest (:mod:`unbroken.worker.healing`) is a pickle that a peer sent; a checkpoint is a
``torch.save`` file. Both hold the same state (model, optimizer, scheduler, scaler, the script's
``extra_state``) and accept the same things: plain containers, numbers, strings, torch dtypes and
sizes, tensors, numpy arrays, and whatever the user allowed with
``torch.serialization.add_safe_globals``. A healing manifest is read with :class:`SafeUnpickler`
(it carries the healing module's own types and tensors by reference, which torch's loader cannot
read); a checkpoint with ``torch.load(weights_only=True)`` inside :func:`plain_data_globals`. A
state that heals therefore also resumes from a checkpoint: before, a numpy array in
``extra_state`` healed but made every checkpoint that held it unreadable.
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
from typing import Any, Iterator

import torch

_SAFE_BUILTINS = frozenset(
    ("dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str", "bytes", "bytearray", "bool", "slice", "range")
)
_HEALING_TYPES = {("unbroken.worker.healing", "TensorSpec"), ("unbroken.worker.healing", "Skeleton")}
"""The manifest's own types, under the module that defines them (named: storage imports no worker)."""
_NUMPY = (
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
)


@functools.lru_cache(maxsize=1)
def _numpy_globals() -> tuple[Any, ...]:
    """numpy's array and scalar reconstructors (under numpy 1's and 2's module names), and every
    dtype class of ``numpy.dtypes``: what pickling a numpy array or scalar names."""
    import importlib

    import numpy

    found = []
    for module, name in _NUMPY:
        if module.startswith("numpy.core.") and hasattr(numpy, "_core"):
            continue  # numpy 2 pickles under numpy._core, and warns when numpy.core is imported
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    dtypes = getattr(numpy, "dtypes", None)
    found += [v for v in vars(dtypes).values() if isinstance(v, type) and issubclass(v, numpy.dtype)] if dtypes else []
    return tuple(found)


def _user_globals() -> set[tuple[str, str]]:
    """What the user allowed for torch's weights-only loads, as (module, name)."""
    allowed = set()
    for entry in torch.serialization.get_safe_globals():
        obj = entry[0] if isinstance(entry, tuple) else entry
        allowed.add((getattr(obj, "__module__", ""), getattr(obj, "__qualname__", getattr(obj, "__name__", ""))))
    return allowed


@contextlib.contextmanager
def plain_data_globals() -> Iterator[None]:
    """Inside, ``torch.load(weights_only=True)`` accepts what :class:`SafeUnpickler` accepts
    (numpy arrays and scalars besides torch's own plain data)."""
    with torch.serialization.safe_globals(list(_numpy_globals())):
        yield


class SafeUnpickler(pickle.Unpickler):
    """Unpickles only plain data: a healing payload can never name a callable to run."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in {("torch", "Size"), ("collections", "OrderedDict")} | _HEALING_TYPES:
            return super().find_class(module, name)
        if (module, name) in _NUMPY or module == "numpy.dtypes" or (module, name) in _user_globals():
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"the healing state holds a {module}.{name}, which is not plain data; state_dicts healed"
            " between members (model, optimizer, scheduler, extra_state) may hold only containers,"
            " numbers, strings, tensors and numpy arrays, or types allowed with"
            " torch.serialization.add_safe_globals (which checkpoints accept too)"
        )


def safe_loads(data: bytes) -> Any:
    return SafeUnpickler(io.BytesIO(data)).load()

