"""One generation's process group, and waits on it that a coordinator verdict can cut short.

A Gloo collective that waits on a dead or stopped peer blocks until the group's timeout. Every
wait here is instead done in slices: it ends as soon as the work completes, the coordinator says
the generation is over (a verdict reached through the heartbeat thread), or the collective
timeout passes, whichever comes first. An abandoned group is never destroyed while work may be
pending on it (destroying it would block); it is parked until the process ends.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from unbroken.errors import GenerationFailed



def _device(store_host: str):
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        return dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0])
    try:
        if ipaddress.ip_address(store_host).is_loopback:
            return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    except ValueError:
        if store_host == "localhost":
            return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()


class GenerationGroup:
    """The process group of one generation, seen from one member."""

    def __init__(
        self,
        number: int,
        rank: int,
        size: int,
        members: list[str],
        abandoned: Callable[[], str | None],
        wake: threading.Event,
        timeout: float,
        blocked: Callable[[str | None], None] = lambda what: None,
    ) -> None:
        self.number = number
        self.rank = rank
        self.size = size
        self.members = members
        self.pg: Any = None
        self._abandoned = abandoned
        self._wake = wake
        self.timeout = timeout
        self._blocked = blocked
        self._waits = 0

    # -- construction --------------------------------------------------------------------------

    def connect(self, store: dist.Store, prefix: str, store_host: str) -> None:
        """Build the Gloo group (a full-mesh connect) on a helper thread, watched like a wait."""
        result: list[Any] = []

        def build() -> None:
            try:
                options = dist.ProcessGroupGloo._Options()
                options._timeout = datetime.timedelta(seconds=self.timeout)
                options._devices = [_device(store_host)]
                result.append(dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), self.rank, self.size, options))
            except BaseException as exc:
                result.append(exc)
            self._wake.set()

        thread = threading.Thread(target=build, name=f"unbroken-connect-g{self.number}", daemon=True)
        thread.start()
        self._watch(lambda: bool(result), "connecting the process group")
        if isinstance(result[0], BaseException):
            raise GenerationFailed(f"generation {self.number}: connect failed: {result[0]}")
        self.pg = result[0]

    # -- waits ---------------------------------------------------------------------------------

    def _watch(self, done: Callable[[], bool], what: str) -> None:
        if done():
            return
        self._waits += 1
        self._blocked(f"g{self.number}:{self._waits}:{what}")  # for the coordinator's progress watchdog
        try:
            self._watch_loop(done, what)
        finally:
            self._blocked(None)

    def _watch_loop(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            if done():
                return
            reason = self._abandoned()
            if reason:
                raise GenerationFailed(f"generation {self.number}: {what} abandoned: {reason}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GenerationFailed(f"generation {self.number}: {what} timed out after {self.timeout:.1f} s")
            self._wake.wait(min(remaining, 1.0))
            self._wake.clear()

    def wait(self, work: Any, what: str) -> None:
        """Wait for a collective's work; raises :class:`GenerationFailed` if it fails or is abandoned."""
        try:
            future = work.get_future()
        except RuntimeError:
            future = None
        if future is not None:
            future.add_done_callback(lambda _: self._wake.set())
            self._watch(future.done, what)
            error = None
            try:
                work.wait()
            except Exception as exc:
                error = exc
        else:
            # Gloo's send/recv have no future and report completion only through a blocking
            # wait(): do that on a helper thread, which is left behind if the wait is abandoned.
            outcome: list[BaseException | None] = []

            def blocking_wait() -> None:
                try:
                    work.wait()
                    outcome.append(None)
                except BaseException as exc:
                    outcome.append(exc)
                self._wake.set()

            threading.Thread(target=blocking_wait, name="unbroken-wait", daemon=True).start()
            self._watch(lambda: bool(outcome), what)
            error = outcome[0]
        if error is not None:
            raise GenerationFailed(f"generation {self.number}: {what} failed: {error}") from None

    # -- collectives ---------------------------------------------------------------------------

    def allreduce(self, tensor: torch.Tensor, what: str) -> None:
        try:
            work = self.pg.allreduce([tensor])
        except Exception as exc:
            raise GenerationFailed(f"generation {self.number}: {what} failed to start: {exc}") from None
        self.wait(work, what)

    def allgather_rows(self, row: torch.Tensor, what: str) -> torch.Tensor:
        """Every member's ``row`` (a 1-D tensor of equal length), as a matrix indexed by rank."""
        table = torch.zeros(self.size, row.numel(), dtype=row.dtype)
        table[self.rank] = row
        self.allreduce(table, what)
        return table

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str) -> None:
        try:
            work = self.pg.send([tensor], dst, tag)
        except Exception as exc:
            raise GenerationFailed(f"generation {self.number}: {what} failed to start: {exc}") from None
        self.wait(work, what)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, what: str) -> None:
        try:
            work = self.pg.recv([tensor], src, tag)
        except Exception as exc:
            raise GenerationFailed(f"generation {self.number}: {what} failed to start: {exc}") from None
        self.wait(work, what)
