"""One generation's process group, and waits on it that a coordinator verdict can cut short.

A collective that waits on a dead or stopped peer blocks until the group's timeout. Every
wait here is instead done in slices: it ends as soon as the work completes, the coordinator says
the generation is over (a verdict reached through the heartbeat thread), or the collective
timeout passes, whichever comes first. An abandoned NCCL group has its communicator aborted at
once (:meth:`GenerationGroup.abort`), which fails its pending work and frees its CUDA stream; the
next generation makes a fresh one. An abandoned Gloo group is never destroyed while work may be
pending on it (destroying it would block): it is parked in the :class:`Graveyard`, which releases
it (its sockets and threads) once its pending work has completed or can no longer be running.

Rendezvous: a Gloo group connects lazily (:data:`LAZY_CONNECT`). Building it costs one store
write per member; each member then connects only the pairs it uses, reading one peer's address
from the store per pair. :meth:`GenerationGroup.connect` connects this member's two ring
neighbours (the pairs of every allreduce) before it returns, so that a peer that dies later is
seen by the survivors' sockets at once, as with a full mesh. A full mesh (the default of torch)
costs every member a read of every other member's record: N^2 store round trips per
generation, and N-1 sockets per member (docs/guide/scale.md, "Rendezvous").
The torch groups themselves are made in :mod:`unbroken.worker.torch_groups`, with the backend
and device of :mod:`unbroken.worker.transport`.

Waits that must tolerate a peer's long deliberate work (a final checkpoint write, reading a
checkpoint to resume from) use flags in the generation's store instead of a collective: such a
wait ends when the flag is set or the generation is abandoned, never by a collective timeout.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from unbroken.errors import GenerationFailed
from unbroken.worker.blocking_waits import PENDING, call_in_thread, wait_briefly, wait_in_thread
from unbroken.worker.nccl import abort as abort_nccl
from unbroken.worker.nccl import nccl_environment, prepare_environment  # noqa: F401 - nccl_environment: its old home
from unbroken.worker.torch_groups import _connect_ring, _device, _nccl_group
from unbroken.worker.transport import Transport, current_transport, set_transport  # noqa: F401 - set_transport: its old home


NCCL_POLL = 0.001
"""Seconds between two looks at an NCCL work's completion (its future cannot wake the wait)."""

