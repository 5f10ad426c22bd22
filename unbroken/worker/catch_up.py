"""Rejoining without stopping the others: a newcomer catches up from a donor while they train.

A process that joins a running job used to be healed inside the next generation: every member
waited at the step boundary while the state crossed the network. Instead, before it is counted
as waiting (so nobody re-forms for it), a newcomer asks the coordinator for a donor and opens a
port. The donor, a member of the running generation, at its next commit (before its optimizer's
step) copies its state into host memory and streams it to the newcomer from a thread of its own,
with the healing wire format (:mod:`unbroken.worker.healing`) over a TCP stream
(:mod:`unbroken.worker.stream_link`); from then on it also keeps the reduced gradients (and
buffers) of every step it commits and streams them after the state. The newcomer loads the state
(into its warmed optimizer memory, :mod:`unbroken.worker.warm_state`) and replays each step: the
same gradients through the same optimizer and scheduler give the same bits. Each record carries the
param_groups' hyper-parameters the step was committed with, and the replay sets them first: a loop
that sets its learning rate by hand (nanoGPT) replays exactly. Once it has replayed every step the
donor had committed, it joins as usual; the others re-form at their next step boundary, the donor
ends the stream with a digest of its whole training state
(:class:`~unbroken.worker.state_digests.WholeStateDigest`: parameters, buffers, optimizer state and
hyper-parameters, scheduler; taken on the donor's stream thread, off the survivors' critical path),
the newcomer replays the last steps and compares it with its own, and the heal then finds it at the
others' step and lineage: nothing is sent, and the survivors paid only for the re-formation.

The replay is a fast path, never a source of truth (DESIGN: Fast paths). A stream that ends without
a digest (the donor's generation broke, the donor died) or with one that differs (the loop changed
the state in a way a replay cannot see: a clamp after the commit, a state set from an ``on_leader``
result) leaves the newcomer *unverified*: it counts as fresh and the heal copies the whole state
from a peer. A digest that differs at a step boundary also turns catch-up off for the rest of the
job (the coordinator names no donor any more, :meth:`CatchUp.mismatch`): such a loop would fail
again at every rejoin.

It falls back to the heal whenever it cannot be exact or bounded: a job with a GradScaler or
``extra_state`` (the loop changes them in ways a replay cannot see), a replica group, a donor
that does not come within ``collective_timeout``, a donor more than ``MAX_RECORDS`` steps ahead
of what the stream has carried, a stream that breaks (donor or newcomer dies), or a generation
formed meanwhile for another reason. The newcomer then holds either nothing or a state of an
earlier step of the same lineage, and the heal brings it up to date.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from unbroken.storage.safe_unpickle import safe_loads
from unbroken.worker import healing, state_digests
from unbroken.worker.replay import _params, hyper_parameters, replay
from unbroken.worker.stream_link import LinkBroken, StreamLink
from unbroken.worker.warm_state import adopt_parameters

if TYPE_CHECKING:
    from unbroken.worker.job_parts import CatchingUpJob

log = logging.getLogger("unbroken")

MAX_RECORDS = int(os.environ.get("UNBROKEN_CATCH_UP_STEPS", "8"))
"""Steps a donor may hold for its newcomer before it gives up (memory: a gradient copy each)."""
TAG_RECORD, TAG_MASK, TAG_TENSOR, TAG_HYPERS, TAG_DIGEST = 101, 102, 103, 104, 105
RECORD, END = 1, 2


def eligible(job: CatchingUpJob) -> bool:
    """Whether a replay can be exact for this job (both sides check it; they run one script)."""
    return (job._reducer is not None and job._group is None and job.scaler is None and job.extra_state is None
            and getattr(job, "_sharded", None) is None  # its partitions come from their holders (resharding)
            and os.environ.get("UNBROKEN_REJOIN", "catch-up") != "heal")


def state_digest(job: CatchingUpJob) -> state_digests.WholeStateDigest:
    """The digest of ``job``'s whole training state, its parameters and optimizer state left to be
    read by :meth:`~unbroken.worker.state_digests.WholeStateDigest.value` (before the next optimizer step)."""
    names = {name for name, _ in job.model.named_parameters()}
    return state_digests.training_state_digest(job._state(), names)


# -- the donor ------------------------------------------------------------------------------------


class Donation:
    """A donor's stream to one newcomer: its state at one step, then every step it commits."""

    def __init__(self, job: CatchingUpJob, newcomer: str, address: str) -> None:
        from unbroken.storage.state_copy import copies_done, snapshot

        self.job, self.newcomer = job, newcomer
        host, port = address.rsplit(":", 1)
        self.link = StreamLink(socket.create_connection((host, int(port)), timeout=5.0))
        self.link.sock.settimeout(None)
        self.state = snapshot(job._state())
        copies_done(self.state)()  # a GPU state: its copies to the host have landed
        self.records: queue.Queue = queue.Queue()
        self.failed: str | None = None
        self.steps = 0
        self._ended = threading.Event()
        self._digested = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._send, name="unbroken-donation", daemon=True)
        self._thread.start()

    def record(self, step: Any) -> None:
        """Keep step ``step``'s gradients (reduced, about to be applied) and buffers for the newcomer."""
        if self.failed:
            return
        if self.records.qsize() >= MAX_RECORDS:
            self.fail(f"the newcomer is more than {MAX_RECORDS} steps behind")
            return
        grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in _params(self.job)]
        buffers = [b.detach().to("cpu", copy=True) for b in self.job.model.buffers()]
        hypers = pickle.dumps(hyper_parameters(self.job.optimizer), protocol=pickle.HIGHEST_PROTOCOL)
        self.records.put((step.index, step.generation, grads, buffers, hypers))
        self.steps += 1

    def fail(self, reason: str) -> None:
        with self._lock:  # a digest read when it fails is never sent (:meth:`_send_end`)
            first = self.failed is None
            if first:
                self.failed = reason
        if first:
            log.info("%s: the catch-up of %s stopped: %s", self.job.member_id, self.newcomer, reason)
        self.link.close()

    def end(self, digest: state_digests.WholeStateDigest, at_boundary: bool) -> None:
        """This member leaves its generation: send what is left, then the end with ``digest``
        (read on the stream's thread: :meth:`settle` before the state next changes).
        ``at_boundary``: at a step boundary, where nothing of the next step has run yet."""
        self.records.put(("end", digest, at_boundary))

    def settle(self, timeout: float) -> None:
        """Before this member's state next changes: wait until the end's digest has been read
        (normally long done: a re-formation and a step's forward and backward passed since);
        past ``timeout`` the stream fails instead, and the newcomer is healed."""
        if not self._digested.wait(timeout):
            self.fail("the digest was not read in time")

    def drain(self, timeout: float) -> None:
        """Wait (up to ``timeout``) until the stream has sent everything: this process may end."""
        if not self._ended.wait(timeout):
            self.fail("the stream did not drain in time")

    def _send(self) -> None:
        try:
            healing.send_state(self.link, self.state, 1)
            self.state = None
            while True:
                item = self.records.get()
                if item[0] == "end":
                    self._send_end(item[1], item[2])
                    break
                index, generation, grads, buffers, hypers = item
                self.link.send(torch.tensor([RECORD, index, generation, self.records.qsize(), len(hypers)]), tag=TAG_RECORD)
                self.link.send(torch.tensor([g is not None for g in grads], dtype=torch.uint8), tag=TAG_MASK)
                self.link.send(torch.frombuffer(bytearray(hypers), dtype=torch.uint8), tag=TAG_HYPERS)
                for tensor in [g for g in grads if g is not None] + buffers:
                    self.link.send(tensor, tag=TAG_TENSOR)
        except (LinkBroken, OSError) as exc:
            self.fail(str(exc))
        finally:
            self._digested.set()
            self.link.close()
            self._ended.set()

    def _send_end(self, digest: state_digests.WholeStateDigest, at_boundary: bool) -> None:
        """Send the end, then read its digest (the newcomer reads its own meanwhile; this member's
        next optimizer step waits for it: :meth:`settle`) and send that."""
        self.link.send(torch.tensor([END, self.job.next_step, int(at_boundary), 0, 0]), tag=TAG_RECORD)
        value = digest.value()
        with self._lock:
            self._digested.set()
            if self.failed:  # settle gave up waiting: the state may have changed while it was read
                return
        self.link.send(torch.tensor([value]), tag=TAG_DIGEST)


