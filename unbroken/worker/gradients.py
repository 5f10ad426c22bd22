"""Bucketed gradient allreduce, overlapped with the last micro-batch's backward.

Parameters are grouped into buckets (by dtype and device, in reverse registration order, which is roughly
the order autograd produces their gradients). During the backward of a step's last micro-batch a
hook notes each parameter whose gradient is final; a bucket whose parameters are all final is
copied into its flat buffer and its allreduce starts at once, while autograd keeps working on the
rest. Buckets always start in index order, so every member issues the same collectives in the
same order whatever its share of the batch (an empty share launches them all at the end).

Each bucket also carries one presence slot per parameter, so a gradient that no member produced
stays ``None`` as it would in a single process, and bucket 0 carries the step's control slots
(the reconfigure flag and the share-weighted loss), summed over members for free.

A parameter sharded by FSDP2 (a DTensor, in a replica group) contributes its local shard: the
shard held by process ``j`` of every group is reduced over the generation's group of shard ``j``.

Buckets live on their parameters' device: CUDA gradients are reduced in CUDA memory (by NCCL, or
by Gloo, which takes CUDA tensors), without a copy through the host. The control slots ride in the
first bucket when its dtype holds them exactly enough (float32 or float64: a count exact to 2**24
or 2**53); with half-precision parameters they get a float64 buffer of their own on the same
device, reduced right after the first bucket (float16 turned a count of 100,000 into ``inf``,
bfloat16 a count of 100,003 into 99,840).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from unbroken.errors import ConfigError
from unbroken.worker.group import GenerationGroup
from unbroken.replica_groups.sharding import _local  # a sharded parameter's own part: what replica groups reduce

CONTROL_SLOTS = 5  # [members asking to reconfigure, weighted loss sum, counted total, members counting, members asking to stop]
CONTROL_DTYPES = (torch.float32, torch.float64)
"""Bucket dtypes that carry the control slots themselves; any other gets a float64 control buffer."""

_CHUNK = 1 << 20
"""A split's digest (below 2**40) rides in a gradient bucket as two 20-bit halves: exact in float32."""