LAZY_CONNECT = os.environ.get("UNBROKEN_GLOO_FULL_MESH", "") in ("", "0")
"""Gloo groups connect their pairs on first use (``lazy_init`` of the Gloo device, what
``TORCH_GLOO_LAZY_INIT`` sets for torch's own groups) rather than as a full mesh while being
built. ``UNBROKEN_GLOO_FULL_MESH=1`` in a worker's environment restores the full mesh."""


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
        transport: Transport | None = None,
    ) -> None:
        transport = transport or current_transport()
        self.backend = transport.backend
        self.device = transport.device
        """Where point-to-point messages and small collectives go: CPU (Gloo) or the GPU (NCCL)."""
        self.aborted = False
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
        self.store: Any = None
        self.store_host = ""
        self.base_store: Any = None
        """The store the group was made under (``store`` is it under this generation's prefix,
        ``store_prefix``)."""
        self.store_prefix = ""
        self.works: list[Any] = []
        """Collectives issued on this group that may still be pending (completed ones are pruned)."""
        self.side_groups: list[tuple[Any, Any]] = []
        """(purpose, group) of groups made within this generation for one purpose (a heal's
        lanes): they live as long as this one, so that they are released with it, once nothing
        can be pending on them."""
        self.script: Any = None
        """This member's :class:`~unbroken.worker.script_collectives.ScriptCollectives` in this
        generation, made when the script's first collective inside a step comes."""
        self.also_check: Callable[[], None] | None = None
        """Called after each idle slice of a wait (a second without news): a step's gradient
        exchange says there how many collectives of its own the script made (it may raise)."""

    # -- construction --------------------------------------------------------------------------

    def connect(self, store: dist.Store, prefix: str, store_host: str) -> None:
        """Build the group on a helper thread, watched like a wait: a Gloo group (lazily
        connecting, then its ring neighbours connected; or a full mesh, see :data:`LAZY_CONNECT`),
        or an NCCL group (whose communicator is made by its first collective, also watched)."""
        self.store_host, self.base_store, self.store_prefix = store_host, store, prefix
        result: list[Any] = []
        if self.backend == "nccl":
            prepare_environment(self.timeout)  # read by torch when the group is made (the Job set it already)

        made: list[Any] = []  # an NCCL group as soon as it exists, to abort if its first collective hangs
        ring: list[Any] = []  # a lazy Gloo group as soon as it exists, then the works connecting its ring

        def build() -> None:
            try:
                if self.backend == "nccl":
                    pg = _nccl_group(dist.PrefixStore(prefix, store), self.rank, self.size, self.timeout, self.device)
                    made.append(pg)
                    # NCCL makes its communicator at the first collective, which blocks until every
                    # rank arrives: do it here, watched, rather than in the first real wait.
                    pg.allreduce([torch.zeros(1, device=self.device)]).wait()
                    result.append(pg)
                    self._wake.set()
                    return
                options = dist.ProcessGroupGloo._Options()
                options._timeout = datetime.timedelta(seconds=self.timeout)
                options._devices = [_device(store_host, lazy=LAZY_CONNECT)]
                pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), self.rank, self.size, options)
                if LAZY_CONNECT:
                    ring.append(pg)
                    ring.extend(_connect_ring(pg, self.rank, self.size))
                    for work in ring[1:]:
                        work.wait()
                result.append(pg)
            except BaseException as exc:
                result.append(exc)
            self._wake.set()

        thread = threading.Thread(target=build, name=f"unbroken-connect-g{self.number}", daemon=True)
        thread.start()
        try:
            self._watch(lambda: bool(result), "connecting the process group")
        except GenerationFailed:
            if made:  # a peer never arrived: free the half-made communicator (and the helper thread)
                self.aborted = True
                abort_nccl(made[0], self.device)
            if ring:  # a neighbour never connected: let the group be parked with its pending works
                self.pg, self.works = ring[0], list(ring[1:])
            raise
        if isinstance(result[0], BaseException):
            if ring:
                self.pg, self.works = ring[0], list(ring[1:])
            raise GenerationFailed(f"generation {self.number}: connect failed: {result[0]}")
        self.pg = result[0]
        self.store = dist.PrefixStore(prefix, store)

    # -- waits ---------------------------------------------------------------------------------

    def _watch(self, done: Callable[[], bool], what: str, poll: float = 1.0) -> None:
        if done():
            return
        self._waits += 1
        self._blocked(f"g{self.number}:{self._waits}:{what}")  # for the coordinator's progress watchdog
        try:
            self._watch_loop(done, what, poll=poll)
        except GenerationFailed:
            # An NCCL collective that waits on a dead peer never ends by itself and keeps its
            # CUDA stream blocked: abort the communicator so that the stream and every pending
            # work are released. (Gloo's are left to fail by their own timeout, in the graveyard.)
            self.abort()
            raise
        finally:
            self._blocked(None)

    def abort(self) -> None:
        """NCCL: abort this generation's communicator (ncclCommAbort); every pending collective
        fails and the group cannot be used again. Gloo: nothing (see :class:`Graveyard`)."""
        if self.backend != "nccl" or self.pg is None or self.aborted:
            return
        self.aborted = True
        abort_nccl(self.pg, self.device)

    def _watch_loop(self, done: Callable[[], bool], what: str, bounded: bool = True, poll: float = 1.0) -> None:
        deadline = time.monotonic() + self.timeout if bounded else float("inf")
        while True:
            if done():
                return
            reason = self._abandoned()
            if reason:
                raise GenerationFailed(f"generation {self.number}: {what} abandoned: {reason}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GenerationFailed(f"generation {self.number}: {what} timed out after {self.timeout:.1f} s")
            woken = self._wake.wait(min(remaining, poll))
            self._wake.clear()
            if not woken and self.also_check is not None:
                self.also_check()

    # -- flags: waits that tolerate a peer's long deliberate work --------------------------------

    def set_flag(self, name: str) -> None:
        """Set a flag in this generation's store (seen by :meth:`wait_flag` on every member)."""
        try:
            self.store.set(f"flag/{name}", b"1")
        except Exception as exc:  # the store's errors are bare RuntimeErrors
            raise GenerationFailed(f"generation {self.number}: cannot set {name}: {exc}") from None

    def wait_flag(self, name: str, what: str) -> None:
        """Wait until a peer sets flag ``name``, or the generation is abandoned (no timeout: the
        peer's liveness is the coordinator's to judge, from its heartbeats)."""
        key = f"flag/{name}"

        def done() -> bool:
            try:
                return bool(self.store.check([key]))
            except Exception as exc:
                raise GenerationFailed(f"generation {self.number}: {what}: store unreachable: {exc}") from None

        self.watch_unbounded(done, what, poll=0.1)

    def watch_unbounded(self, done: Callable[[], bool], what: str, poll: float) -> None:
        """Wait until ``done()``, marked as waiting for a peer, with no timeout (raises
        :class:`GenerationFailed` if the generation is abandoned meanwhile)."""
        if done():
            return
        self._waits += 1
        self._blocked(f"g{self.number}:{self._waits}:{what}")
        try:
            self._watch_loop(done, what, bounded=False, poll=poll)
        finally:
            self._blocked(None)

    def all_arrive(self, name: str, timeout: float) -> bool:
        """Count this member in at barrier ``name`` of the generation's store and wait, at most
        ``timeout`` seconds, for every member to be counted in: True if all were, False after
        the timeout, if the generation was abandoned, or if the store failed. No collective: a
        peer that is not coming waits in a collective of its own, which this must not mismatch."""
        key = f"arrive/{name}"
        try:
            self.store.add(key, 1)
            deadline = time.monotonic() + timeout
            while self.store.add(key, 0) < self.size:
                if time.monotonic() > deadline or self._abandoned():
                    return False
                time.sleep(0.02)
        except Exception:  # noqa: BLE001 - the store's errors are bare RuntimeErrors
            return False
        return True

    def _issued(self, work: Any) -> Any:
        self.works = [w for w in self.works if not _completed(w)]
        self.works.append(work)
        return work

    track = _issued
    """Count a work issued on one of :attr:`side_groups` as this group's (returns it)."""

    def run_watched(self, call: Callable[[], Any], what: str) -> Any:
        """``call()`` (a blocking call such as making a group) on a helper thread, watched like a
        wait; returns its result. Raises :class:`GenerationFailed` if it raises, or if the
        generation is abandoned or times out first (the thread is then left to end by itself,
        counted by :func:`~unbroken.worker.blocking_waits.in_flight` until it does)."""
        result: list[Any] = []

        def run() -> None:
            try:
                result.append(call())
            except BaseException as exc:  # noqa: BLE001 - reported to the waiting thread
                result.append(exc)
            self._wake.set()

        call_in_thread(run, f"unbroken-g{self.number}-{what}")
        self._watch(lambda: bool(result), what)
        if isinstance(result[0], BaseException):
            raise GenerationFailed(f"generation {self.number}: {what} failed: {result[0]}") from None
        return result[0]

    def idle(self) -> bool:
        """True when no collective issued on this group can still be pending."""
        self.works = [w for w in self.works if not _completed(w)]
        return not self.works

    def wait(self, work: Any, what: str) -> None:
        """Wait for a collective's work; raises :class:`GenerationFailed` if it fails or is abandoned.

        NCCL: a work's future completes when the collective is enqueued, not when the GPU has run
        it, so the wait polls ``is_completed()`` (true once the GPU finished or the work failed),
        watching the verdict and the timeout meanwhile, and only then calls ``wait()``, which
        raises if the work failed: no host sync ever blocks on a collective that may never end."""
        if self.backend == "nccl":
            self._watch(lambda: _completed(work), what, poll=NCCL_POLL)
            try:
                work.wait()
                error = None
            except Exception as exc:
                error = str(exc)
            if error is not None:
                self.abort()
                raise GenerationFailed(f"generation {self.number}: {what} failed: {error}") from None
            return
        try:
            future = work.get_future()
        except RuntimeError:
            future = None
        if future is not None:
            future.add_done_callback(lambda _: self._wake.set())
            error = PENDING if self._abandoned() else wait_briefly(work, future)
            if error is PENDING:
                self._watch(future.done, what)
                error = None
                try:
                    work.wait()
                except Exception as exc:
                    # Only the text: an exception object would tie this frame (and the work, which
                    # holds the group's sockets) into a reference cycle that only the GC can free.
                    error = str(exc)
        else:
            # Gloo's send/recv have no future and report completion only through a blocking
            # wait(): do that on a helper thread, which is left behind if the wait is abandoned.
            outcome = wait_in_thread(work, self._wake.set)
            self._watch(lambda: bool(outcome), what)
            error = outcome[0]
        if error is not None:
            self.abort()  # NCCL: a failed collective leaves its communicator unusable
            raise GenerationFailed(f"generation {self.number}: {what} failed: {error}") from None

    # -- collectives ---------------------------------------------------------------------------

    def start_allreduce(self, tensor: torch.Tensor) -> Any:
        """Issue a sum allreduce without waiting; the caller waits with :meth:`wait`."""
        return self._issued(self.pg.allreduce([tensor]))

    def allreduce(self, tensor: torch.Tensor, what: str) -> None:
        try:
            work = self.start_allreduce(tensor)
        except Exception as exc:
            raise GenerationFailed(f"generation {self.number}: {what} failed to start: {exc}") from None
        self.wait(work, what)

    def allgather_rows(self, row: torch.Tensor, what: str) -> torch.Tensor:
        """Every member's ``row`` (a 1-D tensor of equal length), as a CPU matrix indexed by rank."""
        table = torch.zeros(self.size, row.numel(), dtype=row.dtype, device=self.device)
        table[self.rank] = row.to(self.device)
        self.allreduce(table, what)
        return table.cpu()

    def staged(self, tensor: torch.Tensor, sending: bool) -> torch.Tensor:
        """``tensor`` itself if it is on this group's device, else a copy there (to send) or new
        memory there (to receive into, copied to ``tensor`` once the receive completed)."""
        if tensor.device == self.device:
            return tensor
        return tensor.to(self.device) if sending else torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str) -> None:
        """Send ``tensor`` (contiguous) to rank ``dst``; one on another device than this group's
        goes through a copy on it (a CUDA tensor over Gloo, a CPU tensor over NCCL)."""
        staged = self.staged(tensor, sending=True)
        try:
            work = self._issued(self.pg.send([staged], dst, tag))
        except Exception as exc:
            raise GenerationFailed(f"generation {self.number}: {what} failed to start: {exc}") from None
        self.wait(work, what)

    def recv(self, tensor: torch.Tensor, src: int, tag: int, what: str) -> None:
        """Receive into ``tensor`` (contiguous) from rank ``src``, through a copy on this group's
        device if ``tensor`` is on another."""
        staged = self.staged(tensor, sending=False)
        try:
            work = self._issued(self.pg.recv([staged], src, tag))
        except Exception as exc:
            raise GenerationFailed(f"generation {self.number}: {what} failed to start: {exc}") from None
        self.wait(work, what)
        if staged is not tensor:
            tensor.copy_(staged)


def _completed(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # a work whose group failed reports completion by raising
        return True
