"""unbroken: PyTorch data-parallel training that survives the loss of members.

The import is light: torch is loaded only when :class:`Job` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Job", "Step", "RuntimeSettings", "__version__"]

if TYPE_CHECKING:
    from unbroken.runtime import Job, RuntimeSettings, Step


def __getattr__(name: str) -> Any:
    if name in ("Job", "Step", "RuntimeSettings"):
        from unbroken import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
