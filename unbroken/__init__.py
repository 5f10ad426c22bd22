"""unbroken: PyTorch data-parallel training that survives the loss of members.

The import is light: torch is loaded only when :class:`Job` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unbroken import _moved

__version__ = "0.1.0"
__all__ = ["Job", "Step", "RuntimeSettings", "RandomWindows", "ScriptState", "group_mesh", "sample_rng", "sample_seed", "__version__"]

if TYPE_CHECKING:
    from unbroken.data.loader import sample_rng, sample_seed
    from unbroken.data.windows import RandomWindows
    from unbroken.worker.group_member import group_mesh
    from unbroken.worker.runtime import Job, RuntimeSettings, Step
    from unbroken.worker.script_state import ScriptState


_moved.install()


def __getattr__(name: str) -> Any:
    if name in ("Job", "Step", "RuntimeSettings"):
        from unbroken.worker import runtime

        return getattr(runtime, name)
    if name == "group_mesh":
        from unbroken.worker.group_member import group_mesh

        return group_mesh
    if name == "ScriptState":
        from unbroken.worker.script_state import ScriptState

        return ScriptState
    if name == "RandomWindows":
        from unbroken.data.windows import RandomWindows

        return RandomWindows
    if name in ("sample_rng", "sample_seed"):
        from unbroken.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
