"""Blocking waits on helper threads, and whether any is still inside one.

Gloo's send and recv report completion only through a blocking ``wait()``, which releases the
GIL while it blocks in C++. :func:`wait_in_thread` runs such a wait on a daemon thread, so that
the caller can watch for a verdict meanwhile and leave the wait behind if its generation is
abandoned. A thread left behind is harmless while the interpreter runs, but if its wait returns
while the interpreter is being torn down, the thread cannot take the GIL back: CPython ends it
with ``pthread_exit``, whose unwinding through torch's C++ frames calls ``std::terminate`` and
aborts the process ("terminate called without an active exception", SIGABRT), turning a
finished run into a crash. An NCCL abort left to finish in the background
(:func:`unbroken.worker.nccl.abort`) is the same kind of call: :func:`call_in_thread` runs it.
:func:`in_flight` tells the exit guard
(:class:`unbroken.worker.lifetime.ExitGuard`) that such a thread is still running, and it then
ends the process without the teardown.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any, Callable

BRIEF_WAIT = 0.02
"""Seconds a Gloo collective is first waited for inside torch (:func:`wait_briefly`)."""
PENDING = object()
"""What :func:`wait_briefly` returns for a work still running."""

_running: set[threading.Thread] = set()
_lock = threading.Lock()


def wait_briefly(work: Any, future: Any, seconds: float = BRIEF_WAIT) -> Any:
    """Wait up to ``seconds`` inside torch (the collective's own thread wakes this one): None if
    the work completed, its error's text if it failed, :data:`PENDING` if it still runs (a
    timed-out wait leaves it running; the caller then watches it). A healthy step's waits mostly
    end here: waking through the future's callback and an Event cost 0.1-0.15 ms a wait on 2
    cores, a fifth of a small model's step. A verdict that comes meanwhile is seen at most
    ``seconds`` later."""
    if seconds <= 0:
        return PENDING
    try:
        work.wait(datetime.timedelta(seconds=seconds))
        return None
    except Exception:  # noqa: BLE001 - a timeout, or the work's failure
        if not future.done():
            return PENDING  # timed out; the work runs on
    try:  # done: it failed, or it ended just after the timeout; its own wait says which
        work.wait()
        return None
    except Exception as exc:  # noqa: BLE001 - only the text: an exception object would hold the work
        return str(exc)


def wait_in_thread(work: Any, done: Callable[[], None]) -> list[str | None]:
    """Call ``work.wait()`` on a daemon thread; returns a list that receives ``None`` (success)
    or the error's text once the wait returns, after which ``done()`` is called."""
    outcome: list[str | None] = []

    def blocking_wait() -> None:
        try:
            work.wait()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")
        finally:
            with _lock:
                _running.discard(threading.current_thread())
        done()

    thread = threading.Thread(target=blocking_wait, name="unbroken-wait", daemon=True)
    with _lock:
        _running.add(thread)
    thread.start()
    return outcome


def call_in_thread(call: Callable[[], None], name: str) -> threading.Event:
    """Run ``call()`` (a blocking C++ call that releases the GIL) on a daemon thread counted by
    :func:`in_flight`; returns an event set once it returned or raised (its error is the caller's
    to log inside ``call``)."""
    returned = threading.Event()

    def run() -> None:
        try:
            call()
        finally:
            with _lock:
                _running.discard(threading.current_thread())
            returned.set()

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _lock:
        _running.add(thread)
    thread.start()
    return returned


def in_flight() -> int:
    """How many calls started by :func:`wait_in_thread` or :func:`call_in_thread` have not
    returned yet."""
    with _lock:
        return len(_running)
