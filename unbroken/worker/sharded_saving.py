"""Durable checkpoints of a sharded optimizer's state (``shard_optimizer`` with ``--checkpoint-dir``).

No member ever holds the whole optimizer state, not even to save it: at a checkpoint every member
writes the spans it owns (its own partition of every parameter group; buddies write nothing), in
the background, as its part of one checkpoint in torch's DCP format, and rank 0 writes the rest of
the training state beside it and publishes the checkpoint once every part is there
(:mod:`unbroken.storage.optimizer_parts`). The generation's rank 0 decides at a step's barrier, in
the same collective, that a checkpoint follows the step (:meth:`ShardedOptimizer.save_due`), so that
every member knows it at the same step with no collective of its own.

Resuming, at any member count: rank 0 reads ``state.pt`` (no optimizer state in it) and the job is
healed from it as always; then each member reads from the checkpoint's parts exactly the spans its
partitions of the new plan overlap (:func:`read_parts`, from the re-partition: each saved
partition it overlaps is read whole, then sliced). A job that does not
shard, or a single process, reads the whole state into its optimizer in torch's own format
(:func:`~unbroken.storage.optimizer_parts.per_parameter_state`). A plain checkpoint (written without
sharding, or by an earlier version) is loaded by rank 0 whole, and :func:`adopt_loaded` turns it
into holdings of whole parameter groups, from which the re-partition gives every member its spans.
"""

from __future__ import annotations

from typing import Any

import torch

from unbroken.errors import ConfigError
from unbroken.worker.shard_plan import Span, partition_spans
from unbroken.worker.sharded_optimizer import Holding, ShardedOptimizer


def owned(sharded: ShardedOptimizer, rank: int, n: int) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    """The state of the spans member ``rank`` of ``n`` owns, as views of what it holds (the saver copies them)."""
    out = {}
    for span in partition_spans(sharded.sizes, n, rank):
        holding = next((h for h in sharded.holdings
                        if h.span.group == span.group and h.span.start <= span.start and span.end <= h.span.end), None)
        if holding is None:  # (a re-partition gives every member its own partition before any step)
            raise RuntimeError(f"member {rank} of {n} does not hold its own span {span} of the optimizer state to save it")
        at = span.start - holding.span.start
        out[(span.group, span.start, span.end)] = {k: (v[at : at + span.size] if v.dim() else v)
                                                   for k, v in holding.state.items() if isinstance(v, torch.Tensor)}
    return out


def layout_record(sharded: ShardedOptimizer) -> list[list[list[int]]]:
    """Per parameter group, ``[parameter index, offset, numel]`` of each parameter in the group's flat
    vector, the index as in the optimizer's ``state_dict`` (the manifest's ``layout``)."""
    index = {id(p): i for i, p in enumerate(p for group in sharded.face.param_groups for p in group["params"])}
    return [[[index[id(p)], offset, p.numel()] for p, offset in entries] for entries in sharded.layout]


def parameter_shapes(optimizer: torch.optim.Optimizer) -> dict[int, torch.Size]:
    """The shapes of ``optimizer``'s parameters by their ``state_dict`` index."""
    return {i: p.shape for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}


def adopt_loaded(sharded: ShardedOptimizer, at: int) -> bool:
    """The script's optimizer was loaded with a whole state (a plain checkpoint, at step ``at``):
    hold it as whole-group spans, and take it out of the optimizer. False if it holds no state."""
    face = sharded.face
    if not any(face.state.get(p) for entries in sharded.layout for p, _ in entries):
        return False
    holdings = []
    for g, entries in enumerate(sharded.layout):
        states = [face.state.get(p) or {} for p, _ in entries]
        first = next((s for s in states if s), None)
        if first is None or not entries:
            continue
        state: dict[str, Any] = {}
        for key, value in first.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.dim():
                state[key] = torch.cat([(s[key] if s else torch.zeros_like(p)).detach().reshape(-1)
                                        for s, (p, _) in zip(states, entries)])
            else:
                state[key] = value.detach().clone()
        holdings.append(Holding(Span(g, 0, sharded.sizes[g]), torch.empty(0), state))
    face.state.clear()
    sharded.holdings, sharded.shard_step, sharded.pending = holdings, at, None
    return True


def adopt_parts(sharded: ShardedOptimizer, at: int, record: dict[str, Any]) -> None:
    """Rank 0 resumed from a checkpoint whose optimizer state is in parts (``record``, the manifest's):
    it holds nothing yet; the re-partition has every member read its spans of step ``at``
    (:func:`read_parts`). Raises :class:`ConfigError` if the parts were written for other parameters."""
    if record.get("layout") != layout_record(sharded) or record.get("sizes") != list(sharded.sizes):
        raise ConfigError("the checkpoint's optimizer state was written for other parameters than this job's optimizer"
                          f" steps (parameter groups of {record.get('sizes')} elements, this job's {list(sharded.sizes)},"
                          " or another order): resume with the same model and optimizer, or from another checkpoint directory")
    sharded.holdings, sharded.shard_step, sharded.pending, sharded.in_checkpoint = [], at, None, True


def read_parts(sharded: ShardedOptimizer, directory: str, at: int, wanted: list[Span]) -> tuple[list[Holding], int]:
    """This member's ``wanted`` spans, read from the parts of checkpoint ``at`` under ``directory``
    (which the member that resumed verified whole); returns the holdings (masters not made yet) and
    the bytes of state they hold. Raises ``OSError`` if they cannot be read."""
    from unbroken.storage.checkpoint import CheckpointStore
    from unbroken.storage.optimizer_parts import read_spans

    store = CheckpointStore(directory)
    keys = [(s.group, s.start, s.end) for s in wanted]
    states = read_spans(store.fs, store._path(store.name(at)), keys, sharded.device)
    holdings = [Holding(span, torch.empty(0), states[key]) for span, key in zip(wanted, keys)]
    read = sum(v.numel() * v.element_size() for h in holdings for v in h.state.values())
    return holdings, read
