"""The records a group relay publishes, and where: :class:`Relayed` (a record and its sequence
number), :func:`relay_prefix` (the store prefix of one incarnation of a group) and
:class:`RelayTimeout` (no newer record came in time).

Kept apart from :mod:`unbroken.replica_groups.group_relay`, which publishes and reads these over
the store and watches the group's liveness with them; that module offers these names too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unbroken.errors import UnbrokenError

__all__ = ["Relayed", "RelayTimeout", "relay_prefix"]


class RelayTimeout(UnbrokenError):
    """Process 0 of the group published nothing new within the time a peer waited for it."""


@dataclass(frozen=True)
class Relayed:
    """One published record: ``seq`` counts publications of its kind (1, 2, ...) within the
    incarnation, so a reader can ask for anything newer than what it has without relying on the
    coordinator's generation numbers (a restarted coordinator may start them again)."""

    seq: int
    value: dict[str, Any]


def relay_prefix(group: str, incarnation: int | str) -> str:
    """The store prefix of incarnation ``incarnation`` of group ``group`` (the launcher counts a
    group's starts; every start gets a new prefix, so stale keys of a dead one are never read)."""
    if not str(group) or "/" in str(group) or "/" in str(incarnation):
        raise ValueError(f"group name and incarnation must be non-empty and contain no '/': {group!r}, {incarnation!r}")
    return f"unbroken/relay/{group}/{incarnation}/"
