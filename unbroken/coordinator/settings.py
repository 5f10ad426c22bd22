"""Where the coordinator listens and how long its long polls hold: a module of its own, so that
the request handlers and the leadership rounds read the settings without importing the server."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CoordinatorSettings:
    """Where the coordinator listens and how long its long polls hold."""

    host: str = "127.0.0.1"
    """Address to bind (use 0.0.0.0 to serve other hosts)."""
    port: int = 0
    """HTTP port; 0 picks a free one."""
    store_port: int = 0
    """Port of the TCPStore for process groups; 0 picks a free one."""
    advertise_host: str | None = None
    """Host name members use to reach the store; defaults to ``host`` (or this host's name)."""
    hold: float = 2.0
    """Longest time a long poll (join, heartbeat) is held before it is answered anyway."""
    check_interval: float = 0.1
    """How often heartbeat deadlines are checked (each check costs only the deadlines that came
    due, and the connections that no held poll watches)."""
    stall_excuse: float = 0.5
    """A deadline check that comes this many seconds late means the coordinator itself did not
    run: its verdicts for silence and lack of progress then wait as long again as it stalled."""
    wake_slice: float = 0.25
    """Seconds of one turn of the event loop spent waking long polls when a change concerns many
    (a generation formed or broke); then the loop reads the requests that came meanwhile, so none
    waits much longer than this; the lines a slice answered are not served until the last slice
    (their next heartbeat would only be held). Below ``stall_excuse``, so that a slice is never
    taken for the coordinator's own stall."""
    connection_sweep: float = 2.0
    """How often every member's heartbeat connection is checked for closing, as a backstop (O(N)
    per round, a share of it every ``check_interval``): the ones between polls are checked every
    ``check_interval``, and the current generation's 20 ms after a failure report."""
    token: str | None = None
    """Shared secret every request must carry (``Authorization: Bearer TOKEN``); None: none."""
    rejoin_grace: float = 0.5
    """A candidate that takes over the lead forms its first generation once every member of the
    last one has rejoined, or after this many seconds with those that did (a lost host's members
    never do). Live members look for the new leader every 0.1 s, so they rejoin well within it;
    one that is later joins the next generation."""
