"""Sharded checkpoints: each process of one replica group writes its own shard.

A replica group shards one replica of the model with FSDP2, so no process holds the whole state.
Every process of *one* group (all groups hold the same replica) writes its shard with torch's
distributed checkpoint (DCP, ``torch.distributed.checkpoint``), so the checkpoint is a plain DCP
checkpoint that users' tools read (``dcp.load``, ``torch.distributed.checkpoint.format_utils``).
Layout, beside the plain checkpoints of :class:`~unbroken.storage.checkpoint.CheckpointStore` and with the
same names::

    step-00000120/.metadata        DCP's metadata (written by process 0 of the group)
    step-00000120/__0_0.distcp     process 0's shard, __1_0.distcp process 1's, ...
    step-00000120/manifest.json    written last: step, group size and sharding, every file's
                                   size and sha256, time, library versions, the caller's meta

Publishing is :class:`~unbroken.storage.checkpoint.CheckpointStore`'s: on a local file system DCP writes
into a staging directory (``.step-00000120.tmp-XXXXXXXX``) that process 0 renames into place once
every process has written and checksummed its files, then the manifest is written under a
temporary name and renamed; on an object store the manifest is the last PUT. A directory without a
manifest is not a checkpoint: loads ignore it and :meth:`CheckpointStore.retain` removes it.

DCP reshards on load, so a resume may change the number of groups (every group loads the same
replica) and the group size: a checkpoint written by 1 group of 2 loads into 2 groups of 1, 1
group of 3, or a plain unsharded model in one process without a process group
(``tests/integration/test_sharded_checkpoint.py``). What cannot be loaded is another model: a
parameter missing from the checkpoint or of another global shape is refused with
:class:`CheckpointMismatch` before anything is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from unbroken.storage.checkpoint import MANIFEST, CheckpointCorrupt, CheckpointStore, Saver, _versions
from unbroken.storage.training_state import TrainingState  # offered here as before
from unbroken.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["FORMAT", "CheckpointCorrupt", "CheckpointMismatch", "ShardedSaver", "TrainingState", "load_sharded", "save_sharded"]

FORMAT = "dcp/1"
"""The manifest's ``format``: a DCP checkpoint (a plain checkpoint's is the integer 1)."""
DCP_METADATA = ".metadata"
_RESERVED = frozenset({"format", "step", "time", "versions", "group", "files"})


class CheckpointMismatch(ConfigError):
    """A checkpoint cannot be loaded into this state: it lacks one of its entries, or holds one
    with another global shape (another model, or other model settings). The group size and the
    number of groups may change; the model may not."""


class _Group:
    """The processes of one replica group (or this process alone, without torch.distributed)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        if group is not None and not self.distributed:
            raise ValueError("a process group was given but torch.distributed is not initialized")
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.size = dist.get_world_size(group) if self.distributed else 1
        if self.rank < 0:
            raise ValueError("this process is not in the given process group")

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every process of the group, in group-rank order (a collective)."""
        if not self.distributed or self.size == 1:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def dcp_args(self) -> dict[str, Any]:
        return {"process_group": self.group} if self.distributed else {"no_dist": True}


def _sha256(fs: Any, path: str) -> dict[str, Any]:
    with fs.open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256")
    return {"sha256": digest.hexdigest(), "bytes": fs.size(path)}


@contextlib.contextmanager
def _quiet_no_dist() -> Iterator[None]:
    """DCP warns on every single-process save and load that it assumes a single process: it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# -- saving ----------------------------------------------------------------------------------------


