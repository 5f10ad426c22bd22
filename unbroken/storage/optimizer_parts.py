"""A sharded optimizer's state in a checkpoint, written by the members that own it (``shard_optimizer``).

Each member of a job with a sharded optimizer owns one partition of every parameter group's flat
vector (:mod:`unbroken.worker.shard_plan`). At a checkpoint every member writes the state of the
spans it owns (each once: owners write, buddies do not) as a part of one checkpoint in torch's
distributed checkpoint format (DCP), so that no member ever holds more than its own share; rank 0
writes the rest of the training state (``state.pt``, the optimizer's hyper-parameters without its
per-parameter state) beside it and publishes the checkpoint once every part is there. Layout::

    step-00000120/state.pt                      rank 0: model, scheduler, ..., the optimizer's param_groups
    step-00000120/optimizer/m1/__0_0.distcp      member 1's spans, written by member 1 (DCP, no collectives)
    step-00000120/optimizer/m1/.metadata         member 1's part on its own
    step-00000120/optimizer/m1.json              member 1's marker, written last: its spans and files' sha256
    step-00000120/optimizer/.metadata            rank 0: every part's metadata merged (one DCP checkpoint)
    step-00000120/manifest.json                  rank 0, last: every file's sha256, the layout

The entries are named ``<group>/<start>-<end>/<entry>`` (Adam's ``exp_avg`` of elements
``start..end`` of parameter group ``group``), so ``dcp.load`` reads any of them and a member of a
job at another member count reads exactly the spans its new partitions overlap (:func:`read_spans`).
The members write with no collective and no process group: the checkpoint's directory is where
their parts meet (:func:`wait_for_parts`), so a write in the background never shares a group with
training and outlives a change of membership; a part that never comes (its member died) leaves the
checkpoint unpublished, as a cut-short write does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import torch

from unbroken.storage.checkpoint import FORMAT_WITH_PARTS, STATE_FILE, CheckpointStore, Saver
from unbroken.storage.state_copy import MemoryFile, _tensor_bytes

PARTS_DIR = "optimizer"
"""The sub-directory of a checkpoint that holds the optimizer's parts."""
DCP_METADATA = ".metadata"
POLL_SECONDS = 0.05

SpanKey = tuple[int, int, int]
"""(parameter group, start, end) of a span of the group's flat vector."""


class PartMissing(OSError):
    """A member's part of a checkpoint did not arrive (the member left, or its write failed)."""


class PartsIncomplete(OSError):
    """A checkpoint's parts do not cover every element of the optimizer state."""


def entry_name(span: SpanKey, entry: str) -> str:
    """The DCP key of one entry of one span."""
    return f"{span[0]}/{span[1]}-{span[2]}/{entry}"


def parse_name(name: str) -> tuple[SpanKey, str]:
    """The span and entry a DCP key names (:func:`entry_name`'s inverse)."""
    group, span, entry = name.split("/", 2)
    start, end = span.split("-")
    return (int(group), int(start), int(end)), entry


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it assumes a single process on every save and load without a process group: it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield


def _local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, (list, tuple)) else [fs.protocol])


