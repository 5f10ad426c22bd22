"""What the launcher says while the job waits for enough members: who joined, how many more
it needs, where the others must point, and how long until the wait fails (``--quorum-timeout``).

Without it a node started alone (``--nnodes 2`` on one host, a second node that never came)
waits in silence until the quorum timeout; with it the console says so every few seconds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unbroken.launch.launch_settings import LaunchSettings

EVERY = 5.0
"""Seconds between two lines while the wait lasts (the first comes after as long)."""


class QuorumWait:
    """Reads the coordinator's status; a line to print when the wait has lasted long enough."""

    def __init__(self, settings: "LaunchSettings", address: str, started: float) -> None:
        self.min_members, self.quorum_timeout = settings.min_members, settings.quorum_timeout
        self.start_grace, self.address = settings.start_grace, address
        self._since: float | None = None
        self._next = started + EVERY

    def note(self, status: dict[str, Any], now: float) -> str | None:
        """A line if the job has fewer live members than it needs and a line is due, else None."""
        if status.get("finished") or status.get("failed"):
            return None
        live = [m for m in status.get("members", ()) if m.get("state") not in ("dead", "left")]
        if len(live) >= self.min_members:
            self._since = None
            return None
        if self._since is None:
            # as the coordinator counts: before the first generation, after the start grace
            first = not status.get("generation")
            self._since = now + (self.start_grace if first else 0.0)
        left = self.quorum_timeout - (now - self._since)
        if now < self._next or left <= 0:  # past the timeout the coordinator's verdict comes next
            return None
        self._next = now + EVERY
        nodes = sorted({str(m.get("member", "")).split(".w")[0] for m in live})
        joined = f"{len(live)} joined" + (f" (node {', '.join(nodes)})" if nodes else "")
        return (f"waiting for members: the job needs {self.min_members}, {joined}; start the other nodes with"
                f" --rdzv-endpoint {self.address} (the job fails if still short in {left:.0f} s:"
                f" --start-grace and --quorum-timeout)")
