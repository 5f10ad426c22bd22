"""The runtime's side of durable checkpoints: when this member saves, resumes and waits for a save.

:mod:`unbroken.storage.checkpoint` holds the store, the background saver and the schedule's arithmetic;
this module drives them from the training loop. A member that starts a job (nobody holds live
state) resumes from the newest checkpoint that verifies. After each commit, the generation's
rank 0 snapshots the state when the schedule says a save is due and writes it in the background,
never waiting for a write still running (a slow store must not hold up a collective), and
accounts what the save cost training so that the schedule can adapt its interval. At the end a
final checkpoint is written and awaited, by the single process or by rank 0 while the others
wait on a store flag.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from unbroken.worker import state_digests
from unbroken.errors import ConfigError, GenerationFailed

if TYPE_CHECKING:
    from unbroken.worker.job_parts import CheckpointingJob

log = logging.getLogger("unbroken.worker.runtime")  # moved out of the runtime; its messages keep their logger


class Checkpointing:
    """One job's checkpoint directory, saver and schedule (all None without a directory)."""

    def __init__(self, job: CheckpointingJob) -> None:
        self.job = job
        self.store: Any = None  # CheckpointStore, opened when steps() starts
        self.saver: Any = None
        self.schedule: Any = None
        self.last_step_seconds: float | None = None
        """How long the last committed step took (set by the job at each commit)."""
        self._step_ema: float | None = None
        self._save_cost = 0.0
        self._save_cost_pending = False
        self.resumed_parts: dict[str, Any] | None = None
        """The manifest's record of the optimizer's parts, when the checkpoint this member resumed
        from holds the optimizer state in its owners' parts."""

    def open(self, resume: bool) -> None:
        """Open the checkpoint directory; a member that starts a job (nobody holds live state)
        resumes from the newest valid checkpoint there."""
        job = self.job
        if not job.checkpoint.directory or self.store is not None:
            return
        from unbroken.storage.checkpoint import CheckpointStore, Saver, Schedule

        self.store = CheckpointStore(job.checkpoint.directory)
        if job._group is not None:
            from unbroken.storage.sharded_checkpoint import ShardedSaver

            self.saver = ShardedSaver(self.store, job.checkpoint.keep, self._done, job._group.checkpoint_group, job.model)
        elif job._sharded is not None:
            from unbroken.storage.parts_saver import PartsSaver

            self.saver = PartsSaver(self.store, job.checkpoint.keep, self._done, lambda s: job._chaos.point("save", s),
                                    self._given_up, job.checkpoint.part_timeout)
        else:
            self.saver = Saver(self.store, job.checkpoint.keep, self._done, lambda s: job._chaos.point("save", s))
        if job.checkpoint.every is not None:
            self.schedule = Schedule(job.checkpoint.every, job.checkpoint.mtbf, time.monotonic(), job.checkpoint.max_interval)
        if resume:
            self.resume()
        else:
            job._generation_floor = max(job._generation_floor, self.store.newest_generation())

    def generation_formed(self, number: int) -> None:
        """This member leads generation ``number``: note it beside the checkpoints, off the training
        thread (a full restart from them numbers its generations above it). Best effort: a note
        that fails leaves the checkpoints' own numbers, never the step."""
        if self.store is None:
            return

        def note() -> None:
            try:
                self.store.note_generation(number)
            except Exception as exc:  # noqa: BLE001 - a full storage, a lost mount: the checkpoints say why
                log.debug("could not note generation %d in %s: %s", number, self.store.url, exc)

        threading.Thread(target=note, name="unbroken-generation-note", daemon=True).start()

    def resume(self) -> None:
        """Load the newest checkpoint that verifies, if there is one."""
        job = self.job
        self.resumed_parts = None
        if job._group is not None:
            self._resume_sharded()
            return
        found = self.store.load_latest(self._complete)
        if found is None:
            if self.store.steps() or _has_entries(self.store):
                print(f"unbroken: warning: no valid checkpoint in {job.checkpoint.directory}; starting from step 0", flush=True)
            return
        state, manifest, location = found
        self.resumed_parts = manifest.get("optimizer_parts")
        job._load(state)
        self._resumed(manifest)
        job.fresh = False
        # New generations are numbered above the one that wrote it (it may come from an earlier
        # coordinator), so that lineages never reuse a number.
        job._generation_floor = max(job._generation_floor, int(manifest.get("generation", 0)), self.store.newest_generation())
        print(f"unbroken: resumed from step {job.next_step} of {location}", flush=True)
        job._events.emit("resume", step=job.next_step, location=location)

    def _complete(self, state: dict[str, Any], manifest: dict[str, Any]) -> None:
        """A checkpoint whose optimizer state is in its owners' parts, read by a job that does not
        shard (or a single process): the whole state into ``state``, in torch's own format (raises,
        and the checkpoint is skipped, if the parts cannot be read; :class:`ConfigError` if they were
        written for other parameters). A sharded job reads its own spans later (the re-partition)."""
        if "optimizer_parts" not in manifest or self.job._sharded is not None:
            return
        from unbroken.storage.optimizer_parts import per_parameter_state
        from unbroken.worker.sharded_saving import parameter_shapes

        root = self.store._path(self.store.name(int(manifest["step"])))
        state["optimizer"]["state"] = per_parameter_state(self.store.fs, root, manifest["optimizer_parts"]["layout"],
                                                          parameter_shapes(self.job.optimizer))

    def _given_up(self, generation: int) -> str | None:
        """Why the parts of a save of ``generation`` may never all come (a member left, or some did
        not commit the step), or None while the generation holds (asked from the writer's thread)."""
        joiner = self.job._joiner
        group = joiner.group
        if group is None or group.number != generation:
            return f"generation {generation} ended before every member had written its part"
        reason = joiner.abandon_reason(generation)
        return f"generation {generation} is being abandoned ({reason})" if reason else None

    def _resumed(self, manifest: dict[str, Any]) -> None:
        """The job resumed from a checkpoint: unless it was the job's final one, every live copy of
        the state had been lost, the failure that ``auto``'s interval counts (:class:`Schedule`)."""
        if self.schedule is not None:
            self.schedule.adopt(manifest.get("runtime", {}).get("checkpoint_schedule"), time.monotonic(), lost=not manifest.get("final"))

    def record(self) -> dict[str, float] | None:
        """What the schedule knows of the job's history, to travel with the state (heals, checkpoints)."""
        return self.schedule.record(time.monotonic()) if self.schedule is not None else None

    def adopt(self, record: Any) -> None:
        """Take the job's history from a state this process loaded."""
        if self.schedule is not None:
            self.schedule.adopt(record, time.monotonic())

    def maybe_save(self) -> None:
        """After a commit: save if the schedule says so (rank 0 only; with a sharded optimizer,
        every member writes its part of the state when the step's barrier said so)."""
        job = self.job
        if job._sharded is not None:
            return self._maybe_save_sharded()
        if self.schedule is None or job.member_index != 0:
            return
        now = time.monotonic()
        self._account_save_cost(now)
        due = job.next_step < (job.total or 0) and self.schedule.due(job.next_step, now)
        # a replica group writes together or not at all: not while any of its processes still writes
        agreed, (wanted, writing) = job._vote(True, job.generation, [float(due), float(self.saver.busy())])
        if not agreed:  # the group's processes hold different states: nobody saves, all rejoin
            job._abandon("the processes of this replica group disagree on the step or lineage before a save")
            return
        if wanted > 0:
            self.save(skip=writing > 0)

    def due_after(self, index: int) -> bool:
        """Whether rank 0 wants a checkpoint after step ``index`` (asked at a sharded optimizer's
        barrier, which tells every member; :mod:`unbroken.worker.sharded_saving`). One due while the
        previous write still runs is skipped, as :meth:`save` skips it, and said so."""
        job = self.job
        if (self.schedule is None or job.member_index != 0 or index + 1 >= (job.total or 0)
                or not self.schedule.due(index + 1, time.monotonic())):
            return False
        if self.saver.busy():
            self.schedule.began(time.monotonic())
            self._skipped(index + 1)
            return False
        return True

    def _maybe_save_sharded(self) -> None:
        job = self.job
        if self.schedule is not None and job.member_index == 0:
            self._account_save_cost(time.monotonic())
        if job._sharded.save_due:
            tag, job._sharded.save_due = f"g{job._joiner.group.number}-{job._sharded.save_due:x}", 0
            self.save(tag=tag)

    def _account_save_cost(self, now: float) -> None:
        """What a save costs training: its stall plus how much longer the steps took while it was
        being written (the writer competes for cores and memory bandwidth)."""
        seconds = self.last_step_seconds
        if seconds is None:
            return
        if self.saver.busy():
            if self._step_ema is not None:
                self._save_cost += max(0.0, seconds - self._step_ema)
            return
        if self._save_cost_pending:
            self._save_cost_pending = False
            message = self.schedule.cost(self._save_cost, now)
            if message:
                log.info("%s", message)
                print(f"unbroken: {message}", flush=True)
                self.job._events.emit("checkpoint_interval", seconds=self.schedule.interval, cost=self._save_cost,
                                      mtbf=round(self.schedule.mtbf(now), 3), losses=self.schedule.losses)
            return  # the step that saw the write finish is not a healthy sample
        self._step_ema = seconds if self._step_ema is None else 0.9 * self._step_ema + 0.1 * seconds

    def save(self, skip: bool = False, final: bool = False, tag: str = "") -> None:
        """Snapshot the state and write it in the background; skipped (never waited for) while
        the previous write is still running, so that a slow store never holds up a collective.
        A replica group's processes each write their shards (:class:`ShardedSaver`)."""
        job = self.job
        group = job._joiner.group
        meta = {"generation": job.generation, "members": list(group.members) if group else [job.member_id], "final": final,
                "runtime": {"next_step": job.next_step, "lineage": list(job.lineage), "checkpoint_schedule": self.record()}}
        if job._group is not None:
            meta.update(plan=self._plan())
        with job._joiner.busy("checkpoint snapshot"):
            if job._group is not None:
                state = self._sharded_state()
            elif job._sharded is not None:  # every member: its part; rank 0: the rest too
                state, meta["parts"] = self._parts_of_sharded(group, tag or f"g{group.number}-final")
            else:
                state = job._state()
            stall = None if skip else self.saver.save(job.next_step, state, meta)
        if self.schedule is not None:
            self.schedule.began(time.monotonic())  # a skipped save waits for the next interval too
        if stall is None:
            self._skipped(job.next_step)
        elif self.schedule is not None:
            self._save_cost, self._save_cost_pending = stall, True

    def _skipped(self, step: int) -> None:
        message = f"checkpoint of step {step} skipped: the write of step {self.saver.writing} is still running"
        log.warning("%s", message)
        print(f"unbroken: {message}", flush=True)
        self.job._events.emit("checkpoint_skipped", step=step, writing=self.saver.writing)

    def _parts_of_sharded(self, group: Any, tag: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """This member's share of a checkpoint with a sharded optimizer, and what its writer needs
        (``tag``: what every member names this save with, from the barrier that asked for it)."""
        from unbroken.worker import sharded_saving

        job = self.job
        sharded = job._sharded
        state = {"train": job._state() if group.rank == 0 else None, "spans": sharded_saving.owned(sharded, group.rank, group.size)}
        parts = {"member": group.rank, "members": group.size, "generation": group.number, "tag": tag,
                 "sizes": list(sharded.sizes), "layout": sharded_saving.layout_record(sharded)}
        return state, parts

    # -- replica groups: one DCP shard per process, written by one group --------------

    def _sharded_state(self) -> dict[str, Any]:
        from unbroken.storage.training_state import TrainingState

        job = self.job
        return {"train": TrainingState(job.model, job.optimizer), **{name: part.state_dict() for name, part in self._parts()}}

    def _parts(self) -> list[tuple[str, Any]]:
        """The job's other stateful parts that it has: scheduler, extra state, scaler."""
        job = self.job
        return [(n, p) for n, p in (("scheduler", job.scheduler), ("extra", job.extra_state), ("scaler", job.scaler)) if p is not None]

    def _plan(self) -> dict[str, int]:
        plan = self.job.plan
        return {"global_batch_size": plan.global_batch_size, "seed": plan.seed, "dataset_len": plan.dataset_len}

    def _resume_sharded(self) -> None:
        """Every process of the group loads its shard of the newest sharded checkpoint (any number
        of groups, any group size wrote it: DCP reshards)."""
        from unbroken.storage.sharded_checkpoint import load_sharded

        job = self.job
        state = self._sharded_state()
        manifest = load_sharded(job.checkpoint.directory, state)
        if manifest is None:
            if self.store.steps() or _has_entries(self.store):
                print(f"unbroken: warning: no valid sharded checkpoint in {job.checkpoint.directory}; starting from step 0", flush=True)
            return
        if manifest.get("plan") != self._plan():
            raise ConfigError(f"the checkpoint was written with the data plan {manifest.get('plan')}, this job has {self._plan()}")
        for name, part in self._parts():
            part.load_state_dict(state[name])
        runtime = manifest["runtime"]
        job.next_step, job.lineage = int(runtime["next_step"]), list(runtime["lineage"])
        self._resumed(manifest)
        job._digest = state_digests.lineage_digest(job.lineage)
        job.fresh = False
        job._generation_floor = max(job._generation_floor, int(manifest.get("generation", 0)), self.store.newest_generation())
        if job._joiner.heartbeat is not None:
            job._joiner.heartbeat.step = job.next_step
        print(f"unbroken: resumed from step {job.next_step} of the sharded checkpoint in {job.checkpoint.directory}", flush=True)
        job._events.emit("resume", step=job.next_step, location=job.checkpoint.directory)

    def final(self) -> None:
        """A single process saves the final state and waits until it is durable."""
        if self.saver is None:
            return
        self.saver.wait()
        if self.schedule is not None:
            self.save(final=True)
        self.saver.wait()

    def final_together(self) -> bool:
        """After the final replica check: rank 0 writes the final checkpoint and waits until it is
        durable, marked busy (never taken for stuck, however slow the store); the others wait for
        it on a store flag, which tolerates any write time. Every member also lets its own
        background write finish. False if the generation broke meanwhile (rejoin and redo)."""
        job = self.job
        if self.saver is None:
            return True
        try:
            with job._joiner.busy("checkpoint write"):
                self.saver.wait()
                # every member writes its part of a sharded optimizer's state; rank 0 waits for them all,
                # watching the generation: a member lost meanwhile sends every member to redo it
                if self.schedule is not None and (job.member_index == 0 or job._sharded is not None):
                    self.save(final=True)
                    if job._sharded is not None and job.member_index == 0:
                        job._joiner.group.watch_unbounded(lambda: not self.saver.busy(), "the final checkpoint's parts", 0.05)
                    self.saver.wait()
            if self.schedule is not None:
                if job.member_index == 0:
                    job._joiner.group.set_flag("final-checkpoint")
                else:
                    job._joiner.group.wait_flag("final-checkpoint", "waiting for the final checkpoint")
        except GenerationFailed as exc:
            job._abandon(str(exc))
            return False
        return True

    def _done(self, info: dict[str, Any]) -> None:
        self.job._events.emit("checkpoint", **info)


def _has_entries(store: Any) -> bool:
    from unbroken.storage.checkpoint import GENERATION_FILE

    try:
        return any(e.rstrip("/").rsplit("/", 1)[-1] != GENERATION_FILE for e in store.fs.ls(store.root, detail=False))
    except FileNotFoundError:
        return False
