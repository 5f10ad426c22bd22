"""The torch process groups a :class:`~unbroken.worker.group.GenerationGroup` is built on.

A Gloo group's device (bound to ``GLOO_SOCKET_IFNAME``, the loopback address for a local store,
or the default; lazily connecting or not), the first messages that connect a lazily connecting
group's ring neighbours, and an NCCL group bound to the worker's GPU. Kept apart from
:mod:`unbroken.worker.group`, which decides when to build them (:data:`~unbroken.worker.group.LAZY_CONNECT`)
and watches every wait on them.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from typing import Any

import torch
import torch.distributed as dist

_WARM_TAG = 0x7E57  # the tag of the messages that connect a member's ring neighbours


def _device(store_host: str, lazy: bool = False):
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        return dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0], lazy_init=lazy)
    try:
        if ipaddress.ip_address(store_host).is_loopback:
            return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=lazy)
    except ValueError:
        if store_host == "localhost":
            return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=lazy)
    return dist.ProcessGroupGloo.create_default_device(lazy_init=lazy)


def _connect_ring(pg: Any, rank: int, size: int) -> list[Any]:
    """Start connecting a lazily connecting group's pairs with this member's ring neighbours (the
    pairs of a Gloo ring allreduce): one small message to the right and one from the left. The
    caller waits on the works returned."""
    if size < 2:
        return []
    right, left = (rank + 1) % size, (rank - 1) % size
    return [pg.send([torch.zeros(1)], right, _WARM_TAG), pg.recv([torch.zeros(1)], left, _WARM_TAG)]


TORCH_TIMEOUT_MARGIN = 60.0
"""Seconds past unbroken's collective timeout at which torch's own NCCL watchdog times a
collective out. Every wait on a generation's group is unbroken's (it aborts the communicator at
the collective timeout, or at a verdict, which stops torch's watchdog); torch's is only a
backstop. Were they equal, torch's watchdog would race unbroken's abort: on a timeout it writes
``exception_dump`` into the job's store and holds its locks while it waits for a trace dump."""


def _nccl_group(store: dist.Store, rank: int, size: int, timeout: float, device: torch.device) -> Any:
    """A ``ProcessGroupNCCL`` for one generation, bound to ``device``. CUDA only. torch's own
    timeout is :data:`TORCH_TIMEOUT_MARGIN` past ``timeout``: unbroken's watch acts first."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=timeout + TORCH_TIMEOUT_MARGIN)
    torch.cuda.set_device(device)
    return dist.ProcessGroupNCCL(store, rank, size, options)
