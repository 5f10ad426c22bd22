"""Parallel connections for one healing transfer.

One TCP connection between two processes moves data at what one kernel thread on each side can
copy; two connections, each served by its own Gloo I/O thread, move more, even on two cores:
``benchmarks/bench_heal.py`` healed the 1.2 GB state over two lanes in 0.60-0.66x the time of a
heal over one, 0.65-0.72x that of a Gloo broadcast of the same bytes. A heal therefore sends its large tensors' slices over
``lanes`` connections of a small Gloo group of two ranks (the source and its receiver) made for
the heal under the generation's store (through a store client of its own), slice ``j`` on lane
``j % lanes``, with about :data:`IN_FLIGHT_PER_LANE` slices in flight per lane. A state without
large tensors has no lanes. Header, manifest and packs of small tensors still go over the generation's
group.

The lane group costs a store connection, a round trip and one TCP connect per lane (1-2 ms); it
lives as long as the generation's group (kept in its ``side_groups``, released with it), so an
abandoned generation's graveyard keeps it until its works can no longer be pending, as it does
for the group itself. A receiver whose heal fails empties its ``into`` (warm memory a posted
receive may still write), so that memory never becomes its model's.
Only Gloo groups have lanes (NCCL has its own channels). The number is a setting,
``RuntimeSettings.heal_lanes`` (``UNBROKEN_HEAL_LANES``, default 2); 1 sends every slice over the
generation's group, as before lanes.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from unbroken.errors import GenerationFailed
from unbroken.worker.torch_groups import _device

IN_FLIGHT_PER_LANE = 2
"""Slices issued ahead on each lane, so that a lane never waits for the next slice to be posted."""
TAG_LANE = 16
"""Tag of lane 0; lane ``i`` uses ``TAG_LANE + i`` (Gloo picks a group's connection by tag)."""


def lanes_for(group: Any, wanted: int, plan: list[tuple]) -> int:
    """How many lanes a heal over ``group`` of the messages ``plan`` uses: ``wanted`` if ``group``
    is a Gloo generation group, ``wanted`` is more than one and some message is a large tensor's
    slice, else 0 (everything over ``group`` itself)."""
    if wanted <= 1 or getattr(group, "backend", None) != "gloo":
        return 0
    return wanted if any(message[0] == "slice" for message in plan) else 0


def _own_store(group: Any, prefix: str) -> Any:
    """The generation's store under ``prefix``, through a client of its own where the store is a
    TCPStore: making a group waits in the store for the peer's address, holding its client, and a
    peer that dies meanwhile must not hold up this member's next generation on the shared one."""
    base = group.base_store
    if isinstance(base, dist.TCPStore):
        base = dist.TCPStore(base.host, base.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=group.timeout))
        return dist.PrefixStore(group.store_prefix + prefix, base)
    return dist.PrefixStore(prefix, group.store)


@dataclass
class _Pending:
    work: Any
    buffer: torch.Tensor
    """The tensor the work reads or writes (kept alive until it completes)."""
    target: torch.Tensor | None = None
    """A receive's destination when ``buffer`` is a staging copy of it on the group's device."""


class Lanes:
    """``count`` connections between the two ends of one heal, ``src`` sending to ``dst`` (ranks
    of ``group``); built by both ends, watched like any wait on ``group``."""

    def __init__(self, group: Any, src: int, dst: int, count: int) -> None:
        self.group = group
        self.count = count
        self._rank = 0 if group.rank == src else 1
        # both ends have made the same lanes between them before in this generation (for
        # example a benchmark's repeated heals): each anew under a prefix of its own
        pair = (src, dst)
        prefix = f"lanes/{src}-{dst}/{sum(1 for made, _ in group.side_groups if made == pair)}/"

        def build() -> Any:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = datetime.timedelta(seconds=group.timeout)
            options._devices = [_device(group.store_host) for _ in range(count)]
            return dist.ProcessGroupGloo(_own_store(group, prefix), self._rank, 2, options)

        self._issued = 0  # slices issued so far: slice j goes on lane j % count
        self._in_flight: list[_Pending] = []  # oldest first
        self.pg = group.run_watched(build, "connecting the healing lanes")
        group.side_groups.append((pair, self.pg))

    def issue(self, tensor: torch.Tensor, progress: Callable[[], None]) -> int:
        """Issue ``tensor`` (a contiguous slice) as the next message on the lanes, then wait for the
        oldest ones beyond the window; returns the bytes of those that completed (``progress``
        called after each)."""
        self._in_flight.append(self._start(tensor, self._issued))
        self._issued += 1
        return self.drain(progress, keep=self.count * IN_FLIGHT_PER_LANE)

    def drain(self, progress: Callable[[], None], keep: int = 0) -> int:
        """Wait for the oldest slices in flight until ``keep`` are left; returns their bytes."""
        done = 0
        while len(self._in_flight) > keep:
            done += self._finish(self._in_flight.pop(0), "healing transfer (tensor, lane)")
            progress()
        return done

    def _start(self, tensor: torch.Tensor, index: int) -> _Pending:
        """Issue slice ``index`` (a contiguous tensor) on its lane: a send from the source, a
        receive on the other end. A tensor on another device goes through a copy on the group's."""
        tag = TAG_LANE + index % self.count
        staged = self.group.staged(tensor, sending=self._rank == 0)
        try:
            if self._rank == 0:
                return _Pending(self.group.track(self.pg.send([staged], 1, tag)), staged)
            return _Pending(self.group.track(self.pg.recv([staged], 0, tag)), staged, tensor if staged is not tensor else None)
        except Exception as exc:
            raise GenerationFailed(f"generation {self.group.number}: healing transfer (lane) failed to start: {exc}") from None

    def _finish(self, pending: _Pending, what: str) -> int:
        """Wait for ``pending``; returns its bytes."""
        self.group.wait(pending.work, what)
        if pending.target is not None:
            pending.target.copy_(pending.buffer)
        return pending.buffer.numel() * pending.buffer.element_size()
