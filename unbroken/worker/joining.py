"""Joining: this member's side of the coordinator, and the generation's group it is in.

A member under ``unbroken run`` heartbeats the coordinator from a thread of its own
(:meth:`Joiner.start`), asks to join at a step boundary whenever it holds no group
(:meth:`Joiner.join`: the coordinator answers once a generation has formed, or says why it will
not take this member), builds the new generation's process group over the coordinator's store,
has it healed, and keeps it until the generation breaks (:meth:`Joiner.abandon`), asks to be
re-formed (:meth:`Joiner.close_group`) or the job ends (:meth:`Joiner.leave`). Between those,
:meth:`Joiner.abandon_reason` says whether the generation still holds: no reply within the lease,
a verdict, a newer generation or a restarted coordinator each end it (step 1 of the protocol). Its
heartbeats and joins share one connection (:mod:`unbroken.coordinator.member_line`).

Its parts of their own: whether the generation holds (:mod:`unbroken.worker.generation_lease`), what a
join carries and what its answer means (:mod:`unbroken.worker.join_request`), the pieces a generation's
group is formed from (:mod:`unbroken.worker.generation_forming`), and what a newcomer to a running job
does before it joins (:mod:`unbroken.worker.newcomer`). This module keeps the joiner's state and the
order of things: the coordinator link, the join loop, the replica group's relay path, and leaving.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

from unbroken.observe import leader_mark, refusal_mark
from unbroken.errors import EXIT_MISMATCH, EXIT_RESTART_FRESH, GenerationFailed, Unauthorized, UnbrokenError
from unbroken.worker.coordinator_posts import tell
from unbroken.worker import generation_lease, join_request, newcomer
from unbroken.worker.generation_forming import (
    StoreConnection, agree_after_healing, agree_before_healing, generation_group, store_prefix, unmendable_message,
)
from unbroken.worker.lifetime import ExitGuard, die_with_launcher

if TYPE_CHECKING:
    from unbroken.worker.job_parts import JoiningJob

log = logging.getLogger("unbroken.worker.runtime")  # moved out of the runtime; its messages keep their logger


class Joiner:
    """One member's coordinator client, heartbeat and current generation group.

    It writes the job's ``generation``, ``member_index`` and ``member_count`` when a generation
    forms; the job reads the group from :attr:`group` (None between generations).
    """

    def __init__(self, job: JoiningJob) -> None:
        from unbroken.worker.graveyard import Graveyard

        self.job = job
        self.group: Any = None
        """The current generation's :class:`~unbroken.worker.group.GenerationGroup`, or None."""
        self.graveyard = Graveyard()
        """Abandoned groups, released once nothing can be pending on them."""
        self.wake = threading.Event()
        self.client: Any = None
        self.heartbeat: Any = None
        self._store_connection = StoreConnection()
        self._incarnation: str | None = None  # of the coordinator that formed the current generation
        self._preflight_cache: dict[str, Any] | None = None
        self._relayed = 0  # seq of the last generation process 0 of this replica group relayed
        self._join_answered = float("-inf")  # when the newest answered join was sent (a lease of its own)

    def _grouped(self) -> Any:
        """This process's replica group when it has more than one process, else None."""
        group = self.job._group
        return group if group is not None and group.grouped else None

    @property
    def view(self) -> dict[str, Any]:
        """The coordinator's latest view of this member: heard by the heartbeat, or, in processes
        1..K-1 of a replica group, relayed by process 0."""
        if self.heartbeat is not None:
            return self.heartbeat.view
        group = self._grouped()
        return group.relay.view() if group is not None and group.relay is not None else {}

    # -- the coordinator -----------------------------------------------------------------------

    def start(self) -> None:
        """Reach the coordinator and start heartbeating it (before the first join)."""
        from unbroken.coordinator.client import CoordinatorClient, Heartbeat

        job, settings = self.job, self.job.settings
        assert settings.coordinator is not None
        die_with_launcher()
        group = self._grouped()
        if group is not None:
            # every process ticks the group's relay; process 0 reports the group's progress, which
            # moves only while every process of the group moves
            group.start(job._progress, settings.heartbeat_interval, self._on_view)
        if group is None or group.leader:
            self.client = CoordinatorClient(settings.coordinator, settings.coordinator_timeout, settings.token, one_line=True)
            self.heartbeat = Heartbeat(self.client, job.member_id, settings.heartbeat_interval, self._on_view, max_age=settings.lease)
            self.heartbeat.progress = job._progress if group is None else group.relay.group_progress
            self.heartbeat.pace = job._pacing.summary
            self.heartbeat.start()
        job._samples.open()
        ExitGuard.install(job)

    def _on_view(self, view: dict[str, Any]) -> None:
        self.job._donor.wanted = view.get("donate")
        group = self._grouped()
        if group is not None and group.leader:
            group.relay.publish_view(view)
        if view.get("fence"):
            # Declared dead for making no progress (stuck in user code or a device): this process
            # cannot be trusted to reach a step boundary, so it ends itself and its launcher
            # starts a fresh one, which rejoins and is healed.
            print(f"unbroken: {self.job.member_id}: {view.get('reason')}; ending this process", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        self.wake.set()

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        """Mark deliberate work that makes no step progress (never taken for stuck); nests."""
        if self.heartbeat is None:
            yield
            return
        previous = self.heartbeat.busy
        self.heartbeat.busy = previous or what
        try:
            yield
        finally:
            self.heartbeat.busy = previous

    def _blocked(self, what: str | None) -> None:
        # Entering a collective is progress, and so is leaving one: a member whose long wait (a
        # leader's evaluation) just ended is no longer marked blocked, and without the tick the
        # coordinator would count its idleness from before the wait and fence it at once.
        self.job._ticks += 1
        if self.heartbeat is not None:
            self.heartbeat.blocked_on = what

    def preflight(self) -> dict[str, Any]:
        """What every member must agree on, or the collectives mismatch (a livelock, or the wrong
        parameters summed together): sent with every join, compared by the coordinator
        (:func:`~unbroken.worker.join_request.preflight`); taken once."""
        if self._preflight_cache is None:
            job = self.job
            self._preflight_cache = join_request.preflight(job.settings, job._reducer, job.total, job.plan, job._group, job.model)
        return self._preflight_cache

    # -- whether the generation holds ----------------------------------------------------------

    def reconfigure_wanted(self) -> bool:
        view = self.view
        return bool(view.get("reconfigure")) and view.get("generation") == self.job.generation

    def _silence(self) -> float:
        """Seconds since the newest answered heartbeat or join was sent (:func:`~unbroken.worker.generation_lease.silence`)."""
        return generation_lease.silence(self.heartbeat, self._join_answered)

    def abandon_reason(self, number: int, for_commit: bool = False) -> str | None:
        """Why generation ``number`` no longer holds for this member, or None if it does
        (:func:`~unbroken.worker.generation_lease.abandon_reason`: the lease, its grace, the view's verdicts)."""
        settings = self.job.settings
        silent = self._silence()  # before the view: a lease this fresh comes with a view at least as new
        view = self.view
        return generation_lease.abandon_reason(number, silent, view, self._incarnation, settings.lease,
                                               settings.coordinator_grace, for_commit)

    def commit_reason(self, number: int) -> str | None:
        """Why this member must not commit its step in generation ``number``, or None.

        While its lease has run out but not its grace, the member holds the step and waits for
        the coordinator to answer a newer request (:func:`~unbroken.worker.generation_lease.hold_commit`):
        a coordinator that stalled for a second or two costs a pause here, not a re-formation of the whole job."""
        settings = self.job.settings
        generation_lease.hold_commit(self._silence, lambda: self.abandon_reason(number), settings.lease,
                                     settings.coordinator_grace, self.job.member_id, self.job.next_step)
        return self.abandon_reason(number, for_commit=True)

    # -- joining -------------------------------------------------------------------------------

    def join(self) -> bool:
        """Join the next generation and heal; False if the job has finished (nothing to join)."""
        deadline = time.monotonic() + self.job.settings.join_timeout
        group = self._grouped()
        if group is not None and not group.leader:
            return self._join_relayed(group, deadline)
        taken = self._formed_without_joining()
        if taken is not None and self._form(self._relay(taken)):
            return True
        newcomer.warm_for_joining(self.job, group, self.heartbeat, self.busy)
        catch = newcomer.catch_up_for_joining(self.job, group, self.heartbeat)
        job_never_joined = catch is not None  # a newcomer that caught up but never trained in a generation
        with self.client.joining():  # joins take the line back to back; heartbeats resume for a heal
            while True:
                reply = self._ask_to_join(catch.address if catch is not None and catch.wanted() else None)
                if catch is not None and reply["status"] in ("formed", "finished", "failed"):
                    with self.client.paused_joining():
                        unverified = catch.finish(self.job.settings.collective_timeout)  # the rest of the stream, before any heal
                    if unverified is not None:
                        newcomer.replay_unverified(self.job, self.client, unverified, catch.mismatch is not None)
                    catch = None
                if reply["status"] == "finished":
                    self._relay(reply)
                    return self._finished_without_us(never_joined=job_never_joined)
                self._refuse_on(reply)
                if reply["status"] != "formed":
                    if time.monotonic() > deadline:
                        raise UnbrokenError(
                            f"no generation formed within join_timeout={self.job.settings.join_timeout:.0f} s; the coordinator"
                            " may be waiting for more members than have started (see `unbroken status HOST:PORT`)"
                        )
                    continue
                with self.client.paused_joining():
                    if self._form(self._relay(reply)):
                        return True

    def _relay(self, reply: dict[str, Any]) -> dict[str, Any]:
        """Process 0 of a replica group: pass a generation (or the job's end) on to the group."""
        group = self._grouped()
        if group is not None:
            group.relay.publish_generation(reply)
        return reply

    def _join_relayed(self, group: Any, deadline: float) -> bool:
        """Processes 1..K-1 of a replica group: form every generation process 0 joins, in order."""
        while True:
            record = group.relay.wait_generation(self._relayed, max(1.0, deadline - time.monotonic()))
            self._relayed = record.seq
            if record.value.get("status") == "finished":
                return self._finished_without_us()
            if record.value.get("status") == "exit":  # process 0 was refused: the group ends as one
                self._refused(record.value["message"], int(record.value["code"]))
            if self._form(record.value):
                return True

    def _formed_without_joining(self) -> dict[str, Any] | None:
        """The join reply this member would get, when its heartbeat already told it that the
        coordinator formed it into a newer generation (:func:`~unbroken.worker.join_request.formed_from_view`);
        None when it must ask. A view that is stale by the time the group is built only costs a
        failed formation and a join."""
        after = max(self.job.generation, self.job._generation_floor)
        return join_request.formed_from_view(self.view, self._store_connection.address, self._incarnation, after)

    def _ask_to_join(self, catch_up: str | None = None) -> dict[str, Any]:
        job = self.job
        sent = time.monotonic()
        try:
            reply = join_request.ask_to_join(self.client, job.member_id, job.settings.node, job.next_step,
                                             max(job.generation, job._generation_floor), bool(self.heartbeat.warm),
                                             self.preflight(), catch_up)
        except Unauthorized as exc:
            self._refused(f"unbroken: error: {job.member_id}: {exc}", EXIT_MISMATCH)
        # The join's reply is the new generation's first view: the lease of the generation it forms
        # counts from it (a heartbeat stuck in a long poll meanwhile renews it later)
        self._join_answered = max(self._join_answered, sent)
        return reply

    def _finished_without_us(self, never_joined: bool = False) -> bool:
        job = self.job
        if never_joined or job.fresh or job.total is None or job.next_step < job.total:
            # A member that is behind (restarted, late, or cut off until the end): the job
            # ended without it. End the process quietly rather than let the script go on
            # with a stale model as if it had trained.
            print(f"unbroken: {job.member_id}: the job finished before this member could rejoin; exiting", file=sys.stderr, flush=True)
            job._stop(finished=False)
            raise SystemExit(0)
        log.info("%s: the job has finished; nothing to join", job.member_id)
        return False

    def _refuse_on(self, reply: dict[str, Any]) -> None:
        """End here if the coordinator will not take this member (or the job cannot go on)."""
        refused = join_request.refusal(reply, self.job.member_id)
        if refused is not None:
            self._refused(*refused)

    def _form(self, reply: dict[str, Any]) -> bool:
        """Build the group of the generation that ``reply`` announces and heal it; False (after
        reporting the failure) if that generation broke meanwhile."""
        job = self.job
        number = reply["generation"]
        job.generation = number
        self._incarnation = reply.get("incarnation")
        if isinstance(reply.get("stop"), dict):  # a member's job.stop(), durable: it may have died since
            job._durable_stop = reply["stop"]
        group = generation_group(reply, self.client, job.member_id, lambda n=number: job._abandon_reason(n), self.wake,
                                 job.settings.collective_timeout, self._blocked)
        error: GenerationFailed | None = None
        try:
            store = self._store_connection.connect(reply["store_host"], reply["store_port"], job.settings.collective_timeout)
            group.connect(store, store_prefix(reply, job._group), reply["store_host"])
        except GenerationFailed as exc:
            self._store_connection.store = None  # a broken store connection must not break every later generation
            error = exc
        if job._group is not None:
            # did every process connect its shard's group, and do they hold the same state?
            error, as_fresh = agree_before_healing(job._group, number, error, job._state_key(), job.member_id, job.next_step)
            if as_fresh:
                job.fresh = True  # every shard is healed again from one source
        if error is None:
            try:
                job._healer.heal(group)
            except GenerationFailed as exc:
                error = exc
        # a replica group uses a generation only if every one of its processes built and healed
        # its shard's group, and they all hold the same step and lineage after it
        if job._group is not None:
            error, unmendable = agree_after_healing(job._group, number, error, job._state_key())
            if unmendable:
                self._end_unmendable_group(number)
        if error is not None:
            self.report_failure(number, str(error))
            self.graveyard.park(group)
            return False
        self.group = group
        job.member_index, job.member_count = group.rank, group.size
        if job._group is None or job._group.leader:  # before the first step: the console shows the leader's lines
            leader_mark.write(job.run_dir, job.member_id, number, group.rank)
            if group.rank == 0:
                job._checkpointing.generation_formed(number)
        if job._default_group is not None:
            job._default_group.enter(group, reply["store_host"], int(reply["store_port"]))
        log.info("%s: generation %d, member %d of %d, at step %d", job.member_id, number, group.rank, group.size, job.next_step)
        return True

    def _end_unmendable_group(self, number: int) -> None:
        """The group's processes still hold different states after healing as fresh
        (:func:`~unbroken.worker.generation_forming.unmendable_message`): the group ends itself, and
        its launcher restarts it with a truly fresh state."""
        job = self.job
        print(unmendable_message(job.member_id, number, job.next_step), file=sys.stderr, flush=True)
        job._stop(finished=False)
        raise SystemExit(EXIT_RESTART_FRESH)

    def _refused(self, message: str, code: int) -> None:
        """End this worker because the coordinator will not take it (wrong token, a mismatch, a
        quarantined slot): say why, leave, and exit with ``code`` for the launcher to act on.

        Process 0 of a replica group first passes the refusal on, so that its K processes all exit
        with ``code``: the launcher takes the group's status from whichever exits first, and a
        process 1..K-1 that timed out waiting instead would have it restarted (seen in CI)."""
        refusal_mark.write(self.job.run_dir, self.job.member_id, code)  # before any process of the group exits
        group = self._grouped()
        if group is not None and group.leader:
            self._relay({"status": "exit", "code": code, "message": message})
        print(message, file=sys.stderr, flush=True)
        self.job._stop(finished=False)
        raise SystemExit(code)

    # -- leaving -------------------------------------------------------------------------------

    def report_failure(self, number: int, error: str) -> None:
        log.warning("%s: generation %d failed: %s", self.job.member_id, number, error)
        tell(self.client, "/v1/failure", self.job.member_id, "the failure", generation=number, error=error[:500])

    def report_job_failure(self, reason: str) -> None:
        """What no restart mends (replicas that differ, a script whose collectives differ between
        members): the job fails at the coordinator (and in etcd), so that no member re-forms alone
        and finishes, and no slot restarts into it (:mod:`unbroken.coordinator.job_decisions`)."""
        tell(self.client, "/v1/fail_job", self.job.member_id, "the job's failure", reason=reason[:1000])

    def request_stop(self, step: int, reason: str) -> None:
        """Make ``job.stop(reason)`` durable before it returns: the coordinator carries it into
        every generation formed from now on, so it outlives this member (DESIGN: Fast paths)."""
        tell(self.client, "/v1/stop", self.job.member_id, "the stop (it travels with the next step only)", step=step,
             reason=reason[:500])

    def abandon(self, reason: str) -> None:
        """Leave a broken generation: report it, and park its group (work may be pending on it)."""
        self.job._donor.end(at_boundary=False)
        if self.group is not None:
            self.report_failure(self.group.number, reason)
            self.graveyard.park(self.group)
            self.group = None

    def close_group(self) -> None:
        """Leave a healthy generation at a step boundary (someone waits to join)."""
        self.job._donor.end(at_boundary=True)
        if self.group is not None:
            self.group.pg, self.group.side_groups = None, []  # nothing is pending on them: safe to destroy
            self.group = None

    def leave(self, finished: bool) -> None:
        """Tell the coordinator that this member leaves, and stop heartbeating."""
        self.job._donor.end(at_boundary=False, drain=True)
        tell(self.client, "/v1/leave", self.job.member_id, "that this member leaves", finished=finished,
             step=self.job.next_step, **({"reason": self.job.stop_reason} if finished and self.job.stop_reason else {}))
        if self.heartbeat is not None:
            self.heartbeat.stop()