def save_sharded(
    url: str,
    step: int,
    state: Mapping[str, Any],
    group: dist.ProcessGroup | None = None,
    meta: Mapping[str, Any] | None = None,
    *,
    model: torch.nn.Module | None = None,
    keep: int | None = None,
) -> str:
    """Write checkpoint ``step`` of one replica group under ``url`` (a path or fsspec URL) and
    publish it; returns its location. Blocks until it is published, on every process.

    Every process of the group calls it, with its own shards in ``state`` (a DCP state dict:
    tensors, DTensors, :class:`TrainingState` or other ``Stateful`` values, small picklable
    objects) and the group's process group (``None``: the default group, or this process alone
    without torch.distributed). Each process writes its own file with ``dcp.save`` and checksums
    it; process 0 then writes the manifest, with ``meta`` (JSON; its keys must not be the
    manifest's own), the group's size and, given ``model``,
    :func:`~unbroken.replica_groups.sharding.sharding_fingerprint` of process 0. With ``keep``, process 0
    then applies :meth:`CheckpointStore.retain` (a failure there is logged: the checkpoint is
    already published). Exactly one group may save a given step.

    Raises ``ValueError`` for a ``meta`` key the manifest uses; any error of a process (DCP's
    ``CheckpointException``, an ``OSError`` while checksumming or publishing) is raised on every
    process of the group, and the checkpoint is then not published.
    """
    meta = dict(meta or {})
    clash = sorted(_RESERVED & set(meta))
    if clash:
        raise ValueError(f"checkpoint meta may not use the manifest's own keys {clash}")
    peers = _Group(group)
    store = CheckpointStore(url)
    name = store.name(step)
    where = _where_to_write(store, name, peers)
    if store.local:
        writer: dcp.StorageWriter = dcp.FileSystemWriter(where)
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(f"{store.url}/{name}")
    with _quiet_no_dist():
        metadata = dcp.save(dict(state), storage_writer=writer, **peers.dcp_args())
    files = _checksums(store, where, metadata, peers)

    location: str | None = None
    error: BaseException | None = None
    if peers.rank == 0 and files is not None:
        manifest = {
            "format": FORMAT,
            "step": step,
            "time": time.time(),
            "group": {"size": peers.size, "sharding": _fingerprint(model)},
            "files": files,
            "versions": _versions(),
            **meta,
        }
        try:
            if store.local:
                store.move_into_place(where, name)
            store.publish(name, manifest)
            location = f"{store.url}/{name}"
        except Exception as exc:  # noqa: BLE001 - told to the group, then re-raised here
            error = exc
    location = peers.gather(location)[0]  # every process returns only once it is published
    if error is not None:
        raise error
    if location is None:
        raise OSError(f"checkpoint of step {step} at {store.url}/{name} was not published: "
                      + ("a process could not checksum its files" if files is None else "process 0 could not publish it"))
    log.info("sharded checkpoint of step %d published at %s (%d processes)", step, location, peers.size)
    if keep is not None and peers.rank == 0:
        try:
            store.retain(keep, just_written=step)
        except OSError as exc:  # the checkpoint is published; older ones stay until the next save
            log.warning("retention after the checkpoint of step %d failed: %s", step, exc)
    return location


class ShardedSaver(Saver):
    """Writes sharded checkpoints in the background, one in flight, as :class:`Saver` writes plain
    ones: :meth:`save` returns once this process's shards are copied to host memory, and a thread
    then writes them with :func:`save_sharded` over ``group``, a process group of the replica
    group's processes kept for checkpoints (FSDP's collectives go on over the default one
    meanwhile), so that a store that takes a minute never holds up a step.

    Every process of the group must save the same steps: a process that started a write alone
    would wait in its collectives for the others. So the group agrees before each save that it is
    due and that no process still writes (the runtime votes on both)."""

    def __init__(self, store: CheckpointStore, keep: int, on_done: Any, group: dist.ProcessGroup | None,
                 model: torch.nn.Module | None = None) -> None:
        super().__init__(store, keep, on_done)
        self.group = group
        self.model = model

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> float | None:
        """Copy ``state`` (``Stateful`` values, e.g. :class:`TrainingState`, as their state dicts)
        to host memory and start writing it; None (nothing done) if the previous write still runs."""
        if self.busy():
            return None
        resolved = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
        return super().save(step, resolved, meta)

    what = "sharded checkpoint"

    def _write(self, step: int, copy: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any] | None:
        location = save_sharded(self.store.url, step, copy, self.group, meta, model=self.model, keep=self.keep)
        peers = _Group(self.group)
        return {"location": location, "processes": peers.size} if peers.rank == 0 else None


def _where_to_write(store: CheckpointStore, name: str, peers: _Group) -> str:
    """The directory DCP writes checkpoint ``name`` into, the same on every process: on a local
    file system a staging directory that process 0 makes (renamed into place when complete), on
    an object store the final name (invisible until the manifest is written)."""
    made: str | None = None
    if store.local and peers.rank == 0:
        try:
            made = store.staging_dir(name)
        except OSError as exc:
            made = f"error: {exc}"
    made = peers.gather(made)[0]
    if made is not None and made.startswith("error: "):
        raise OSError(f"process 0 of the group could not make a staging directory under {store.url}: {made[7:]}")
    return made or store._path(name)


def _checksums(store: CheckpointStore, where: str, metadata: dcp.Metadata, peers: _Group) -> dict[str, Any] | None:
    """Size and sha256 of every file of the checkpoint, by name (None on every process if a
    process could not read its files back; it logs why). Each process checksums the files it
    wrote (process 0 also DCP's ``.metadata``), so every file is read back once, by the process
    that has it in its page cache."""
    files = sorted({entry.relative_path for entry in metadata.storage_data.values()} | {DCP_METADATA})
    prefixes = [f"__{r}_" for r in range(peers.size)]
    mine = [f for f in files if f.startswith(prefixes[peers.rank])
            or (peers.rank == 0 and not any(f.startswith(p) for p in prefixes))]
    try:
        sums: dict[str, Any] | None = {f: _sha256(store.fs, f"{where}/{f}") for f in mine}
    except OSError as exc:
        log.error("could not checksum the checkpoint files this process wrote under %s: %s", where, exc)
        sums = None
    gathered = peers.gather(sums)
    if any(g is None for g in gathered):
        return None
    return {f: entry for g in gathered for f, entry in sorted(g.items())}


