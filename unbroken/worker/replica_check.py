"""Replica checks: every member must hold bit-identical parameters and buffers (an invariant of the protocol, docs/protocol.md).

The members allgather a sha256 of their model's state_dict over the generation's group and
compare. A mismatch is :class:`~unbroken.errors.ReplicaDivergence`, never repaired silently: it
means the protocol was broken (or the forward pass is not deterministic across members). Run at
the end of every job, and every ``verify_every`` steps when that is set.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

import torch

from unbroken.errors import GenerationFailed, ReplicaDivergence

if TYPE_CHECKING:
    from unbroken.worker.runtime import Job

log = logging.getLogger("unbroken.worker.runtime")  # moved out of the runtime; its messages keep their logger


def verify_replicas(job: Job) -> bool:
    """Exchange a hash of the parameters and buffers; all members must agree.

    Returns False (after abandoning the generation) if the exchange itself failed."""
    digest = hashlib.sha256()
    for name, tensor in job.model.state_dict().items():
        digest.update(name.encode())
        tensor = getattr(tensor, "_local_tensor", tensor)  # a replica group's process compares its own shard
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    row = torch.tensor(list(digest.digest()), dtype=torch.int64)
    group = job._joiner.group
    try:
        table = group.allgather_rows(row, "replica check")
    except GenerationFailed as exc:
        job._abandon(str(exc))
        return False
    rows = [bytes(r).hex() for r in table.tolist()]
    if len(set(rows)) != 1:
        by_member = ", ".join(f"{m}={h[:12]}" for m, h in zip(group.members, rows))
        raise ReplicaDivergence(f"members hold different parameters after step {job.next_step} (generation {job.generation}): {by_member}")
    job.replica_hash = digest.hexdigest()
    job._events.emit("replicas", generation=job.generation, members=job.member_count, hash=job.replica_hash, step=job.next_step)
    log.info("%s: %d replicas identical at step %d (sha256 %s)", job.member_id, job.member_count, job.next_step, job.replica_hash[:16])
    return True
