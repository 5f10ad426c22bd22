"""Optimizer state sharded across the members, every part held twice (``shard_optimizer``, ZeRO-1 style).

The script's optimizer stays what the script, its scheduler and its logging see (its
``param_groups``, hyper-parameters and all) but holds no per-parameter state: a member keeps the
state of the two partitions it holds (:mod:`unbroken.worker.shard_plan`), as flat slices stepped by
an optimizer of the same class, the *inner* one, over flat copies of those slices of the
parameters. Its memory is about 2/N of a full replica's.

A step, after the gradient allreduce (which is as without sharding):

1. each member copies the reduced gradients of its held spans into their flat copies;
2. *barrier*: a one-element allreduce. Once it completes on any member, every member had reduced
   gradients, so every member's spans can be brought to step s+1 from what it holds;
3. *apply*: the inner optimizer steps the held spans (owner and buddy alike, bit-equal) and
   writes them into the model's parameters;
4. *gather*: every member sends the partition it owns; each writes the others into its parameters.

The step is committed when the gather completes. A failure between 2 and 4 leaves this member
*pending* (:class:`Pending`): "ready" (gradients kept, nothing applied: the barrier failed here)
or "applied" (the gather failed here). The next generation decides
(:func:`unbroken.worker.resharding.roll_forward`): if any survivor applied step s, every pending
member completes it (rolls forward) and the parameters every member misses come from the members
that hold them; otherwise nobody applied it and the step is redone. No copy of the state is taken
per step: the guarantee rests on step 2, as the gradient allreduce's does today.

Only optimizers whose update is element-wise are sharded (a slice of a parameter steps as the
whole would): :data:`ELEMENTWISE`. Others are refused by name, with what to do.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from unbroken.errors import ConfigError, GenerationFailed
from unbroken.worker.shard_plan import Span, chunk

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta")
"""torch.optim's optimizers whose update of an element reads only that element's gradient and state."""

GATHER_BYTES = 16 << 20
"""The gather's staging buffer, all members' parts of one round together: a step's gather moves the
parameters in rounds of this size instead of allocating (and faulting in) a buffer the size of the
model every step."""

READY, APPLIED = 1, 2
"""Kinds of :class:`Pending`: reduced gradients kept (the barrier failed here), or the step applied
to this member's spans (the gather failed here)."""


@dataclass
class Holding:
    """A span of one parameter group that this member holds: the flat copy of its parameters
    (the inner optimizer's parameter) and its optimizer state (the inner optimizer's for it)."""

    span: Span
    master: torch.Tensor
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class Pending:
    """A step whose barrier or gather failed on this member (see the module's docstring)."""

    kind: int
    step: Any
    """The :class:`~unbroken.worker.step.Step`, committed later if the next generation rolls forward."""
    was: int = 0
    """The kind it had when the step failed (a ``READY`` member that applied in a roll-forward is ``APPLIED``)."""

    def __post_init__(self) -> None:
        self.was = self.was or self.kind


