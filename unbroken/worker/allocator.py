"""Fixed thresholds for glibc's ``malloc``, so that a step's large temporaries reuse memory.

A CPU step allocates and frees the same large tensors every time: an optimizer's temporaries
(AdamW's ``sqrt`` and division, one per parameter), the gradients after ``zero_grad``. glibc
serves a block above its *mmap threshold* with a fresh ``mmap`` and returns it at ``free``, and
it gives back the top of its heap once more than the *trim threshold* is free there; either way
the next step touches new pages, and every 4 KiB page is a fault that the kernel fills with
zeros. glibc raises both thresholds by itself after freeing a large block, but whether that
happens depends on the heap's layout, which any import changes: measured on this project's
2-core machines, AdamW over two 1024x1024 weights took 8.2 ms a step in a bare interpreter and
20 ms (4,064 page faults a step: every temporary) after ``import typing``; a two-worker step of
``benchmarks/transformers_step.py`` spent 5 ms of its 40 ms in these faults. PyTorch's CPU
performance guide gives the same advice in another form (switch to jemalloc or tcmalloc).

:func:`tune` fixes the two thresholds at the values glibc's own adjustment ends at (an mmap
threshold of 32 MiB, a trim threshold twice that), whatever the layout: the same AdamW then took
5.7-6.3 ms a step with 0-80 faults. The cost is memory a process keeps for reuse: blocks up to
32 MiB come from the heap, and up to 64 MiB free at its top stays there. Blocks above 32 MiB are
mapped and returned as before. Off with ``RuntimeSettings(tune_malloc=False)``
(``UNBROKEN_TUNE_MALLOC=0``); a C library without ``mallopt`` (musl) is left as it is.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""Bytes above which a block is mapped on its own: glibc's largest dynamic mmap threshold."""
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
"""Free bytes at the heap's top kept for reuse: glibc sets twice the mmap threshold when it raises it."""

_tuned = False


def tune(wanted: bool = True) -> bool:
    """Fix glibc's thresholds in this process (once) if ``wanted`` (the ``tune_malloc`` setting);
    True if they are set."""
    global _tuned
    if _tuned or not wanted:
        return _tuned
    try:  # the process's own symbols: libc's, without a search (find_library runs ldconfig)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _tuned = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _tuned
