"""Healing: bring members behind the highest committed step up to date from a live peer.

After a generation forms, its members exchange (next step, fresh, lineage digest) over the new
group. The source is the lowest-ranked member at the highest step that holds real state; every
other member that is behind it, at the same step by another history, or has never been healed
nor committed (a fresh joiner), receives the full training state point to point over the
generation's group. No checkpoint is read. Who sends to whom is decided in
:mod:`unbroken.worker.heal_plan`; this module moves the state.

The state moves tensor by tensor (:func:`send_state`, :func:`recv_state`): the nested state is
split into a *skeleton* (its structure and every non-tensor leaf, pickled, with each tensor
replaced by its index) and the list of its tensors (:func:`split`, :func:`join`). The messages,
all from the source to one receiver, in this order:

1. header (tag ``TAG_HEADER``): int64[4] = ``MAGIC``, ``STATE_VERSION``, manifest bytes, tensor
   bytes. Its layout never changes, so that a receiver can tell a sender of another version.
2. manifest (tag ``TAG_MANIFEST``): uint8[manifest bytes], a pickle of the skeleton, each
   tensor's dtype and shape, the list of tensor messages that follow and the number of lanes.
3. tensor messages, in the manifest's order: a slice of at most ``MESSAGE_BYTES`` of one large
   tensor (``LARGE_BYTES`` or more; tag ``TAG_TENSOR``), sent from the tensor's own CPU memory
   without a copy when it is contiguous; or a pack (tag ``TAG_PACK``): small tensors of one dtype
   concatenated into one flat buffer of at most ``PACK_BYTES``, so that thousands of tiny
   tensors do not pay a message each. Empty tensors send nothing. With lanes (Gloo), the slices
   go over parallel connections made for the heal (:mod:`unbroken.worker.heal_lanes`).

The manifest is a pickle, read by a restricted unpickler (:class:`~unbroken.storage.safe_unpickle.SafeUnpickler`):
only plain containers, numbers, strings, torch dtypes and sizes, numpy arrays and this module's own types, never
an arbitrary callable; another object is refused with an error naming its type (as checkpoints' ``weights_only``).

A receiver loads nothing into the caller's objects: it builds a new state and returns it only
once every message has arrived, so a transfer cut by a failure leaves it as it was. It allocates
its large tensors when the manifest arrives and faults their pages in on a helper thread while
the data comes (``PREFAULT``, :mod:`unbroken.worker.prefault`): for a receiver that does not hold the
memory yet, the first touch of new pages costs about as much as the transfer (benchmarks/bench_heal.py).
"""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch

from unbroken.errors import ConfigError
from unbroken.worker import heal_lanes
from unbroken.worker.group import GenerationGroup
from unbroken.worker.runtime_settings import RuntimeSettings
from unbroken.worker.heal_plan import HealPlan, plan, rounds  # noqa: F401 - offered here as before
from unbroken.worker.rng_state import rng_state, set_rng_state  # noqa: F401 - offered here as before
from unbroken.worker.state_digests import extend_digest, lineage_digest, state_digest  # noqa: F401 - offered here as before
from unbroken.worker.prefault import Prefault as _Prefault
from unbroken.storage.safe_unpickle import SafeUnpickler, safe_loads

STATE_VERSION = 4
"""Version of the healing wire format; a receiver refuses a state of another version."""
MAGIC = 0x756E62726B6E6865  # "unbrknhe": the first int64 of every header
LARGE_BYTES = 1 << 20
"""Tensors of at least this many bytes are sent from their own memory, the others in packs."""
PACK_BYTES = 16 << 20
"""Largest pack of small tensors of one dtype."""
MESSAGE_BYTES = 64 << 20
"""Largest message: a larger tensor goes in slices, so that every wait stays short and counts as
progress on a slow link."""
TAG_HEADER = 1
TAG_MANIFEST = 2
TAG_TENSOR = 3
TAG_PACK = 4
_HEADER_BYTES = 4 * 8


