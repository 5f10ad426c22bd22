"""The worker runtime: the training-loop API that a user's script calls.

::

    job = unbroken.Job(model, optimizer, dataset, global_batch_size=256, micro_batch_size=64)
    for step in job.steps(total=500):
        for x, y in step.micro_batches():
            step.backward(loss_fn(model(x), y))
        step.commit()

Under ``unbroken run`` each step follows the protocol of docs/protocol.md: the member learns its
generation from the coordinator (joining and healing when it changed), processes its share of
the step's fixed global batch, allreduces share-weighted gradients in buckets overlapped with
backward, and then either commits (optimizer step) or, if the allreduce failed, leaves its
parameters untouched and redoes the step in the next generation. Run as a plain single process
(no coordinator in the environment) the same script trains on the whole global batch, which is
the reference every distributed run must match.

This module holds :class:`Job` (the training objects, the step counter and lineage); its settings
are :class:`~unbroken.worker.runtime_settings.RuntimeSettings`. The rest of the work is done by
parts of their own: the loop (:mod:`unbroken.worker.step_loop`), :class:`Step`
(:mod:`unbroken.worker.step`), joining a generation and keeping its group
(:mod:`unbroken.worker.joining`), healing it (:mod:`unbroken.worker.healer`), durable checkpoints
(:mod:`unbroken.worker.checkpointing`), replica checks (:mod:`unbroken.worker.replica_check`), the
sample record (:mod:`unbroken.worker.sample_record`), the training state as one dict
(:mod:`unbroken.worker.job_state`), the checks of the loop's rules on the script's own calls
(:mod:`unbroken.worker.loop_rules`) and the device and backend
(:func:`unbroken.worker.devices.take_device`); what it builds as it is made comes from
:mod:`unbroken.worker.job_setup`.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from unbroken.worker import allocator, devices, job_setup, mixed_precision, state_digests, step_loop
from unbroken.worker.chaos import Chaos
from unbroken.worker.checkpointing import Checkpointing
from unbroken.data.data_plan import DataPlan
from unbroken.errors import ConfigError
from unbroken.worker.healer import Healer
from unbroken.worker.job_state import TrainingObjects, gather_state, load_state
from unbroken.worker.joining import Joiner
from unbroken.worker.lifetime import ExitGuard
from unbroken.worker.loop_rules import LoopGuard
from unbroken.data.loader import Loader
from unbroken.worker.replica_check import verify_replicas
from unbroken.worker.runtime_settings import RuntimeSettings
from unbroken.worker.sample_record import SampleRecord
from unbroken.worker.step import Step
from unbroken.observe.events import RUN_DIR_ENV, EventLog

if TYPE_CHECKING:
    from unbroken.storage.checkpoint import CheckpointSettings


class Job:
    """A training job whose steps survive the loss of members.

    Args:
        model: the module to train; every member builds the same architecture.
        optimizer: any ``torch.optim`` optimizer over the model's parameters.
        dataset: a map-style data set (``len()`` and indexing); not an ``IterableDataset``.
        global_batch_size: samples per step over all members, fixed whatever the member count.
        micro_batch_size: largest batch one forward/backward sees (default: the global batch).
        seed: seeds the sample order (one permutation per epoch).
        scheduler: an optional learning-rate scheduler, stepped after each commit.
        collate_fn: turns a list of samples into a batch (default: ``default_collate``).
        num_workers: DataLoader worker processes that load the micro-batches of the next steps
            ahead (default 0: each micro-batch is loaded in the training thread when needed).
        prefetch: micro-batches in flight per loader worker (default 2); needs ``num_workers``.
        pin_memory: return batches in page-locked memory, for a fast copy to a GPU.
        worker_init_fn: called with the worker id in each loader worker as it starts (open files
            there); randomness is seeded per sample from (seed, stream position), not here.
        extra_state: any object with ``state_dict``/``load_state_dict`` healed with the model.
        scaler: a ``torch.amp.GradScaler`` for fp16 mixed precision: ``step.backward`` scales
            each loss, ``step.commit`` unscales the reduced gradients, skips the step on inf/nan
            (on every member alike) and updates the scale; healed and checkpointed with the model
            (see :mod:`unbroken.worker.mixed_precision`). Pass losses unscaled.
        settings: runtime settings (default: from the environment ``unbroken run`` sets).
        checkpoint: durable checkpoints (default: from ``UNBROKEN_CHECKPOINT_*``, which
            ``unbroken run --checkpoint-dir/--checkpoint-every`` set): where, how often, how many.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        *,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        seed: int = 0,
        scheduler: Any = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        prefetch: int | None = None,
        pin_memory: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        extra_state: Any = None,
        scaler: Any = None,
        settings: RuntimeSettings | None = None,
        checkpoint: "CheckpointSettings | None" = None,
    ) -> None:
        self.settings = settings or RuntimeSettings.from_env()
        allocator.tune(self.settings.tune_malloc)  # before the first step allocates
        self.distributed = self.settings.coordinator is not None
        from unbroken.worker.group_member import job_group

        self._group = job_group(self.distributed)
        self.plan: DataPlan = job_setup.data_plan(dataset, global_batch_size, micro_batch_size, seed, self._group)
        self.model = model
        self.optimizer = optimizer
        self._committing = False
        """True while :meth:`Step.commit` steps the optimizer: its only rightful caller."""
        self._left_on_error = False
        """Set by a framework's loop that leaves job.steps() because of an error (never a stop)."""
        self._inputs_checked = False  # this process's first micro-batch followed into the model (input_check)
        self._loop_guard = LoopGuard(optimizer, lambda: self._committing, lambda: self.next_step)
        """Where the script's loop stands (in a step's body, which step), and the checks of its rules."""
        self._sharded = job_setup.sharded_optimizer(self.settings, self.distributed, self._group, optimizer, self._loop_guard)
        self.dataset = dataset
        self.scheduler = scheduler
        self.extra_state = extra_state
        mixed_precision.check_scaler(scaler, model)
        self.scaler = scaler
        self.collate_fn = collate_fn
        self._loader = Loader(
            dataset, self.plan, num_workers=num_workers, prefetch=prefetch, pin_memory=pin_memory,
            collate_fn=collate_fn, worker_init_fn=worker_init_fn,
        )
        self._choose_backend(model)
        self.member_id = job_setup.member_id(self.settings, self._group)
        self._init_progress()
        self._joiner = Joiner(self)
        self._ticks = 0  # progress: micro-batches, backwards, collectives entered (see _progress)
        self._generation_floor = 0  # the generation of a checkpoint resumed from
        self._chaos = Chaos.from_env()
        self._chaos.leading = lambda: self.distributed and self._joiner.group is not None and self.is_leader
        run_dir = self.settings.run_dir or os.environ.get(RUN_DIR_ENV)
        self.run_dir = run_dir
        self._events = EventLog.for_run_dir(run_dir if self.distributed else None, f"worker:{self.member_id}")
        self._samples = SampleRecord(bool(self.settings.record_samples and run_dir), run_dir, self.member_id)
        from unbroken.storage.checkpoint import CheckpointSettings

        self.checkpoint = checkpoint or CheckpointSettings.from_env()
        self._checkpointing = Checkpointing(self)
        self._warm: dict[Any, torch.Tensor] | None = None
        """A fresh member's optimizer state, allocated before it joins, for its heal to land in."""
        from unbroken.worker.catch_up import Donor

        self._donor = Donor(self)
        self._healer = Healer(self)
        self._grad_events = 0  # gradient accumulations seen by a single process's hooks
        self._buffers = [b for b in model.buffers() if b.numel()]
        from unbroken.worker.gradients import watch_gradients

        self._reducer = watch_gradients(model, self.distributed, self.settings.bucket_cap_mb, self._count_grad)
        from unbroken.worker.leader_calls import LeaderCalls

        self._leader_calls = LeaderCalls(
            lambda: self._joiner.group, self._rejoin, self._joiner.busy, lambda: self.next_step, self._device,
            self.settings.collective_timeout,
        )
        self._pacing = job_setup.pacing(self.settings, self.distributed, self.plan, self._group, self._events)
        self._started_generation = 0  # the generation whose first step passed first_step_barrier
        self._default_group = job_setup.default_group(self.settings, self.distributed, self._group, self._loop_guard,
                                                      self._joiner)

    def _init_progress(self) -> None:
        """Where this member stands: no step committed, no generation joined, no live state."""
        self.next_step = 0
        self.lineage: list[int] = []
        self._digest = 0  # state_digests.lineage_digest(self.lineage), kept up to date
        self.fresh = True
        self._unverified: str | None = None  # why its state is unverified (a catch-up): never a heal's source
        self.generation = 0
        self.member_index = 0
        self.member_count = 1
        self.replica_hash: str | None = None
        self.total: int | None = None
        self._durable_stop: dict | None = None  # the job's stop request, from this generation's formation
        self.stop_reason: str | None = None
        """Why the job ends before ``total`` (:meth:`stop`, or the loop left with ``break``)."""

    def _choose_backend(self, model: torch.nn.Module) -> None:
        """The model's device and, in a distributed job, the backend its groups use (:func:`devices.take_device`)."""
        self._device, self.backend = devices.take_device(model, self.settings.backend, self.settings.collective_timeout,
                                                         self.distributed)

    # -- what the script sees ------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True on the member at index 0 of the current generation (and in a single process)."""
        return self.member_index == 0

    def on_leader(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once, on the leader, and return its result on every member.

        Call it on every member at the same point of the loop, after a commit (an evaluation
        every 100 steps, a log line, a ``torch.save``). The leader runs ``fn``; the others wait
        for its result without a collective timeout and are never taken for stuck, however long
        ``fn`` takes, up to ``--busy-timeout`` (default an hour). The result (plain data: numbers,
        strings, lists, dicts, tensors) is returned on every member, so what the script derives
        from it (a best loss, ``job.stop(...)``) is the same everywhere. If the leader dies inside
        ``fn`` the survivors re-form and the new leader runs it again; if ``fn`` raises, the
        leader raises the error and every other member :class:`~unbroken.errors.LeaderCallFailed`
        naming it, and the call is never run again. ``fn`` runs on the leader alone, so a
        collective inside it (``dist.all_reduce``, a torchmetrics sync) is refused at once with
        :class:`~unbroken.errors.LoopMisuse`. Before :meth:`steps` there is no leader yet:
        :class:`~unbroken.errors.LoopMisuse`. In a single process it is ``fn(*args, **kwargs)``."""
        if not self.distributed:
            return fn(*args, **kwargs)
        return self._leader_calls.run_for_script(fn, args, kwargs, self._loop_guard, started=self.total is not None)

    def _rejoin(self, reason: str | None) -> bool:
        """Leave the broken generation (for ``reason``) and join the next, inside the loop body
        (an :meth:`on_leader` call whose leader died); False if the job finished meanwhile."""
        if reason is not None and self._joiner.group is not None:
            self._abandon(reason)
        while self._joiner.group is None:
            if not self._joiner.join():
                return False
        return True

    def stop(self, reason: str = "stopped by the script") -> None:
        """End the job early, for every member, at one step boundary: call it on any member (an
        early-stopping rule on the leader, say). The request travels with the next step's
        gradient reduce, so every member learns of it at the same point: that step is not
        committed, and :meth:`steps` ends at the boundary before it, after the final replica
        check and the final checkpoint, as at a normal end. The launcher exits 0 and the job is
        recorded as finished, with ``reason``. In a single process the loop ends at the next
        boundary."""
        if self.stop_reason is None:
            self.stop_reason = str(reason)
            if self.distributed and self._joiner.client is not None:
                self._joiner.request_stop(self.next_step, self.stop_reason)

    def steps(self, total: int) -> Iterator[Step]:
        """Yield steps ``next_step .. total-1``; each must end in :meth:`Step.commit` (done for you
        if the loop body does not). A step whose allreduce failed is yielded again."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ConfigError(f"total must be a non-negative integer number of steps, got {total!r}")
        self.total = total
        if not self.distributed:
            yield from step_loop.steps_alone(self, total)
        else:
            yield from step_loop.steps_together(self, total)

    def _vote(self, ok: bool, generation: int, extra: list[float] | None = None) -> tuple[bool, list[float]]:
        """Whether every process of this member is ``ok`` in ``generation`` and holds the same
        next step, lineage and freshness, with the sums of ``extra`` over them: a replica group's
        vote (:meth:`GroupMember.vote`); alone or as a plain member, this process's own ``ok``
        and ``extra``. Every decision a group takes goes through here, so its processes can
        never train, commit or save from different steps."""
        if self._group is None:
            return ok, list(extra or [])
        return self._group.vote(ok, generation, extra, state=self._state_key())

    def _state_key(self) -> tuple[int, int, bool]:
        """What the processes of a replica group must agree on: next step, lineage, freshness."""
        return self.next_step, self._digest, self.fresh

    def _verify_replicas(self) -> bool:
        """Compare every member's parameters and buffers (:func:`verify_replicas`); False if the
        exchange failed and the generation was abandoned."""
        found = verify_replicas(self.model, self._joiner.group, self._abandon, self._events, self.member_id,
                                self.next_step, self.generation, self._joiner.report_job_failure, self._sharded)
        if found is None:
            return False
        self.replica_hash = found
        return True

    def _together(self, ok: bool, what: str) -> bool:
        """Whether every process of this member is ok (:meth:`_vote`); one that is ok while another
        of its replica group is not leaves the generation with it, so that the group's processes
        always run the same collectives (each judges the generation on its own view, and process
        0's view reaches the others a few milliseconds later)."""
        agreed, _ = self._vote(ok, self.generation)
        if ok and not agreed and self._joiner.group is not None:
            self._abandon(f"another process of this replica group {what}")
        return agreed

    # -- data and progress ---------------------------------------------------------------------

    def _batch(self, step: Step, micro: int) -> Any:
        """Micro-batch ``micro`` of this member's share of ``step`` (see :mod:`unbroken.data.loader`)."""
        return self._loader.get(step.index, step.rank, step.split, micro)

    def _count_grad(self, _: torch.Tensor) -> None:
        self._grad_events += 1

    def _grad_count(self) -> int:
        """Gradient accumulations so far (to tell step.backward's from any other backward)."""
        return self._reducer.ticks if self._reducer is not None else self._grad_events

    def _progress(self) -> int:
        """A counter that moves whenever this member works on a step: micro-batches, backwards,
        gradients that became final, collectives entered, state sent. Read by the heartbeat
        thread; the coordinator's watchdog fences only a member whose counter stopped."""
        return self._ticks + (self._reducer.ticks if self._reducer is not None else 0)

    def _tick(self) -> None:
        self._ticks += 1

    # -- the training state ----------------------------------------------------------------------

    def _training_objects(self) -> TrainingObjects:
        return TrainingObjects(self.model, self.optimizer, self.scheduler, self.extra_state, self.scaler, self.plan,
                               self._group, self._device)

    def _state(self) -> dict[str, Any]:
        """The training state (:func:`~unbroken.worker.job_state.gather_state`), with this job's record."""
        runtime = {"next_step": self.next_step, "lineage": list(self.lineage), "checkpoint_schedule": self._checkpointing.record()}
        return gather_state(self._training_objects(), runtime)

    def _load(self, state: dict[str, Any]) -> None:
        """Load a training state (:func:`~unbroken.worker.job_state.load_state`), this job's record with it."""
        load_state(self._training_objects(), state, self._restore_record)
        if self._joiner.heartbeat is not None:
            self._joiner.heartbeat.step = self.next_step

    def _restore_record(self, runtime: dict[str, Any]) -> None:
        self.next_step = runtime["next_step"]
        self.lineage = list(runtime["lineage"])
        self._digest = state_digests.lineage_digest(self.lineage)
        self._checkpointing.adopt(runtime.get("checkpoint_schedule"))  # absent from older states

    def _committed(self, step: Step) -> None:
        self.next_step = step.index + 1
        self._checkpointing.last_step_seconds = time.monotonic() - step.started
        self.lineage.append(step.generation)
        self._digest = state_digests.extend_digest(self._digest, step.generation)
        self.fresh = False
        self._samples.commit(step, self._digest, self._group)
        heartbeat = self._joiner.heartbeat
        if heartbeat is not None:
            heartbeat.step = self.next_step
            heartbeat.warm = True
        if self._events.enabled and self.member_index == 0 and (self._group is None or self._group.leader):
            job_setup.emit_step(self._events, step, self.plan.global_batch_size, self.total)

    # -- the generation ------------------------------------------------------------------------

    def _abandon_reason(self, number: int, for_commit: bool = False) -> str | None:
        """Why generation ``number`` no longer holds for this member (see :meth:`Joiner.abandon_reason`)."""
        return self._joiner.abandon_reason(number, for_commit)

    def _abandon(self, reason: str) -> None:
        # Park (and, for NCCL, abort) the broken group first, then replace the gradient buffers:
        # the new ones are allocated after the old ones were let go, so that bucket memory is not
        # doubled at the worst moment (Gloo's pending work still holds the old ones until the
        # graveyard releases it: docs/guide/gpus.md gives that peak). Gloo's works are let go
        # before the park instead: once parked, the graveyard may drop the group at once, and a
        # work dropped here after that would hold the last reference to the broken Gloo context,
        # whose destructor can wait here on Gloo's threads (20 s seen; the order frees nothing
        # sooner or later on Gloo, whose pending work holds its buffers either way).
        group = self._joiner.group
        gloo_first = self._reducer is not None and group is not None and group.backend == "gloo"
        if gloo_first:
            self._reducer.renew_buffers()
        self._joiner.abandon(reason)
        if self._reducer is not None and not gloo_first:
            self._reducer.renew_buffers()

    def _stop(self, finished: bool) -> None:
        if self._default_group is not None:
            self._default_group.leave()
        if self._group is not None:
            self._group.stop()
        if finished:
            self._samples.write_lineage(self.lineage, self.replica_hash, self.next_step)
        self._joiner.leave(finished)
        self._samples.close()
        self._loader.close()
        self._joiner.close_group()
        ExitGuard.finished = finished

    # Read by tests and the integration scripts, under the names they had before the split.

    @property
    def _client(self) -> Any:
        return self._joiner.client

    @_client.setter
    def _client(self, client: Any) -> None:
        self._joiner.client = client

    @property
    def _graveyard(self) -> Any:
        return self._joiner.graveyard

    @property
    def _saver(self) -> Any:
        return self._checkpointing.saver
