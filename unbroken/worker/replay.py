"""A newcomer's replay of one step its donor committed (:mod:`unbroken.worker.catch_up`): the
hyper-parameters the commit used, then its reduced gradients through the same optimizer and
scheduler, then its synced buffers: the same bits as the commit, for a loop whose state changes
only there (the whole-state digest at the stream's end checks that it did).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from unbroken.worker import state_digests
from unbroken.worker.stream_link import LinkBroken

if TYPE_CHECKING:
    from unbroken.worker.job_parts import CatchingUpJob


def _params(job: CatchingUpJob) -> list[torch.nn.Parameter]:
    return [p for group in job.optimizer.param_groups for p in group["params"]]


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param_group's settings but its parameters: what a commit used, for its replay to use."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def replay(job: CatchingUpJob, index: int, generation: int, grads: list[torch.Tensor | None], buffers: list[torch.Tensor],
           hypers: list[dict[str, Any]] | None = None) -> None:
    """Apply step ``index`` as its commit did (:meth:`unbroken.worker.step.Step.commit`): the
    param_groups' hyper-parameters it used (``hypers``), the reduced gradients through the
    optimizer and the scheduler, then the synced buffers."""
    if hypers is not None:
        if len(hypers) != len(job.optimizer.param_groups):
            raise LinkBroken(f"the donor's optimizer has {len(hypers)} param_groups, this member's {len(job.optimizer.param_groups)}")
        for group, values in zip(job.optimizer.param_groups, hypers):
            group.update(values)
    for p, grad in zip(_params(job), grads):
        p.grad = None if grad is None else grad.to(p.device)
    job._committing = True
    try:
        job.optimizer.step()
        if job.scheduler is not None:
            job.scheduler.step()
        job.optimizer.zero_grad(set_to_none=True)
    finally:
        job._committing = False
    with torch.no_grad():
        for b, value in zip(job.model.buffers(), buffers):
            b.copy_(value)
    job.next_step = index + 1
    job.lineage.append(generation)
    job._digest = state_digests.extend_digest(job._digest, generation)
    job.fresh = False
