"""The collective backends a job may name (``--backend``, ``UNBROKEN_BACKEND``), checked without
importing torch: ``unbroken run`` validates its flags before it starts its zygote, and a launcher
that imported torch for that would start the zygote 1.5 s later (:mod:`unbroken.worker.devices`
has what needs torch: which backend a worker uses, and whether NCCL can work here)."""

from __future__ import annotations

from unbroken.errors import ConfigError

BACKENDS = ("auto", "gloo", "nccl")


def check_backend_name(name: str) -> str:
    """``name`` if it is one of :data:`BACKENDS`, else a ConfigError naming them."""
    if name not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name