def _fingerprint(model: torch.nn.Module | None) -> str:
    if model is None:
        return ""
    from unbroken.replica_groups.sharding import sharding_fingerprint

    return sharding_fingerprint(model)


# -- loading ---------------------------------------------------------------------------------------


def read_manifest(url: str, step: int) -> dict[str, Any]:
    """The manifest of sharded checkpoint ``step``; raises :class:`CheckpointCorrupt` if it is
    unreadable or not a sharded checkpoint's."""
    store = CheckpointStore(url)
    location = f"{store.url}/{store.name(step)}"
    try:
        with store.fs.open(store._path(store.name(step), MANIFEST), "rb") as f:
            manifest = json.loads(f.read())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorrupt(f"{location}: manifest unreadable ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointCorrupt(f"{location}: format {manifest.get('format')!r} is not a sharded checkpoint's ({FORMAT!r}); "
                                "a plain checkpoint is read by CheckpointStore")
    if DCP_METADATA not in files:
        raise CheckpointCorrupt(f"{location}: the manifest names no {DCP_METADATA} file")
    return manifest


def _verify(store: CheckpointStore, step: int, manifest: Mapping[str, Any], names: list[str]) -> str | None:
    """What is wrong with ``names`` (files of checkpoint ``step``) against the manifest, or None."""
    location = f"{store.url}/{store.name(step)}"
    for name in names:
        entry = manifest["files"][name]
        path = store._path(store.name(step), name)
        try:
            found = _sha256(store.fs, path)
        except FileNotFoundError:
            return f"{location}: {name} is missing"
        except OSError as exc:
            return f"{location}: {name} is unreadable ({exc})"
        if found["bytes"] != entry.get("bytes"):
            return f"{location}: {name} has {found['bytes']} bytes, the manifest says {entry.get('bytes')} (truncated?)"
        if found["sha256"] != entry.get("sha256"):
            return f"{location}: {name} does not match its checksum (corrupt)"
    return None


def _check_loadable(state: Mapping[str, Any], metadata: dcp.Metadata, location: str) -> None:
    """Refuse, before anything is read, a state DCP cannot fill from this checkpoint: DCP's own
    load planning, run locally, finds a missing entry or another global shape."""
    target = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(target, metadata, is_coordinator=False)
    try:
        planner.create_local_plan()
    except (ValueError, RuntimeError, KeyError) as exc:
        raise CheckpointMismatch(
            f"{location} cannot be loaded into this model: {exc}. The group size and the number of groups "
            "may differ from the job that wrote it, the model may not: resume with the same model code and "
            "settings, or from another checkpoint directory"
        ) from None


def load_sharded(
    url: str,
    state: dict[str, Any],
    group: dist.ProcessGroup | None = None,
    *,
    step: int | None = None,
    verify: bool = True,
) -> dict[str, Any] | None:
    """Load the newest published sharded checkpoint under ``url`` into ``state``, in place, and
    return its manifest (with the saver's meta); None if there is none.

    Every process of the group calls it (``None``: the default group, or this process alone
    without torch.distributed) with its own ``state``, shaped as it will train: DTensors of any
    group size, or plain tensors. Each replica group loads the whole replica on its own; DCP
    reshards. ``verify`` checks every file's size and sha256 against the manifest first, the
    files shared out among the group's processes. Newest is by the manifest's write time; one
    that does not verify is skipped with a warning (with ``step``, that checkpoint or
    :class:`CheckpointCorrupt`). Raises :class:`CheckpointMismatch`, before reading any tensor,
    if ``state`` holds an entry the checkpoint lacks or one of another global shape.
    """
    peers = _Group(group)
    store = CheckpointStore(url)
    # process 0 lists, so that every process of the group tries the same checkpoints in order
    candidates: list[int] = peers.gather(store.steps() if step is None and peers.rank == 0 else None)[0] or []
    if step is not None:
        candidates = [step]
    for candidate in candidates:
        location = f"{store.url}/{store.name(candidate)}"
        try:
            manifest: dict[str, Any] | None = read_manifest(url, candidate)
            names = sorted(manifest["files"])[peers.rank :: peers.size] if verify else []
            problem = _verify(store, candidate, manifest, names)
        except CheckpointCorrupt as exc:
            manifest, problem = None, str(exc)
        problems = [p for p in peers.gather(problem) if p]
        if problems:
            if step is not None:
                raise CheckpointCorrupt("; ".join(problems))
            log.warning("skipping checkpoint: %s", problems[0])
            print(f"unbroken: warning: skipping checkpoint {problems[0]}", flush=True)
            continue
        assert manifest is not None
        path = store._path(store.name(candidate))
        if store.local:
            reader: dcp.StorageReader = dcp.FileSystemReader(path)
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            reader = FsspecReader(location)
        _check_loadable(state, reader.read_metadata(), location)
        with _quiet_no_dist():
            dcp.load(state, storage_reader=reader, **peers.dcp_args())
        log.info("loaded sharded checkpoint %s (written by %s processes, loaded by %d)",
                 location, manifest.get("group", {}).get("size"), peers.size)
        return manifest
    return None
