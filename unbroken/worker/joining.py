"""Joining: this member's side of the coordinator, and the generation's group it is in.

A member under ``unbroken run`` heartbeats the coordinator from a thread of its own
(:meth:`Joiner.start`), asks to join at a step boundary whenever it holds no group
(:meth:`Joiner.join`: the coordinator answers once a generation has formed, or says why it will
not take this member), builds the new generation's process group over the coordinator's store,
has it healed, and keeps it until the generation breaks (:meth:`Joiner.abandon`), asks to be
re-formed (:meth:`Joiner.close_group`) or the job ends (:meth:`Joiner.leave`). Between those,
:meth:`Joiner.abandon_reason` says whether the generation still holds: no reply within the lease,
a verdict, a newer generation or a restarted coordinator each end it (step 1 of the protocol, "No stale
writes").
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

import torch

from unbroken.observe import leader_mark, refusal_mark
from unbroken.errors import EXIT_MISMATCH, EXIT_RESTART_FRESH, GenerationFailed, Unauthorized, UnbrokenError
from unbroken.worker.lifetime import ExitGuard, die_with_launcher
from unbroken.open_files import raise_limit

if TYPE_CHECKING:
    from unbroken.worker.runtime import Job

log = logging.getLogger("unbroken.worker.runtime")  # moved out of the runtime; its messages keep their logger


class Joiner:
    """One member's coordinator client, heartbeat and current generation group.

    It writes the job's ``generation``, ``member_index`` and ``member_count`` when a generation
    forms; the job reads the group from :attr:`group` (None between generations).
    """

    def __init__(self, job: Job) -> None:
        from unbroken.worker.group import Graveyard

        self.job = job
        self.group: Any = None
        """The current generation's :class:`~unbroken.worker.group.GenerationGroup`, or None."""
        self.graveyard = Graveyard()
        """Abandoned groups, released once nothing can be pending on them."""
        self.wake = threading.Event()
        self.client: Any = None
        self.heartbeat: Any = None
        self._store: Any = None
        self._store_address: tuple[str, int] | None = None
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
            self.client = CoordinatorClient(settings.coordinator, settings.coordinator_timeout, settings.token)
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
        parameters summed together): sent with every join, compared by the coordinator."""
        if self._preflight_cache is None:
            from unbroken.version import __version__

            job = self.job
            script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
            try:
                with open(script, "rb") as f:
                    script_hash = hashlib.sha256(f.read()).hexdigest()[:16]
            except OSError:
                script_hash = "-"
            layout = [] if job._reducer is None else [
                f"{b.flat.dtype}x{b.numel}/{len(b.params)}" for b in job._reducer.buckets
            ]
            self._preflight_cache = {
                "gradient buckets": hashlib.sha256(";".join(layout).encode()).hexdigest()[:16] + f" ({len(layout)} buckets)",
                "bucket_cap_mb": str(job.settings.bucket_cap_mb),
                "verify_every": str(job.settings.verify_every),
                "stragglers": job.settings.stragglers,
                "total steps": str(job.total),
                "data plan": (
                    f"dataset {job.plan.dataset_len}, global batch {job.plan.global_batch_size},"
                    f" micro-batch {job.plan.micro_batch_size}, seed {job.plan.seed}"
                ),
                **self._group_preflight(),
                "torch": torch.__version__,
                "unbroken": __version__,
                "script": f"{os.path.basename(script)} sha256 {script_hash}",
            }
        return self._preflight_cache

    def _group_preflight(self) -> dict[str, str]:
        """A replica group's size and sharding: every group must match (same shard at index j)."""
        group = self.job._group
        if group is None:
            return {}
        from unbroken.replica_groups.sharding import sharding_fingerprint

        return {"group size": str(group.size), "sharding": sharding_fingerprint(self.job.model)}

    # -- whether the generation holds ----------------------------------------------------------

    def reconfigure_wanted(self) -> bool:
        view = self.view
        return bool(view.get("reconfigure")) and view.get("generation") == self.job.generation

    def _silence(self) -> float:
        """Seconds since the sending of the newest heartbeat (or join) whose reply this member has
        taken in (0 in processes 1..K-1 of a replica group, whose watchdog judges process 0's
        silence). Other answered requests (a roster's) renew nothing: their replies carry no
        verdict, and a lease renewed without the news would let a stale view commit."""
        if self.heartbeat is None:
            return 0.0
        return time.monotonic() - max(self.heartbeat.answered, self._join_answered)

    def abandon_reason(self, number: int, for_commit: bool = False) -> str | None:
        """Why generation ``number`` no longer holds for this member, or None if it does.

        A lease that ran out forbids a commit (``for_commit``) but ends the generation only
        ``coordinator_grace`` later: a stalled coordinator has declared nobody dead meanwhile,
        and a member that was declared dead hears so as soon as the coordinator answers."""
        settings = self.job.settings
        silent = self._silence()  # before the view: a lease this fresh comes with a view at least as new
        view = self.view
        if silent > settings.lease + settings.coordinator_grace or (for_commit and silent > settings.lease):
            return f"no reply from the coordinator for {silent:.1f} s (lease {settings.lease:.1f} s)"
        if view.get("state") == "dead":
            return "the coordinator declared this member dead"
        # A restarted coordinator (or a new leader) has another incarnation and does not know
        # this member. An "unknown" from the incarnation that formed this generation only means a
        # heartbeat sent before this member joined was answered late: not a reason to leave.
        incarnation = view.get("incarnation")
        if self._incarnation is not None and incarnation is not None and incarnation != self._incarnation:
            return f"the coordinator restarted (incarnation {incarnation}; generation {number} was formed by {self._incarnation})"
        current = view.get("generation", 0)
        if current > number:
            return f"generation {current} has formed"
        if current == number and view.get("broken") and not for_commit:
            return "a member of this generation failed"
        return None

    def commit_reason(self, number: int) -> str | None:
        """Why this member must not commit its step in generation ``number``, or None.

        While its lease has run out but not its grace, the member holds the step and waits for
        the coordinator to answer a newer request: a coordinator that stalled for a second or two
        costs a pause here, not a re-formation of the whole job."""
        settings = self.job.settings
        held = None
        while True:
            silent = self._silence()
            if silent <= settings.lease or silent > settings.lease + settings.coordinator_grace:
                break
            if self.abandon_reason(number) is not None:
                break
            if held is None:
                held = time.monotonic()
                log.warning("%s: no reply from the coordinator for %.1f s: holding step %d until it answers",
                            self.job.member_id, silent, self.job.next_step)
            time.sleep(0.01)
        if held is not None and self._silence() <= settings.lease:
            log.warning("%s: the coordinator answered again after %.2f s; committing", self.job.member_id, time.monotonic() - held)
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
        self._warm_before_joining(group)
        catch = self._start_catch_up(group)
        job_never_joined = catch is not None  # a newcomer that caught up but never trained in a generation
        while True:
            reply = self._ask_to_join(catch.address if catch is not None and catch.wanted() else None)
            if catch is not None and reply["status"] in ("formed", "finished", "failed"):
                catch.finish(self.job.settings.collective_timeout)  # the rest of the stream, before any heal
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
            if self._form(self._relay(reply)):
                return True

    def _warm_before_joining(self, group: Any) -> None:
        """A fresh process joining a running job: allocate and touch its optimizer state now, while
        the others still train, so that its heal lands in warm memory (:mod:`unbroken.worker.warm_state`).
        Not at the job's start (no heal comes), nor in a replica group (sharded state)."""
        job = self.job
        if not job.fresh or job._warm is not None or group is not None or self.heartbeat is None:
            return
        deadline = time.monotonic() + 1.0  # the heartbeat's first reply comes at once
        while not self.heartbeat.view and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.heartbeat.view.get("generation", 0) <= 0 or self.heartbeat.view.get("finished"):
            return
        from unbroken.worker.warm_state import warm_optimizer

        started = time.monotonic()
        with self.busy("warming the optimizer state"):
            job._warm = warm_optimizer(job.optimizer)
        if job._warm:
            log.info("%s: optimizer state warmed for the heal in %.2f s (%d tensors)", job.member_id,
                     time.monotonic() - started, len(job._warm))

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
        coordinator formed it into a newer generation (it was waiting in a collective of the one a
        verdict broke: ``Membership.take_survivors``); None when it must ask. A view that is stale
        by the time the group is built only costs a failed formation and a join."""
        view = self.view
        number = view.get("generation", 0)
        if (
            self._store_address is None
            or self._incarnation is None
            or view.get("incarnation") != self._incarnation
            or view.get("state") != "active"
            or view.get("broken")
            or view.get("rank") is None
            or number <= max(self.job.generation, self.job._generation_floor)
        ):
            return None
        host, port = self._store_address
        return {
            "status": "formed",
            "incarnation": self._incarnation,
            "generation": number,
            "size": view["size"],
            "rank": view["rank"],
            "prefix": view["prefix"],
            "store_host": host,
            "store_port": port,
        }

    def _start_catch_up(self, group: Any) -> Any:
        """A fresh process joining a running job: open a port for a donor and catch up from it
        while the others train (:mod:`unbroken.worker.catch_up`); None where that cannot be exact."""
        from unbroken.worker.catch_up import CatchUp, eligible

        job = self.job
        if not job.fresh or group is not None or self.heartbeat is None or not eligible(job):
            return None
        if self.heartbeat.view.get("generation", 0) <= 0 or self.heartbeat.view.get("finished"):
            return None
        try:
            return CatchUp(job, _local_address(job.settings.coordinator), job._warm)
        except OSError as exc:
            log.info("%s: cannot open a port to catch up (%s); healed as usual", job.member_id, exc)
            return None

    def _ask_to_join(self, catch_up: str | None = None) -> dict[str, Any]:
        job = self.job
        sent = time.monotonic()
        try:
            reply = self.client.post(
                "/v1/join",
                read_timeout=30.0,
                member=job.member_id,
                node=job.settings.node,
                pid=os.getpid(),
                step=job.next_step,
                after=max(job.generation, job._generation_floor),
                warm=bool(self.heartbeat.warm),
                preflight=self.preflight(),
                **({"catch_up": catch_up} if catch_up else {}),
                lean=True,  # no member list in the reply: a Roster fetches ids if they are needed
            )
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
        member_id = self.job.member_id
        if reply["status"] == "failed":
            raise UnbrokenError(f"the job cannot go on: {reply.get('reason')}")
        if reply["status"] == "mismatch":
            self._refused(
                f"unbroken: error: {member_id} does not match the job, so the coordinator refused it:"
                f" {reply.get('reason')}. Run every node with the same script, settings and versions.",
                EXIT_MISMATCH,
            )
        if reply["status"] == "refused":
            self._refused(f"unbroken: {member_id}: the coordinator refuses this member: {reply.get('reason')}", 1)

    def _form(self, reply: dict[str, Any]) -> bool:
        """Build the group of the generation that ``reply`` announces and heal it; False (after
        reporting the failure) if that generation broke meanwhile."""
        from unbroken.worker.group import LAZY_CONNECT, GenerationGroup

        job = self.job
        number = reply["generation"]
        job.generation = number
        self._incarnation = reply.get("incarnation")
        prefix = reply["prefix"]
        if job._group is not None:
            prefix = f"{prefix}/shard{job._group.rank}"  # process j reduces and heals shard j
        if "members" in reply:  # a coordinator that sends the whole list
            members: Any = reply["members"]
        elif self.client is None:  # processes 1..K-1 of a replica group: names only for messages
            members = [f"rank{i}" for i in range(int(reply["size"]))]
        else:
            from unbroken.coordinator.roster import Roster

            members = Roster(self.client, number, int(reply["size"]), job.member_id, reply["rank"])
        # A lazily connected Gloo group holds connections to its two ring neighbours and to the
        # peers it heals or is healed by; the full mesh one to every peer.
        raise_limit(8 if LAZY_CONNECT else len(members), f"a member of a generation of {len(members)}")
        group = GenerationGroup(
            number,
            reply["rank"],
            len(members),
            members,
            abandoned=lambda n=number: job._abandon_reason(n),
            wake=self.wake,
            timeout=job.settings.collective_timeout,
            blocked=self._blocked,
        )
        error: GenerationFailed | None = None
        try:
            group.connect(self._store_for(reply["store_host"], reply["store_port"]), prefix, reply["store_host"])
        except GenerationFailed as exc:
            self._store = None  # a broken store connection must not break every later generation
            error = exc
        if job._group is not None:
            error = self._agree_before_healing(number, error)
        if error is None:
            try:
                job._healer.heal(group)
            except GenerationFailed as exc:
                error = exc
        # a replica group uses a generation only if every one of its processes built and healed
        # its shard's group, and they all hold the same step and lineage after it
        if job._group is not None:
            ballot = job._group.ballot(error is None, number, state=job._state_key())
            if ballot.ok and not ballot.same_state:
                self._end_unmendable_group(number)
            if error is None and not ballot.ok:
                error = GenerationFailed(f"generation {number}: another process of this replica group could not join it")
        if error is not None:
            self.report_failure(number, str(error))
            self.graveyard.park(group)
            return False
        self.group = group
        job.member_index, job.member_count = group.rank, group.size
        if job._group is None or job._group.leader:  # before the first step: the console shows the leader's lines
            leader_mark.write(job.run_dir, job.member_id, number, group.rank)
        if job._default_group is not None:
            job._default_group.enter(group, reply["store_host"], int(reply["store_port"]))
        log.info("%s: generation %d, member %d of %d, at step %d", job.member_id, number, group.rank, group.size, job.next_step)
        return True

    def _agree_before_healing(self, number: int, error: GenerationFailed | None) -> GenerationFailed | None:
        """A replica group's processes, before they heal: did every one connect its shard's group,
        and do they hold the same next step, lineage and freshness? If they do not (a heal that
        failed part-way left some shards loaded and others not), the whole group counts as fresh,
        so that every shard is healed again from one source. Returns the error to fail with."""
        job = self.job
        ballot = job._group.ballot(error is None, number, state=job._state_key())
        if error is None and not ballot.ok:
            return GenerationFailed(f"generation {number}: another process of this replica group could not connect")
        if ballot.ok and not ballot.same_state:
            log.warning("%s: the processes of this replica group hold different steps or lineages (this one: step %d);"
                        " the group is healed as fresh", job.member_id, job.next_step)
            job.fresh = True
        return error

    def _end_unmendable_group(self, number: int) -> None:
        """The group's processes still hold different states after healing as fresh: nobody in
        generation ``number`` held the job's state to heal every shard from (each shard went to
        whichever process held the most of it). Its state is a mix no step can be trusted from,
        so the group ends itself; its launcher restarts it with a truly fresh state, which is
        healed from a member that holds the job's, or from the newest checkpoint, or starts over."""
        job = self.job
        message = (f"unbroken: {job.member_id}: the processes of this replica group hold different steps or lineages"
                   f" after healing in generation {number} (this one: step {job.next_step}), and no member holds the"
                   " job's state to heal them from; ending the group so that it restarts fresh")
        print(message, file=sys.stderr, flush=True)
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

    def _store_for(self, host: str, port: int) -> Any:
        if self._store is not None and self._store_address != (host, port):
            self._store = None  # the store moved (a restarted coordinator)
        if self._store is None:
            self._store_address = (host, port)
            import datetime

            import torch.distributed as dist

            try:
                self._store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=self.job.settings.collective_timeout))
            except Exception as exc:  # DistNetworkError / RuntimeError from torch
                raise GenerationFailed(f"cannot reach the process-group store at {host}:{port}: {exc}") from None
        return self._store

    # -- leaving -------------------------------------------------------------------------------

    def report_failure(self, number: int, error: str) -> None:
        log.warning("%s: generation %d failed: %s", self.job.member_id, number, error)
        if self.client is None:
            return  # a process of a replica group other than 0: its process 0 reports for the group
        try:
            self.client.post("/v1/failure", member=self.job.member_id, generation=number, error=error[:500])
        except UnbrokenError as exc:
            log.warning("could not report the failure: %s", exc)

    def abandon(self, reason: str) -> None:
        """Leave a broken generation: report it, and park its group (work may be pending on it)."""
        self.job._donor.end(with_digest=False)
        if self.group is not None:
            self.report_failure(self.group.number, reason)
            self.graveyard.park(self.group)
            self.group = None

    def close_group(self) -> None:
        """Leave a healthy generation at a step boundary (someone waits to join)."""
        self.job._donor.end(with_digest=True)
        if self.group is not None:
            self.group.pg = None  # nothing is pending on it: safe to destroy
            self.group = None

    def leave(self, finished: bool) -> None:
        """Tell the coordinator that this member leaves, and stop heartbeating."""
        self.job._donor.end(with_digest=False)
        if self.client is not None:
            try:
                self.client.post("/v1/leave", member=self.job.member_id, finished=finished, step=self.job.next_step,
                                 **({"reason": self.job.stop_reason} if finished and self.job.stop_reason else {}))
            except UnbrokenError as exc:
                log.warning("could not tell the coordinator that this member leaves: %s", exc)
        if self.heartbeat is not None:
            self.heartbeat.stop()


def _local_address(coordinator: str) -> str:
    """This host's address on the route to the coordinator (a donor reaches it there)."""
    host, port = coordinator.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host.strip("[]"), int(port)))
        return probe.getsockname()[0]
