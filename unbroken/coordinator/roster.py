"""Roster: a generation's member list, fetched from the coordinator only when it is needed.

A formed reply that listed every member, sent to each of N members, made a formation cost O(N^2)
bytes (19 MB at 1,000 members, 4.9 GB at 16,000). A member asks to join ``lean`` and learns only
its rank and the generation's size; the ids of its peers are needed only to name them in a log
line (healing) or a checkpoint's metadata, so :class:`Roster` fetches them from the coordinator's
``GET /v1/members`` on first use: one id at a time for the first few, then the whole list once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Iterator, overload

from unbroken.errors import UnbrokenError

log = logging.getLogger(__name__)

_SINGLES = 8
"""Ids fetched one by one before the whole list is fetched instead."""


class Roster(Sequence):
    """The members of generation ``number`` in rank order; ``len`` is known without a request.

    Reading an id may block for one request to the coordinator (``client``, a
    :class:`~unbroken.coordinator.client.CoordinatorClient`), bounded by its timeout. If the coordinator no
    longer knows the generation (it moved on, or restarted) the ids read ``rank<i>``: they only
    ever name members, they never decide anything.
    """

    def __init__(self, client: Any, number: int, size: int, me: str | None = None, rank: int | None = None) -> None:
        self._client = client
        self.number = number
        self._size = size
        self._all: list[str] | None = None
        self._known: dict[int, str] = {rank: me} if me is not None and rank is not None else {}

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return self._everyone()[index]
        if index < 0:
            index += self._size
        if not 0 <= index < self._size:
            raise IndexError(f"rank {index} is not in generation {self.number} of {self._size}")
        if self._all is not None:
            return self._all[index]
        if index not in self._known:
            if len(self._known) >= _SINGLES:
                return self._everyone()[index]
            self._known[index] = self._fetch_one(index)
        return self._known[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._everyone())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (Sequence, list, tuple)) and not isinstance(other, str) else NotImplemented

    def __repr__(self) -> str:
        return f"Roster(generation {self.number}, {self._size} members)"

    def _everyone(self) -> list[str]:
        if self._all is None:
            try:
                reply = self._client.request("GET", f"/v1/members?generation={self.number}")
                members = reply.get("members")
                if not isinstance(members, list) or len(members) != self._size:
                    raise UnbrokenError(f"unexpected member list {str(members)[:80]}")
                self._all = [str(m) for m in members]
            except UnbrokenError as exc:
                log.debug("member list of generation %d not available: %s", self.number, exc)
                self._all = [self._known.get(i, f"rank{i}") for i in range(self._size)]
        return self._all

    def _fetch_one(self, rank: int) -> str:
        try:
            reply = self._client.request("GET", f"/v1/members?generation={self.number}&rank={rank}")
            return str(reply["member"])
        except (UnbrokenError, KeyError) as exc:
            log.debug("member %d of generation %d not available: %s", rank, self.number, exc)
            return f"rank{rank}"
