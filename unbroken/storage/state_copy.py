"""Copies of a training state: the snapshot into host memory that a checkpoint takes at a step
boundary (the only stall of training; a GPU's tensors go into pinned buffers reused between
saves, asynchronously), and :class:`MemoryFile`, through which a state is serialised and read
back without holding the GIL for its large copies.
"""

from __future__ import annotations

import io
from typing import Any, Callable

import torch


def snapshot(state: Any, pool: "PinnedPool | None" = None) -> Any:
    """A copy of ``state`` in host memory whose tensors share nothing with training.

    A GPU tensor is copied into a page-locked host buffer (from ``pool`` when given) by an
    asynchronous copy on the current CUDA stream: the caller must wait for the stream (see
    :func:`copies_done`) before reading the copy. Kernels queued later on that stream (the
    optimizer's) run after the copy, so training can go on at once."""
    if isinstance(state, torch.Tensor):
        tensor = state.detach()
        if tensor.device.type == "cuda" and hasattr(tensor, "to_local"):
            # a DTensor (FSDP2's sharded parameters): copy only this process's shard and keep
            # its place in the global tensor, so that a sharded checkpoint can be written from it
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(snapshot(tensor.to_local(), pool), tensor.device_mesh, tensor.placements,
                                      shape=tensor.shape, stride=tensor.stride(), run_check=False)
        if tensor.device.type == "cuda":
            host = pool.take(tensor) if pool is not None else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            return host
        return tensor.to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: snapshot(v, pool) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v, pool) for v in state)
    return state


def copies_done(state: Any) -> Callable[[], None]:
    """A function that waits until the asynchronous copies :func:`snapshot` queued for ``state``
    (a GPU state) have landed; a no-op when CUDA is not in use."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized() or not _has_gpu_tensor(state):
        return lambda: None
    events = []
    for device in sorted(cuda_devices(state), key=lambda d: d.index or 0):
        # each copy was queued on the current stream of its tensor's device, not of this thread's
        with torch.cuda.device(device):
            event = torch.cuda.Event()
            event.record()
            events.append(event)

    def wait() -> None:
        for event in events:
            event.synchronize()

    return wait


def cuda_devices(state: Any) -> set[torch.device]:
    """The CUDA devices that hold tensors of ``state``."""
    if isinstance(state, torch.Tensor):
        return {state.device} if state.device.type == "cuda" else set()
    if isinstance(state, dict):
        return set().union(*(cuda_devices(v) for v in state.values())) if state else set()
    if isinstance(state, (list, tuple)):
        return set().union(*(cuda_devices(v) for v in state)) if state else set()
    return set()


def _has_gpu_tensor(state: Any) -> bool:
    if isinstance(state, torch.Tensor):
        return state.device.type == "cuda"
    if isinstance(state, dict):
        return any(_has_gpu_tensor(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(_has_gpu_tensor(v) for v in state)
    return False


class PinnedPool:
    """Page-locked host buffers for GPU snapshots, kept from one save to the next (pinning
    memory is slow: it is done once per tensor shape, not once per save). One save uses them
    at a time (the :class:`Saver` has one in flight)."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor] = []

    def take(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, tuple(like.shape))
        free = self._free.get(key)
        buffer = free.pop() if free else torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        self._lent.append(buffer)
        return buffer

    def give_back(self) -> None:
        """Every buffer lent is free again (the save that used them is over)."""
        for buffer in self._lent:
            self._free.setdefault((buffer.dtype, tuple(buffer.shape)), []).append(buffer)
        self._lent = []


class MemoryFile(io.RawIOBase):
    """An in-memory file for ``torch.save``/``torch.load`` whose large writes and reads copy
    with numpy, which releases the GIL: through ``io.BytesIO`` a 1 GiB state held the GIL for
    seconds at a time, starving the member's heartbeat thread (measured: heartbeats 6.8 s late
    with ``benchmarks/bench_heartbeat_load.py``)."""

    def __init__(self, data: Any = None, capacity: int = 1 << 20) -> None:
        import numpy

        self._np = numpy
        self._array = numpy.frombuffer(data, numpy.uint8) if data is not None else numpy.empty(capacity, numpy.uint8)
        self._size = len(self._array) if data is not None else 0
        self._pos = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._size + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        target = self._np.frombuffer(buffer, self._np.uint8)
        count = max(0, min(len(target), self._size - self._pos))
        target[:count] = self._array[self._pos : self._pos + count]
        self._pos += count
        return count

    def write(self, data: Any) -> int:
        source = self._np.frombuffer(memoryview(data).cast("B"), self._np.uint8)
        end = self._pos + len(source)
        if end > len(self._array):
            grown = self._np.empty(max(end, 2 * len(self._array)), self._np.uint8)
            grown[: self._size] = self._array[: self._size]
            self._array = grown
        self._array[self._pos : end] = source
        self._pos = end
        self._size = max(self._size, end)
        return len(source)

    def getbuffer(self) -> memoryview:
        """What was written, without a copy."""
        return memoryview(self._array[: self._size])


def _tensor_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0
