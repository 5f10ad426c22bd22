"""This process's place in its replica group: the group's own process group, relay and watchdog.

Under ``unbroken run --group-size K`` a member of the job is a *replica group* of K processes that
shard one replica of the model with FSDP2 (see :mod:`unbroken.replica_groups.sharding`). The launcher starts
the K processes together, hosts a store for them and tells each its place
(``UNBROKEN_GROUP_SIZE``, ``UNBROKEN_RANK_IN_GROUP``, ``UNBROKEN_GROUP_STORE``,
``UNBROKEN_GROUP_PREFIX``, ``UNBROKEN_GROUP_TIMEOUT``). :func:`group_mesh` is what a script calls
before it builds its model: it makes the group torch.distributed's default process group (the one
FSDP shards over, which lives exactly as long as the group's processes) and returns its 1-D device
mesh. The :class:`GroupMember` it keeps then serves the runtime:

- process 0 is the coordinator's member; it relays every generation it joins and every view to
  processes 1..K-1 (:class:`~unbroken.replica_groups.group_relay.GroupRelay`);
- a :class:`~unbroken.replica_groups.group_relay.GroupWatchdog` ends a process whose group peer fell silent, and
  the launcher then restarts the whole group (fate sharing);
- :meth:`GroupMember.agree` is the group's vote before anything it must do as one: a generation
  is used, a step is committed, a checkpoint is written only if every process says so.

Run as a plain single process (no launcher), :func:`group_mesh` makes a group of one, so the same
script is its own reference.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from unbroken.errors import ConfigError

log = logging.getLogger(__name__)

CHECKPOINT_TIMEOUT = 3600.0
"""Seconds a process of a group waits in a sharded checkpoint's collectives for the others'
writes (a slow store's minutes, not the collective timeout of a step)."""

__all__ = ["GroupMember", "GroupSettings", "current", "group_mesh"]


@dataclass(frozen=True)
class GroupSettings:
    """Where this process sits in its replica group (set by ``unbroken run --group-size``)."""

    size: int = 1
    """Processes in each replica group (``UNBROKEN_GROUP_SIZE``)."""
    rank: int = 0
    """This process's index in its group, 0..size-1 (``UNBROKEN_RANK_IN_GROUP``)."""
    store: str | None = None
    """``HOST:PORT`` of the store the launcher hosts for its groups (``UNBROKEN_GROUP_STORE``)."""
    prefix: str = ""
    """Key prefix of this incarnation of the group in that store (``UNBROKEN_GROUP_PREFIX``)."""
    timeout: float = 3.0
    """Seconds of silence of a peer after which the group is ended (``UNBROKEN_GROUP_TIMEOUT``)."""

    @classmethod
    def from_env(cls) -> "GroupSettings":
        def number(name: str, kind: Callable[[str], Any], default: Any) -> Any:
            raw = os.environ.get(name, "")
            if not raw:
                return default
            try:
                return kind(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not a number") from None

        settings = cls(
            size=number("UNBROKEN_GROUP_SIZE", int, 1),
            rank=number("UNBROKEN_RANK_IN_GROUP", int, 0),
            store=os.environ.get("UNBROKEN_GROUP_STORE") or None,
            prefix=os.environ.get("UNBROKEN_GROUP_PREFIX", ""),
            timeout=number("UNBROKEN_GROUP_TIMEOUT", float, 3.0),
        )
        if settings.size < 1 or not 0 <= settings.rank < settings.size:
            raise ConfigError(f"UNBROKEN_RANK_IN_GROUP={settings.rank} is not in 0..{settings.size - 1} (UNBROKEN_GROUP_SIZE={settings.size})")
        if settings.size > 1 and (settings.store is None or not settings.prefix):
            raise ConfigError("UNBROKEN_GROUP_SIZE > 1 needs UNBROKEN_GROUP_STORE and UNBROKEN_GROUP_PREFIX (start the script with `unbroken run --group-size K`)")
        return settings


class GroupMember:
    """One process of a replica group: its index, the group's process group, relay and watchdog."""

    def __init__(self, settings: GroupSettings, collective_timeout: float = 300.0, device: str = "cpu") -> None:
        self.settings = settings
        self.size = settings.size
        self.rank = settings.rank
        self.relay: Any = None
        self.watchdog: Any = None
        self._store: Any = None
        self._owns_default_group = False
        if settings.size > 1:
            from unbroken.coordinator.client import parse_address

            host, port = parse_address(settings.store or "")
            self._store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=collective_timeout))
        if not dist.is_initialized():
            store = dist.PrefixStore(settings.prefix + "pg/", self._store) if self._store is not None else dist.HashStore()
            # FSDP's collectives on GPU tensors go over NCCL; the group's votes (CPU tensors) over Gloo
            backend = "cpu:gloo,cuda:nccl" if str(device).startswith("cuda") else "gloo"
            if backend != "gloo":
                from unbroken.worker.devices import local_device
                from unbroken.worker.nccl import prepare_environment

                torch.cuda.set_device(local_device())
                prepare_environment(collective_timeout)  # this group may be the process's first NCCL group
            dist.init_process_group(backend, store=store, rank=settings.rank, world_size=settings.size,
                                    timeout=datetime.timedelta(seconds=collective_timeout))
            self._owns_default_group = True
        elif dist.get_world_size() != settings.size:
            raise ConfigError(
                f"torch.distributed is already initialized with {dist.get_world_size()} processes, but this replica group"
                f" has {settings.size}: call unbroken.group_mesh() instead of init_process_group"
            )
        # Sharded checkpoints are written in the background over a process group of their own,
        # while FSDP's collectives go on over the default one; a write may take as long as the
        # store needs (a process of the group that dies ends the whole group anyway).
        self.checkpoint_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CHECKPOINT_TIMEOUT))

    @property
    def leader(self) -> bool:
        """Process 0: the one that talks to the coordinator for the whole group."""
        return self.rank == 0

    @property
    def grouped(self) -> bool:
        """More than one process: the runtime relays, votes and watches."""
        return self.size > 1

    def mesh(self, device: str = "cpu") -> Any:
        """The group's 1-D device mesh (dimension name ``shard``), for ``fully_shard(mesh=...)``."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device, (self.size,), mesh_dim_names=("shard",))

    def start(self, progress: Callable[[], int], interval: float, on_view: Callable[[dict[str, Any]], None]) -> None:
        """Start relaying and watching (under ``unbroken run``, once the job starts)."""
        if not self.grouped or self.relay is not None:
            return
        from unbroken.replica_groups.group_relay import GroupRelay, GroupWatchdog

        self.relay = GroupRelay(self._store, self.rank, self.size, prefix=self.settings.prefix + "relay/",
                                peer_timeout=self.settings.timeout)
        interval = min(interval, self.settings.timeout / 3)
        self.watchdog = GroupWatchdog(self.relay, progress, interval, on_view=on_view).start()

    def stop(self) -> None:
        """Stop watching: a process that finished must not be taken for a silent peer."""
        if self.watchdog is not None:
            self.watchdog.stop()

    def close(self) -> None:
        """Destroy the process groups this group made (the default one and the checkpoint one),
        after a clean finish: at interpreter teardown, Gloo's threads could release tensors after
        Python is gone and abort the process. A group the script made itself is left alone."""
        global _current
        self.stop()
        if self._owns_default_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - at exit: say it, never turn a finish into a crash
                log.warning("could not destroy the replica group's process groups at exit: %s", exc)
        self._owns_default_group = False
        if _current is self:
            _current = None

    def agree(self, values: list[float]) -> list[float]:
        """Sum ``values`` over the group's processes (a collective of all K; alone, the values).

        The runtime puts a failure count, the generation and its square first, so that one vote
        says whether every process succeeded in the same generation (:func:`unanimous`)."""
        if not self.grouped:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def vote(self, ok: bool, generation: int, extra: list[float] | None = None,
             state: tuple[int, int, bool] | None = None) -> tuple[bool, list[float]]:
        """Whether every process of the group is ``ok`` in ``generation`` and, with ``state``
        (next step, lineage digest, fresh), holds the same one; and the sums of ``extra``."""
        ballot = self.ballot(ok, generation, extra, state)
        return ballot.ok and ballot.same_state, ballot.sums

    def ballot(self, ok: bool, generation: int, extra: list[float] | None = None,
               state: tuple[int, int, bool] | None = None) -> Ballot:
        """One collective of the group's K processes: whether all are ``ok`` in the same
        ``generation``, whether all hold the same ``state``, and the sums of ``extra``."""
        compared = _state_values(state) if state is not None else []
        values = [0.0 if ok else 1.0, float(generation), float(generation) ** 2]
        for value in compared:
            values += [value, value * value]
        summed = self.agree(values + list(extra or []))
        n = 3 + 2 * len(compared)
        same = all(_same(summed[3 + 2 * i], summed[4 + 2 * i], self.size) for i in range(len(compared)))
        return Ballot(unanimous(summed[:3], self.size), same, summed[n:])


@dataclass(frozen=True)
class Ballot:
    """What a replica group's vote found."""

    ok: bool
    """Every process was ok, in the same generation."""
    same_state: bool
    """Every process holds the same next step, lineage digest and freshness."""
    sums: list[float]
    """The sums of the extra values over the processes."""


