"""The coordinator's long polls, for :class:`~unbroken.coordinator.server.Coordinator`: a ``join`` or
``heartbeat`` waits until a change concerns its member (:meth:`LongPolls._wait_change`), and a
change wakes only the polls whose answer may have changed, for up to ``wake_slice`` seconds per
turn of the event loop. A mixin: the waiters and the state it reads are the coordinator's (set up in
its ``__init__``).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from unbroken.coordinator.membership import Membership
    from unbroken.coordinator.settings import CoordinatorSettings


GC_PAUSE_FROM = 1024
"""From this many polls to wake at once (a generation of thousands formed or broke), the cyclic
garbage collector waits until they are woken: a collection that falls in the middle (the answers
allocate, and count towards one) would hold every survivor's answer for as long as it walks the
heap (0.26 s at 16,384 members here). Nothing is lost: it runs once they are answered."""


class LongPolls:
    """Waiting for a change and waking the polls it concerns; see :meth:`_wake_changed`."""

    settings: CoordinatorSettings
    state: Membership
    incarnation: str
    _durable: int
    _waiters: dict[str, set[asyncio.Future]]
    _to_wake: collections.deque[asyncio.Future]
    _waking: bool
    _shared: tuple[Any, ...] | None
    _serving: Callable[[], bool]
    _collection_paused = False
    _deferred_lines: collections.deque[Any]

    def _wake_changed(self) -> None:
        """Wake the long polls whose answer may have changed: all of them if the view shared by
        every member changed (one wake-up each, however many changes came together), else only
        those of the members whose own state changed. O(woken polls), never O(N) per change."""
        shared = (self.state.shared_view(), self._durable, self._serving(), self.incarnation, id(self.state))
        changed = self.state.changed_members
        if shared != self._shared:
            self._shared = shared
            changed.clear()
            self._wake_all()
            return
        while changed:
            waiters = self._waiters.pop(changed.pop(), None)
            if waiters:
                self._to_wake.extend(waiters)
        self._schedule_wakes()

    def _wake_all(self) -> None:
        """Wake every long poll, so that each recomputes its answer."""
        waiters, self._waiters = self._waiters, {}
        for group in waiters.values():
            self._to_wake.extend(group)
        self._schedule_wakes()

    def _schedule_wakes(self) -> None:
        if self._to_wake and not self._waking:
            self._waking = True
            if len(self._to_wake) >= GC_PAUSE_FROM and gc.isenabled():
                gc.disable()
                self._collection_paused = True
            asyncio.get_running_loop().call_soon(self._wake_some)

    def _wake_some(self) -> None:
        """Wake polls for up to ``wake_slice`` seconds, then let the loop read new requests before
        the next slice: thousands of polls answered at once would otherwise hold the loop for as
        long as all their handlers take, and a request that arrives meanwhile would wait for all of
        them. A slice of time, not a count: what a poll's wake-up costs varies tenfold (a lean
        line's poll answers in place; aiohttp's handler runs as a task, its answer on a later turn)."""
        if self._for_a_slice(self._to_wake, _resolve):
            asyncio.get_running_loop().call_soon(self._wake_some)
        else:
            self._waking = False
            self._resume_collection()
            self._serve_deferred()

    def _defer_serving(self, line: Any) -> None:
        """Serve no request of ``line`` (a lean line whose held poll a wake-up just answered) until
        every poll of this wake-up is answered. What it sends next is its next heartbeat, which
        would only be held; served between slices, such heartbeats (one per poll answered)
        doubled the time until the last survivor heard of a re-formation (16,384 members: the
        last slice's polls waited 0.4-0.6 s behind the heartbeats of the slices before). The
        requests of other connections are served between slices as before."""
        line.defer_serving()
        self._deferred_lines.append(line)

    def _serve_deferred(self) -> None:
        """Serve the deferred lines again, oldest first, ``wake_slice`` seconds of them a turn."""
        if self._for_a_slice(self._deferred_lines, _serve_again):
            asyncio.get_running_loop().call_soon(self._serve_deferred)

    def _for_a_slice(self, queue: collections.deque[Any], act: Callable[[Any], None]) -> bool:
        """``act`` on the items of ``queue``, oldest first, for ``wake_slice`` seconds (at least a
        chunk of 64, the clock read once a chunk); True if some are left for the next turn."""
        end = time.monotonic() + self.settings.wake_slice
        while queue:
            for _ in range(min(64, len(queue))):
                act(queue.popleft())
            if time.monotonic() >= end:
                break
        return bool(queue)

    def _resume_collection(self) -> None:
        """Let the garbage collector run again if a wake-up paused it (at its end, or a stop)."""
        if self._collection_paused:
            self._collection_paused = False
            gc.enable()

    async def _wait_change(self, timeout: float, member_id: str = "") -> None:
        """Wait until a change concerns ``member_id`` (see :meth:`_wake_changed`), or ``timeout``."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        group = self._waiters.setdefault(member_id, set())
        group.add(waiter)
        timer = loop.call_later(max(timeout, 0.0), _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            group.discard(waiter)
            if not group and self._waiters.get(member_id) is group:
                del self._waiters[member_id]


def _serve_again(line: Any) -> None:
    line.serve_again()


def _resolve(waiter: Any) -> None:
    """Answer a waiting poll (a future, or a lean line's held poll), unless it already was."""
    if not waiter.done():
        waiter.set_result(None)