class ShardedOptimizer:
    """The sharded state of one job's optimizer: what this member holds, and the step over it.

    Args:
        face: the script's optimizer (its param_groups are the hyper-parameters' truth).
        allowed: ``check()`` raises if the script itself calls ``face.step()`` (the loop's rules).
    """

    def __init__(self, face: torch.optim.Optimizer, allowed: Callable[[], None]) -> None:
        refuse_unshardable(face)
        self.face = face
        face.state.clear()  # (Adagrad makes its state when built: the inner optimizers make theirs)
        self.layout: list[list[tuple[torch.Tensor, int]]] = []
        """Per parameter group: each parameter that requires a gradient (torch.optim never steps the
        others) with its offset in the group's flat vector."""
        for group in face.param_groups:
            offset, entries = 0, []
            for p in (p for p in group["params"] if p.requires_grad):
                entries.append((p, offset))
                offset += p.numel()
            self.layout.append(entries)
        self.sizes = [sum(p.numel() for p, _ in entries) for entries in self.layout]
        self.holdings: list[Holding] = []
        self.shard_step = 0
        """The step the held spans' state is at: the number of updates applied to it."""
        self.pending: Pending | None = None
        self.must_resume = False
        """Set when the state was lost: the next generation must go on from a checkpoint, or not at all."""
        self.in_checkpoint = False
        """Set on the member that resumed from a checkpoint whose optimizer state is in parts: every
        member reads its spans from there at the re-partition (:mod:`unbroken.worker.sharded_saving`)."""
        self.read_failures = 0
        """Re-partitions in a row in which this member could not read its spans from that checkpoint."""
        self.inner: torch.optim.Optimizer | None = None
        self._group: Any = None
        self._step_index = -1
        self._chaos: Callable[[str, int], None] = lambda point, step: None
        self._wants_save: Callable[[], bool] = lambda: False
        self.save_due = 0
        """Set by a step's barrier: rank 0 asked for a checkpoint after this step, named by this number
        (:mod:`unbroken.worker.sharded_saving`; 0: none)."""
        self._allowed = allowed
        self._stages: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

        def step(closure: Any = None) -> None:  # scaler.step(face) lands here too
            face._opt_called = True  # type: ignore[attr-defined]  # what an LR scheduler checks, as its own wrapper does
            self._face_step(closure)

        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        face.step = step  # type: ignore[method-assign]

    # -- the parameters' flat views ----------------------------------------------------------

    def pieces(self, span: Span) -> list[tuple[torch.Tensor, int, int, int]]:
        """``span`` as (parameter, start in it, end in it, start in the span)."""
        out = []
        for p, offset in self.layout[span.group]:
            a, b = max(span.start, offset), min(span.end, offset + p.numel())
            if a < b:
                out.append((p, a - offset, b - offset, a - span.start))
        return out

    def read(self, span: Span, into: torch.Tensor | None = None, grads: bool = False) -> torch.Tensor:
        """The parameters (or their gradients; zero where there is none) of ``span`` as one flat tensor."""
        dtype, device = self.dtype(span.group), self.device(span.group)
        flat = into if into is not None else torch.empty(span.size, dtype=dtype, device=device)
        with torch.no_grad():
            for p, a, b, at in self.pieces(span):
                source = p.grad if grads else p
                if source is None:
                    flat[at : at + b - a].zero_()
                else:
                    flat[at : at + b - a].copy_(source.detach().reshape(-1)[a:b])
        return flat

    def write(self, span: Span, flat: torch.Tensor) -> None:
        """Write ``flat`` (the span's values) into the model's parameters."""
        with torch.no_grad():
            for p, a, b, at in self.pieces(span):
                p.detach().view(-1)[a:b].copy_(flat[at : at + b - a])

    def dtype(self, group: int) -> torch.dtype:
        return self.layout[group][0][0].dtype

    def device(self, group: int) -> torch.device:
        return self.layout[group][0][0].device

    # -- the plan this member holds ----------------------------------------------------------

    def hold(self, holdings: list[Holding]) -> None:
        """Hold ``holdings`` from now on (their masters read from the parameters, which are at
        :attr:`shard_step`), and build the inner optimizer over them."""
        self.holdings = holdings
        pairs = []
        for g, face_group in enumerate(self.face.param_groups):
            mine = [h for h in holdings if h.span.group == g]
            for h in mine:
                h.master = torch.nn.Parameter(self.read(h.span), requires_grad=True)
            if mine:
                pairs.append((g, {**_hyper(face_group), "params": [h.master for h in mine]}))
        self._inner_groups = [g for g, _ in pairs]
        self.inner = type(self.face)([group for _, group in pairs]) if pairs else None
        if self.inner is not None:
            for h in holdings:
                if h.state:  # received or kept: replaces what a constructor may have made (Adagrad)
                    self.inner.state[h.master] = h.state
                h.state = self.inner.state[h.master]  # the same dict from now on: stepped in place

    def forget(self) -> None:
        """Hold nothing valid any more (this member received the whole state of another)."""
        self.holdings, self.shard_step, self.pending, self.inner, self.in_checkpoint = [], -1, None, None, False

    def state_bytes(self) -> int:
        """Bytes of optimizer state this member holds (its spans')."""
        return sum(v.numel() * v.element_size() for h in self.holdings for v in h.state.values() if isinstance(v, torch.Tensor))

    # -- the step ----------------------------------------------------------------------------

    def arm(self, group: Any, step_index: int, chaos: Callable[[str, int], None], wants_save: Callable[[], bool]) -> None:
        """The next ``face.step()`` (from :meth:`Step.commit`, directly or through a GradScaler)
        is step ``step_index`` of ``group``; ``wants_save()`` is rank 0's wish for a checkpoint after it."""
        self._group, self._step_index, self._chaos, self._wants_save = group, step_index, chaos, wants_save
        self.save_due = 0  # a step that failed after its barrier said so saves nothing: the members differ

    def _face_step(self, closure: Any = None) -> None:
        self._allowed()
        if closure is not None:
            raise ConfigError("a closure cannot be passed to the optimizer's step with shard_optimizer")
        group, self._group = self._group, None
        if group is None:  # a single process: everything is held
            self._load_grads()
            self.apply()
            return
        self._load_grads()
        what = f"step {self._step_index}: sharded optimizer"
        try:
            wish = secrets.randbits(40) + 1 if self._wants_save() else 0  # names the save: the same on every member
            barrier = torch.tensor([1.0, float(wish)], dtype=torch.float64, device=group.device)
            work = issue(group, lambda: group.pg.allreduce([barrier]), f"{what} barrier")
            self._chaos("barrier", self._step_index)
            group.wait(work, f"{what} barrier")
            self.save_due = int(barrier[1])
        except GenerationFailed:
            self.pending = Pending(READY, None)
            raise
        self.apply()
        try:
            self._chaos("gather", self._step_index)
            self.gather(group, what)
        except GenerationFailed:
            self.pending = Pending(APPLIED, None)
            raise

    def _load_grads(self) -> None:
        missing = [i for entries in self.layout for i, (p, _) in enumerate(entries) if p.grad is None]
        if missing:  # the same on every member: the reduced gradients are
            raise ConfigError(
                f"shard_optimizer: {len(missing)} parameter(s) of the optimizer got no gradient in this step (unused in"
                " the forward pass); torch.optim would skip them, which a shared slice of state cannot: give the"
                " optimizer only the parameters the loss uses (or freeze the others with requires_grad_(False))")
        for h in self.holdings:
            if h.master.grad is None:
                h.master.grad = torch.empty_like(h.master)
            self.read(h.span, into=h.master.grad, grads=True)

    def apply(self) -> None:
        """Step the held spans with their loaded gradients, and write them into the parameters."""
        if self.inner is not None:
            for inner_group, g in zip(self.inner.param_groups, self._inner_groups):
                inner_group.update(_hyper(self.face.param_groups[g]))  # a scheduler's or the script's lr
            self.inner.step()
        self.shard_step += 1
        for h in self.holdings:
            self.write(h.span, h.master.detach())

    def gather(self, group: Any, what: str) -> None:
        """Every member sends the partition it owns, in rounds of at most :data:`GATHER_BYTES` over all
        members through one staging buffer kept from step to step; write the others' into the parameters."""
        n, rank = group.size, group.rank
        for g, size in enumerate(self.sizes):
            width = chunk(size, n)
            if not width:
                continue
            dtype, device = self.dtype(g), self.device(g)
            rows = max(1, GATHER_BYTES // (n * dtype.itemsize))
            stage = self._staging(dtype, device, n * min(rows, width))
            own = Span(g, min(size, rank * width), min(size, (rank + 1) * width))
            master = next((h.master.detach() for h in self.holdings if h.span == own), None) if own.size else None
            held = {h.span for h in self.holdings}
            for at in range(0, width, rows):
                b = min(rows, width - at)
                if master is not None and at + b <= own.size:
                    send = master[at : at + b]
                else:  # the short end of the last partition (or none at all): padded
                    send = torch.zeros(b, dtype=dtype, device=device)
                    if master is not None and at < own.size:
                        send[: own.size - at] = master[at:]
                out = stage[: n * b]
                work = issue(group, lambda: group.pg._allgather_base(out, send), f"{what} gather")
                group.wait(work, f"{what} gather")
                for k in range(n):
                    part = Span(g, min(size, k * width), min(size, (k + 1) * width))
                    piece = Span(g, min(part.end, part.start + at), min(part.end, part.start + at + b))
                    if piece.size and part not in held:
                        self.write(piece, out[k * b : k * b + piece.size])

    def _staging(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        key = (dtype, device)
        stage = self._stages.get(key)
        if stage is None or stage.numel() < numel:
            stage = self._stages[key] = torch.empty(numel, dtype=dtype, device=device)
        return stage


def issue(group: Any, start: Callable[[], Any], what: str) -> Any:
    """Start a collective or transfer on ``group``'s process group, counted as its work (waited for with
    ``group.wait``); :class:`GenerationFailed` if it cannot even start (a broken group)."""
    try:
        return group._issued(start())
    except Exception as exc:
        raise GenerationFailed(f"generation {group.number}: {what} failed to start: {exc}") from None


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def refuse_unshardable(optimizer: Any) -> None:
    """Raise :class:`ConfigError` for an optimizer whose state cannot be sharded as flat slices."""
    kind = type(optimizer)
    if kind.__module__.split(".")[:2] != ["torch", "optim"] or kind.__name__ not in ELEMENTWISE:
        raise ConfigError(
            f"shard_optimizer shards element-wise optimizers only ({', '.join(ELEMENTWISE)} from torch.optim);"
            f" {kind.__module__}.{kind.__name__} is not one of them: use one of those, or run without"
            " --shard-optimizer (every member then holds the whole state)")
    for g, group in enumerate(optimizer.param_groups):
        params = group["params"]
        if len({p.dtype for p in params}) > 1 or len({p.device for p in params}) > 1:
            raise ConfigError(f"shard_optimizer: parameter group {g} mixes dtypes or devices; give each its own group")
        if any(not p.is_contiguous() for p in params):
            raise ConfigError(f"shard_optimizer: parameter group {g} has a non-contiguous parameter; make it contiguous")
    if kind.__name__ != "Adagrad" and any(state for state in optimizer.state.values()):  # Adagrad makes its own
        raise ConfigError("shard_optimizer: the optimizer already holds state (was it stepped, or loaded?);"
                          " pass it as built, before any step; the job loads checkpoints itself")