class Donor:
    """A member's side: start a donation when the coordinator names this member a newcomer's
    donor, feed it at every commit, end it when this member leaves its generation."""

    def __init__(self, job: CatchingUpJob) -> None:
        self.job = job
        self.wanted: dict[str, Any] | None = None
        """The coordinator's request (``{"member", "address"}``), set from the heartbeat thread."""
        self.active: Donation | None = None
        self._ended: Donation | None = None
        """The last donation ended, while its digest may still be being read."""
        self._served: set[str] = set()

    def before_step(self, step: Any) -> None:
        """In a commit, before the optimizer's step."""
        self.settle()
        wanted = self.wanted
        if self.active is None and wanted and wanted.get("member") not in self._served and eligible(self.job):
            self._served.add(wanted["member"])
            try:
                self.active = Donation(self.job, wanted["member"], wanted["address"])
            except OSError as exc:
                log.info("%s: could not reach %s to donate its state: %s", self.job.member_id, wanted["member"], exc)
                return
            self.job._events.emit("donation", member=self.job.member_id, to=wanted["member"], step=step.index)
            self.job._chaos.point("donate", step.index)
        if self.active is not None:
            self.active.record(step)

    def end(self, at_boundary: bool, drain: bool = False) -> None:
        """This member leaves its generation (or the job, ``drain``: wait until the stream is sent):
        end the stream with the digest of its whole state, which the newcomer checks its replay
        against. ``at_boundary``: at a step boundary, where nothing of the next step has run (else
        a loop that already set the next step's learning rate differs there, and the newcomer is healed)."""
        donation, self.active = self.active, None
        if donation is None or donation.failed:  # a failed donation closed its stream already
            return
        donation.end(state_digest(self.job), at_boundary)
        self._ended = donation
        if drain:
            donation.drain(self.job.settings.collective_timeout)

    def settle(self) -> None:
        """Before this member's parameters or optimizer state change: the last ended stream's
        digest has been read (:meth:`Donation.settle`)."""
        donation, self._ended = self._ended, None
        if donation is not None:
            donation.settle(self.job.settings.collective_timeout)


