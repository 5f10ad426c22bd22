"""Abandoned generations' groups, and whatever else references their backends, released on a
reaper thread once nothing can be pending on them (see :class:`Graveyard`)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unbroken.worker.group import GenerationGroup


class Graveyard:
    """Abandoned generations' groups, released once nothing can be pending on them.

    A group is released (its Python reference dropped, so that its sockets and threads go) when
    every collective issued on it has completed, or when enough time has passed that none can
    still be running: Gloo fails each pending collective after the group's timeout, and a
    group's collectives run one after another on its worker threads. Releasing happens on a
    reaper thread of its own, so that a destructor that has to wait never holds up training.
    """

    def __init__(self, poll: float = 0.25) -> None:
        self.poll = poll
        self._parked: list[tuple[GenerationGroup, float]] = []
        self._buried: list[Any] = []
        self._destroying = 0  # buried objects being dropped now (counted until they are gone)
        self._lock = threading.Lock()
        self._reaper: threading.Thread | None = None
        self.released = 0

    def park(self, group: GenerationGroup) -> None:
        if group.pg is None:
            return
        group.abort()  # NCCL: nothing of an abandoned generation may keep a CUDA stream blocked
        pending = max(1, len(group.works))
        with self._lock:
            self._parked.append((group, time.monotonic() + group.timeout * pending + 1.0))
            self._start_reaper()

    def bury(self, holder: Any) -> None:
        """Drop ``holder`` (an object that references a generation's backend, such as
        torch.distributed's default group of a past generation) on the reaper thread: if it holds
        the last reference, the backend is destroyed there, and that can wait on Gloo's threads
        for as long as a broken peer keeps them (20 s seen), which must not hold up a join."""
        with self._lock:
            self._buried.append(holder)
            self._start_reaper()

    def _start_reaper(self) -> None:
        if self._reaper is None or not self._reaper.is_alive():
            self._reaper = threading.Thread(target=self._reap, name="unbroken-graveyard", daemon=True)
            self._reaper.start()

    def __len__(self) -> int:
        with self._lock:
            return len(self._parked) + len(self._buried) + self._destroying

    def __bool__(self) -> bool:
        return len(self) > 0

    def _reap(self) -> None:
        while True:
            with self._lock:
                if not self._parked and not self._buried:
                    self._reaper = None
                    return
                parked = list(self._parked)
                buried, self._buried = self._buried, []
                self._destroying = len(buried)
            del buried[:]  # the last references of what was buried: destroyed here, not in a join
            with self._lock:
                self._destroying = 0
            now = time.monotonic()
            done = [(g, d) for g, d in parked if now >= d or g.idle()]
            for group, _ in done:
                group.works = []
                group.pg = None  # the last reference: the group is destroyed here
                group.side_groups = []  # a heal's lanes: their works were counted in group.works
                group.store = group.base_store = None
            if done:
                with self._lock:
                    self._parked = [p for p in self._parked if p not in done]
                    self.released += len(done)
            time.sleep(self.poll)
