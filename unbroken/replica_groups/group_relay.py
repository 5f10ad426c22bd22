"""The group relay: what process 0 of a replica group hears from the coordinator, passed on to
processes 1..K-1, and the group's liveness and progress, gathered for process 0.

In a replica group (see :mod:`unbroken.replica_groups.sharding`) only process 0 talks to the coordinator:
it joins and heartbeats for the whole group. Its K-1 peers still need

- every generation process 0 joins (the join reply), to build their own shard's cross-group
  process group of that generation, and every new heartbeat view, so that their cross-group
  collectives are abandoned as soon as the generation breaks (step 1 of the protocol);
- to count for the group's liveness and progress: a hang (SIGSTOP) or a crash of *any* process of
  the group must fail the whole group, which the launcher then stops and restarts as one.

:class:`GroupRelay` does this over a ``torch.distributed`` store that the caller provides (a
TCPStore hosted by the launcher or by process 0), under a key prefix per group *incarnation*
(:func:`relay_prefix`): a restarted group never reads what a dead incarnation wrote. Everything
crosses the store as JSON (join replies and views are JSON already); no pickle.

Liveness never compares clocks across processes (STYLE 3): each process bumps a tick counter in
the store, and an observer measures, on its own ``time.monotonic()``, how long ago it last *saw*
that counter change. :class:`GroupWatchdog` runs the ticks and ends its process when the peers it
watches (process 0 watches everyone, the others watch process 0) are silent for longer than
``peer_timeout``: the launcher, which stops and restarts a whole group when any of its processes
exits, then replaces the group. The exit status is :data:`EXIT_PEER_SILENT`.

No store operation here blocks on a missing key (counters are read with ``add(key, 0)``, records
only once ``check`` has seen them), so one thread's read never holds the store client while
another waits behind it. A store that stops answering (its host SIGSTOPped) blocks a read up to
the store's own timeout; the watchdog judges silence on a thread that does no store I/O, so such
a store still ends the process after ``peer_timeout``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from unbroken.errors import EXIT_PEER_SILENT  # defined beside the other exit statuses
from unbroken.replica_groups.relay_records import Relayed, RelayTimeout, relay_prefix  # offered here as before

log = logging.getLogger(__name__)

__all__ = [
    "EXIT_PEER_SILENT",
    "GroupRelay",
    "GroupWatchdog",
    "Relayed",
    "RelayTimeout",
    "relay_prefix",
]


@dataclass
class _Peer:
    """What one observer knows of one process of the group (local clock only)."""

    record: str | None = None  # the last "tick progress" read; None: never seen
    changed_at: float = 0.0  # when (observer's monotonic clock) the record was last seen to change
    progress: int = 0


class GroupRelay:
    """One process's end of its group's relay.

    Process 0 (the *leader*): :meth:`publish_generation`, :meth:`publish_view`,
    :meth:`group_progress`, :meth:`silent_peers`. Processes 1..K-1: :meth:`wait_generation`,
    :meth:`view`, :meth:`leader_silent`. Every process: :meth:`tick` (usually from a
    :class:`GroupWatchdog`). Methods are thread-safe; none blocks on a missing key.

    ``peer_timeout``: a watched process whose tick was not seen to change for this long is silent.
    ``start_timeout`` (default ``max(peer_timeout, 60)``): the same for a process never seen yet,
    counted from this relay's creation, since K processes importing torch on a busy machine start
    seconds apart. ``view_refresh``: :meth:`view` reads the store at most this often (it is cheap
    enough to call from ``abandoned()`` every few ms). ``clock``: injectable for tests.
    """

    def __init__(
        self,
        store: dist.Store,
        rank_in_group: int,
        group_size: int,
        *,
        prefix: str,
        peer_timeout: float,
        start_timeout: float | None = None,
        view_refresh: float = 0.015,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if group_size < 1 or not 0 <= rank_in_group < group_size:
            raise ValueError(f"rank in group {rank_in_group} is not in 0..{group_size - 1} (group size {group_size})")
        if not prefix:
            raise ValueError("prefix must name the group's incarnation (see relay_prefix)")
        if peer_timeout <= 0 or (start_timeout is not None and start_timeout <= 0) or view_refresh < 0:
            raise ValueError(f"peer_timeout {peer_timeout}, start_timeout {start_timeout} must be positive, view_refresh {view_refresh} not negative")
        self.store = dist.PrefixStore(prefix, store)
        self.rank = rank_in_group
        self.size = group_size
        self.prefix = prefix
        self.peer_timeout = peer_timeout
        self.start_timeout = max(peer_timeout, 60.0) if start_timeout is None else start_timeout
        self.view_refresh = view_refresh
        self.clock = clock
        self._lock = threading.Lock()
        self._ticks = 0
        self._started = clock()
        self._peers = {r: _Peer(changed_at=self._started) for r in self.watched}
        self._present: set[int] = set()
        # group progress (leader): rounds completed, and each process's progress when the current round began
        self._rounds = 0
        self._round_base: dict[int, int] | None = None
        self._published = {"generation": 0, "view": 0}
        self._view = Relayed(0, {})
        self._view_read_at = -float("inf")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def watched(self) -> list[int]:
        """The processes whose silence this process judges: all others for the leader, the leader
        for the others (the leader's own exit then ends them)."""
        return [r for r in range(self.size) if r != self.rank] if self.leader else [0]

    def _require(self, leader: bool, what: str) -> None:
        if self.leader != leader:
            raise RuntimeError(f"{what} is for {'process 0' if leader else 'processes 1..K-1'} of a group, not process {self.rank}")

    # -- liveness and progress ---------------------------------------------------------------------

    def tick(self, progress: int) -> None:
        """Publish that this process lives, with its progress counter (micro-batches, collectives
        entered: whatever the runtime counts). One store write; call it every heartbeat interval."""
        with self._lock:
            self._ticks += 1
            ticks = self._ticks
        self.store.set(f"peer/{self.rank}", f"{ticks} {int(progress)}")

    def poll(self) -> None:
        """Read the records of every process of the group (one ``multi_get`` once all exist) and
        note which changed. A store error counts as no news: silence keeps growing."""
        try:
            with self._lock:
                missing = [r for r in range(self.size) if r not in self._present]
            for r in missing:
                if self.store.check([f"peer/{r}"]):
                    with self._lock:
                        self._present.add(r)
            with self._lock:
                ranks = sorted(self._present)
            values = self.store.multi_get([f"peer/{r}" for r in ranks]) if ranks else []
        except Exception as exc:  # a dead or stalled store host: judged by silence, not here
            log.debug("group relay %s: reading the peers failed: %s", self.prefix, exc)
            return
        now = self.clock()
        with self._lock:
            for r, raw in zip(ranks, values):
                record = raw.decode()
                peer = self._peers.setdefault(r, _Peer(changed_at=self._started))
                if record != peer.record:
                    peer.record, peer.changed_at = record, now
                    peer.progress = int(record.split()[1])

    def silences(self) -> dict[int, float]:
        """Watched process -> seconds since its record was last seen to change, as of the last
        :meth:`poll` (no store I/O: safe on a thread that must never block)."""
        now = self.clock()
        with self._lock:
            return {r: now - self._peers[r].changed_at for r in self.watched}

    def overdue(self) -> dict[int, float]:
        """The watched processes silent beyond their limit (``start_timeout`` for one never seen,
        else ``peer_timeout``), with their silence; no store I/O."""
        silences = self.silences()
        with self._lock:
            seen = {r for r in self.watched if self._peers[r].record is not None}
        return {r: s for r, s in silences.items() if s > (self.peer_timeout if r in seen else self.start_timeout)}

    def silent_peers(self) -> list[int]:
        """Leader: the processes of the group silent beyond their limit (reads the store first)."""
        self._require(True, "silent_peers")
        self.poll()
        return sorted(self.overdue())

    def leader_silent(self) -> bool:
        """Processes 1..K-1: whether process 0 is silent beyond its limit (reads the store first)."""
        self._require(False, "leader_silent")
        self.poll()
        return 0 in self.overdue()

    def group_progress(self) -> int:
        """Leader: the group's progress counter, for process 0's heartbeat to report.

        The rule: it counts *rounds*. A round begins with a snapshot of every process's progress
        counter (process 0's included) and ends at the first call that finds *every* counter
        changed since that snapshot; the count then grows by one and a new round begins. So it
        moves only while every process of the group moves, and stops (after at most the round in
        flight) when any one stops: a process stuck in user code or a device stalls the whole
        group's progress and the coordinator's progress watchdog fences the group. It grows at
        most once per call, so its pace is that of the caller (once per heartbeat)."""
        self._require(True, "group_progress")
        self.poll()
        with self._lock:
            if len(self._present) < self.size:
                return self._rounds  # a process that never ticked has made no progress
            # process 0's own counter too is read from the store (what it last ticked), like the others'
            current = {r: self._peers[r].progress for r in range(self.size)}
            if self._round_base is None:
                self._round_base = current
            elif all(current[r] != self._round_base[r] for r in range(self.size)):
                self._rounds += 1
                self._round_base = current
            return self._rounds

    # -- generations and views ---------------------------------------------------------------------

    def _publish(self, kind: str, value: dict[str, Any]) -> int:
        with self._lock:
            self._published[kind] += 1
            seq = self._published[kind]
        # the record first, then its counter: a reader that sees the counter finds the record
        self.store.set(kind, json.dumps({"seq": seq, "value": value}))
        self.store.add(f"{kind}/seq", 1)
        return seq

    def _read(self, kind: str, after: int) -> Relayed | None:
        """The newest record of ``kind`` if its seq is beyond ``after``, else None."""
        if self.store.add(f"{kind}/seq", 0) <= after:
            return None
        record = json.loads(self.store.get(kind))
        return Relayed(int(record["seq"]), record["value"])

    def publish_generation(self, reply: dict[str, Any]) -> int:
        """Leader: relay the reply of a join that formed a generation; returns its seq."""
        self._require(True, "publish_generation")
        return self._publish("generation", reply)

    def wait_generation(self, after: int, timeout: float, poll: float = 0.01) -> Relayed:
        """Processes 1..K-1: the newest generation process 0 published with seq beyond ``after``
        (the seq of the last one this process used; 0 at start), waiting up to ``timeout``
        seconds. Older ones it skipped are dead already (a newer one formed). Raises
        :class:`RelayTimeout` if none came."""
        self._require(False, "wait_generation")
        deadline = time.monotonic() + timeout
        while True:
            found = self._read("generation", after)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                self.poll()
                silence = self.silences().get(0, 0.0)
                raise RelayTimeout(
                    f"process {self.rank} of group {self.prefix!r}: process 0 published no generation after #{after}"
                    f" within {timeout:.1f} s (process 0 last seen ticking {silence:.1f} s ago)"
                )
            time.sleep(poll)

    def publish_view(self, view: dict[str, Any]) -> int:
        """Leader: relay a new heartbeat view (call it from the heartbeat's ``on_change``)."""
        self._require(True, "publish_view")
        seq = self._publish("view", view)
        with self._lock:
            self._view = Relayed(seq, view)
        return seq

    def view(self) -> dict[str, Any]:
        """The newest view process 0 published ({} before the first). Reads the store at most
        every ``view_refresh`` seconds, else answers from a cache; a store error keeps the
        cached view (the watchdog judges a silent leader). Do not mutate the result."""
        return self.relayed_view().value

    def relayed_view(self) -> Relayed:
        """:meth:`view` with its seq (0 before the first)."""
        now = self.clock()
        with self._lock:
            cached, fresh = self._view, now - self._view_read_at < self.view_refresh
        if fresh or self.leader:
            return cached
        try:
            found = self._read("view", cached.seq)
        except Exception as exc:
            log.debug("group relay %s: reading the view failed: %s", self.prefix, exc)
            found = None
        with self._lock:
            self._view_read_at = now
            if found is not None and found.seq > self._view.seq:
                self._view = found
            return self._view


class GroupWatchdog:
    """Ticks the relay and ends this process when a watched process of its group falls silent.

    Two daemon threads: the *ticker* calls ``relay.tick(progress())`` and ``relay.poll()`` every
    ``interval`` (and, in processes 1..K-1 given ``on_view``, reads the view every
    ``relay.view_refresh`` and calls ``on_view(view)`` on each new one, e.g. to set the
    generation group's ``wake`` event); the *judge* does no store I/O, so a store that stops
    answering cannot stop it: every ``check_every`` seconds it looks at
    :meth:`GroupRelay.overdue` and, if any watched process is overdue, calls ``on_silent(message)``
    once and stops. The default ``on_silent`` prints the message (which process, silent for how
    long) on stderr and ends the process with :data:`EXIT_PEER_SILENT` (``os._exit``: nothing of
    a hung group is worth a clean shutdown, and a Gloo group alive at exit could abort anyway)."""

    def __init__(
        self,
        relay: GroupRelay,
        progress: Callable[[], int],
        interval: float,
        *,
        on_silent: Callable[[str], None] | None = None,
        on_view: Callable[[dict[str, Any]], None] | None = None,
        check_every: float | None = None,
    ) -> None:
        if interval <= 0 or interval >= relay.peer_timeout:
            raise ValueError(f"the tick interval ({interval} s) must be positive and below the peer timeout ({relay.peer_timeout} s)")
        self.relay = relay
        self.progress = progress
        self.interval = interval
        self.on_silent = on_silent or _exit_silent
        self.on_view = on_view if not relay.leader else None
        self.check_every = check_every if check_every is not None else min(interval, relay.peer_timeout / 4)
        self.fired: str | None = None
        """The message ``on_silent`` was called with, once it was."""
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._tick_loop, name="unbroken-relay-tick", daemon=True),
            threading.Thread(target=self._judge_loop, name="unbroken-relay-judge", daemon=True),
        ]

    def start(self) -> "GroupWatchdog":
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop both threads (a finished process must not be taken for a silent peer's victim),
        and wait for them, at most the peer timeout: a store call still in flight at interpreter
        exit would abort the process (see :mod:`unbroken.worker.blocking_waits`)."""
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(self.relay.peer_timeout)

    def _tick_loop(self) -> None:
        period = min(self.interval, self.relay.view_refresh) if self.on_view else self.interval
        next_tick = 0.0
        seen = 0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_tick:
                    self.relay.tick(self.progress())
                    self.relay.poll()
                    next_tick = time.monotonic() + self.interval
                if self.on_view is not None:
                    view = self.relay.relayed_view()
                    if view.seq > seen:
                        seen = view.seq
                        self.on_view(view.value)
            except Exception as exc:  # the judge decides what a store that fails means
                log.debug("group relay %s: tick failed: %s", self.relay.prefix, exc)
                # a dead store host fails every call, each raising torch's error with a C++ stack
                # (built holding the GIL): back off, so that the judge and the training thread run
                self._stop.wait(max(period, self.relay.peer_timeout / 4))
                continue
            self._stop.wait(period)

    def _judge_loop(self) -> None:
        while not self._stop.wait(self.check_every):
            overdue = self.relay.overdue()
            if overdue:
                rank, silence = max(overdue.items(), key=lambda item: item[1])
                who = "process 0 (the group's leader)" if rank == 0 else f"process {rank}"
                self.fired = (
                    f"unbroken: group relay {self.relay.prefix}: process {self.relay.rank}: {who} silent for"
                    f" {silence:.1f} s (peer timeout {self.relay.peer_timeout:.1f} s); ending this process so that the"
                    " group is restarted"
                )
                self._stop.set()
                self.on_silent(self.fired)
                return


def _exit_silent(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_SILENT)