# -- skeleton and tensors ------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver needs to allocate one tensor of the state."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    on_gpu: bool = False
    """Whether the sender holds it in GPU memory: a receiver with a GPU puts it on its own."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Skeleton:
    """A state without its tensors: ``body`` pickles the structure and every other leaf, with
    tensor ``i`` in place of each tensor (a pickle persistent id); ``specs[i]`` describes it."""

    body: bytes
    specs: tuple[TensorSpec, ...]


def _streamable(obj: Any) -> bool:
    """Whether a tensor goes by the tensor path. Anything else (sparse, quantized, nested, meta,
    tensor subclasses) is pickled inside the skeleton as torch would pickle it."""
    return (
        type(obj) in (torch.Tensor, torch.nn.Parameter)
        and obj.layout == torch.strided
        and not obj.is_quantized
        and not obj.is_nested
        and obj.device.type != "meta"
    )


class _Splitter(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and _streamable(obj):
            index = self._index.get(id(obj))  # the state holds obj alive while it is pickled
            if index is None:
                index = self._index[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
            return ("tensor", index)
        return None


class _Joiner(SafeUnpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        kind, index = pid
        if kind != "tensor":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r} in a healing skeleton")
        return self._tensors[index]


def split(state: Any) -> tuple[Skeleton, list[torch.Tensor]]:
    """The skeleton of ``state`` and its tensors, in the skeleton's order. Pure: ``state`` is
    only read. Any picklable structure works (dicts keep their type and attributes, e.g. a
    state_dict's ``_metadata``); one tensor object met twice is listed once."""
    buffer = io.BytesIO()
    splitter = _Splitter(buffer)
    splitter.dump(state)
    specs = tuple(TensorSpec(t.dtype, tuple(t.shape), t.device.type == "cuda") for t in splitter.tensors)
    return Skeleton(buffer.getvalue(), specs), splitter.tensors


def join(skeleton: Skeleton, tensors: list[torch.Tensor]) -> Any:
    """The state that :func:`split` took apart, with ``tensors`` in place of its tensors."""
    if len(tensors) != len(skeleton.specs):
        raise ValueError(f"the skeleton holds {len(skeleton.specs)} tensors, got {len(tensors)}")
    for index, (tensor, spec) in enumerate(zip(tensors, skeleton.specs)):
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"tensor {index} is {tensor.dtype}{list(tensor.shape)}, the skeleton says {spec.dtype}{list(spec.shape)}"
            )
    return _Joiner(io.BytesIO(skeleton.body), tensors).load()


class _Mark:
    """Stands for tensor ``index`` while :func:`tensor_places` walks a skeleton."""

    def __init__(self, index: int) -> None:
        self.index = index


def tensor_places(skeleton: Skeleton) -> list[tuple[Any, ...] | None]:
    """Where each tensor of ``skeleton`` sits in its state: the keys from the root (dict keys,
    list and tuple indices), or None for one met only inside another kind of object. Pure."""
    places: list[tuple[Any, ...] | None] = [None] * len(skeleton.specs)

    def walk(node: Any, place: tuple[Any, ...]) -> None:
        if isinstance(node, _Mark):
            if places[node.index] is None:
                places[node.index] = place
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(value, place + (key,))
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, place + (i,))

    walk(_Joiner(io.BytesIO(skeleton.body), [_Mark(i) for i in range(len(skeleton.specs))]).load(), ())
    return places