# -- the newcomer ---------------------------------------------------------------------------------


class CatchUp:
    """A newcomer's side: a port for its donor, and a thread that receives and replays."""

    def __init__(self, job: CatchingUpJob, host: str, warm: dict | None) -> None:
        self.job, self.warm = job, warm
        self.server = socket.create_server((host, 0))
        self.address = f"{host}:{self.server.getsockname()[1]}"
        self.deadline = time.monotonic() + max(10.0, job.settings.collective_timeout)
        self.connected = threading.Event()
        self.loaded = False
        self.caught_up = False
        self.ended = threading.Event()
        self.error: str | None = None
        self.verified = False
        """The replay ended at the donor's step with the donor's whole-state digest."""
        self.mismatch: str | None = None
        """Why a digest taken at a step boundary differed: the loop is not replayable."""
        self.replayed = 0
        self.bytes = 0
        self._stop = False
        self._link: StreamLink | None = None
        self._thread = threading.Thread(target=self._receive, name="unbroken-catch-up", daemon=True)
        self._thread.start()

    def wanted(self) -> bool:
        """Whether the newcomer should still ask to catch up (not yet caught up, nothing failed,
        and a donor has come, or may still come)."""
        if self.caught_up or self.ended.is_set():
            return False
        return self.connected.is_set() or time.monotonic() < self.deadline

    def finish(self, timeout: float) -> str | None:
        """Wait (up to ``timeout``) for the stream's end (the donor left its generation), then
        stop the receiver and wait until it has: it never touches the state after this returns.
        Returns why the state it loaded is unverified (None: verified, or nothing was loaded):
        the caller must then treat this member as fresh, to be healed from a peer."""
        if not self.ended.wait(timeout if self.connected.is_set() else 0.0):
            self._stop = True
            if self._link is not None:
                self._link.close()
        self._thread.join()  # at most one load or replay more: it checks _stop between them
        self.server.close()
        if not self.loaded or self.verified:
            return None
        return self.mismatch or f"the stream ended before its digest ({self.error or 'stopped'})"

    def _receive(self) -> None:
        job = self.job
        started = time.monotonic()
        try:
            self.server.settimeout(0.2)  # short waits: finish() must be able to stop it at once
            conn = None
            while conn is None:
                if self._stop or time.monotonic() > self.deadline:
                    raise LinkBroken("no donor came")
                try:
                    conn, _ = self.server.accept()
                except socket.timeout:
                    continue
            conn.settimeout(None)
            if self._stop:
                conn.close()
                raise LinkBroken("a generation formed before the donor came")
            self._link = link = StreamLink(conn)
            self.connected.set()
            state, self.bytes = healing.recv_state(link, 0, into=self.warm)
            if self._stop:
                raise LinkBroken("a generation formed while the state arrived")
            adopt_parameters(job.model, state["model"])  # never a replica group (eligible): whole parameters
            job._load(state)
            del state
            job.fresh = False
            self.warm = job._warm = None
            self.loaded = True
            log.info("%s: state of step %d received from its donor (%d bytes); replaying the steps since",
                     job.member_id, job.next_step, self.bytes)
            params, buffers = _params(job), list(job.model.buffers())
            while not self._stop:
                header = torch.zeros(5, dtype=torch.int64)
                link.recv(header, tag=TAG_RECORD, what="catch-up record")
                kind, index, value, pending, extra = header.tolist()
                if kind == END:
                    self._check(link, index, at_boundary=bool(value))
                    break
                mask = torch.zeros(len(params), dtype=torch.uint8)
                link.recv(mask, tag=TAG_MASK, what="catch-up record")
                hypers = torch.empty(extra, dtype=torch.uint8)
                link.recv(hypers, tag=TAG_HYPERS, what="catch-up hyper-parameters")
                grads = []
                for p, present in zip(params, mask.tolist()):
                    grad = None
                    if present:
                        grad = torch.empty(p.shape, dtype=p.dtype)
                        link.recv(grad, tag=TAG_TENSOR, what="catch-up gradient")
                    grads.append(grad)
                values = []
                for b in buffers:
                    value = torch.empty(b.shape, dtype=b.dtype)
                    link.recv(value, tag=TAG_TENSOR, what="catch-up buffer")
                    values.append(value)
                if index != job.next_step:
                    raise LinkBroken(f"the donor sent step {index}, this member is at step {job.next_step}")
                replay(job, index, value, grads, values, safe_loads(hypers.numpy().tobytes()))
                self.replayed += 1
                self.caught_up = self.caught_up or pending == 0
        except (LinkBroken, OSError, socket.timeout, pickle.UnpicklingError) as exc:
            self.error = str(exc)
            log.info("%s: catching up stopped (%s); the heal brings it up to date", job.member_id, exc)
        finally:
            if self._link is not None:
                self._link.close()
            self.server.close()
            job._events.emit("catch_up", member=job.member_id, loaded=self.loaded, replayed=self.replayed, step=job.next_step,
                             bytes=self.bytes, seconds=round(time.monotonic() - started, 3), error=self.error,
                             verified=self.verified, mismatch=self.mismatch)
            self.ended.set()

    def _check(self, link: StreamLink, next_step: int, at_boundary: bool) -> None:
        """The donor's end: this member must stand at its step with its whole state's digest
        (each side reads its own at the same time; the donor's comes after)."""
        job = self.job
        if next_step != job.next_step:
            raise LinkBroken(f"the donor ended at step {next_step}, this member replayed to step {job.next_step}")
        mine = state_digest(job).value()
        digest = torch.zeros(1, dtype=torch.int64)
        link.recv(digest, tag=TAG_DIGEST, what="catch-up digest")
        if mine == int(digest):
            self.verified = True
        elif at_boundary:
            self.mismatch = (f"the state replayed to step {job.next_step} differs from its donor's: the loop changes"
                             " the training state outside the optimizer's and the scheduler's steps")
        else:
            self.error = "the donor's generation broke mid-step: its state there may differ from a replay's"
