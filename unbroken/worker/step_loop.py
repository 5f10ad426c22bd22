"""The loop of :meth:`Job.steps <unbroken.worker.runtime.Job.steps>`: alone, and under a coordinator.

Alone (:func:`steps_alone`) every step commits: the reference every distributed run must match.
Under a coordinator (:func:`steps_together`) each pass joins a generation when the job has none,
heals, passes the first-step barrier of a new generation, yields the step and then commits it or
abandons the generation so the next one redoes it, until every member is at ``total`` or stops
together. Moved out of the runtime so that it stays short: the loop takes the job it drives, typed
by :class:`~unbroken.worker.job_parts.LoopingJob` (no import of the runtime, no cycle).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Iterator

from unbroken.errors import GenerationFailed
from unbroken.worker import loop_exit
from unbroken.worker.job_state import check_sendable
from unbroken.worker.step import Step

if TYPE_CHECKING:
    from unbroken.worker.job_parts import LoopingJob

OPEN_ENDED = 2**62
"""A total for a job whose script's loop decides where it ends (an integration's epoch loop whose
count it was not told): the job ends where every member leaves the loop together."""


def steps_alone(job: LoopingJob, total: int) -> Iterator[Step]:
    """A single process: every step commits; the reference every distributed run must match."""
    job._loader.start(total)
    try:
        job._checkpointing.open(resume=job.fresh)
        while job.next_step < total and job.stop_reason is None:
            step = job._loop_guard.step = Step(job, job.next_step)
            try:
                job._loop_guard.in_body = True
                yield step
            except GeneratorExit:
                step.untrack()
                job._loop_guard.in_body = False
                if step.untouched or (step.committed and not loop_exit.left_by_exception()):  # a break at a boundary: the job ends here, as at a normal end
                    if step.committed:  # (an untouched step may still be used: the test idiom next(iter(job.steps())))
                        job.stop(f"the script left the loop after step {step.index}")
                    job._checkpointing.final()
                return
            job._loop_guard.in_body = False
            step.untrack()
            step.commit()
            job._checkpointing.maybe_save()
        job._checkpointing.final()
    finally:
        job._loader.close()


def steps_together(job: LoopingJob, total: int) -> Iterator[Step]:
    """Under a coordinator: join, heal, step, commit or redo, until every member is at ``total``."""
    finished = stopping = False
    check_sendable(job._state())  # before any peer needs it: a survivor must be able to heal the others
    job._loader.start(total)  # forks the loader workers before any thread of the runtime runs
    job._joiner.start()
    # Whether to resume from a checkpoint is decided when a generation forms (see Healer.heal).
    job._checkpointing.open(resume=False)
    try:
        while True:
            if job._joiner.group is None:
                if not job._joiner.join():
                    finished = True
                    break
                continue
            durable = job._durable_stop
            if durable is not None and job.next_step >= durable["step"]:
                # a member's stop outlived it: every member of this generation learnt the same
                # request from its formation, and ends at this same boundary
                job.stop_reason = job.stop_reason or str(durable["reason"])
                stopping = True
            if job.next_step >= total or (job.stop_reason is not None and stopping):
                if _finish(job):
                    finished = True
                    break
                continue
            reason = job._abandon_reason(job.generation)
            if not reason:
                try:
                    job._chaos.point("step", job.next_step)
                except GenerationFailed as exc:
                    reason = str(exc)
            if not job._together(not reason, f"left generation {job.generation}"):
                if reason:
                    job._abandon(reason)
                continue
            if not _first_step_barrier(job):
                continue
            step = job._loop_guard.step = Step(job, job.next_step)
            try:
                job._loop_guard.in_body = True
                yield step
            except GeneratorExit:
                step.untrack()
                job._loop_guard.in_body = False
                # The loop body left: a break, or an exception (loop_exit tells them apart). An
                # exception is a failure: this member leaves unfinished and its process fails.
                # A break after the step's commit (or at the top of a step) ends the job at this
                # boundary: together with the others when every member broke, as at a normal
                # end; alone, as job.stop() would, for every member.
                job._left_on_error = job._left_on_error or loop_exit.left_by_exception()
                if (step.committed or step.untouched) and not job._left_on_error:
                    if _left_together(job):
                        finished = True
                        return
                    job.stop(f"the script left the loop after step {job.next_step - 1} on {job.member_id} alone")
                raise
            job._loop_guard.in_body = False
            step.untrack()
            if not step.committed and not step.failed:
                step.commit()
            if step.stopped:
                stopping = True  # every member saw the request in this reduce: end at this boundary
                continue
            if step.failed:
                job._abandon(str(step.error))
                continue
            if job._joiner.group is None or job._joiner.group.number != step.generation:
                continue  # re-formed inside the body (on_leader's leader died): the new generation starts at its first step
            job._checkpointing.maybe_save()
            if job._pacing.evicted:
                job._pacing.leave_as_straggler(job.next_step - 1, job.member_id)
            verify = job.settings.verify_every and job.next_step % job.settings.verify_every == 0 and job.next_step < total
            # a due replica check runs before a re-formation too: the members compare what one
            # of them is about to heal a newcomer from (the reconfigure flag came in the step's
            # reduce, so every member takes the same branch)
            if verify and not job._together(job._verify_replicas(), "could not compare replicas"):
                continue
            if step.reconfigure:
                job._joiner.close_group()
    finally:
        job._stop(finished)


def _left_together(job: LoopingJob) -> bool:
    """The loop was left at a step boundary (a ``break`` after a step's commit, or at the top
    of the next step before any micro-batch): True once every member
    of the generation left at the same boundary and the job ended there together, as at a
    normal end. Who else left is counted in the generation's store, never by a collective: a
    peer that went on waits in the next allreduce, and a collective it does not expect would
    mismatch its own. False when this member left alone (within a few seconds): the caller
    then stops the job for every member at this boundary (a durable :meth:`~unbroken.Job.stop`)
    and this member leaves."""
    group = job._joiner.group
    if group is None:
        return False
    bound = min(10.0, job.settings.collective_timeout / 3)
    last = job.next_step - 1
    with job._joiner.busy("leaving the training loop"):
        together = group.all_arrive(f"left/{job.next_step}", bound)
    if not together:
        print(f"unbroken: {job.member_id}: left the training loop after step {last}, but not every member did"
              f" within {bound:.0f} s; a break on one member stops the job for every member: the others end after"
              f" step {last} too (to stop without the wait, call job.stop(reason) and let the loop end)",
              file=sys.stderr, flush=True)
        return False
    if job.total is None or job.next_step < job.total:  # at the total it is the job's normal end
        job.stop(f"the script left the loop after step {last}")
    return _finish(job)


def _finish(job: LoopingJob) -> bool:
    """The end of the job, at this step boundary, for every member together: the final
    replica check, then the final checkpoint (each a decision of a replica group as a whole,
    so that a process whose check failed never leaves the others half-way into a save)."""
    return (job._together(job._verify_replicas(), "could not compare replicas")
            and job._together(job._checkpointing.final_together(), "could not finish"))


def _first_step_barrier(job: LoopingJob) -> bool:
    """Before the first step of each generation, wait until every member is at its start
    (see :func:`unbroken.worker.leader_calls.first_step_barrier`); False if the generation broke."""
    group = job._joiner.group
    if group.number == job._started_generation:
        return True
    from unbroken.worker.leader_calls import first_step_barrier

    reason = None
    try:
        first_step_barrier(group, job.next_step)
    except GenerationFailed as exc:
        reason = str(exc)
    if not job._together(reason is None, f"left generation {group.number} at its first step"):
        if reason:
            job._abandon(reason)
        return False
    job._started_generation = group.number
    return True
