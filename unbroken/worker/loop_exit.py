"""How the script's ``for step in job.steps(...)`` loop was left: by ``break`` (or ``return``), or
by an exception.

Python closes the steps generator the same way in both cases (``GeneratorExit``), and the
exception that unwinds the loop's frame is not visible from inside the generator while it
closes. The loop's frame is: it is the first frame above unbroken's steps generators, and the
instruction it stands at tells. A ``break`` or ``return`` pops the loop's iterator with
``POP_TOP``, which is what closes the generator; an exception closes it while the frame unwinds
from the instruction that raised (a call, a ``raise``...). Checked on CPython 3.11, 3.12 and 3.13.
Anything else (the generator driven by other code) counts as an exception: the cautious reading,
which never turns a crash into an early stop.
"""

from __future__ import annotations

import dis
import inspect
import os
import sys

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_POP_TOP = dis.opmap["POP_TOP"]


def left_by_exception() -> bool:
    """Called while the steps generator handles ``GeneratorExit``: True when the script's loop was
    left by an exception. False for a ``break`` or ``return``, and when unbroken's own code closed
    the generator (an integration's :meth:`~unbroken.integrations.driven_loop.DrivenLoop.finish`,
    which says itself whether an exception is in flight)."""
    frame = sys._getframe(1).f_back  # the generator's closer: an enclosing generator of ours, or the loop
    while frame is not None and _ours(frame) and frame.f_code.co_flags & inspect.CO_GENERATOR:
        frame = frame.f_back
    if frame is not None and _ours(frame):
        return False
    if frame is None or frame.f_lasti < 0:
        return True
    code = frame.f_code.co_code
    return frame.f_lasti >= len(code) or code[frame.f_lasti] != _POP_TOP


def _ours(frame: object) -> bool:
    return os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep)  # type: ignore[attr-defined]
