"""How a worker process ends: never outliving its launcher, never crashing at a clean exit.

Two guards that the runtime installs when a member starts under ``unbroken run``:
:func:`die_with_launcher` asks Linux to kill the worker when its launcher dies (no orphan keeps
a node's devices or trains unwatched), and :class:`ExitGuard` keeps a Gloo group abandoned while
a peer hung (or a wait left behind on it) from aborting the interpreter at exit, which would make
a finished run look like a crash to the launcher (measured on this kind of machine).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import Any, Protocol

from unbroken.parent_death import die_with
from unbroken.errors import JobCannotGoOn
from unbroken.worker import blocking_waits

log = logging.getLogger("unbroken.worker.runtime")  # moved out of the runtime; its messages keep their logger


def die_with_launcher() -> None:
    """End this worker the moment its launcher dies (Linux's parent-death signal), so that no
    orphan holds a node's devices or trains on unwatched; if it died already, end now. (A worker
    forked by the launcher's zygote has the zygote's pid here, its parent, which dies with the
    launcher.)"""
    launcher = os.environ.get("UNBROKEN_LAUNCHER_PID")
    if not launcher or not sys.platform.startswith("linux"):
        return
    if os.getppid() != int(launcher):
        print("unbroken: the launcher of this worker is gone; exiting", file=sys.stderr, flush=True)
    if not die_with(int(launcher)):
        log.warning("cannot ask to die with the launcher")


class Guarded(Protocol):
    """What :class:`ExitGuard` reads of a job: its abandoned groups (``_graveyard``, true while
    any holds pending work) and its replica group (``_group``, closed after a clean finish)."""

    _graveyard: Any
    _group: Any


class ExitGuard:
    """Keeps an abandoned Gloo group from turning a finished run into a crash at exit.

    A group abandoned while a peer hung may still hold pending work; destroying it at interpreter
    exit can abort the process, and so can a wait left behind on a helper thread that returns
    during the teardown (:mod:`unbroken.worker.blocking_waits`). If any such group or wait exists
    at exit, the process ends with ``os._exit`` after flushing, with status 1 if an exception
    escaped, else 0. After a clean finish, a replica group's own process groups are destroyed
    while the interpreter is still whole: left to its teardown, Gloo's worker threads can release
    tensors once Python is gone, and the process aborts ("terminate called without an active
    exception", SIGABRT).
    """

    jobs: list[Guarded] = []
    finished = False
    crashed = False
    _installed = False

    @classmethod
    def install(cls, job: Guarded) -> None:
        cls.jobs.append(job)
        if cls._installed:
            return
        cls._installed = True
        previous = sys.excepthook

        def hook(*args: Any) -> None:
            cls.crashed = True
            if isinstance(args[1], JobCannotGoOn):  # an outcome the coordinator decided: one line
                print(f"unbroken: {args[1]}", file=sys.stderr, flush=True)
                return
            previous(*args)

        sys.excepthook = hook
        atexit.register(cls._at_exit)

    @classmethod
    def _at_exit(cls) -> None:
        if any(job._graveyard for job in cls.jobs) or blocking_waits.in_flight():
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            # A script that exits with sys.exit(n) after an unfinished job must not look like
            # success; the exact status of such an exit is not known here.
            os._exit(1 if cls.crashed or not cls.finished else 0)
        if cls.finished and not cls.crashed:
            for job in cls.jobs:
                if job._group is not None:
                    job._group.close()