_CHUNK = 1 << 21


def _state_values(state: tuple[int, int, bool]) -> list[float]:
    """A process's (next step, lineage digest, fresh) as small floats whose sums and sums of
    squares over a group stay exact in float64: the 63-bit digest in three 21-bit parts."""
    step, digest, fresh = state
    return [float(step), float(digest % _CHUNK), float(digest // _CHUNK % _CHUNK), float(digest // _CHUNK // _CHUNK), float(fresh)]


def _same(total: float, squares: float, size: int) -> bool:
    """From the sum and the sum of squares of one value over ``size`` processes: all equal."""
    return total * total == squares * size


def unanimous(summed: list[float], size: int) -> bool:
    """From the sums of ``[failed, generation, generation**2]`` over ``size`` processes: nobody
    failed and every generation was the same (a variance of zero)."""
    failed, total, squares = summed
    return failed == 0 and total * total == squares * size


_current: GroupMember | None = None


def current() -> GroupMember | None:
    """The group this process is in, once :func:`group_mesh` made it (else None)."""
    return _current


def job_group(distributed: bool) -> GroupMember | None:
    """The replica group this process is in (:func:`unbroken.group_mesh` made it), or None; a
    :class:`~unbroken.errors.ConfigError` when the launcher started it as one of a replica group
    but the script made none (a :class:`~unbroken.worker.runtime.Job` asks as it is built)."""
    group = current()
    if group is None and distributed and GroupSettings.from_env().size > 1:
        raise ConfigError(
            "this process is one of a replica group (unbroken run --group-size), but the script did not call"
            " unbroken.group_mesh(): call it before building the model and shard the model over the mesh it"
            " returns (fully_shard(..., mesh=mesh)); see examples/train_fsdp.py"
        )
    return group


def group_mesh(device: str = "cpu") -> Any:
    """The device mesh of this process's replica group: shard the model over it with FSDP2.

    ::

        mesh = unbroken.group_mesh()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        unbroken.replica_groups.sharding.sum_gradients(model)
        job = unbroken.Job(model, optimizer, dataset, global_batch_size=...)

    Under ``unbroken run --group-size K`` this makes the K processes of the group
    torch.distributed's default process group (never the whole job's: groups come and go); run
    alone, a group of one. ``device="cuda"``: this process's GPU (``cuda:LOCAL_RANK``) becomes its
    current device and the group's GPU collectives use NCCL (not yet run on a GPU). Call it once,
    before building the model; later calls return a mesh of the same group.
    """
    global _current
    if _current is None:
        _current = GroupMember(GroupSettings.from_env(), device=device)
    return _current.mesh(device)