def _writer(fs: Any, path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter

    if _local(fs):
        return FileSystemWriter(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(fs.unstrip_protocol(path))


def _reader(fs: Any, path: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    if _local(fs):
        return FileSystemReader(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(fs.unstrip_protocol(path))


def sha256(fs: Any, path: str) -> dict[str, Any]:
    """A file's size and sha256, read in blocks."""
    with fs.open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256")
    return {"sha256": digest.hexdigest(), "bytes": fs.size(path)}


def _put(fs: Any, path: str, data: bytes | memoryview) -> None:
    """Write a small file whole: on a local file system under a temporary name, fsynced, renamed."""
    if not _local(fs):
        with fs.open(path, "wb") as f:
            f.write(data)
        return
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


# -- writing ---------------------------------------------------------------------------------------


def write_part(fs: Any, root: str, member: int, spans: dict[SpanKey, dict[str, torch.Tensor]],
               before_marker: Callable[[], None] = lambda: None, tag: str = "") -> dict[str, Any]:
    """Member ``member`` writes its ``spans`` (each span's entries, tensors in host memory) as its
    part of the checkpoint whose directory is ``root`` (a path of ``fs``), then its marker; returns
    the marker (its spans, its files' sizes and sha256 by path relative to ``root``, and ``tag``,
    which names the save: an object store has no staging directory, and a try at the same step by
    an earlier generation may have left its markers there)."""
    where = f"{root}/{PARTS_DIR}/m{member}"
    fs.makedirs(where, exist_ok=True)
    from torch.distributed.checkpoint import save

    state = {entry_name(span, k): v for span, entries in spans.items() for k, v in entries.items()}
    with _quiet():
        metadata = save(state, storage_writer=_writer(fs, where), no_dist=True)
    names = sorted({info.relative_path for info in metadata.storage_data.values()} | {DCP_METADATA})
    marker = {"member": member, "tag": tag, "spans": sorted(list(s) for s in spans),
              "files": {f"{PARTS_DIR}/m{member}/{n}": sha256(fs, f"{where}/{n}") for n in names}}
    before_marker()
    _put(fs, f"{root}/{PARTS_DIR}/m{member}.json", json.dumps(marker).encode())
    return marker


def wait_for_parts(fs: Any, root: str, members: int, timeout: float, gone: Callable[[int], bool] = lambda member: False,
                   tag: str = "") -> list[dict[str, Any]]:
    """The markers of members ``0..members-1`` under ``root`` with ``tag``, once all are there. Raises
    :class:`PartMissing` as soon as a member whose part is missing is ``gone`` (it left the job, so
    its part will never come), or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    found: dict[int, dict[str, Any]] = {}
    while True:
        for member in range(members):
            if member in found:
                continue
            path = f"{root}/{PARTS_DIR}/m{member}.json"
            if fs.exists(path):
                with fs.open(path, "rb") as f:
                    marker = json.loads(f.read())
                if marker.get("tag", "") == tag:  # (another's: an earlier try, replaced when this one's comes)
                    found[member] = marker
        missing = [m for m in range(members) if m not in found]
        if not missing:
            return [found[m] for m in range(members)]
        left = [m for m in missing if gone(m)]
        if left:
            raise PartMissing(f"the optimizer state's part of member {left[0]} will not come: the member left the job")
        if time.monotonic() > deadline:
            raise PartMissing(f"the optimizer state's parts of members {missing} did not arrive within {timeout:.0f} s")
        time.sleep(POLL_SECONDS)


def merge(fs: Any, root: str, markers: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    """Rank 0: check that the parts of ``markers`` cover every element of every group of ``sizes``
    exactly once, and write their merged DCP metadata, so that the parts read as one checkpoint.
    Returns every file of the parts (the markers' and the merged metadata's) with size and sha256."""
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.storage import WriteResult

    _check_cover([tuple(s) for m in markers for s in m["spans"]], sizes)
    described: dict[str, Any] = {}
    planner: dict[str, Any] = {}
    stored: dict[Any, Any] = {}
    for marker in markers:
        sub = f"m{marker['member']}"
        metadata = _reader(fs, f"{root}/{PARTS_DIR}/{sub}").read_metadata()
        described.update(metadata.state_dict_metadata)
        planner.update(metadata.planner_data or {})
        for index, info in metadata.storage_data.items():
            stored[index] = dataclasses.replace(info, relative_path=f"{sub}/{info.relative_path}")
    writer = _writer(fs, f"{root}/{PARTS_DIR}")
    writer.set_up_storage_writer(True)
    writer.finish(Metadata(described, planner_data=planner),
                  [[WriteResult(index=i, size_in_bytes=info.length, storage_data=info) for i, info in stored.items()]])
    files = {name: entry for m in markers for name, entry in m["files"].items()}
    files[f"{PARTS_DIR}/{DCP_METADATA}"] = sha256(fs, f"{root}/{PARTS_DIR}/{DCP_METADATA}")
    return files


def _check_cover(spans: list[SpanKey], sizes: list[int]) -> None:
    for g, size in enumerate(sizes):
        at = 0
        for _, start, end in sorted(s for s in spans if s[0] == g):
            if start != at:
                break
            at = end
        if at != size:
            raise PartsIncomplete(f"the optimizer state's parts do not cover parameter group {g} (elements {at}..{size}"
                                  " are missing or held twice)")


# -- reading ---------------------------------------------------------------------------------------


def saved_spans(fs: Any, root: str) -> dict[SpanKey, dict[str, Any]]:
    """The spans a checkpoint's parts hold: {span: {entry: (shape, dtype)}}."""
    metadata = _reader(fs, f"{root}/{PARTS_DIR}").read_metadata()
    out: dict[SpanKey, dict[str, Any]] = {}
    for name, described in metadata.state_dict_metadata.items():
        span, entry = parse_name(name)
        out.setdefault(span, {})[entry] = (tuple(described.size), described.properties.dtype)
    return out


def read_spans(fs: Any, root: str, wanted: list[SpanKey], device: Callable[[int], torch.device] = lambda g: torch.device("cpu"),
               ) -> dict[SpanKey, dict[str, torch.Tensor]]:
    """The state of each ``wanted`` span, assembled from the saved spans it overlaps (each read
    whole: at most one saved partition more than the span itself in memory at a time); per-span
    entries (a step count) from the first. Raises :class:`PartsIncomplete` if some element of a
    wanted span is in no saved one."""
    from torch.distributed.checkpoint import load

    saved = saved_spans(fs, root)
    reader_path = f"{root}/{PARTS_DIR}"
    out: dict[SpanKey, dict[str, torch.Tensor]] = {}
    for want in wanted:
        g, start, end = want
        pieces = sorted(s for s in saved if s[0] == g and s[1] < end and start < s[2])
        reach = start
        for piece in pieces:
            reach = reach if piece[1] > reach else max(reach, piece[2])
        if reach < end:
            raise PartsIncomplete(f"no part of the checkpoint at {root} holds elements {reach}..{end} of parameter group {g}")
        columns: dict[str, list[torch.Tensor]] = {}
        scalars: dict[str, torch.Tensor] = {}
        for piece in pieces:
            described = saved[piece]
            state = {entry_name(piece, k): torch.empty(shape, dtype=dtype) for k, (shape, dtype) in described.items()}
            with _quiet():
                load(state, storage_reader=_reader(fs, reader_path), no_dist=True)
            a, b = max(piece[1], start) - piece[1], min(piece[2], end) - piece[1]
            for k in described:
                value = state[entry_name(piece, k)]
                if value.dim():
                    columns.setdefault(k, []).append(value[a:b].clone())
                else:
                    scalars.setdefault(k, value)
        out[want] = {**{k: torch.cat(v).to(device(g)) for k, v in columns.items()}, **{k: v.to(device(g)) for k, v in scalars.items()}}
    return out


def per_parameter_state(fs: Any, root: str, layout: list[list[list[int]]], shapes: dict[int, torch.Size]) -> dict[int, dict[str, torch.Tensor]]:
    """The whole optimizer state in torch's ``state_dict`` form ({parameter index: {entry: tensor}}),
    for a job that does not shard (or a single process) resuming from a sharded one's checkpoint.
    ``layout`` is the manifest's: per parameter group, ``[parameter index, offset, numel]`` of each
    parameter in the group's flat vector; ``shapes`` the parameters' shapes by index."""
    wanted = [(g, 0, sum(n for _, _, n in entries)) for g, entries in enumerate(layout) if entries]
    groups = read_spans(fs, root, wanted)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for (g, _, _), entries in groups.items():
        for index, offset, numel in layout[g]:
            state[index] = {k: (v[offset : offset + numel].view(shapes[index]).clone() if v.dim() else v.clone())
                            for k, v in entries.items()}
    return state


# -- the background writer -------------------------------------------------------------------------

PART_TIMEOUT = 600.0
"""How long rank 0 waits for a member's part of a checkpoint when that member is still in the job
(one that left is not waited for): the checkpoint is then not published, as a write cut short."""


class PartsSaver(Saver):
    """Every member's writer of checkpoints with a sharded optimizer: in the background, each member
    writes its part (:func:`write_part`); rank 0 also writes ``state.pt`` and publishes the
    checkpoint once every part is there (:func:`wait_for_parts`, :func:`merge`).

    ``save(step, {"train": state or None, "spans": {span: entries}}, meta)``: ``meta`` carries the
    manifest's fields and ``"parts"``: this member's index, the members' ids (by index), the tag
    every member names the staging directory with, the groups' sizes and the layout.
    ``gone(member_id)`` says whether a member has left the job (its part will never come)."""

    def __init__(self, store: CheckpointStore, keep: int, on_done: Callable[[dict[str, Any]], None],
                 fault: Callable[[int], None] = lambda step: None, gone: Callable[[str], bool] = lambda member: False,
                 timeout: float = PART_TIMEOUT) -> None:
        super().__init__(store, keep, on_done, fault)
        self.gone = gone
        self.timeout = timeout

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> float | None:
        """As :meth:`Saver.save`, but a member other than rank 0 never skips its part (rank 0, which
        asked for the save, is not writing; a part of the previous save still in flight is waited for)."""
        if meta["parts"]["member"] != 0 and self.busy():
            self.wait()
        return super().save(step, state, meta)

    def _write(self, step: int, copy: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any] | None:
        store, name = self.store, self.store.name(step)
        parts = meta.pop("parts")
        root = store.staging_dir(name, parts["tag"]) if store.local else store._path(name)
        if parts["member"] != 0:  # (a fault injected here: the member dies with its part written, unannounced)
            write_part(store.fs, root, parts["member"], copy.pop("spans"), lambda: self.fault(step), parts["tag"])
            return None
        write_part(store.fs, root, 0, copy.pop("spans"), tag=parts["tag"])
        buffer = MemoryFile(capacity=_tensor_bytes(copy) + (1 << 20))
        torch.save(copy.pop("train"), buffer)
        payload = buffer.getbuffer()
        _put(store.fs, f"{root}/{STATE_FILE}", payload)
        ids = parts["ids"]
        markers = wait_for_parts(store.fs, root, len(ids), self.timeout, lambda m: self.gone(ids[m]), parts["tag"])
        files = merge(store.fs, root, markers, parts["sizes"])
        files[STATE_FILE] = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": payload.nbytes}
        record = {"dir": PARTS_DIR, "members": len(ids), "sizes": parts["sizes"], "layout": parts["layout"]}
        manifest = store.manifest(step, files, {**meta, "optimizer_parts": record}, FORMAT_WITH_PARTS)
        if store.local:
            store.move_into_place(root, name)
        self.fault(step)
        store.publish(name, manifest)
        deleted = store.retain(self.keep, just_written=step)
        return {"location": f"{store.url}/{name}", "bytes": sum(f["bytes"] for f in files.values()), "deleted": deleted,
                "parts": len(ids)}
