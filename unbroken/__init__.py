"""unbroken: PyTorch data-parallel training that survives the loss of members.

The import is light: torch is loaded only when :class:`Job` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unbroken import _moved

from unbroken.version import __version__
_PUBLIC = {
    "Job": "unbroken.worker.runtime",
    "Step": "unbroken.worker.runtime",
    "RuntimeSettings": "unbroken.worker.runtime",
    "ScriptState": "unbroken.worker.script_state",
    "group_mesh": "unbroken.worker.group_member",
    "local_device": "unbroken.worker.devices",
    "RandomWindows": "unbroken.data.windows",
    "ShardedArrays": "unbroken.data.shards",
    "sample_rng": "unbroken.data.sample_randomness",
    "sample_seed": "unbroken.data.sample_randomness",
    "current_sample": "unbroken.data.sample_randomness",
    "SampleInfo": "unbroken.data.sample_randomness",
    "CheckpointSettings": "unbroken.storage.checkpoint",
    "sum_gradients": "unbroken.replica_groups.sharding",
    "read_events": "unbroken.observe.events",
}
"""Each public name, and the module that defines it (loaded when the name is first used)."""

__all__ = [
    "Job", "Step", "RuntimeSettings", "ScriptState", "group_mesh", "local_device", "RandomWindows", "ShardedArrays",
    "sample_rng", "sample_seed", "current_sample", "SampleInfo", "CheckpointSettings", "sum_gradients", "read_events",
    "__version__",
]  # written out for the linters; a test checks that it names exactly _PUBLIC and __version__

if TYPE_CHECKING:
    from unbroken.data.sample_randomness import SampleInfo, current_sample, sample_rng, sample_seed
    from unbroken.data.shards import ShardedArrays
    from unbroken.data.windows import RandomWindows
    from unbroken.observe.events import read_events
    from unbroken.replica_groups.sharding import sum_gradients
    from unbroken.storage.checkpoint import CheckpointSettings
    from unbroken.worker.devices import local_device
    from unbroken.worker.group_member import group_mesh
    from unbroken.worker.runtime import Job, RuntimeSettings, Step
    from unbroken.worker.script_state import ScriptState


_moved.install()


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