def _encode_pace(pace: list[float]) -> list[float]:
    """The pace exchange (``[pace of each member..., digest of each member...]``) as slots that
    a float32 bucket sums exactly: the paces, then each digest's high and low 20 bits. Each
    member writes only its own slots (the others are 0), so every sum is one member's value."""
    n = len(pace) // 2
    digests = [int(d) for d in pace[n:]]
    return list(pace[:n]) + [float(d // _CHUNK) for d in digests] + [float(d % _CHUNK) for d in digests]


def _decode_pace(slots: list[float]) -> list[float]:
    n = len(slots) // 3
    return list(slots[:n]) + [hi * _CHUNK + lo for hi, lo in zip(slots[n : 2 * n], slots[2 * n :])]


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A gradient for a sharded ``param`` whose local shard is ``local``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())


@dataclass
class Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    flat: torch.Tensor
    ready: int = 0
    work: Any = None
    launched: bool = False
    control: bool = False
    extra: int = field(init=False)
    _views: list[torch.Tensor] | None = field(default=None, init=False, repr=False)
    _views_of: Any = field(default=None, init=False, repr=False)
    _presence: dict[tuple[float, ...], torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.extra = len(self.params) + (CONTROL_SLOTS if self.control else 0)

    def _shaped(self) -> list[torch.Tensor] | None:
        """Views of :attr:`flat`, one per parameter, shaped like it (remade when ``flat`` is
        replaced); None when a parameter is sharded (its gradient is a DTensor: the plain path)."""
        if self._views_of is not self.flat:
            self._views_of = self.flat
            self._views = None
            if all(_local(p) is p for p in self.params):
                self._views = [self.flat[off : off + p.numel()].view_as(p) for p, off in zip(self.params, self.offsets)]
        return self._views

    def pack(self) -> None:
        grads = [p.grad for p in self.params]
        shaped = self._shaped()
        if shaped is not None and all(g is not None for g in grads):  # one copy for every parameter
            torch._foreach_copy_(shaped, grads)
            presence = (1.0,) * len(grads)
        else:
            presence = []
            for p, off, g in zip(self.params, self.offsets, grads):
                view = self.flat[off : off + _local(p).numel()]
                if g is None:
                    view.zero_()
                    presence.append(0.0)
                else:
                    view.copy_(_local(g).reshape(-1))
                    presence.append(1.0)
            presence = tuple(presence)
        # the presence slots in one copy (on a GPU, one transfer instead of one per parameter)
        slots = self._presence.get(presence)
        if slots is None:
            slots = self._presence[presence] = torch.tensor(presence, dtype=self.flat.dtype).to(self.flat.device)
        self.flat[self.numel : self.numel + len(presence)].copy_(slots)

    def unpack(self) -> None:
        present = self.flat[self.numel : self.numel + len(self.params)].tolist()  # one read (one sync on a GPU)
        shaped = self._shaped()
        if shaped is not None and all(present):
            grads = [p.grad for p in self.params]
            if all(g is None for g in grads):  # after zero_grad(set_to_none=True): new tensors in one call
                for p, g in zip(self.params, torch._foreach_mul(shaped, 1.0)):
                    p.grad = g
                return
            if all(g is not None for g in grads):
                torch._foreach_copy_(grads, shaped)
                return
        for p, off, here in zip(self.params, self.offsets, present):
            if here == 0:
                p.grad = None
                continue
            local = _local(p)
            view = self.flat[off : off + local.numel()].view_as(local)
            if p.grad is None:
                p.grad = view.clone() if local is p else _like(p, view.clone())
            else:
                _local(p.grad).copy_(view)


class GradientReducer:
    """Owns the buckets and the hooks; one per Job, reused across generations."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_cap_bytes: int, first_bucket_cap_bytes: int = 1 << 20) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        self._group: GenerationGroup | None = None
        self._armed = False
        self._next = 0
        self.error: Exception | None = None
        self.control: torch.Tensor | None = None
        """The control slots' own float64 buffer, when the first bucket is half precision."""
        self._control_work: Any = None
        self.pace: torch.Tensor | None = None
        """The pace exchange of this step (:mod:`unbroken.worker.pacing`) when it needs an allreduce
        of its own (a replica group's power means need float64); else it rides with the control
        slots, in the first bucket or the float64 control buffer (see :meth:`arm`)."""
        self._pace_where = ""
        """Where this step's pace exchange is: ``"bucket"``, ``"control"``, ``"own"`` or ``""``."""
        self._pace_work: Any = None
        self.paces: list[float] = []
        """The summed pace exchange of the last finished step (empty without one)."""
        self.ticks = 0
        """Gradients that became final, ever: progress the coordinator's watchdog sees."""
        self._build(bucket_cap_bytes, first_bucket_cap_bytes)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _build(self, cap: int, first_cap: int) -> None:
        # Like DDP, the first bucket (the last layers' gradients, ready first) is small so that
        # communication starts early in the backward.
        # keyed by (dtype, device): one flat buffer holds one dtype on one device
        pending: dict[Any, list[torch.nn.Parameter]] = {}
        sizes: dict[Any, int] = {}

        def close(key: Any) -> None:
            params = pending.pop(key, [])
            sizes.pop(key, None)
            if params:
                offsets, total = [], 0
                for p in params:
                    offsets.append(total)
                    total += _local(p).numel()
                control = not self.buckets and params[0].dtype in CONTROL_DTYPES
                if not self.buckets and not control:
                    self.control = torch.zeros(CONTROL_SLOTS, dtype=torch.float64, device=params[0].device)
                extra = len(params) + (CONTROL_SLOTS if control else 0)
                flat = torch.zeros(total + extra, dtype=params[0].dtype, device=params[0].device)
                bucket = Bucket(params, offsets, total, flat, control=control)
                self.buckets.append(bucket)
                for p in params:
                    self._bucket_of[id(p)] = bucket

        for p in reversed(self.params):
            key = (p.dtype, p.device)
            pending.setdefault(key, []).append(p)
            sizes[key] = sizes.get(key, 0) + _local(p).numel() * p.element_size()
            if sizes[key] >= (first_cap if not self.buckets else cap):
                close(key)
        for key in list(pending):
            close(key)

    # -- per step ------------------------------------------------------------------------------

    def arm(self, group: GenerationGroup, reconfigure: bool, weighted_loss: torch.Tensor | None, count: float | None = None,
            stop: bool = False, pace: list[float] | None = None, pace_float64: bool = False) -> None:
        """Start reducing buckets as their gradients become final (call before the last backward).

        ``pace``: this member's part of the pace exchange, summed with the gradients: after the
        control slots in the first bucket (float32 or float64: :func:`_encode_pace`), or in the
        float64 control buffer of a half-precision model; in an allreduce of its own only with
        ``pace_float64`` (values that a float32 sum would not carry exactly). An extra collective
        every step cost a healthy 6 ms step on 3 CPU workers a third of its time."""
        self._group = group
        self._armed = True
        self._next = 0
        self.error = None
        for bucket in self.buckets:
            bucket.ready = 0
            bucket.work = None
            bucket.launched = False
        self._control_work = self._pace_work = None
        self.paces = []
        self._place_pace(pace, pace_float64)
        control = self._control_slots()
        if control is not None:
            control[0] = 1.0 if reconfigure else 0.0
            if weighted_loss is not None:
                control[1].copy_(weighted_loss.detach().reshape(()))
            else:
                control[1] = 0.0
            control[2] = 0.0 if count is None else count
            control[3] = 0.0 if count is None else 1.0
            control[4] = 1.0 if stop else 0.0

    def _place_pace(self, pace: list[float] | None, pace_float64: bool) -> None:
        """Write this step's pace exchange where it travels (see :meth:`arm`), resizing the first
        bucket's or the control buffer's tail when the member count changed."""
        self.pace, self._pace_where = None, ""
        device = self.buckets[0].flat.device if self.buckets else torch.device("cpu")
        if self.control is not None:  # a half-precision model: its float64 control buffer carries it
            values = list(pace or [])
            if self.control.numel() != CONTROL_SLOTS + len(values):
                self.control = torch.zeros(CONTROL_SLOTS + len(values), dtype=torch.float64, device=device)
            if values:
                self.control[CONTROL_SLOTS:].copy_(torch.tensor(values, dtype=torch.float64))
                self._pace_where = "control"
            return
        if pace is None:
            self._pace_tail([])
            return
        if pace_float64 or not self.buckets:
            self._pace_tail([])
            self.pace = torch.tensor(pace, dtype=torch.float64, device=device)
            self._pace_where = "own"
            return
        self._pace_tail(_encode_pace(pace))
        self._pace_where = "bucket"

    def _pace_tail(self, slots: list[float]) -> None:
        """The first bucket's slots after its control slots: ``slots`` this step (none: no tail)."""
        if not self.buckets or not self.buckets[0].control:
            return
        first = self.buckets[0]
        base = first.numel + len(first.params) + CONTROL_SLOTS
        if first.flat.numel() != base + len(slots):
            first.flat = torch.zeros(base + len(slots), dtype=first.flat.dtype, device=first.flat.device)
        if slots:
            first.flat[base:].copy_(torch.tensor(slots, dtype=first.flat.dtype))

    def _control_slots(self) -> torch.Tensor | None:
        """The control slots: a view into the first bucket, or their own float64 buffer."""
        if self.control is not None:
            return self.control
        if not self.buckets:
            return None
        first = self.buckets[0]
        base = first.numel + len(first.params)
        return first.flat[base : base + CONTROL_SLOTS]

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        self.ticks += 1
        if not self._armed:
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not force and bucket.ready < len(bucket.params):
                return
            self._next += 1
            if self.error is not None:
                continue
            bucket.pack()
            try:
                bucket.work = self._group.start_allreduce(bucket.flat)
                bucket.launched = True
                if self._next == 1 and self.control is not None:  # every member, right after bucket 0
                    self._control_work = self._group.start_allreduce(self.control)
                if self._next == 1 and self.pace is not None:
                    self._pace_work = self._group.start_allreduce(self.pace)
            except Exception as exc:  # the group is broken: finish() reports it
                self.error = exc

    def finish(self, in_flight: Callable[[], None] | None = None) -> tuple[float, float, float, float, float]:
        """Launch what is left, wait for every bucket and write the sums back into ``.grad``.

        ``in_flight`` is called once every bucket was sent and before any wait (a fault point).
        Returns the summed control slots (members asking to reconfigure, weighted loss sum,
        counted total and members counting, the last two for losses normalised by a global count,
        and members asking to stop the job, :meth:`unbroken.Job.stop`).
        Raises :class:`~unbroken.errors.GenerationFailed` if any allreduce fails or is abandoned;
        the gradients are then left unreduced and must not be applied.
        """
        from unbroken.errors import GenerationFailed

        assert self._group is not None
        self._launch_ready(force=True)
        self._armed = False
        if self.error is not None:
            raise GenerationFailed(f"generation {self._group.number}: gradient allreduce failed to start: {self.error}")
        if in_flight is not None:
            in_flight()
        for i, bucket in enumerate(self.buckets):
            self._group.wait(bucket.work, f"gradient allreduce (bucket {i})")
        if self._control_work is not None:
            self._group.wait(self._control_work, "control allreduce")
        if self._pace_work is not None:
            self._group.wait(self._pace_work, "pace exchange")
            self.paces = self.pace.tolist()
        for bucket in self.buckets:
            bucket.unpack()
        control = self._control_slots()
        if control is None:
            return 0.0, 0.0, 0.0, 0.0, 0.0
        if self._pace_where == "bucket":  # the control slots and the pace exchange in one read
            first = self.buckets[0]
            values = first.flat[first.numel + len(first.params):].tolist()
            self.paces = _decode_pace(values[CONTROL_SLOTS:])
        else:
            values = control.tolist()  # one read (one sync on a GPU); with a float64 control buffer, all of it
            if self._pace_where == "control":
                self.paces = values[CONTROL_SLOTS:]
        flag, loss, count, counting, stop = values[:CONTROL_SLOTS]
        return float(flag), float(loss), float(count), float(counting), float(stop)

    def disarm(self) -> None:
        self._armed = False

    def renew_buffers(self) -> None:
        """Give every bucket a new flat buffer after a generation was abandoned.

        An abandoned allreduce is never cancelled: it stays queued in the parked process group
        and completes if the member it waited for comes back (a stopped process woken by
        SIGCONT sends its share into the old generation). Gloo then writes the result into the
        buffer it was given, so that buffer must never be used for a later step.
        """
        self._armed = False
        for bucket in self.buckets:
            shape, dtype, device = bucket.flat.shape, bucket.flat.dtype, bucket.flat.device
            bucket.flat = bucket.work = bucket._views_of = bucket._views = None  # let go of the old buffer first
            bucket.flat = torch.zeros(shape, dtype=dtype, device=device)
            bucket.launched = False
        if self.control is not None:
            self.control = torch.zeros_like(self.control)
        self._control_work = self._pace_work = self.pace = None
        self._pace_where = ""

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def watch_gradients(model: torch.nn.Module, distributed: bool, bucket_cap_mb: float,
                    count: Callable[[torch.Tensor], None]) -> GradientReducer | None:
    """Distributed: a reducer that allreduces gradients as they become final. Alone: a hook
    that counts them (to tell step.backward's gradients from any other backward's), and None."""
    if distributed:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the model has no parameters that require gradients")
        return GradientReducer(params, int(bucket_cap_mb * (1 << 20)))
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(count)
    return None
