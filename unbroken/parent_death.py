"""Dying with one's parent: Linux's parent-death signal, for every process unbroken starts that
must not outlive the one that started it (a worker its launcher or zygote, the zygote its
launcher, a data-loader worker its training process)."""

from __future__ import annotations

import os
import signal
import sys


def die_with(parent: int) -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; end it at once (status 1) if its
    parent is no longer ``parent`` (it died before the request took effect). False if the request
    could not be made (not Linux, no ``prctl``)."""
    asked = False
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
            asked = True
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)
    return asked
