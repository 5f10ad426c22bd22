"""Which backend (Gloo or NCCL) and device this process's generation groups use.

One :class:`~unbroken.worker.runtime.Job` per process sets it (:func:`set_transport`), and every
:class:`~unbroken.worker.group.GenerationGroup` built afterwards without a transport of its own
takes the current one (:func:`current_transport`). Kept apart from :mod:`unbroken.worker.group`
(which offers these names too): this is a process-wide setting, not a group.
"""

from __future__ import annotations

import torch


class Transport:
    """Which backend a process's generation groups use, and the device their point-to-point
    messages and small collectives go through: the CPU for Gloo, the worker's GPU for NCCL.
    One :class:`~unbroken.worker.runtime.Job` per process sets it (:func:`set_transport`)."""

    def __init__(self, backend: str = "gloo", device: torch.device | str = "cpu") -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        self.backend = backend
        self.device = torch.device(device) if backend == "nccl" else torch.device("cpu")

    def __repr__(self) -> str:
        return f"Transport({self.backend!r}, {str(self.device)!r})"


_transport = Transport()


def set_transport(backend: str, device: torch.device | str) -> None:
    """Set the backend (gloo or nccl) and device of the groups this process builds from now on."""
    global _transport
    _transport = Transport(backend, device)


def current_transport() -> Transport:
    """The transport set last by :func:`set_transport` (Gloo on the CPU until then)."""
    return _transport
