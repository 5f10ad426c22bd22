"""Whether a generation still holds for this member: its lease on the coordinator's replies, the
grace after it, and the verdicts the coordinator's view carries (step 1 of the protocol, "No stale
writes").

Decisions over what the member heard, given as arguments: how long ago the newest answered
request was sent, and the view it brought. Kept apart from the joiner
(:mod:`unbroken.worker.joining`), which holds the heartbeat and the view these read.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

log = logging.getLogger("unbroken.worker.runtime")  # moved out of the runtime; its messages keep their logger


def silence(heartbeat: Any, join_answered: float) -> float:
    """Seconds since the sending of the newest heartbeat (or join, answered at ``join_answered``)
    whose reply this member has taken in (0 without a ``heartbeat``: in processes 1..K-1 of a
    replica group, whose watchdog judges process 0's silence). Other answered requests (a
    roster's) renew nothing: their replies carry no verdict, and a lease renewed without the news
    would let a stale view commit."""
    if heartbeat is None:
        return 0.0
    return time.monotonic() - max(heartbeat.answered, join_answered)


def abandon_reason(
    number: int,
    silent: float,
    view: dict[str, Any],
    incarnation: str | None,
    lease: float,
    grace: float,
    for_commit: bool = False,
) -> str | None:
    """Why generation ``number`` no longer holds for this member, or None if it does.

    ``silent`` is the seconds since the sending of the newest request whose reply was taken in
    (read before ``view``: a lease this fresh comes with a view at least as new), ``incarnation``
    the coordinator's that formed the current generation. A lease that ran out forbids a commit
    (``for_commit``) but ends the generation only ``grace`` later: a stalled coordinator has
    declared nobody dead meanwhile, and a member that was declared dead hears so as soon as the
    coordinator answers."""
    if silent > lease + grace or (for_commit and silent > lease):
        return f"no reply from the coordinator for {silent:.1f} s (lease {lease:.1f} s)"
    if view.get("state") == "dead":
        return "the coordinator declared this member dead"
    # A restarted coordinator (or a new leader) has another incarnation and does not know
    # this member. An "unknown" from the incarnation that formed this generation only means a
    # heartbeat sent before this member joined was answered late: not a reason to leave.
    current_incarnation = view.get("incarnation")
    if incarnation is not None and current_incarnation is not None and current_incarnation != incarnation:
        return f"the coordinator restarted (incarnation {current_incarnation}; generation {number} was formed by {incarnation})"
    current = view.get("generation", 0)
    if current > number:
        return f"generation {current} has formed"
    if current == number and view.get("broken") and not for_commit:
        return "a member of this generation failed"
    return None


def hold_commit(
    silence: Callable[[], float],
    abandoned: Callable[[], str | None],
    lease: float,
    grace: float,
    member_id: str,
    next_step: int,
) -> None:
    """Hold step ``next_step``'s commit while the lease has run out but not its grace, until the
    coordinator answers a newer request (``silence()`` back within ``lease``), the generation is
    ``abandoned()`` (a reason, not None), or the grace runs out: a coordinator that stalled for a
    second or two costs a pause here, not a re-formation of the whole job."""
    held = None
    while True:
        silent = silence()
        if silent <= lease or silent > lease + grace:
            break
        if abandoned() is not None:
            break
        if held is None:
            held = time.monotonic()
            log.warning("%s: no reply from the coordinator for %.1f s: holding step %d until it answers",
                        member_id, silent, next_step)
        time.sleep(0.01)
    if held is not None and silence() <= lease:
        log.warning("%s: the coordinator answered again after %.2f s; committing", member_id, time.monotonic() - held)
