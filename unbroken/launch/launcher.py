"""The launcher (node agent): ``unbroken run``.

It starts the coordinator (unless one is given), starts the local workers, watches them, tells the
coordinator about every exit at once, restarts a worker that crashed (with backoff, at most
``max_restarts`` times within any ``restart_window`` seconds; a slot that fails more often is
quarantined for ``quarantine_cooloff`` seconds, see :mod:`unbroken.launch.restarts`), forwards Ctrl-C and
SIGTERM as a clean shutdown, and writes each worker's output to
``<run dir>/workers/w<local rank>.log``. The console shows one worker's output, prefixed with its
name: the job's leader when it is one of this node's workers (``[wN leader]``), else the lowest
local rank alive, or those chosen with ``--local-ranks-filter``; and any worker's tracebacks and errors.

With ``--group-size`` K > 1 a slot is a replica group of K processes (one member of the job) and
shares one fate: the first of them to fail ends all K, and the slot exits, is restarted or
quarantined as one, with that process's status (see :mod:`unbroken.launch.workers`).

Worker (slot) lifecycle::

    RUNNING --exit 0--> SUCCEEDED
    RUNNING --crash, budget left--> BACKOFF --backoff--> RUNNING (restart count + 1)
    RUNNING --crash, over budget--> QUARANTINED --cool-off--> RUNNING (restart count + 1, fresh budget)
    RUNNING --non-zero exit once the job finished or failed--> FAILED
    RUNNING --shutdown; or the job finished and it had not left job.steps() within shutdown_grace--> STOPPED
    BACKOFF/QUARANTINED --shutdown, or the job finished--> STOPPED

A worker whose member left ``job.steps()`` (its coordinator state is ``left``) is never stopped for
running on: what the script does after the loop (saving, evaluating) is the user's. If such a
worker exits non-zero once the job finished, ``unbroken run`` exits 1 and names it.

The launcher ends when every slot is SUCCEEDED, FAILED or STOPPED. A quarantined slot is not an
end: the others go on, and if every slot of this node is quarantined the launcher waits for the
cool-off (the coordinator's quorum timeout still bounds the job: the launcher ends with status 1
when the coordinator says the job failed).

This module holds :class:`Launcher`: the main loop and what it decides on a worker's exit. Its
settings are :class:`~unbroken.launch.launch_settings.LaunchSettings`; starting, reaping and stopping
the worker processes is :mod:`unbroken.launch.workers`, the coordinator it runs itself
:mod:`unbroken.launch.embedded_coordinator`.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from unbroken.launch.embedded_coordinator import EmbeddedCoordinator
from unbroken.observe import refusal_mark
from unbroken.errors import EXIT_MISMATCH, RESTARTABLE_EXITS, ConfigError, UnbrokenError
from unbroken.launch.launch_settings import LaunchSettings
from unbroken.launch.quorum_wait import QuorumWait
from unbroken.launch.restarts import SlotBudget
from unbroken.observe.events import EventLog
from unbroken.launch.workers import Worker, WorkerProcesses, WorkerState, _describe_exit, _signal_group

log = logging.getLogger(__name__)


def new_token() -> str:
    """A fresh secret for an embedded coordinator: 192 random bits as 48 hex digits, so that it
    can be passed as ``--token TOKEN`` (a URL-safe token starts with ``-`` one time in 64, and
    argparse then takes it for a flag)."""
    import secrets

    return secrets.token_hex(24)


class Launcher(WorkerProcesses, EmbeddedCoordinator):
    """Runs one node of a job; :meth:`run` returns the process exit code."""

    def __init__(self, settings: LaunchSettings) -> None:
        self.settings = settings
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = os.path.abspath(settings.run_dir or os.path.join("unbroken-runs", f"{stamp}-{os.getpid()}"))
        try:
            os.makedirs(os.path.join(self.run_dir, "workers"), exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot make the run directory {self.run_dir} ({exc.strerror}); choose another with --run-dir") from None
        self.events = EventLog.for_run_dir(self.run_dir, f"launcher:{settings.node}")
        policy = settings.restart_policy()
        # one slot per replica group (--group-size processes; a lone process when it is 1): the
        # coordinator's member, restarted, quarantined and counted as one
        self.workers = [Worker(i, SlotBudget(policy)) for i in range(settings.slots)]
        self.coordinator: Any = None
        self.address = settings.coordinator
        # An embedded coordinator that only this machine can reach gets a token of its own unless
        # one is given: only this launcher's workers (and whoever reads the run directory's token
        # file) can speak to it. One that other nodes reach (SLURM, --coordinator-host 0.0.0.0)
        # needs a token they share: the one given (UNBROKEN_TOKEN in the job's environment), or
        # none, with a warning.
        local = settings.coordinator_host in ("127.0.0.1", "localhost", "::1")
        self.token = settings.token or (new_token() if settings.coordinator is None and local else None)
        if settings.coordinator is None and not local and not settings.token:
            print(
                f"[unbroken] warning: the coordinator listens on {settings.coordinator_host} without a token: anyone who"
                " reaches it can end the job; set UNBROKEN_TOKEN to the same secret on every node",
                flush=True,
            )
        self._exits: queue.Queue[tuple[Worker, subprocess.Popen, int, int]] = queue.Queue()
        self._stop_signal: int | None = None
        self._console_lock = threading.Lock()
        self._leader: tuple[int, str] | None = None
        """(generation, member at index 0) of the job's current generation, as last polled: the
        console shows the leader's output when it is one of this node's workers (the workers' own
        marks, :mod:`unbroken.observe.leader_mark`, tell it sooner)."""
        self._error_exits: dict[int, int] = {}
        self._after_loop_failures: list[Worker] = []
        self._finished_at: float | None = None
        self._next_status_check = 0.0
        self._quorum_wait: QuorumWait | None = None  # once the coordinator is known
        self._progress: Any = None
        self.reason = ""

    # -- main loop -----------------------------------------------------------------------------

    def run(self) -> int:
        from unbroken.coordinator.client import CoordinatorClient

        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._start_zygote()  # it imports torch while the coordinator starts
            self._start_coordinator()
            if self.coordinator is None:  # another's: it must answer, as a coordinator, before workers start
                from unbroken.launch.coordinator_probe import probe

                if not probe(self.address, self.token, self._say, stopped=lambda: self._stop_signal is not None):
                    self.reason = f"stopped by {signal.Signals(self._stop_signal).name}"
                    return 130 if self._stop_signal == signal.SIGINT else 143
            self.client = CoordinatorClient(self.address, timeout=30.0, token=self.token)
            self._quorum_wait = QuorumWait(self.settings, str(self.address), time.monotonic())
            self._say(f"run directory {self.run_dir}, coordinator {self.address}, {len(self.workers)} worker(s)")
            from unbroken.observe.console import ProgressView

            self._progress = ProgressView(self.events.path, self.settings.progress_interval, self._say).start()
            for worker in self.workers:
                self._spawn(worker)
            code = self._supervise()
        except ConfigError as exc:
            self.reason = str(exc)
            code = 2
        except UnbrokenError as exc:
            self.reason = str(exc)
            code = 1
        finally:
            if self._progress is not None:
                self._progress.stop()
            self._shutdown()
            self._stop_zygote()
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._write_summary()
            if self.coordinator is not None:
                self.coordinator.stop()
            self._stop_etcd_member()
        if code != 0 and self.reason:
            print(f"unbroken: {self.reason}", file=sys.stderr, flush=True)
        return code

    def _supervise(self) -> int:
        while True:
            if self._stop_signal is not None:
                self.reason = f"stopped by {signal.Signals(self._stop_signal).name}"
                return 130 if self._stop_signal == signal.SIGINT else 143
            try:
                worker, proc, code, failed = self._exits.get(timeout=0.05)
            except queue.Empty:
                worker = None
            if worker is not None:
                verdict = self._on_exit(worker, proc, code, failed)
                if verdict is not None:
                    return verdict
            now = time.monotonic()
            for w in self.workers:
                if w.state is WorkerState.BACKOFF and now >= w.restart_at:
                    self._restart(w)
                elif w.state is WorkerState.QUARANTINED and now >= w.restart_at:
                    self._end_quarantine(w)
            verdict = self._watch_job(now)
            if verdict is not None:
                return verdict
            if all(w.state in (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.STOPPED) for w in self.workers):
                return self._final_code()

    def _watch_job(self, now: float) -> int | None:
        """Every half second while a slot is not done, ask the coordinator how the job stands.

        Once the job has finished, no slot is started again, and a running worker whose member has
        not left ``job.steps()`` within ``shutdown_grace`` of the finish (one stopped by SIGSTOP,
        stuck, or one that never registered) is stopped, so that the launcher itself can end. A
        worker whose member left is never stopped: what the script does after the loop is the
        user's. When the job failed and no worker of this node runs (every slot waits out a
        backoff or a quarantine), the launcher ends with status 1: no worker would exit to say so.
        """
        pending = (WorkerState.RUNNING, WorkerState.BACKOFF, WorkerState.QUARANTINED)
        if not any(w.state in pending for w in self.workers) or now < self._next_status_check:
            return None
        self._next_status_check = now + 0.5
        try:
            status = self.client.status()
        except UnbrokenError:
            return None
        members = status.get("generation_members") or []
        self._leader = (int(status.get("generation") or 0), members[0]) if members else None
        note = self._quorum_wait.note(status, now) if self._quorum_wait is not None else None
        if note:
            self._say(note)
        if self._finished_at is None:
            if not status.get("finished"):
                if status.get("failed") and not any(w.state is WorkerState.RUNNING for w in self.workers):
                    self.reason = f"the job cannot go on: {status['failed']}"
                    return 1
                return None
            self._finished_at = now
        states = {m.get("member"): m.get("state") for m in status.get("members", ())}
        for w in self.workers:
            if w.state in (WorkerState.BACKOFF, WorkerState.QUARANTINED):
                self._say(f"the job finished; worker {w.local_rank} is not started again")
                w.state = WorkerState.STOPPED
            elif w.state is WorkerState.RUNNING and w.proc is not None:
                w.left = w.left or states.get(w.member_id) == "left"  # a member never comes back from left
                if not w.left and now - self._finished_at >= self.settings.shutdown_grace:
                    self._say(f"the job finished; stopping worker {w.local_rank}, which had not left the training loop")
                    w.state = WorkerState.STOPPED
                    _signal_group(w.proc, signal.SIGKILL)
        return None

    def _final_code(self) -> int:
        finished = self._job_finished()
        if finished and self._after_loop_failures:
            last = self._after_loop_failures[-1]
            self.reason = (
                f"training finished, but worker {last.local_rank} ({last.member_id}) failed after leaving the"
                f" training loop: {last.exits[-1]['how']}{self._log_tail(last)}"
            )
            return 1
        if finished and any(w.state is WorkerState.SUCCEEDED for w in self.workers):
            from unbroken.observe.incidents import finish_notes

            self._say("training finished" + "".join(f"; {note}" for note in finish_notes(self.run_dir)))
            return 0
        failed = [w for w in self.workers if w.state is WorkerState.FAILED]
        if failed:
            last = failed[-1]
            self.reason = f"no workers left: worker {last.local_rank} {last.exits[-1]['how']}{self._log_tail(last)}"
        else:
            self.reason = "workers exited before the job finished"
        return 1

    def _job_finished(self) -> bool:
        """Whether the coordinator says the job finished (once seen, for good: under ``--ha`` the
        launchers that end first take their etcd members with them)."""
        if self._finished_at is not None:
            return True
        try:
            return bool(self.client.status().get("finished"))
        except UnbrokenError:
            return False

    def _on_exit(self, worker: Worker, proc: subprocess.Popen, code: int, failed: int = 0) -> int | None:
        """A slot's process (or replica group: ``failed`` is the index of the process whose exit
        ended it) exited with ``code``."""
        if proc is not worker.proc:
            return None
        refused = refusal_mark.read(self.run_dir, worker.member_id) if code != 0 else None
        if refused is not None and refused != code:  # another process of its group exited first
            code = refused
        how = _describe_exit(code)
        k = self.settings.group_size
        extra: dict[str, Any] = {}
        if k > 1:
            extra = {"process": failed}
            if code != 0:
                how = f"process {failed} of {k}: {how}"
        stopped = self._stop_signal is not None or worker.state is WorkerState.STOPPED
        if stopped and code != 0:  # ended on purpose (a shutdown, a worker kept past the job's end): no crash
            how = f"{how} (stopped by the launcher)"
        worker.exits.append({"member": worker.member_id, "code": code, "how": how, "t": time.time(), **extra})
        self.events.emit("worker_exit", member=worker.member_id, local_rank=worker.local_rank, code=code, how=how, **extra)
        if stopped:
            worker.state = WorkerState.STOPPED
            return None
        if code == 0:
            worker.state = WorkerState.SUCCEEDED
            return None
        try:
            self.client.post("/v1/exit", member=worker.member_id, exitcode=code, reason=how)
            status = self.client.status()
        except UnbrokenError:
            status = {}
        if status.get("finished"):
            worker.state = WorkerState.FAILED
            left = any(m.get("member") == worker.member_id and m.get("state") == "left" for m in status.get("members", ()))
            if left or worker.left:
                # It got through job.steps() and then failed in the script's own work after the loop
                # (saving, evaluating): training is done, but the run did not end well. Not retried.
                self._after_loop_failures.append(worker)
                self._say(f"worker {worker.local_rank} ({worker.member_id}) {how} after leaving the training loop")
            return None
        if status.get("failed"):
            worker.state = WorkerState.FAILED
            self.reason = f"the job cannot go on: {status['failed']}"
            return 1
        self._say(f"worker {worker.local_rank} ({worker.member_id}) {how}")
        if code == EXIT_MISMATCH:
            # Refused by the coordinator: this node's script, settings or versions differ from the
            # job's. A restart would differ just the same; stop this node and let the others train.
            self.reason = f"worker {worker.local_rank} does not match the job; stopping this node{self._log_tail(worker, 1)}"
            return 2
        if code > 0 and code not in RESTARTABLE_EXITS:
            # A script's own bug raises on every member: when every worker has failed with an error
            # and no step was committed in between, restarting would only repeat it. (A quarantined
            # slot counts by its last exit.)
            step = int(status.get("committed_step", -1))
            self._error_exits = {r: s for r, s in self._error_exits.items() if s == step}
            self._error_exits[worker.local_rank] = step
            if len(self._error_exits) == len(self.workers):
                self.reason = f"every worker failed with an error at the same point (worker {worker.local_rank}: {how}); not retrying a bug in the script{self._log_tail(worker)}"
                return 1
        self._restart_later(worker, how)
        return None

    def _restart_later(self, worker: Worker, how: str) -> None:
        """After a crash: back off before starting the slot again, or quarantine it when it has
        failed more often within the window than its budget allows."""
        now = time.monotonic()
        verdict = worker.budget.failed(now)
        worker.restart_at = now + verdict.delay
        if verdict.restart:
            worker.state = WorkerState.BACKOFF
            return
        worker.state = WorkerState.QUARANTINED
        policy = worker.budget.policy
        slot = self._slot(worker)
        self._say(
            f"worker {worker.local_rank} ({slot}) failed {verdict.failures} times within {policy.window:g} s;"
            f" quarantined for {policy.cooloff:g} s"
        )
        self.events.emit(
            "quarantine", local_rank=worker.local_rank, prefix=f"{slot}.", member=worker.member_id,
            failures=verdict.failures, window=policy.window, seconds=policy.cooloff, reason=how,
        )
        self._tell_quarantine(worker, policy.cooloff, f"failed {verdict.failures} times within {policy.window:g} s, the last: {how}")

    def _slot(self, worker: Worker) -> str:
        """``<node>.w<local rank>``: every member id of this slot starts with it and a dot."""
        return f"{self.settings.node}.w{worker.local_rank}"

    def _tell_quarantine(self, worker: Worker, seconds: float, reason: str) -> None:
        """The coordinator refuses joins from the slot for ``seconds`` (0: no longer)."""
        try:
            self.client.post("/v1/quarantine", prefix=f"{self._slot(worker)}.", seconds=seconds, reason=reason)
        except UnbrokenError as exc:
            log.warning("could not tell the coordinator about the quarantine of %s: %s", self._slot(worker), exc)

    def _end_quarantine(self, worker: Worker) -> None:
        cooloff = worker.budget.policy.cooloff
        self._tell_quarantine(worker, 0, "cool-off over")
        worker.budget.release()
        self.events.emit("quarantine_end", local_rank=worker.local_rank, prefix=f"{self._slot(worker)}.", seconds=cooloff)
        self._say(f"worker {worker.local_rank} ({self._slot(worker)}): cool-off over; starting it again")
        self._restart(worker)

    def _restart(self, worker: Worker) -> None:
        worker.restarts += 1
        self._spawn(worker)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop_signal = signum

    def _say(self, message: str) -> None:
        with self._console_lock:
            print(f"[unbroken] {message}", flush=True)

    def _write_summary(self) -> None:
        summary = {
            "run_dir": self.run_dir,
            "coordinator": self.address,
            "reason": self.reason,
            "workers": [
                {
                    "local_rank": w.local_rank,
                    "state": w.state.value,
                    "restarts": w.restarts,
                    "quarantines": w.budget.quarantines,
                    "exits": w.exits,
                }
                for w in self.workers
            ],
            "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.settings).items() if k != "token"},
        }
        with open(os.path.join(self.run_dir, "launcher.json"), "w") as f:
            json.dump(summary, f, indent=2)

