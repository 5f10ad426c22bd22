"""Durable checkpoints: for the case where every member is gone at once.

A save has two phases (as torchtitan's asynchronous checkpointing): at a step boundary the
training state is copied into host memory, which is the only stall of training; a background
thread then serializes and writes it while training goes on. One save is in flight at a time.

Layout under the checkpoint directory (a local path or any fsspec URL, s3:// among them)::

    step-00000120/state.pt        the training state (torch.save)
    step-00000120/manifest.json   written last: per-file sha256 and size, step, generation,
                                  members, time, library versions

A checkpoint is visible only once its manifest exists, and is used only if every file matches
the manifest. On a local file system the files are written under a temporary directory, fsynced,
and the directory is renamed into place before the manifest is published with the same
write-fsync-rename; on an object store each object is written whole by one PUT and the manifest
is written last. A save cut short leaves at most an unpublished directory, which a later save's
retention removes.

Replicas are identical, so one member (rank 0 of the generation) writes every byte once: splitting
one small state across members would add coordination for no gain in write bandwidth on one
filesystem (see the README's checkpoint benchmark). The exception is a sharded optimizer's state,
which no member holds whole: its owners write it in parts beside rank 0's ``state.pt``
(:mod:`unbroken.storage.optimizer_parts`; the manifest's format is then :data:`FORMAT_WITH_PARTS`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import threading
import time
import uuid
from typing import Any, Callable

import torch

from unbroken.errors import ConfigError, UnbrokenError
from unbroken.storage.checkpoint_schedule import DEFAULT_MAX_INTERVAL, Schedule, young_daly_interval  # noqa: F401  (re-exported)
from unbroken.storage.checkpoint_settings import CheckpointSettings  # noqa: F401  (re-exported)
from unbroken.storage.safe_unpickle import plain_data_globals
from unbroken.storage.state_copy import MemoryFile, PinnedPool, _has_gpu_tensor, _tensor_bytes, copies_done, snapshot  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

FORMAT = 1
FORMAT_WITH_PARTS = 2
"""A checkpoint whose optimizer state is in parts written by its owners (:mod:`unbroken.storage.optimizer_parts`):
``state.pt`` alone holds no optimizer state, so a reader that knows only :data:`FORMAT` must refuse it."""
STATE_FILE = "state.pt"
MANIFEST = "manifest.json"
GENERATION_FILE = "generation.json"
"""Beside the checkpoints: the newest generation a leader noted (:meth:`CheckpointStore.note_generation`)."""


class CheckpointCorrupt(UnbrokenError):
    """A checkpoint's files do not match its manifest."""


def _versions() -> dict[str, str]:
    from unbroken.version import __version__

    return {"unbroken": __version__, "torch": torch.__version__, "python": platform.python_version()}