def messages(specs: tuple[TensorSpec, ...]) -> list[tuple]:
    """The tensor messages that carry tensors of ``specs``, in order: ``("slice", index, start,
    count)`` for elements [start, start + count) of a large tensor, flattened, or ``("pack",
    dtype, indices)`` for small tensors of one dtype, concatenated. Pure."""
    out: list[tuple] = []
    packs: dict[torch.dtype, list[int]] = {}
    filled: dict[torch.dtype, int] = {}
    for index, spec in enumerate(specs):
        size = spec.nbytes
        if size == 0:
            continue
        if size >= LARGE_BYTES:
            per_message = max(1, MESSAGE_BYTES // spec.dtype.itemsize)
            for start in range(0, spec.numel, per_message):
                out.append(("slice", index, start, min(per_message, spec.numel - start)))
            continue
        pack = packs.setdefault(spec.dtype, [])
        if pack and filled[spec.dtype] + size > PACK_BYTES:
            out.append(("pack", spec.dtype, tuple(pack)))
            pack.clear()
            filled[spec.dtype] = 0
        pack.append(index)
        filled[spec.dtype] = filled.get(spec.dtype, 0) + size
    out.extend(("pack", dtype, tuple(pack)) for dtype, pack in packs.items() if pack)
    return out


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a flat, contiguous tensor on its own device: itself (a view) if it already
    is one. The group stages it through its own device if that differs (a GPU tensor over Gloo)."""
    return tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)


# -- transfer ------------------------------------------------------------------------------------

PREFAULT = True
"""Whether a receiver faults in the pages of its new tensors on a helper thread, ahead of the data."""


def send_state(
    group: GenerationGroup,
    state: dict[str, Any],
    dst: int,
    on_started: Callable[[], None] = lambda: None,
    progress: Callable[[], None] = lambda: None,
    lanes: int = RuntimeSettings.heal_lanes,
) -> int:
    """Send ``state`` to rank ``dst`` of ``group``; returns the bytes sent; ``lanes``: connections
    for the large tensors where ``group`` is a Gloo group (the receiver follows).

    ``on_started`` is called once, after the first messages (header and manifest) and before
    any tensor (a fault-injection point); ``progress`` after every message sent. Large tensors
    go from their own memory (a copy only if they are not contiguous, or not on the CPU).
    Raises :class:`GenerationFailed` if the transfer fails or the generation is abandoned.
    """
    skeleton, tensors = split(state)
    plan_ = messages(skeleton.specs)
    lane_count = heal_lanes.lanes_for(group, lanes, plan_)
    manifest = pickle.dumps((skeleton, plan_, lane_count), protocol=pickle.HIGHEST_PROTOCOL)
    payload = sum(spec.nbytes for spec in skeleton.specs)
    header = torch.tensor([MAGIC, STATE_VERSION, len(manifest), payload], dtype=torch.int64)
    group.send(header, dst, TAG_HEADER, "healing transfer (header)")
    progress()
    group.send(torch.frombuffer(bytearray(manifest), dtype=torch.uint8), dst, TAG_MANIFEST, "healing transfer (manifest)")
    progress()
    lane_group = heal_lanes.Lanes(group, group.rank, dst, lane_count) if lane_count else None
    on_started()
    sent = _HEADER_BYTES + len(manifest)
    current: tuple[int, torch.Tensor] | None = None  # the large tensor being sent, flattened
    buffer: torch.Tensor | None = None
    for message in plan_:
        if message[0] == "slice":
            _, index, start, count = message
            if current is None or current[0] != index:
                current = buffer = None  # free a copy of the previous tensor before making the next
                current = (index, _flat(tensors[index]))
            buffer = current[1][start : start + count]
            if lane_group is not None:  # counted and reported as it completes
                sent += lane_group.issue(buffer, progress)
                continue
            group.send(buffer, dst, TAG_TENSOR, "healing transfer (tensor)")
        else:
            _, _, indices = message
            parts = [tensors[i].detach().resolve_conj().resolve_neg().reshape(-1) for i in indices]
            device = getattr(group, "device", torch.device("cpu"))
            if len({part.device for part in parts}) == 1:
                buffer = torch.cat(parts).to(device)  # a pack of GPU tensors over Gloo: one copy to the host
            else:
                buffer = torch.cat([part.to(device) for part in parts])
            del parts
            group.send(buffer, dst, TAG_PACK, "healing transfer (small tensors)")
        sent += buffer.numel() * buffer.element_size()
        progress()
    return sent + (lane_group.drain(progress) if lane_group is not None else 0)


def recv_state(
    group: GenerationGroup, src: int, progress: Callable[[], None] = lambda: None, gpu: torch.device | None = None,
    into: dict[tuple[Any, ...], torch.Tensor] | None = None,
) -> tuple[dict[str, Any], int]:
    """Receive a state sent by :func:`send_state` from rank ``src``; returns (state, bytes
    received). ``progress`` is called after every message received.

    ``into``: tensors of this member, by their place in the state (:func:`tensor_places`), that
    may be overwritten: a large tensor received at that place with the same dtype, shape and
    device lands in it instead of in new memory (:mod:`unbroken.worker.warm_state`). Only memory
    that holds nothing of value belongs there: a cut transfer leaves it partly written, and
    empties ``into`` (a receive still posted may write it later).
    Nothing is loaded into the caller's objects: a transfer cut by a failure
    (:class:`GenerationFailed`) leaves the receiver as it was. Every tensor arrives as a plain,
    contiguous tensor with its own memory, of the sender's dtype, shape and values: a
    non-contiguous tensor or a view arrives as a contiguous copy, tensors that share memory in
    the sender (a view and its base) arrive as separate tensors, a GPU tensor arrives on ``gpu``
    (on the CPU when ``gpu`` is None), a CPU tensor on the CPU, a Parameter as a plain tensor.
    One tensor object that appears twice in the state arrives as one object, twice.
    Raises :class:`ConfigError` if the sender runs another version of the wire format."""
    header = torch.zeros(4, dtype=torch.int64)
    group.recv(header, src, TAG_HEADER, "healing transfer (header)")
    progress()
    magic, version, manifest_bytes, payload = header.tolist()
    if magic != MAGIC:
        raise ConfigError(f"the healing transfer from rank {src} does not start with a healing header")
    if version != STATE_VERSION:
        raise ConfigError(
            f"healing state version {version} from rank {src} is not {STATE_VERSION}: members run different versions of unbroken"
        )
    raw = torch.empty(manifest_bytes, dtype=torch.uint8)
    group.recv(raw, src, TAG_MANIFEST, "healing transfer (manifest)")
    progress()
    skeleton, plan_, lane_count = safe_loads(raw.numpy().tobytes())
    del raw
    specs = skeleton.specs
    tensors: list[torch.Tensor | None] = [None] * len(specs)
    places = tensor_places(skeleton) if into else [None] * len(specs)
    large = []  # allocated now (no memory is touched yet), in the order they arrive
    for message in plan_:
        if message[0] == "slice" and tensors[message[1]] is None:
            spec = specs[message[1]]
            warm = _warm_destination(into, places[message[1]], spec, _place(spec, gpu))
            if warm is not None:
                tensors[message[1]] = warm
                continue
            tensors[message[1]] = torch.empty(spec.shape, dtype=spec.dtype, device=_place(spec, gpu))
            if tensors[message[1]].device.type == "cpu":
                large.append(tensors[message[1]])
    lanes = heal_lanes.Lanes(group, src, group.rank, lane_count) if lane_count else None
    prefault = _Prefault(large) if PREFAULT else None
    del large
    try:
        received = _receive_tensors(group, src, plan_, specs, tensors, progress, gpu, lanes)
    except BaseException:
        if into:
            into.clear()
        raise
    finally:
        if prefault is not None:
            prefault.stop()
    if received != payload:
        raise ValueError(f"healing transfer from rank {src}: received {received} tensor bytes, the header announced {payload}")
    received += _HEADER_BYTES + manifest_bytes
    for index, spec in enumerate(specs):
        if tensors[index] is None:  # empty tensors travel in the manifest only
            tensors[index] = torch.empty(spec.shape, dtype=spec.dtype, device=_place(spec, gpu))
    return join(skeleton, tensors), received


def _warm_destination(into: dict[tuple[Any, ...], torch.Tensor] | None, place: tuple[Any, ...] | None,
                      spec: TensorSpec, device: torch.device) -> torch.Tensor | None:
    """The tensor of ``into`` at ``place``, if the one received there fits it exactly."""
    tensor = into.get(place) if into and place is not None else None
    if (tensor is None or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape
            or tensor.device != device or not tensor.is_contiguous()):
        return None
    return tensor


def _place(spec: TensorSpec, gpu: torch.device | None) -> torch.device:
    """Where a received tensor goes: on this member's GPU if the sender held it on one."""
    return gpu if spec.on_gpu and gpu is not None else torch.device("cpu")


def _receive_tensors(group: GenerationGroup, src: int, plan_: list[tuple], specs: tuple[TensorSpec, ...], tensors: list[torch.Tensor | None],
                     progress: Callable[[], None], gpu: torch.device | None = None, lanes: heal_lanes.Lanes | None = None) -> int:
    received = 0
    for message in plan_:
        if message[0] == "slice":
            _, index, start, count = message
            buffer = tensors[index].view(-1)[start : start + count]
            if lanes is not None:  # counted and reported as it completes
                received += lanes.issue(buffer, progress)
                continue
            group.recv(buffer, src, TAG_TENSOR, "healing transfer (tensor)")
        else:
            _, dtype, indices = message
            buffer = torch.empty(sum(specs[i].numel for i in indices), dtype=dtype, device=getattr(group, "device", "cpu"))
            group.recv(buffer, src, TAG_PACK, "healing transfer (small tensors)")
            offset = 0
            for i in indices:
                count = specs[i].numel
                part = buffer[offset : offset + count].reshape(specs[i].shape)
                place = _place(specs[i], gpu)
                tensors[i] = part.clone() if part.device == place else part.to(place)
                offset += count
        received += buffer.numel() * buffer.element_size()
        progress()
    return received + (lanes.drain(progress) if lanes is not None else 0)
