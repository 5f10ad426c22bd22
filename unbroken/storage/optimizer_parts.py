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
job at another member count reads the saved partitions its new spans overlap (:func:`read_spans`).
The members write with no collective and no process group: the checkpoint's directory is where
their parts meet (:func:`wait_for_parts`), so a write in the background never shares a group with
training and outlives a change of membership; a part that never comes (its member died) leaves the
checkpoint unpublished, as a cut-short write does. The background writer is
:class:`~unbroken.storage.parts_saver.PartsSaver`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
import warnings
from typing import Any, Callable

import torch

from unbroken.errors import ConfigError

log = logging.getLogger(__name__)

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


class PartsUnreadable(OSError):
    """A checkpoint's parts could not be read (DCP's own error, a ``BaseException``, as an ``OSError``)."""


class PartsMismatch(ConfigError):
    """A checkpoint's optimizer state was written for other parameters than this job's optimizer has."""


def entry_name(span: SpanKey, entry: str) -> str:
    """The DCP key of one entry of one span."""
    return f"{span[0]}/{span[1]}-{span[2]}/{entry}"


def parse_name(name: str) -> tuple[SpanKey, str]:
    """The span and entry a DCP key names (:func:`entry_name`'s inverse)."""
    group, span, entry = name.split("/", 2)
    start, end = span.split("-")
    return (int(group), int(start), int(end)), entry


# DCP warns on every save and load without a process group that it assumes a single process: it
# does. Filtered once here (a per-call ``warnings.catch_warnings`` is not thread-safe, and the parts
# are written from background threads).
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")


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


def put_file(fs: Any, path: str, data: bytes | memoryview) -> None:
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
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        metadata = save(state, storage_writer=_writer(fs, where), no_dist=True)
    except CheckpointException as exc:  # a BaseException: as an OSError, so that callers' handlers see it
        raise OSError(f"member {member}'s part could not be written under {where}: {exc}") from None
    names = sorted({info.relative_path for info in metadata.storage_data.values()} | {DCP_METADATA})
    marker = {"member": member, "tag": tag, "spans": sorted(list(s) for s in spans),
              "files": {f"{PARTS_DIR}/m{member}/{n}": sha256(fs, f"{where}/{n}") for n in names}}
    before_marker()
    put_marker(fs, root, member, marker)
    return marker


def put_marker(fs: Any, root: str, member: int, marker: dict[str, Any]) -> None:
    """Write member ``member``'s marker (its part is complete, or ``"failed"``: it will not come)."""
    fs.makedirs(f"{root}/{PARTS_DIR}", exist_ok=True)
    put_file(fs, f"{root}/{PARTS_DIR}/m{member}.json", json.dumps(marker).encode())


def wait_for_parts(fs: Any, root: str, members: int, timeout: float, given_up: Callable[[], str | None] = lambda: None,
                   tag: str = "") -> list[dict[str, Any]]:
    """The markers of members ``0..members-1`` under ``root`` with ``tag``, once all are there. Raises
    :class:`PartMissing` as soon as a member's marker says its part failed, or ``given_up()`` gives a
    reason (the save's generation ended: a member left, or some did not commit the step), or after
    ``timeout`` seconds."""
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
                    if marker.get("failed"):
                        raise PartMissing(f"member {member} could not write its part of the optimizer state: {marker['failed']}")
                    found[member] = marker
        missing = [m for m in range(members) if m not in found]
        if not missing:
            return [found[m] for m in range(members)]
        reason = given_up()
        if reason:
            raise PartMissing(f"the optimizer state's parts of members {missing} will not come: {reason}")
        if time.monotonic() > deadline:
            raise PartMissing(f"the optimizer state's parts of members {missing} did not arrive within {timeout:.0f} s"
                              " (UNBROKEN_CHECKPOINT_PART_TIMEOUT)")
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
    """Raise :class:`PartsIncomplete` unless ``spans`` cover every element of every group once."""
    for g, size in enumerate(sizes):
        at = 0
        for _, start, end in sorted(s for s in spans if s[0] == g):
            if start != at:
                what = "missing" if start > at else "held twice"
                raise PartsIncomplete(f"the optimizer state's parts do not cover parameter group {g} once: elements"
                                      f" {min(at, start)}..{max(at, start)} are {what}")
            at = end
        if at != size:
            raise PartsIncomplete(f"the optimizer state's parts do not cover parameter group {g}: elements {at}..{size} are missing")


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
    entries (a step count) from the first; no entries for a group the optimizer keeps no state for
    (the parts were checked to cover every group when they were published). Raises
    :class:`PartsIncomplete` if some element of a wanted span is in no saved one."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return _read_spans(fs, root, wanted, device)
    except CheckpointException as exc:
        raise PartsUnreadable(f"the optimizer state's parts at {root} could not be read: {exc}") from None


def _read_spans(fs: Any, root: str, wanted: list[SpanKey], device: Callable[[int], torch.device]) -> dict[SpanKey, dict[str, torch.Tensor]]:
    from torch.distributed.checkpoint import load

    saved = saved_spans(fs, root)
    reader_path = f"{root}/{PARTS_DIR}"
    out: dict[SpanKey, dict[str, torch.Tensor]] = {}
    for want in wanted:
        g, start, end = want
        if not any(s[0] == g for s in saved):  # an optimizer with no state for it (SGD without momentum)
            out[want] = {}
            continue
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
    parameter in the group's flat vector; ``shapes`` the parameters' shapes by index. Raises
    :class:`PartsMismatch` before reading anything if they do not fit each other."""
    for index, _, numel in (e for entries in layout for e in entries):
        if index not in shapes or shapes[index].numel() != numel:
            raise PartsMismatch(f"the checkpoint's optimizer state holds {numel} elements for parameter {index}, this job's"
                                f" optimizer has {shapes[index].numel() if index in shapes else 'no such parameter'}")
    wanted = [(g, 0, sum(n for _, _, n in entries)) for g, entries in enumerate(layout) if entries]
    groups = read_spans(fs, root, wanted)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for (g, _, _), entries in groups.items():
        if not entries:  # an optimizer that keeps no state (SGD without momentum) has none in torch's format either
            continue
        for index, offset, numel in layout[g]:
            state[index] = {k: (v[offset : offset + numel].view(shapes[index]).clone() if v.dim() else v.clone())
                            for k, v in entries.items()}
    return state
