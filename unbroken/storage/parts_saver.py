"""The background writer of a sharded optimizer's checkpoints (``shard_optimizer``): every member
writes the part it owns, rank 0 the rest, and publishes once every part is there
(:mod:`unbroken.storage.optimizer_parts` holds the format)."""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any, Callable

import torch

from unbroken.storage.checkpoint import FORMAT_WITH_PARTS, STATE_FILE, CheckpointStore, Saver
from unbroken.storage.optimizer_parts import PARTS_DIR, merge, put_file, put_marker, wait_for_parts, write_part
from unbroken.storage.state_copy import MemoryFile, _tensor_bytes

log = logging.getLogger(__name__)

PART_TIMEOUT = 600.0
"""The default of ``CheckpointSettings.part_timeout``: how long rank 0 waits for the parts of members
still in the save's generation (``UNBROKEN_CHECKPOINT_PART_TIMEOUT``)."""


class PartsSaver(Saver):
    """Every member's writer of checkpoints with a sharded optimizer: in the background, each member
    writes its part (:func:`write_part`); rank 0 also writes ``state.pt`` and publishes the
    checkpoint once every part is there (:func:`wait_for_parts`, :func:`merge`).

    ``save(step, {"train": state or None, "spans": {span: entries}}, meta)``: ``meta`` carries the
    manifest's fields and ``"parts"``: this member's index, the number of members, the save's
    generation, the tag every member names the save with (its staging directory, its markers), the
    groups' sizes and the layout. ``given_up(generation)`` says why the parts of members of that
    generation may never come (it ended, or is being abandoned), or None; rank 0 then stops waiting.
    A member never waits for its own previous write: if it still runs, the member says so in a
    marker instead of a part, and rank 0 gives that save up."""

    def __init__(self, store: CheckpointStore, keep: int, on_done: Callable[[dict[str, Any]], None],
                 fault: Callable[[int], None] = lambda step: None,
                 given_up: Callable[[int], str | None] = lambda generation: None, timeout: float = PART_TIMEOUT) -> None:
        super().__init__(store, keep, on_done, fault)
        self.given_up = given_up
        self.timeout = timeout

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> float | None:
        """As :meth:`Saver.save`; a member other than rank 0 whose previous part is still being
        written (a slow store) writes a marker that says so, so that rank 0 does not wait for it."""
        parts = meta["parts"]
        if parts["member"] != 0 and self.busy():
            reason = f"its part of the checkpoint of step {self.writing} was still being written"
            threading.Thread(target=self._refuse, args=(step, parts, reason), name="unbroken-checkpoint-refusal",
                             daemon=True).start()
            return None
        return super().save(step, state, meta)

    def _root(self, step: int, tag: str) -> str:
        """Where the save of ``step`` tagged ``tag`` is written: a staging directory every member names
        alike on a local file system, the checkpoint's own on an object store."""
        name = self.store.name(step)
        return self.store.staging_dir(name, tag) if self.store.local else self.store._path(name)

    def _refuse(self, step: int, parts: dict[str, Any], reason: str) -> None:
        try:
            put_marker(self.store.fs, self._root(step, parts["tag"]), parts["member"], {"tag": parts["tag"], "failed": reason})
        except Exception as exc:  # noqa: BLE001 - rank 0 then waits for its timeout, or the generation's end
            log.warning("could not tell rank 0 that the part of step %d will not come: %s", step, exc)

    def _write(self, step: int, copy: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any] | None:
        store, name = self.store, self.store.name(step)
        parts = meta.pop("parts")
        root = self._root(step, parts["tag"])
        if parts["member"] != 0:  # (a fault injected here: the member dies with its part written, unannounced)
            try:
                write_part(store.fs, root, parts["member"], copy.pop("spans"), lambda: self.fault(step), parts["tag"])
            except Exception as exc:
                self._refuse(step, parts, f"{type(exc).__name__}: {exc}")
                raise
            return None
        write_part(store.fs, root, 0, copy.pop("spans"), tag=parts["tag"])
        buffer = MemoryFile(capacity=_tensor_bytes(copy) + (1 << 20))
        torch.save(copy.pop("train"), buffer)
        payload = buffer.getbuffer()
        put_file(store.fs, f"{root}/{STATE_FILE}", payload)
        members = parts["members"]
        markers = wait_for_parts(store.fs, root, members, self.timeout, lambda: self.given_up(parts["generation"]), parts["tag"])
        files = merge(store.fs, root, markers, parts["sizes"])
        files[STATE_FILE] = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": payload.nbytes}
        record = {"dir": PARTS_DIR, "members": members, "sizes": parts["sizes"], "layout": parts["layout"]}
        manifest = store.manifest(step, files, {**meta, "optimizer_parts": record}, FORMAT_WITH_PARTS)
        if store.local:
            store.move_into_place(root, name)
        self.fault(step)
        store.publish(name, manifest)
        deleted = store.retain(self.keep, just_written=step)
        return {"location": f"{store.url}/{name}", "bytes": sum(f["bytes"] for f in files.values()), "deleted": deleted,
                "parts": members}
