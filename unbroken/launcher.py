"""The launcher (node agent): ``unbroken run``.

It starts the coordinator (unless one is given), starts the local workers, watches them, tells the
coordinator about every exit at once, restarts a worker that crashed (with backoff, at most
``max_restarts`` times within any ``restart_window`` seconds; a slot that fails more often is
quarantined for ``quarantine_cooloff`` seconds, see :mod:`unbroken.restarts`), forwards Ctrl-C and
SIGTERM as a clean shutdown, and writes each worker's output to
``<run dir>/workers/w<local rank>.log``. The console shows one worker's output (the lowest local
rank alive, or the one chosen with ``--tee``), prefixed with its name.

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
"""

from __future__ import annotations

import enum
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from unbroken.errors import EXIT_MISMATCH, ConfigError, UnbrokenError
from unbroken.restarts import RestartPolicy, SlotBudget
from unbroken.telemetry import EventLog

log = logging.getLogger(__name__)


class WorkerState(enum.Enum):
    RUNNING = "running"
    BACKOFF = "backoff"
    QUARANTINED = "quarantined"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class LaunchSettings:
    """Everything ``unbroken run`` needs; the CLI flags map one to one onto these fields."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    """Worker processes on this node."""
    max_restarts: int = 5
    """Restarts allowed per worker slot within ``restart_window``; one failure more quarantines it."""
    restart_window: float = 300.0
    """Seconds over which a slot's failures are counted (see :mod:`unbroken.restarts` for why
    these defaults)."""
    quarantine_cooloff: float = 600.0
    """Seconds a quarantined slot is not started; then it starts again with a fresh budget."""
    restart_backoff: float = 0.1
    """Delay before restarting a slot after its first failure within the window; doubles with each
    further failure within the window."""
    max_restart_backoff: float = 10.0
    """Upper bound of the restart delay."""
    run_dir: str | None = None
    """Where logs and events go (default: ``unbroken-runs/<time>-<pid>``)."""
    coordinator: str | None = None
    """``HOST:PORT`` of an external coordinator; None starts one inside the launcher."""
    coordinator_host: str = "127.0.0.1"
    """Address the embedded coordinator binds."""
    coordinator_port: int = 0
    """Port of the embedded coordinator (0: any free port)."""
    coordinator_advertise: str | None = None
    """Host name other nodes use to reach the embedded coordinator's store (default: its bind address)."""
    expected_members: int | None = None
    """Workers the embedded coordinator's first generation waits for (default: this node's, or --min-members)."""
    node: str = field(default_factory=socket.gethostname)
    """Name of this node in member ids."""
    heartbeat_interval: float = 0.5
    """Seconds between a worker's heartbeats."""
    heartbeat_timeout: float = 5.0
    """Seconds of silence after which the coordinator declares a worker dead."""
    collective_timeout: float = 30.0
    """Longest wait of one collective when no verdict ends it sooner."""
    checkpoint_dir: str | None = None
    """Durable checkpoints go here: a path or fsspec URL (s3://...)."""
    checkpoint_every: int | str | None = None
    """Save every this many steps, or ``auto`` (Young/Daly); None: never (with a directory, the
    job still resumes from what is there)."""
    checkpoint_keep: int = 3
    """Complete checkpoints to keep."""
    min_members: int = 1
    """The embedded coordinator forms no generation below this many workers."""
    max_members: int | None = None
    """The embedded coordinator puts at most this many workers in a generation."""
    progress_timeout: float = 20.0
    """A worker whose progress (micro-batches, gradients, collectives) stops for this long while
    its peers wait for it is declared dead and restarted; a long step that moves is never stuck."""
    warmup_timeout: float = 600.0
    """The same for a worker that has not committed its first step yet (compilation, loading)."""
    quorum_timeout: float = 300.0
    """The job fails if live workers stay below ``min_members`` this long."""
    start_grace: float = 30.0
    """The first generation waits this long for every expected worker before starting with fewer."""
    shutdown_grace: float = 5.0
    """Seconds workers get to exit after SIGTERM before SIGKILL; and, once the job finished, how
    long a worker that has not left ``job.steps()`` gets before SIGKILL."""
    tee: int | None = None
    """Local rank whose output the console shows (default: the lowest one alive)."""
    progress_interval: float = 10.0
    """Seconds between plain progress lines when the output is not a terminal (a terminal gets a
    live progress bar); 0 turns both off."""
    chaos: str | None = None
    """Fault schedule for the workers (see ``unbroken.chaos``)."""
    record_samples: bool = False
    """Workers log the stream positions of every step attempt (for exactly-once checks)."""
    etcd: str | None = None
    """``HOST:PORT,...`` of an etcd cluster: the embedded coordinator is then one of several
    candidates (one per launcher), the one that leads serves, and the job survives the loss of
    any host, this one's included. Needs ``job_id``."""
    job_id: str | None = None
    """Names the job in etcd; the same on every node."""
    leader_lease: float = 2.0
    """With ``etcd``: seconds after which a lost leading candidate is replaced."""
    etcd_member: Any = None
    """With ``--ha`` under SLURM: the :class:`~unbroken.etcd_member.MemberSpec` of the etcd member
    this launcher runs for the job (on the first three nodes), else None."""
    token: str | None = field(default=None, repr=False)
    """Shared secret for the coordinator (``--token``/``UNBROKEN_TOKEN``). The embedded coordinator
    makes one up when none is given; an external one needs the token it was started with."""

    def __post_init__(self) -> None:
        if isinstance(self.nproc_per_node, bool) or not isinstance(self.nproc_per_node, int) or self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be a positive integer, got {self.nproc_per_node!r}")
        self.restart_policy()  # validates
        if not 0 < self.heartbeat_interval < self.heartbeat_timeout:
            raise ConfigError("need 0 < --heartbeat-interval < --heartbeat-timeout")
        if self.heartbeat_timeout >= self.collective_timeout:
            raise ConfigError("need --heartbeat-timeout < --collective-timeout")
        if not self.heartbeat_timeout > 2 * self.heartbeat_interval:
            raise ConfigError("need --heartbeat-timeout > 2 x --heartbeat-interval (a worker's lease is their difference)")
        if not 0 < self.heartbeat_timeout <= self.progress_timeout:
            raise ConfigError("need --heartbeat-timeout <= --progress-timeout, so that a stopped worker is judged by its heartbeats")
        if self.quorum_timeout <= 0:
            raise ConfigError("--quorum-timeout must be positive")
        if self.warmup_timeout < self.progress_timeout:
            raise ConfigError("need --warmup-timeout >= --progress-timeout")
        if self.progress_timeout >= self.collective_timeout:
            raise ConfigError("need --progress-timeout < --collective-timeout, so that a stuck worker is evicted before its peers give up")
        if self.min_members < 1 or (self.max_members is not None and self.max_members < self.min_members):
            raise ConfigError(f"need 1 <= --min-members <= --max-members, got {self.min_members} and {self.max_members}")
        for name in ("restart_backoff", "max_restart_backoff", "shutdown_grace", "quorum_timeout", "start_grace", "progress_interval"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must not be negative")
        if self.tee is not None and not 0 <= self.tee < self.nproc_per_node:
            raise ConfigError(f"--tee must name a local rank in 0..{self.nproc_per_node - 1}, got {self.tee}")
        if not os.path.isfile(self.script):
            raise ConfigError(f"training script not found: {self.script!r}")
        if self.chaos:
            from unbroken.chaos import parse

            parse(self.chaos)
        from unbroken.checkpoint import CheckpointSettings

        CheckpointSettings(self.checkpoint_dir, self.checkpoint_every, self.checkpoint_keep)  # validates
        if self.etcd:
            from unbroken.replicated import leadership_from_flags

            leadership_from_flags(self.etcd, self.job_id, self.leader_lease)  # validates
            if self.leader_lease >= self.heartbeat_timeout + 1:
                log.warning(
                    "--leader-lease %.1f s is well above --heartbeat-timeout %.1f s: losing the leading coordinator"
                    " will stall training longer than losing a worker", self.leader_lease, self.heartbeat_timeout,
                )

    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(
            max_restarts=self.max_restarts,
            window=self.restart_window,
            backoff=self.restart_backoff,
            max_backoff=self.max_restart_backoff,
            cooloff=self.quarantine_cooloff,
        )


@dataclass
class Worker:
    """One slot (local rank) and its current process."""

    local_rank: int
    budget: SlotBudget
    state: WorkerState = WorkerState.RUNNING
    restarts: int = 0
    proc: subprocess.Popen | None = None
    member_id: str = ""
    started_at: float = 0.0
    restart_at: float = 0.0
    """When a slot in BACKOFF or QUARANTINED is started again (``time.monotonic()``)."""
    left: bool = False
    """The current process's member left ``job.steps()`` (seen in the coordinator's status)."""
    exits: list[dict[str, Any]] = field(default_factory=list)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Launcher:
    """Runs one node of a job; :meth:`run` returns the process exit code."""

    def __init__(self, settings: LaunchSettings) -> None:
        self.settings = settings
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = os.path.abspath(settings.run_dir or os.path.join("unbroken-runs", f"{stamp}-{os.getpid()}"))
        os.makedirs(os.path.join(self.run_dir, "workers"), exist_ok=True)
        self.events = EventLog.for_run_dir(self.run_dir, f"launcher:{settings.node}")
        policy = settings.restart_policy()
        self.workers = [Worker(i, SlotBudget(policy)) for i in range(settings.nproc_per_node)]
        self.coordinator: Any = None
        self.address = settings.coordinator
        import secrets

        # An embedded coordinator that only this machine can reach gets a token of its own unless
        # one is given: only this launcher's workers (and whoever reads the run directory's token
        # file) can speak to it. One that other nodes reach (SLURM, --coordinator-host 0.0.0.0)
        # needs a token they share: the one given (UNBROKEN_TOKEN in the job's environment), or
        # none, with a warning.
        local = settings.coordinator_host in ("127.0.0.1", "localhost", "::1")
        self.token = settings.token or (secrets.token_urlsafe(24) if settings.coordinator is None and local else None)
        if settings.coordinator is None and not local and not settings.token:
            print(
                f"[unbroken] warning: the coordinator listens on {settings.coordinator_host} without a token: anyone who"
                " reaches it can end the job; set UNBROKEN_TOKEN to the same secret on every node",
                flush=True,
            )
        self._exits: queue.Queue[tuple[Worker, subprocess.Popen, int]] = queue.Queue()
        self._stop_signal: int | None = None
        self._console_lock = threading.Lock()
        self._error_exits: dict[int, int] = {}
        self._after_loop_failures: list[Worker] = []
        self._finished_at: float | None = None
        self._next_status_check = 0.0
        self._progress: Any = None
        self.reason = ""

    # -- main loop -----------------------------------------------------------------------------

    def run(self) -> int:
        from unbroken.client import CoordinatorClient

        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._start_coordinator()
            self.client = CoordinatorClient(self.address, timeout=30.0, token=self.token)
            self._say(f"run directory {self.run_dir}, coordinator {self.address}, {len(self.workers)} worker(s)")
            from unbroken.console import ProgressView

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
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._write_summary()
            if self.coordinator is not None:
                self.coordinator.stop()
            self._stop_etcd_member()
        if code != 0 and self.reason:
            print(f"unbroken: {self.reason}", file=sys.stderr, flush=True)
        return code

    def _start_coordinator(self) -> None:
        """Start the embedded coordinator: alone, or with ``--etcd`` as this node's candidate
        (after this node's etcd member under ``--ha``)."""
        if self.address is not None and not self.settings.etcd:
            return
        from unbroken.coordinator import Coordinator, CoordinatorSettings
        from unbroken.membership import MembershipSettings

        leadership = None
        if self.settings.etcd:
            from unbroken.replicated import leadership_from_flags

            self._start_etcd_member()
            leadership = leadership_from_flags(self.settings.etcd, self.settings.job_id, self.settings.leader_lease)
        self.coordinator = Coordinator(
            CoordinatorSettings(
                host=self.settings.coordinator_host,
                port=self.settings.coordinator_port,
                advertise_host=self.settings.coordinator_advertise,
                token=self.token,
            ),
            MembershipSettings(
                heartbeat_timeout=self.settings.heartbeat_timeout,
                expected_members=self.settings.expected_members or max(len(self.workers), self.settings.min_members),
                min_members=self.settings.min_members,
                max_members=self.settings.max_members,
                progress_timeout=self.settings.progress_timeout,
                warmup_timeout=self.settings.warmup_timeout,
                quorum_timeout=self.settings.quorum_timeout,
                start_grace=self.settings.start_grace,
            ),
            EventLog.for_run_dir(self.run_dir, "coordinator"),
            leadership=leadership,
        ).start_in_thread()
        host = "127.0.0.1" if self.settings.coordinator_host == "0.0.0.0" else self.settings.coordinator_host
        # this node's candidate first, then the others known up front (workers learn the rest)
        self.address = ",".join([f"{host}:{self.coordinator.port}"] + ([self.address] if self.address else []))
        # for `unbroken status` and metrics scrapers: readable by this user only
        # (written whole, then renamed into place: a reader never sees half of it)
        path = os.path.join(self.run_dir, "coordinator.json")
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"address": self.address, "token": self.token}, f)
        os.rename(path + ".tmp", path)

    def _start_etcd_member(self) -> None:
        """Under ``--ha``: this node's etcd member, in a fresh local data directory, until the
        launcher ends. The cluster is healthy once a majority of the first three nodes runs."""
        spec = self.settings.etcd_member
        if spec is None:
            return
        import tempfile

        from unbroken.etcd_member import EtcdMember

        self._etcd_dir = tempfile.mkdtemp(prefix="unbroken-etcd-")
        self.etcd_member = EtcdMember(spec, self._etcd_dir, os.path.join(self.run_dir, "etcd.log")).start()
        self._say(f"etcd member {spec.name} at {spec.client_url} (log {self.run_dir}/etcd.log)")

    def _stop_etcd_member(self) -> None:
        member = getattr(self, "etcd_member", None)
        if member is not None:
            member.stop(signal.SIGTERM)
            import shutil

            shutil.rmtree(self._etcd_dir, ignore_errors=True)

    def _supervise(self) -> int:
        while True:
            if self._stop_signal is not None:
                self.reason = f"stopped by {signal.Signals(self._stop_signal).name}"
                return 130 if self._stop_signal == signal.SIGINT else 143
            try:
                worker, proc, code = self._exits.get(timeout=0.05)
            except queue.Empty:
                worker = None
            if worker is not None:
                verdict = self._on_exit(worker, proc, code)
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
            self._say("training finished")
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

    def _on_exit(self, worker: Worker, proc: subprocess.Popen, code: int) -> int | None:
        if proc is not worker.proc:
            return None
        how = _describe_exit(code)
        worker.exits.append({"member": worker.member_id, "code": code, "how": how, "t": time.time()})
        self.events.emit("worker_exit", member=worker.member_id, local_rank=worker.local_rank, code=code, how=how)
        if self._stop_signal is not None or worker.state is WorkerState.STOPPED:
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
        if code > 0:
            # A script's own bug raises on every member: when every worker has failed with an error
            # and no step was committed in between, restarting would only repeat it. (A quarantined
            # slot counts by its last exit.)
            step = int(status.get("committed_step", -1))
            self._error_exits = {r: s for r, s in self._error_exits.items() if s == step}
            self._error_exits[worker.local_rank] = step
            if len(self._error_exits) == len(self.workers):
                self.reason = f"every worker failed with an error at the same point (worker {worker.local_rank}: {how}); not retrying a bug in the script{self._log_tail(worker)}"
                return 1
        now = time.monotonic()
        verdict = worker.budget.failed(now)
        worker.restart_at = now + verdict.delay
        if verdict.restart:
            worker.state = WorkerState.BACKOFF
            return None
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
        return None

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

    # -- processes -----------------------------------------------------------------------------

    def _spawn(self, worker: Worker) -> None:
        s = self.settings
        worker.member_id = f"{s.node}.w{worker.local_rank}.r{worker.restarts}"
        env = dict(os.environ)
        env.update(
            {
                # every candidate known so far, this node's first
                "UNBROKEN_COORDINATOR": ",".join(f"{h}:{p}" for h, p in self.client.addresses),
                "UNBROKEN_TOKEN": self.token or "",
                "UNBROKEN_LAUNCHER_PID": str(os.getpid()),
                "UNBROKEN_MEMBER_ID": worker.member_id,
                "UNBROKEN_NODE": s.node,
                "UNBROKEN_RUN_DIR": self.run_dir,
                "UNBROKEN_RESTART_COUNT": str(worker.restarts),
                "UNBROKEN_HEARTBEAT_INTERVAL": str(s.heartbeat_interval),
                "UNBROKEN_COLLECTIVE_TIMEOUT": str(s.collective_timeout),
                # The lease ends one heartbeat interval before the coordinator's deadline, so that a
                # member cut off from the coordinator stops committing before it is declared dead.
                "UNBROKEN_LEASE": str(s.heartbeat_timeout - s.heartbeat_interval),
                "LOCAL_RANK": str(worker.local_rank),
                "LOCAL_WORLD_SIZE": str(len(self.workers)),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        if s.chaos:
            env["UNBROKEN_CHAOS"] = s.chaos
        if s.record_samples:
            env["UNBROKEN_RECORD_SAMPLES"] = "1"
        if s.checkpoint_dir:
            env["UNBROKEN_CHECKPOINT_DIR"] = s.checkpoint_dir
            env["UNBROKEN_CHECKPOINT_KEEP"] = str(s.checkpoint_keep)
            if s.checkpoint_every is not None:
                env["UNBROKEN_CHECKPOINT_EVERY"] = str(s.checkpoint_every)
        log_path = os.path.join(self.run_dir, "workers", f"w{worker.local_rank}.log")
        logfile = open(log_path, "ab", buffering=0)
        logfile.write(f"===== {worker.member_id} starting =====\n".encode())
        proc = subprocess.Popen(
            [sys.executable, s.script, *s.script_args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        worker.proc = proc
        worker.state = WorkerState.RUNNING
        worker.left = False
        worker.started_at = time.monotonic()
        self.events.emit("worker_start", member=worker.member_id, local_rank=worker.local_rank, pid=proc.pid, restart=worker.restarts)
        if worker.restarts:
            self.events.emit("restart", member=worker.member_id, local_rank=worker.local_rank, restart=worker.restarts)
        pump = threading.Thread(target=self._pump, args=(worker, proc, logfile), daemon=True)
        pump.start()
        threading.Thread(target=self._reap, args=(worker, proc, pump), daemon=True).start()

    def _reap(self, worker: Worker, proc: subprocess.Popen, pump: threading.Thread) -> None:
        """Report a worker's exit the moment it happens, and end what it left running.

        The exit is taken from the process itself, not from the end of its output: a child the
        worker started may hold the output pipe open long after the worker died. Its process
        group is killed right away (the group id cannot be reused while any member lives)."""
        code = proc.wait()
        _signal_group(proc, signal.SIGKILL)
        pump.join(timeout=2.0)  # its last lines (a traceback) belong in the log before the verdict
        self._exits.put((worker, proc, code))

    def _pump(self, worker: Worker, proc: subprocess.Popen, logfile: IO[bytes]) -> None:
        """Copy a worker's output to its log (and the console) until the pipe closes."""
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            logfile.write(line)
            if self._console_rank() == worker.local_rank:
                with self._console_lock:
                    sys.stdout.write(f"[w{worker.local_rank}] {line.decode(errors='replace')}")
                    sys.stdout.flush()
        logfile.close()

    def _console_rank(self) -> int | None:
        if self.settings.tee is not None:
            return self.settings.tee
        for w in self.workers:
            if w.state is WorkerState.RUNNING and w.proc is not None and w.proc.poll() is None:
                return w.local_rank
        return None

    def _log_tail(self, worker: Worker, lines: int = 3) -> str:
        path = os.path.join(self.run_dir, "workers", f"w{worker.local_rank}.log")
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 4096))
                tail = [l for l in f.read().decode(errors="replace").splitlines() if l.strip()][-lines:]
        except OSError:
            return ""
        return ("; its log ends with: " + " | ".join(t.strip() for t in tail)) if tail else ""

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop_signal = signum

    def _shutdown(self) -> None:
        """Stop every worker still running: SIGTERM, then SIGKILL after the grace period."""
        running = []
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                running.append(w.proc)
                w.state = WorkerState.STOPPED
            elif w.state in (WorkerState.RUNNING, WorkerState.BACKOFF, WorkerState.QUARANTINED):
                w.state = WorkerState.STOPPED
        for proc in running:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown_grace
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in running:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
            _signal_group(proc, signal.SIGKILL)  # children the worker started die with it

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


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
