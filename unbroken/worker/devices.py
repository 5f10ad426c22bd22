"""Devices and backends: which device a worker trains on and which collective backend it uses.

``unbroken run`` gives each worker ``LOCAL_RANK`` (and ``LOCAL_WORLD_SIZE``), as torchrun does,
and leaves ``CUDA_VISIBLE_DEVICES`` alone: every worker sees every GPU of its node, and worker
``LOCAL_RANK`` trains on ``cuda:(LOCAL_RANK % device_count)`` (:func:`local_device`). Several
workers on fewer GPUs share them round-robin, which only Gloo allows (NCCL refuses two ranks on
one GPU).

Backends (``--backend``, ``UNBROKEN_BACKEND``): ``gloo`` works with CPU and CUDA tensors;
``nccl`` needs CUDA tensors and a GPU per worker; ``auto`` (the default) picks NCCL when the
model is on a GPU, NCCL is available and every worker of the node has a GPU of its own, else Gloo.
"""

from __future__ import annotations

import os

import torch

from unbroken.errors import ConfigError
from unbroken.worker.local_rank import local_rank
from unbroken.worker.backend_names import BACKENDS, check_backend_name  # noqa: F401 - offered here as before


def cuda_usable() -> bool:
    """Whether this process can use CUDA (never initialises it when no driver is there)."""
    return torch.cuda.is_available()


def nccl_usable() -> bool:
    import torch.distributed as dist

    return cuda_usable() and dist.is_available() and dist.is_nccl_available()


def local_device() -> torch.device:
    """The device this worker should train on: ``cuda:(LOCAL_RANK % device_count)`` when CUDA is
    usable, else the CPU. ``LOCAL_RANK`` is 0 outside ``unbroken run``."""
    if not cuda_usable():
        return torch.device("cpu")
    return torch.device("cuda", (local_rank() or 0) % torch.cuda.device_count())


def model_device(model: torch.nn.Module) -> torch.device:
    """The one device that holds the model's parameters and buffers (CPU for an empty model).
    A ConfigError if they are spread over several: one member trains one replica on one device."""
    found = {t.device for t in list(model.parameters()) + list(model.buffers())}
    if not found:
        return torch.device("cpu")
    if len(found) > 1:
        names = ", ".join(sorted(str(d) for d in found))
        raise ConfigError(f"the model's parameters and buffers are on several devices ({names}); put the whole model on one device")
    return found.pop()


def check_backend_available(name: str) -> None:
    """At launch: refuse ``nccl`` on a machine where it cannot work."""
    check_backend_name(name)
    if name == "nccl" and not nccl_usable():
        why = "CUDA is not available" if not cuda_usable() else "this torch build has no NCCL"
        raise ConfigError(f"--backend nccl needs CUDA GPUs and NCCL, but {why} on this machine; use --backend gloo (or auto)")


def choose_backend(name: str, device: torch.device) -> str:
    """The backend for a model on ``device`` under setting ``name`` (auto, gloo or nccl)."""
    check_backend_name(name)
    if name == "auto":
        return "nccl" if device.type == "cuda" and nccl_usable() and not gpus_shared() else "gloo"
    if name == "nccl":
        check_backend_available(name)
        if device.type != "cuda":
            raise ConfigError(f"backend nccl needs the model on a CUDA device, but it is on {device}; move it with model.to(unbroken.worker.devices.local_device())")
        if gpus_shared():
            raise ConfigError(
                f"backend nccl needs a GPU per worker, but {os.environ.get('LOCAL_WORLD_SIZE')} workers share"
                f" {torch.cuda.device_count()} GPU(s) on this node (NCCL refuses two ranks on one GPU); use --backend gloo"
            )
    elif device.type not in ("cpu", "cuda"):
        raise ConfigError(f"backend gloo handles CPU and CUDA tensors, but the model is on {device}")
    return name


def gpus_shared() -> bool:
    """Whether this node runs more workers (``LOCAL_WORLD_SIZE``) than it has GPUs."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) > torch.cuda.device_count()


def check_assigned(device: torch.device) -> None:
    """Under ``unbroken run``: refuse a model on a GPU that is not this worker's (``LOCAL_RANK``)."""
    if device.type != "cuda" or local_rank() is None or not cuda_usable():
        return
    given = local_device()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index != given.index:
        raise ConfigError(
            f"the model is on cuda:{index} but this worker (LOCAL_RANK={local_rank()}) was given {given};"
            " use model.to(unbroken.worker.devices.local_device())"
        )


def take_device(model: torch.nn.Module, backend: str, collective_timeout: float, distributed: bool) -> tuple[torch.device, str]:
    """The ``model``'s device, made this process's current CUDA device if it is one, and, in a
    ``distributed`` job, the backend its generation groups use (``backend`` as set: ``auto``,
    ``gloo`` or ``nccl``), with the NCCL environment (``collective_timeout``) and the transport
    prepared; ``"none"`` alone. Called on the main thread, before anything touches CUDA."""
    device = model_device(model)
    if device.type == "cuda":
        # On this (the main) thread, before anything touches CUDA: the current device is where
        # snapshots, events and new tensors go (a worker with LOCAL_RANK 1 waited on cuda:0).
        torch.cuda.set_device(device)
    chosen = choose_backend(backend, device) if distributed else "none"
    if distributed:
        check_assigned(device)
        from unbroken.worker.group import set_transport

        if chosen == "nccl":
            from unbroken.worker.nccl import prepare_environment

            prepare_environment(collective_timeout)  # before this process's first NCCL group
        set_transport(chosen, device)
    return device, chosen