class CheckpointStore:
    """Checkpoints under one directory or URL (fsspec)."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, (list, tuple)) else [self.fs.protocol])

    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    @staticmethod
    def name(step: int) -> str:
        return f"step-{step:08d}"

    # -- writing -------------------------------------------------------------------------------

    def write(self, step: int, payload: bytes | memoryview, meta: dict[str, Any], before_manifest: Callable[[], None] | None = None) -> str:
        """Publish checkpoint ``step``: data first, manifest last. Returns its location."""
        name = self.name(step)
        digest = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": memoryview(payload).nbytes}
        manifest = self.manifest(step, {STATE_FILE: digest}, meta)
        if self.local:
            self._write_local(name, payload, manifest, before_manifest)
        else:
            self.fs.makedirs(self._path(name), exist_ok=True)
            with self.fs.open(self._path(name, STATE_FILE), "wb") as f:
                f.write(payload)
            if before_manifest:
                before_manifest()
            self.publish(name, manifest)
        return f"{self.url}/{name}"

    @staticmethod
    def manifest(step: int, files: dict[str, Any], meta: dict[str, Any], format: int = FORMAT) -> dict[str, Any]:
        """The manifest of checkpoint ``step`` with ``files`` (name -> sha256 and bytes) and the writer's ``meta``."""
        return {"format": format, "step": step, "time": time.time(), "files": files, "versions": _versions(), **meta}

    def _write_local(self, name: str, payload: bytes | memoryview, manifest: dict[str, Any], before_manifest: Callable[[], None] | None) -> None:
        tmp = self.staging_dir(name)
        _write_synced(os.path.join(tmp, STATE_FILE), payload)
        self.move_into_place(tmp, name)
        if before_manifest:
            before_manifest()
        self.publish(name, manifest)

    def staging_dir(self, name: str, tag: str | None = None) -> str:
        """A local directory beside the checkpoints to write checkpoint ``name``'s files in (local
        file systems only): a fresh one, or with ``tag`` the one every writer of the same save names
        alike (the members writing their parts of one checkpoint). Its name
        (``.step-NNNNNNNN.tmp-XXXXXXXX``) is one that :meth:`retain` removes when a save was cut
        short before :meth:`move_into_place`."""
        assert self.local, "staging directories are for local file systems"
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, f".{name}.tmp-{tag or uuid.uuid4().hex[:8]}")
        os.makedirs(tmp, exist_ok=tag is not None)
        return tmp

    def move_into_place(self, tmp: str, name: str) -> None:
        """Rename the staging directory ``tmp`` (its files written and fsynced) to checkpoint
        ``name``, replacing a leftover of that name (an unpublished one, or a published one being
        written again: its manifest goes first, so it is never visible half-removed). Still
        unpublished afterwards: :meth:`publish` makes it visible."""
        final = os.path.join(self.root, name)
        if os.path.isdir(final):
            leftovers = sorted(os.listdir(final), key=lambda base: base != MANIFEST)  # the manifest first
            for leftover in leftovers:
                path = os.path.join(final, leftover)
                if os.path.isdir(path):  # the parts of a sharded optimizer's state
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            os.rmdir(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)

    def publish(self, name: str, manifest: dict[str, Any]) -> None:
        """Make checkpoint ``name`` visible by writing its manifest, after every file it names is
        complete: on a local file system written under a temporary name, fsynced and renamed into
        place (then the directory fsynced); on an object store one PUT, which is atomic."""
        data = json.dumps(manifest, indent=1).encode()
        if not self.local:
            with self.fs.open(self._path(name, MANIFEST), "wb") as f:
                f.write(data)
            return
        final = os.path.join(self.root, name)
        _write_synced(os.path.join(final, f".{MANIFEST}.tmp"), data)
        os.rename(os.path.join(final, f".{MANIFEST}.tmp"), os.path.join(final, MANIFEST))
        _fsync_dir(final)

    # -- reading -------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the checkpoints that have a manifest, newest (most recently written) first;
        not yet verified. A checkpoint directory may hold an earlier run's checkpoints of higher
        steps than the current run's newest: the write time, not the step, says which is newest."""
        found = self._published()
        return [step for step, _ in sorted(found.items(), key=lambda item: (item[1], item[0]), reverse=True)]

    def newest_generation(self) -> int:
        """The newest generation this directory knows of (0 if none): the one that wrote the newest
        checkpoint, or a later one a leader noted (:meth:`note_generation`). A new coordinator's
        generations are numbered above it, so that lineages, events and metrics never reuse a
        number, even after every worker died and the job resumed from here."""
        noted = 0
        try:
            with self.fs.open(self._path(GENERATION_FILE), "rb") as f:
                noted = int(json.loads(f.read()).get("generation", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            pass
        for step in self.steps():
            try:
                with self.fs.open(self._path(self.name(step), MANIFEST), "rb") as f:
                    return max(noted, int(json.loads(f.read()).get("generation", 0)))
            except (OSError, ValueError, TypeError, AttributeError):
                continue
        return noted

    def note_generation(self, number: int) -> None:
        """Record that generation ``number`` formed (by its leader, once per generation), so that a
        job resumed from this directory numbers its generations above it, not only above the one
        that wrote the newest checkpoint. Written whole, then renamed into place."""
        self.fs.makedirs(self.root, exist_ok=True)
        tmp = self._path(f".{GENERATION_FILE}.tmp-{uuid.uuid4().hex[:8]}")
        with self.fs.open(tmp, "wb") as f:
            f.write(json.dumps({"generation": number, "time": time.time()}).encode())
        self.fs.mv(tmp, self._path(GENERATION_FILE))

    def _written_at(self, base: str) -> float:
        try:
            with self.fs.open(self._path(base, MANIFEST), "rb") as f:
                return float(json.loads(f.read()).get("time", 0.0))
        except (OSError, ValueError, TypeError, AttributeError):
            return 0.0

    def _published(self) -> dict[int, float]:
        """{step: write time} of the checkpoints that have a manifest."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return {}
        found = []
        for entry in entries:
            base = entry.rstrip("/").rsplit("/", 1)[-1]
            if base.startswith("step-") and base[5:].isdigit() and self.fs.exists(self._path(base, MANIFEST)):
                found.append(int(base[5:]))
        return {step: self._written_at(self.name(step)) for step in found}

    def read(self, step: int) -> tuple[dict[str, Any], bytes]:
        """Manifest and verified state bytes of checkpoint ``step``; raises CheckpointCorrupt. Every
        other file the manifest names (a sharded optimizer's parts) is verified too, read in blocks."""
        name = self.name(step)
        try:
            with self.fs.open(self._path(name, MANIFEST), "rb") as f:
                manifest = json.loads(f.read())
            entry = manifest["files"][STATE_FILE]
            with self.fs.open(self._path(name, STATE_FILE), "rb") as f:
                payload = f.read()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorrupt(f"{self.url}/{name}: unreadable ({exc})") from None
        if manifest.get("format") not in (FORMAT, FORMAT_WITH_PARTS):
            raise CheckpointCorrupt(f"{self.url}/{name}: format {manifest.get('format')} is not {FORMAT} or {FORMAT_WITH_PARTS}")
        if len(payload) != entry["bytes"]:
            raise CheckpointCorrupt(f"{self.url}/{name}: {STATE_FILE} has {len(payload)} bytes, the manifest says {entry['bytes']} (truncated?)")
        if hashlib.sha256(payload).hexdigest() != entry["sha256"]:
            raise CheckpointCorrupt(f"{self.url}/{name}: {STATE_FILE} does not match its checksum (corrupt)")
        for other, expected in sorted(manifest["files"].items()):
            if other != STATE_FILE:
                self._verify_file(name, other, expected)
        return manifest, payload

    def _verify_file(self, name: str, file: str, expected: dict[str, Any]) -> None:
        try:
            with self.fs.open(self._path(name, file), "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            size = self.fs.size(self._path(name, file))
        except (OSError, TypeError) as exc:
            raise CheckpointCorrupt(f"{self.url}/{name}: {file} unreadable ({exc})") from None
        if size != expected.get("bytes"):
            raise CheckpointCorrupt(f"{self.url}/{name}: {file} has {size} bytes, the manifest says {expected.get('bytes')} (truncated?)")
        if digest != expected.get("sha256"):
            raise CheckpointCorrupt(f"{self.url}/{name}: {file} does not match its checksum (corrupt)")

    def load_latest(self, complete: Callable[[dict[str, Any], dict[str, Any]], None] = lambda state, manifest: None,
                    ) -> tuple[dict[str, Any], dict[str, Any], str] | None:
        """The newest checkpoint that verifies: (state, manifest, location). Warns about and skips
        the ones that do not; returns None if there is none. ``complete(state, manifest)`` adds what
        is not in ``state.pt`` (a sharded optimizer's parts); a checkpoint it cannot complete is
        skipped too, except for a :class:`ConfigError` (it does not fit this job), which is raised."""
        for step in self.steps():
            try:
                manifest, payload = self.read(step)
                # weights_only: a checkpoint holds plain data only, and cannot name code to run;
                # what healing accepts, a checkpoint accepts (one allow-list)
                with plain_data_globals():
                    state = torch.load(MemoryFile(payload), weights_only=True)
                complete(state, manifest)
            except ConfigError:
                raise
            except CheckpointCorrupt as exc:
                log.warning("skipping checkpoint: %s", exc)
                print(f"unbroken: warning: skipping checkpoint {exc}", flush=True)
                continue
            except Exception as exc:  # a payload that verifies but does not load
                log.warning("skipping checkpoint %s/%s: cannot load: %s", self.url, self.name(step), exc)
                print(f"unbroken: warning: skipping checkpoint {self.url}/{self.name(step)}: cannot load ({exc})", flush=True)
                continue
            return state, manifest, f"{self.url}/{self.name(step)}"
        return None

    def retain(self, keep: int, just_written: int | None = None) -> list[str]:
        """Delete all but the newest ``keep`` published checkpoints (newest by write time; the
        one ``just_written`` is always kept), and unpublished leftovers of steps below it (or
        below the newest, if None). Returns what was deleted."""
        published = self.steps()
        if not published:
            return []
        kept = published[:keep]
        if just_written is not None and just_written in published and just_written not in kept:
            kept = [just_written, *published[: keep - 1]]
        doomed = [self.name(s) for s in published if s not in kept]
        newest = just_written if just_written is not None else published[0]
        try:
            entries = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        for base in entries:
            if base.startswith("step-") and base[5:].isdigit() and int(base[5:]) not in published and int(base[5:]) < newest:
                doomed.append(base)
            elif base.startswith(".step-") and ".tmp-" in base:
                step = base[6:].split(".tmp-")[0]
                if step.isdigit() and int(step) < newest:
                    doomed.append(base)
        for base in doomed:
            try:
                self.fs.rm(self._path(base), recursive=True)
            except FileNotFoundError:
                pass
        return doomed


def _write_synced(path: str, data: bytes | memoryview) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Saver:
    """Saves in the background; one save in flight. ``save`` returns after the memory copy, and
    never waits for a previous write: while one runs, a new save is refused (None)."""

    def __init__(self, store: CheckpointStore, keep: int, on_done: Callable[[dict[str, Any]], None], fault: Callable[[int], None] = lambda step: None) -> None:
        self.store = store
        self.keep = keep
        self.on_done = on_done
        self.fault = fault
        self._thread: threading.Thread | None = None
        self.writing: int | None = None
        """The step whose write is in flight (None when idle)."""
        self.last_stall = 0.0
        self.error: BaseException | None = None
        self._pool = PinnedPool()

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> float | None:
        """Copy ``state`` to memory and start writing it; returns the stall in seconds, or None
        (nothing done) if the previous write is still running."""
        if self.busy():
            return None
        started = time.perf_counter()
        pool = self._pool if _has_gpu_tensor(state) else None
        copy = snapshot(state, pool)
        landed = copies_done(state) if pool is not None else (lambda: None)
        self.last_stall = time.perf_counter() - started
        self.writing = step
        self._thread = threading.Thread(target=self._persist, args=(step, copy, meta, self.last_stall, landed, pool),
                                        name="unbroken-checkpoint", daemon=True)
        self._thread.start()
        return self.last_stall

    def _persist(self, step: int, copy: dict[str, Any], meta: dict[str, Any], stall: float,
                 landed: Callable[[], None] = lambda: None, pool: PinnedPool | None = None) -> None:
        started = time.perf_counter()
        try:
            landed()  # the device-to-host copies of a GPU state, queued by save()
            written = self._write(step, copy, meta)
            if written is not None:
                self.on_done({"step": step, "stall": stall, "write_seconds": time.perf_counter() - started, **written})
        except BaseException as exc:  # reported, never raised into training
            self.error = exc
            log.error("%s of step %d failed: %s", self.what, step, exc)
            print(f"unbroken: error: {self.what} of step {step} failed: {exc}", flush=True)
        finally:
            if pool is not None:
                pool.give_back()

    what = "checkpoint"
    """What this saver writes, for its messages."""

    def _write(self, step: int, copy: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any] | None:
        """Write and publish ``copy`` (and empty it as soon as it is serialised, so that a large
        state is not held twice); the fields of the ``checkpoint`` event, or None for no event."""
        buffer = MemoryFile(capacity=_tensor_bytes(copy) + (1 << 20))
        torch.save(copy, buffer)
        copy.clear()
        location = self.store.write(step, buffer.getbuffer(), meta, before_manifest=lambda: self.fault(step))
        deleted = self.store.retain(self.keep, just_written=step)
        return {"location": location, "bytes": buffer.getbuffer().nbytes, "deleted": deleted}

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self.writing = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
