"""What a process needs from torch's NCCL layer before its first NCCL group, and a bounded abort.

torch's defaults suit a job that dies with its first failure; unbroken's workers must outlive a
peer's. Before the first NCCL process group of a process (a generation's group, or the default
group that :func:`unbroken.group_mesh` builds for a replica group) :func:`prepare_environment`
sets, unless the user set them:

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly): when torch's watchdog sees a failed or
  timed-out collective it aborts the communicator and leaves the process alive. torch's default,
  3 (SkipCleanUp), and 1 (TearDown) end the process: a user's 1 or 3 is refused.
- ``TORCH_NCCL_ENABLE_MONITORING=0``: torch's heartbeat monitor ends the whole process when its
  watchdog thread looks stuck for ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` (480 s by default), which
  an aborted generation's communicator can cause minutes after the survivors moved on.
- ``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` and ``TORCH_NCCL_PROPAGATE_ERROR=0``: on a timeout, torch
  writes ``exception_dump`` (and ``remote_error``) into the group's store so that every rank
  dumps and dies; the store outlives generations, so a worker restarted on it would die the same
  way.
- ``TORCH_NCCL_USE_COMM_NONBLOCKING=1`` and ``TORCH_NCCL_NONBLOCKING_TIMEOUT``: communicators are
  made in NCCL's non-blocking mode, so that one whose peer never arrives can be aborted, and
  non-blocking calls give up after the collective timeout instead of 30 minutes (as torchft does).

A user's other contrary setting is kept, with a warning that says what it costs.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from unbroken.errors import ConfigError
from unbroken.worker.blocking_waits import call_in_thread

log = logging.getLogger("unbroken.worker.runtime")

ABORT_BOUND = 0.5
"""Seconds the caller waits for an abort before it goes on without it; the abort finishes in the
background, its thread holding the group until it returns. ``ncclCommAbort`` returns only once
the kernels queued before the aborted collectives have run (a long compute kernel: seconds, as an
H200 showed), and torch's abort of a communicator whose peer never arrived waits for its
initialisation to give up (``TORCH_NCCL_NONBLOCKING_TIMEOUT``). Waiting for either would add it
to the survivors' stall; the next generation's communicator is a fresh one and needs nothing from
the old."""

_REFUSED = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": ("1", "3")}
"""Values that would end a worker at its first failed collective: refused."""

_COSTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "torch will not abort a failed communicator; unbroken's own abort must",
    "TORCH_NCCL_ENABLE_MONITORING": "torch's heartbeat monitor may end a healthy worker minutes after a peer failed",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "a timeout writes exception_dump into the job's store, and every worker that sees it dumps and dies",
    "TORCH_NCCL_PROPAGATE_ERROR": "a failed collective is signalled through the job's store to every worker",
    "TORCH_NCCL_USE_COMM_NONBLOCKING": "a communicator whose peer never arrives blocks its thread and cannot be aborted",
}

_warned: set[str] = set()


def nccl_environment(timeout: float) -> dict[str, str]:
    """The torch NCCL settings unbroken needs, for a collective timeout of ``timeout`` seconds."""
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_PROPAGATE_ERROR": "0",
        "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
        "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(max(1, int(timeout))),
    }


def prepare_environment(timeout: float, environ: dict[str, str] | Any = None) -> list[str]:
    """Put :func:`nccl_environment` in place (before the first NCCL group: torch reads it when a
    group is made). A user's value that would end the worker at its first failure raises
    :class:`ConfigError`; any other contrary value is kept and warned about once. Returns the
    warnings."""
    environ = os.environ if environ is None else environ
    warnings = []
    for key, wanted in nccl_environment(timeout).items():
        given = environ.get(key)
        if given is None or given == wanted:
            environ[key] = wanted
            continue
        if given in _REFUSED.get(key, ()):
            raise ConfigError(
                f"{key}={given} makes torch end a worker at its first failed NCCL collective, which is what unbroken"
                f" exists to survive; unset it (unbroken sets {key}={wanted}: abort the communicator, keep the process)"
            )
        if key in _COSTS:
            warnings.append(f"{key}={given} is kept (unbroken would set {wanted}): {_COSTS[key]}")
    for warning in warnings:
        if warning not in _warned:
            _warned.add(warning)
            log.warning("%s", warning)
            print(f"unbroken: warning: {warning}", flush=True)
    return warnings


def abort(pg: Any, device: torch.device, bound: float | None = None) -> bool:
    """Abort an NCCL group's communicators (``abort``, else ``_abort``) on a thread of its own;
    True if that returned within ``bound`` seconds (default :data:`ABORT_BOUND`), else the abort
    goes on in the background (counted by :func:`unbroken.worker.blocking_waits.in_flight`, so
    that the process never tears down its interpreter under it). Never ``shutdown()``: on a broken
    communicator it waits for pending work that will never finish."""
    bound = ABORT_BOUND if bound is None else bound

    def run() -> None:
        for target in (pg, _backend_of(pg, device)):
            for name in ("abort", "_abort"):
                method = getattr(target, name, None) if target is not None else None
                if callable(method):
                    try:
                        method()
                        return
                    except Exception as exc:  # noqa: BLE001 - the next way may work
                        log.debug("NCCL %s failed: %s", name, exc)
        log.warning("this torch offers no abort for NCCL process groups; a broken communicator stays")

    if not call_in_thread(run, "unbroken-nccl-abort").wait(bound):
        log.info("an NCCL abort is still running after %.1f s; it finishes in the background", bound)
        return False
    return True


def _backend_of(pg: Any, device: torch.device) -> Any:
    try:
        return pg._get_backend(device)
    except Exception:  # noqa: BLE001 - a stand-in or an older torch
        return None
