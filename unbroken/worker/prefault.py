"""Faulting in the pages of new tensors ahead of the data that will fill them.

A healing receiver allocates its large tensors as soon as it knows their shapes; for memory the
process does not hold yet, the first touch of each page costs about as much as the transfer
itself (benchmarks/bench_heal.py). :class:`Prefault` maps those pages on a helper thread with
Linux's ``MADV_POPULATE_WRITE`` while the data is still on its way, so the two overlap. Where
that call is missing (another OS, a Linux before 5.14) it does nothing.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

import torch

_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later
_PREFAULT_STEP = 8 << 20
_madvise: Any = None


def _populate_write() -> Any:
    """libc's madvise, or None where it or MADV_POPULATE_WRITE cannot be used."""
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                function = ctypes.CDLL(None, use_errno=True).madvise
                function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                function.restype = ctypes.c_int
                _madvise = function
            except (OSError, AttributeError):
                pass
    return _madvise or None


class Prefault:
    """Faults in the pages of the tensors a receiver is about to fill, in order, on a helper
    thread (ctypes lets go of the GIL), so that the first touch of new memory, which can cost more
    than the transfer itself, overlaps with the transfer instead of stalling it. It only maps
    pages (``MADV_POPULATE_WRITE``) and never writes data, so it may run over a tensor that is
    being filled. Where that call is missing it does nothing."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        madvise = _populate_write()
        if madvise is not None and tensors:
            self._thread = threading.Thread(target=self._run, args=(madvise, tensors), name="unbroken-heal-prefault", daemon=True)
            self._thread.start()

    def _run(self, madvise: Any, tensors: list[torch.Tensor]) -> None:
        page = 4096
        for tensor in tensors:
            first = tensor.data_ptr()
            start = (first + page - 1) // page * page
            end = (first + tensor.numel() * tensor.element_size()) // page * page
            for at in range(start, end, _PREFAULT_STEP):
                if self._stop.is_set():
                    return
                if madvise(at, min(_PREFAULT_STEP, end - at), _MADV_POPULATE_WRITE) != 0:
                    return  # not supported here (EINVAL), or out of memory: the transfer will tell

    def stop(self) -> None:
        self._stop.set()

