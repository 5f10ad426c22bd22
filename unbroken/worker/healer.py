"""A member's side of healing, right after its generation's group is built (step 2 of the protocol, docs/protocol.md).

The members exchange (next step, fresh, lineage digest); :func:`unbroken.worker.heal_plan.plan` picks the
source and the receivers, and the state fans out over the new group in rounds
(:func:`unbroken.worker.heal_plan.rounds`: every member that holds it, receivers once healed included,
sends it to one more member per round; :mod:`unbroken.worker.healing` holds the wire format). If nobody
holds live state (the start of a job, or every holder died), the group's rank 0 first reads the
newest checkpoint. Every member then reseeds its RNGs for itself, since healing copied the source's. When no member
holds live state and every member built the same state (the same model from the same seed), no
state is sent at all.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from unbroken.errors import EXIT_RESTART_FRESH, GenerationFailed, JobCannotGoOn
from unbroken.worker import heal_plan, healing, resharding, sharded_saving, state_digests
from unbroken.worker.randomness import seed_member
from unbroken.worker.warm_state import adopt_parameters

if TYPE_CHECKING:
    from unbroken.worker.job_parts import HealingJob

log = logging.getLogger("unbroken.worker.runtime")  # moved out of the runtime; its messages keep their logger


class Healer:
    """Brings the members of a new generation to one state: the job's, or a peer's."""

    def __init__(self, job: HealingJob) -> None:
        self.job = job

    def heal(self, group: Any) -> None:
        """Heal ``group``'s members; raises :class:`GenerationFailed` if the group breaks meanwhile."""
        job = self.job
        if job._sharded is not None:
            self._sharded(resharding.roll_forward, group)
        statuses = self._exchange_status(group)
        if job._checkpointing.store is not None and all(fresh for _, fresh, _ in statuses):
            # Nobody in this generation holds live state (the start of a job, or every holder
            # died): its rank 0 reads the newest checkpoint and heals the others from it. The
            # others wait on a store flag, which no collective timeout cuts short.
            if group.rank == 0:
                with job._joiner.busy("reading a checkpoint"):
                    job._checkpointing.resume()
                parts = job._checkpointing.resumed_parts
                if job._sharded is not None and not sharded_saving.adopt_loaded(job._sharded, job.next_step) and parts:
                    sharded_saving.adopt_parts(job._sharded, job.next_step, parts)  # each member reads its own below
                group.set_flag("resume-read")
            else:
                group.wait_flag("resume-read", "waiting for a checkpoint to be read")
            statuses = self._exchange_status(group)
            if job._sharded is not None and job._sharded.must_resume:
                if all(fresh for _, fresh, _ in statuses):  # never train on from step 0 with the trained weights
                    job._joiner.report_job_failure("the sharded optimizer state was lost and no valid checkpoint could be read")
                    raise JobCannotGoOn("the job cannot go on: the sharded optimizer state was lost and no valid"
                                        f" checkpoint could be read from {job.checkpoint.directory}")
                job._sharded.must_resume = False
        plan = heal_plan.plan(statuses)
        if job._unverified is not None and job.fresh and plan.source == group.rank:
            self._restart_afresh(job._unverified)
        if plan.receivers and all(fresh for _, fresh, _ in statuses) and self._same_fresh_state(group):
            # Every member built its model from the same seed: nothing to copy (the start of a job)
            job.fresh = False
            log.info("%s: every member starts from the same state; no heal needed", job.member_id)
        elif plan.receivers:
            self._transfer(group, plan)
        if not job.fresh:
            job._unverified = None  # healed from a peer
        job._warm = None  # unused if no heal came (the whole job started afresh): let it go
        # Healing copied one member's RNG states to the others: give every member its own.
        seed_member(job.plan.seed, job.next_step, group.rank)
        if job._sharded is not None:
            self._sharded(resharding.reshard, group)

    def _sharded(self, part: Any, group: Any) -> None:
        """A part of the sharded optimizer's new generation (:mod:`unbroken.worker.resharding`). A
        span nobody holds any more: every member forgets its state and the next generation goes on
        from the newest checkpoint; without one, the job ends, saying why."""
        job = self.job
        try:
            part(job, group)
        except resharding.ShardedStateLost as lost:
            store = job._checkpointing.store
            if store is None or not store.steps():
                reason = f"{lost}; no checkpoint to go on from (use --checkpoint-dir)"
                job._joiner.report_job_failure(reason)
                raise JobCannotGoOn(f"the job cannot go on: {reason}") from None
            if group.rank == 0:
                print(f"unbroken: {lost}; the job goes on from its newest checkpoint", flush=True)
            job._events.emit("sharded_state_lost", generation=group.number, step=job.next_step, reason=str(lost))
            resharding.forget_progress(job)  # every member: the next generation's rank 0 reads the newest checkpoint
            job._sharded.must_resume = True
            raise GenerationFailed(f"generation {group.number}: {lost}") from None

    def _restart_afresh(self, why: str) -> None:
        """This member's state is unverified and no peer holds a live one: it must not become the
        job's state (DESIGN: Fast paths). It ends, and its launcher restarts it with the state its
        script builds; the others form without it and go on from the newest durable state."""
        job = self.job
        print(f"unbroken: {job.member_id}: its state is unverified ({why}) and no peer holds a live one;"
              " it restarts afresh", file=sys.stderr, flush=True)
        job._stop(finished=False)
        raise SystemExit(EXIT_RESTART_FRESH)

    def _exchange_status(self, group: Any) -> list[tuple[int, bool, int]]:
        job = self.job
        row = torch.tensor([job.next_step, int(job.fresh), job._digest], dtype=torch.int64)
        table = group.allgather_rows(row, "state exchange")
        return [(int(step), bool(fresh), int(digest)) for step, fresh, digest in table.tolist()]

    def _same_fresh_state(self, group: Any) -> bool:
        """Whether every member, none of which holds live state, built bit for bit the same one."""
        mine = state_digests.state_digest(self.job._state())
        table = group.allgather_rows(torch.tensor([mine], dtype=torch.int64), "fresh state comparison")
        return len(set(table.reshape(-1).tolist())) == 1

    def _transfer(self, group: Any, plan: Any) -> None:
        """Run this member's part of the fan-out (:func:`unbroken.worker.healing.rounds`): receive the
        state once if behind, then send it on in every later round that names this member."""
        job = self.job
        started = time.monotonic()
        schedule = heal_plan.rounds(plan, group.size)
        received_from, sent, receivers = None, 0, []
        for pairs in schedule:
            for sender, receiver in pairs:
                if receiver == group.rank:
                    gpu = job._device if job._device.type == "cuda" else None
                    # a fresh member's warmed optimizer state holds nothing of value: the heal may land in it
                    warm = job._warm if job.fresh else None
                    state, received = healing.recv_state(group, sender, job._tick, gpu, into=warm)
                    if job._group is None:  # complete: the received parameters become the model's memory
                        adopt_parameters(job.model, state["model"])
                    job._load(state)
                    job._warm = None  # now the optimizer's own state (or garbage, if it did not fit)
                    if job._sharded is not None:
                        job._sharded.forget()  # what it held is of another step or history
                    del state
                    job.fresh = False
                    received_from = sender
                    log.info("%s: healed to step %d from %s (%d bytes)", job.member_id, job.next_step, group.members[sender], received)
                elif sender == group.rank:
                    # A receiver sends what it loaded: its state now equals the source's bit for bit.
                    state = job._state()
                    sent += healing.send_state(group, state, receiver, lambda: job._chaos.point("heal", job.next_step), job._tick,
                                               lanes=job.settings.heal_lanes)
                    del state
                    receivers.append(receiver)
        if receivers:
            job.fresh = False
            job._events.emit(
                "heal",
                generation=group.number,
                sender=job.member_id,
                receivers=[group.members[r] for r in receivers],
                received_from=None if received_from is None else group.members[received_from],
                rounds=len(schedule),
                step=plan.step,
                bytes=sent,
                seconds=time.monotonic() - started,
            )
