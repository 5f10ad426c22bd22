"""A fresh process joining a running job: what it does before it asks to join, while the others
still train without waiting for it.

It warms its optimizer state and tensors like its parameters, so that its heal lands in warm memory
(:func:`warm_before_joining`, :mod:`unbroken.worker.warm_state`), and opens a port for a donor to
stream the state to, so that it catches up instead of being healed (:func:`start_catch_up`,
:mod:`unbroken.worker.catch_up`). Both only when the heartbeat says a generation is running. The
joiner (:mod:`unbroken.worker.joining`) decides whether this process is such a newcomer and passes
in what these use.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any, Callable, ContextManager

log = logging.getLogger("unbroken.worker.runtime")  # moved out of the runtime; its messages keep their logger


def warm_before_joining(
    heartbeat: Any, optimizer: Any, model: Any, busy: Callable[[str], ContextManager[None]], member_id: str,
) -> dict[Any, Any] | None:
    """Allocate and touch ``optimizer``'s state and tensors like ``model``'s parameters now, marked
    ``busy`` on the ``heartbeat``, if its view (waited for up to a second: the first reply comes at
    once) shows a running generation; the tensors by place in the state
    (:func:`~unbroken.worker.warm_state.warm_optimizer`, :func:`~unbroken.worker.warm_state.warm_model`), or None."""
    deadline = time.monotonic() + 1.0  # the heartbeat's first reply comes at once
    while not heartbeat.view and time.monotonic() < deadline:
        time.sleep(0.01)
    if heartbeat.view.get("generation", 0) <= 0 or heartbeat.view.get("finished"):
        return None
    from unbroken.worker.warm_state import warm_model, warm_optimizer

    started = time.monotonic()
    with busy("warming the state's memory for the heal"):
        warm = {**warm_optimizer(optimizer), **warm_model(model)}
    if warm:
        log.info("%s: optimizer state and parameters warmed for the heal in %.2f s (%d tensors)", member_id,
                 time.monotonic() - started, len(warm))
    return warm


def start_catch_up(open_catch_up: Callable[[str], Any], heartbeat: Any, coordinator: str, member_id: str) -> Any:
    """Open a port for a donor on this host's address towards the ``coordinator``
    (``open_catch_up(address)``, a :class:`~unbroken.worker.catch_up.CatchUp`), if the
    ``heartbeat``'s view shows a running generation; None otherwise or if no port can be opened."""
    if heartbeat.view.get("generation", 0) <= 0 or heartbeat.view.get("finished"):
        return None
    try:
        return open_catch_up(local_address(coordinator))
    except OSError as exc:
        log.info("%s: cannot open a port to catch up (%s); healed as usual", member_id, exc)
        return None


def local_address(coordinator: str) -> str:
    """This host's address on the route to the coordinator (a donor reaches it there)."""
    host, port = coordinator.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host.strip("[]"), int(port)))
        return probe.getsockname()[0]


def replay_unverified(job: Any, client: Any, reason: str, loop_not_replayable: bool) -> None:
    """The catch-up's replay could not be checked against the donor (DESIGN: Fast paths): the
    member counts as fresh, so the heal copies the whole state from a peer; if no peer holds live
    state, it never becomes a source (:meth:`~unbroken.worker.healer.Healer.heal`). A replay whose
    digest differed at a step boundary turns catch-up off for the job."""
    from unbroken.worker.coordinator_posts import tell

    job.fresh = True
    job._unverified = reason
    if not loop_not_replayable:
        log.info("%s: its catch-up is unverified (%s); the heal brings it up to date", job.member_id, reason)
        return
    tell(client, "/v1/catch_up_off", job.member_id, "that catch-ups must stop", reason=reason[:500])


def warm_for_joining(job: Any, group: Any, heartbeat: Any, busy: Callable[[str], ContextManager[None]]) -> None:
    """A fresh process joining a running job: allocate and touch its optimizer state now, while
    the others still train, so that its heal lands in warm memory (:func:`warm_before_joining`).
    Not at the job's start (no heal comes), nor in a replica group (sharded state)."""
    if not job.fresh or job._warm is not None or group is not None or heartbeat is None or job._sharded is not None:
        return  # (a sharded optimizer's state is received by parts, after the heal: resharding)
    job._warm = warm_before_joining(heartbeat, job.optimizer, job.model, busy, job.member_id)


def catch_up_for_joining(job: Any, group: Any, heartbeat: Any) -> Any:
    """A fresh process joining a running job: open a port for a donor and catch up from it while
    the others train (:mod:`unbroken.worker.catch_up`); None where that cannot be exact."""
    from unbroken.worker.catch_up import CatchUp, eligible

    if not job.fresh or group is not None or heartbeat is None or not eligible(job):
        return None
    return start_catch_up(lambda address: CatchUp(job, address, job._warm), heartbeat, job.settings.coordinator,
                          job.member_id)
