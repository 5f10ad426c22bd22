"""Replica checks: every member must hold bit-identical parameters and buffers (an invariant of the protocol, docs/protocol.md).

The members allgather a sha256 of their model's state_dict over the generation's group and
compare. A mismatch is :class:`~unbroken.errors.ReplicaDivergence`, never repaired silently: it
means the protocol was broken (or the forward pass is not deterministic across members). Run at
the end of every job, and every ``verify_every`` steps when that is set.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable

import torch

from unbroken.errors import GenerationFailed, ReplicaDivergence

log = logging.getLogger("unbroken.worker.runtime")  # moved out of the runtime; its messages keep their logger


def verify_replicas(model: torch.nn.Module, group: Any, abandon: Callable[[str], None], events: Any, member_id: str,
                    step: int, generation: int, fail_job: Callable[[str], None] = lambda reason: None,
                    sharded: Any = None) -> str | None:
    """Exchange a hash of ``model``'s parameters and buffers over the generation's ``group``; all
    members must agree. Returns the hash, or None (after ``abandon``) if the exchange failed.
    Replicas that differ fail the job (``fail_job``, before raising): no member may re-form
    alone, pass its own check and finish with a model nobody can vouch for.

    ``step`` is the job's next step and ``generation`` its generation, for the messages and the
    ``replicas`` event written to ``events``. With a sharded optimizer (``sharded``), the two holders of
    every partition must hold the same optimizer state too (:func:`verify_shards`)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        tensor = getattr(tensor, "_local_tensor", tensor)  # a replica group's process compares its own shard
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    row = torch.tensor(list(digest.digest()), dtype=torch.int64)
    try:
        table = group.allgather_rows(row, "replica check")
    except GenerationFailed as exc:
        abandon(str(exc))
        return None
    rows = [bytes(r).hex() for r in table.tolist()]
    if len(set(rows)) != 1:
        by_member = ", ".join(f"{m}={h[:12]}" for m, h in zip(group.members, rows))
        message = f"members hold different parameters after step {step} (generation {generation}): {by_member}"
        fail_job(f"replicas diverged: {message}")
        raise ReplicaDivergence(message)
    if sharded is not None and not verify_shards(sharded, group, abandon, step, generation, fail_job):
        return None
    found = digest.hexdigest()
    events.emit("replicas", generation=generation, members=len(group.members), hash=found, step=step)
    log.info("%s: %d replicas identical at step %d (sha256 %s)", member_id, len(group.members), step, found[:16])
    return found


def verify_shards(sharded: Any, group: Any, abandon: Callable[[str], None], step: int, generation: int,
                  fail_job: Callable[[str], None]) -> bool:
    """Every span of the sharded optimizer state held by two members (owner and buddy) holds the
    same state on both (:mod:`unbroken.worker.sharded_optimizer`); False (after ``abandon``) if the
    exchange failed. Copies that differ fail the job, as replicas that differ do."""
    spans = []
    for h in sharded.holdings:
        digest = hashlib.sha256()
        for key in sorted(h.state):
            value = h.state[key]
            if isinstance(value, torch.Tensor):
                digest.update(key.encode())
                digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        spans.append([h.span.group, h.span.start, h.span.end, int.from_bytes(digest.digest()[:7], "big")])
    width = 2 * max(1, len(sharded.sizes))
    row = torch.full((width, 4), -1, dtype=torch.int64)
    for i, span in enumerate(spans[:width]):
        row[i] = torch.tensor(span)
    try:
        table = group.allgather_rows(row.reshape(-1), "optimizer shard check").reshape(group.size, width, 4).tolist()
    except GenerationFailed as exc:
        abandon(str(exc))
        return False
    seen: dict[tuple[int, int, int], dict[int, str]] = {}
    for rank, rows in enumerate(table):
        for g, start, end, value in rows:
            if g >= 0:
                seen.setdefault((g, start, end), {})[value] = group.members[rank]
    split = {span: holders for span, holders in seen.items() if len(holders) > 1}
    if split:
        (g, start, end), holders = next(iter(split.items()))
        message = (f"the two copies of the optimizer state of elements {start}..{end} of parameter group {g} differ after"
                   f" step {step} (generation {generation}): held by {', '.join(sorted(holders.values()))}")
        fail_job(f"replicas diverged: {message}")
        raise ReplicaDivergence(message)
    return True
