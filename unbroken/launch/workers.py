"""A launcher's worker processes: starting one, copying its output, reaping it, stopping them all.

Each local rank is a slot (:class:`Worker`) whose process is started again after a crash; its
state is a :class:`WorkerState` (the transitions are drawn in :mod:`unbroken.launch.launcher`). A worker
runs in a process group of its own, so that whatever it started dies with it. Its output goes to
``<run dir>/workers/w<local rank>.log`` and, for one rank, to the console; its exit is reported
to the launcher's queue the moment it happens.

With ``--group-size`` K > 1 a slot is a replica group: K processes (local ranks ``slot*K + j``)
in one process group led by process 0, whose output all goes to the slot's log (process j > 0's
lines prefixed ``[pj] ``). They share one fate: the first to fail kills the process group, and
the slot reports one exit, that process's. They meet in a TCPStore the launcher hosts
(``UNBROKEN_GROUP_STORE``) under a prefix per incarnation of the group (``UNBROKEN_GROUP_PREFIX``).
"""

from __future__ import annotations

import enum
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from unbroken.errors import JOB_CANNOT_GO_ON
from unbroken.observe import leader_mark, refusal_mark
from unbroken.observe.console_lines import for_console, looks_like_an_error
from unbroken.launch.restarts import SlotBudget
from unbroken.store_keys import key_tag

if TYPE_CHECKING:
    from unbroken.launch.launch_settings import LaunchSettings
    from unbroken.observe.events import EventLog


class WorkerState(enum.Enum):
    RUNNING = "running"
    BACKOFF = "backoff"
    QUARANTINED = "quarantined"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class Worker:
    """One slot and its current process (or processes): a local rank, or with ``--group-size`` K
    a replica group of K processes, local ranks ``slot*K`` to ``slot*K + K - 1``. ``local_rank``
    is the slot's index."""

    local_rank: int
    budget: SlotBudget
    state: WorkerState = WorkerState.RUNNING
    restarts: int = 0
    proc: subprocess.Popen | None = None
    """The current process, or with ``--group-size`` K > 1 the replica group's process 0 (its
    pid is the process group of all K)."""
    procs: list[subprocess.Popen] = field(default_factory=list)
    """Every process of the current incarnation: ``[proc]``, or the group's K in order."""
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


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class WorkerProcesses:
    """The process side of :class:`~unbroken.launch.launcher.Launcher`, which it is a base of: the
    methods that start, watch and stop worker processes, on the launcher's own state."""

    settings: LaunchSettings
    run_dir: str
    token: str | None
    client: Any
    events: EventLog
    workers: list[Worker]
    _exits: queue.Queue[tuple[Worker, subprocess.Popen, int, int]]
    """(slot, its process 0, exit status, which process of the group failed: 0 for a lone worker)"""
    _console_lock: threading.Lock
    _stop_signal: int | None
    """The signal that asked the launcher to stop (None: none did)."""

    def _on_exit(self, worker: Worker, proc: subprocess.Popen, code: int, failed: int = 0) -> int | None: ...

    def _worker_env(self, worker: Worker) -> dict[str, str]:
        """The environment of ``worker``'s process(es), less the two variables that differ
        within a replica group (``UNBROKEN_RANK_IN_GROUP``, ``LOCAL_RANK``)."""
        s = self.settings
        k = s.group_size
        client = getattr(self, "client", None)
        env = dict(os.environ)
        env.update(
            {
                # every candidate known so far, this node's first
                "UNBROKEN_COORDINATOR": ",".join(f"{h}:{p}" for h, p in client.addresses) if client else "",
                "UNBROKEN_TOKEN": self.token or "",
                "UNBROKEN_LAUNCHER_PID": str(os.getpid()),
                "UNBROKEN_MEMBER_ID": worker.member_id,  # the same for every process of a replica group
                "UNBROKEN_NODE": s.node,
                "UNBROKEN_RUN_DIR": self.run_dir,
                "UNBROKEN_RESTART_COUNT": str(worker.restarts),
                "UNBROKEN_HEARTBEAT_INTERVAL": str(s.heartbeat_interval),
                "UNBROKEN_COLLECTIVE_TIMEOUT": str(s.collective_timeout),
                # The lease ends one heartbeat interval before the coordinator's deadline, so that a
                # member cut off from the coordinator stops committing before it is declared dead.
                "UNBROKEN_LEASE": str(s.heartbeat_timeout - s.heartbeat_interval),
                "UNBROKEN_GROUP_SIZE": str(k),
                # as torchrun: the worker picks cuda:LOCAL_RANK (unbroken.worker.devices.local_device());
                # CUDA_VISIBLE_DEVICES is passed on as it is, never narrowed per worker
                "LOCAL_WORLD_SIZE": str(s.nproc_per_node),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        if s.chaos:
            env["UNBROKEN_CHAOS"] = s.chaos
        if s.record_samples:
            env["UNBROKEN_RECORD_SAMPLES"] = "1"
        env["UNBROKEN_BACKEND"] = s.backend
        env["UNBROKEN_STRAGGLERS"] = s.stragglers
        if s.shard_optimizer:
            env["UNBROKEN_SHARD_OPTIMIZER"] = "1"
        if s.checkpoint_dir:
            env["UNBROKEN_CHECKPOINT_DIR"] = s.checkpoint_dir
            env["UNBROKEN_CHECKPOINT_KEEP"] = str(s.checkpoint_keep)
            if s.checkpoint_every is not None:
                env["UNBROKEN_CHECKPOINT_EVERY"] = str(s.checkpoint_every)
        if k > 1:
            # The group's own rendezvous: a store of this launcher's, under a prefix that names this
            # incarnation of the group, so that a restarted group never reads a dead one's keys.
            env["UNBROKEN_GROUP_STORE"] = self._group_store_address()
            incarnation = f"{s.node}.w{worker.local_rank}/{worker.restarts}"
            env["UNBROKEN_GROUP_PREFIX"] = f"unbroken/group/{key_tag(self.token, 'group/' + incarnation)}{incarnation}/"
            env["UNBROKEN_GROUP_TIMEOUT"] = str(s.heartbeat_timeout)
        return env

    def _spawn(self, worker: Worker) -> None:
        s = self.settings
        k = s.group_size
        worker.member_id = f"{s.node}.w{worker.local_rank}.r{worker.restarts}"
        env = self._worker_env(worker)
        log_path = os.path.join(self.run_dir, "workers", f"w{worker.local_rank}.log")
        logfile = open(log_path, "ab", buffering=0)
        logfile.write(f"===== {worker.member_id} starting =====\n".encode())
        refusal_mark.clear(self.run_dir, worker.member_id)  # a run directory used before: no stale refusal
        procs: list[subprocess.Popen] = []
        logfiles = [logfile] + [open(log_path, "ab", buffering=0) for _ in range(k - 1)]
        try:
            for j in range(k):
                env_j = {**env, "UNBROKEN_RANK_IN_GROUP": str(j), "LOCAL_RANK": str(worker.local_rank * k + j)}
                # One process group for the K processes of a replica group, so that one killpg ends
                # them all (with whatever they started). A lone worker has a session of its own; the
                # processes of a group cannot (a process joins only a process group of its own
                # session), so process 0 leads a new process group in the launcher's session.
                procs.append(self._start_process(env_j, None if k == 1 else (procs[0].pid if j else 0)))
        except BaseException:
            if procs:
                _signal_group(procs[0], signal.SIGKILL)
            for p in procs:
                p.wait()
            for f in logfiles:
                f.close()
            raise
        worker.proc = procs[0]
        worker.procs = procs
        worker.state = WorkerState.RUNNING
        worker.left = False
        worker.started_at = time.monotonic()
        extra: dict[str, Any] = {"pids": [p.pid for p in procs]} if k > 1 else {}
        self.events.emit(
            "worker_start", member=worker.member_id, local_rank=worker.local_rank, pid=procs[0].pid, restart=worker.restarts, **extra
        )
        if worker.restarts:
            self.events.emit("restart", member=worker.member_id, local_rank=worker.local_rank, restart=worker.restarts)
        pumps = []
        for j, (proc, f) in enumerate(zip(procs, logfiles)):
            # stdout and stderr each have a pump, into the same log (appended line by line)
            for stream, number, log in ((proc.stdout, 1, f), (proc.stderr, 2, open(log_path, "ab", buffering=0))):
                pumps.append(threading.Thread(target=self._pump, args=(worker, stream, number, log, j), daemon=True))
                pumps[-1].start()
        threading.Thread(target=self._reap, args=(worker, procs, pumps), daemon=True).start()

    def _start_zygote(self) -> None:
        """Start the zygote that forks workers (:mod:`unbroken.launch.zygote`), if the settings
        want one; it imports torch meanwhile, while the coordinator starts."""
        self._zygote = None
        if not self.settings.zygote:
            return
        from unbroken.launch.zygote import Zygote, ZygoteError

        try:
            self._zygote = Zygote(self._worker_env(self.workers[0]))
        except (OSError, ZygoteError) as exc:
            print(f"[unbroken] warning: workers start as fresh interpreters: {exc}", flush=True)

    def _stop_zygote(self) -> None:
        zygote, self._zygote = getattr(self, "_zygote", None), None
        if zygote is not None:
            zygote.close()

    def _start_process(self, env: dict[str, str], group: int | None) -> Any:
        """Start one worker process with ``env``: forked by the zygote when there is one and
        ``env`` allows it, else a fresh interpreter. ``group`` None: a session of its own; 0: a
        new process group that it leads (a replica group's process 0); else that process group."""
        s = self.settings
        zygote = getattr(self, "_zygote", None)
        if zygote is not None and not zygote.alive:
            print("[unbroken] warning: the zygote ended; workers start as fresh interpreters from now on", flush=True)
            self._stop_zygote()
            zygote = None
        if zygote is not None and zygote.can_start(env):
            from unbroken.launch.zygote import ZygoteError

            try:
                return zygote.start([s.script, *s.script_args], s.module, env, group)
            except ZygoteError as exc:
                print(f"[unbroken] warning: workers start as fresh interpreters from now on: {exc}", flush=True)
                self._stop_zygote()
        placement = {"start_new_session": True} if group is None else {"process_group": group}
        return subprocess.Popen(
            [sys.executable, *(["-m"] if s.module else []), s.script, *s.script_args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **placement,
        )

    def _group_store_address(self) -> str:
        """``host:port`` of the store the replica groups of this launcher meet in (started once,
        the first time a group starts; it lives as long as the launcher)."""
        store = getattr(self, "_group_store", None)
        if store is None:
            import torch.distributed as dist

            store = self._group_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return f"127.0.0.1:{store.port}"

    def _reap(self, worker: Worker, procs: list[subprocess.Popen], pumps: list[threading.Thread]) -> None:
        """Report a worker's (or replica group's) exit the moment it happens, and end what it left running.

        The exit is taken from the process itself, not from the end of its output: a child the
        worker started may hold the output pipe open long after the worker died. Its process
        group is killed right away (the group id cannot be reused while any member lives).

        A replica group shares one fate: the first of its processes to exit with an error (or by
        a signal) ends all K at once, and its status is the group's; a process that exits 0
        waits for the others, and the group exits 0 once all K did."""
        if len(procs) == 1:
            code, failed = procs[0].wait(), 0
        else:
            code, failed = self._wait_group(procs)
        _signal_group(procs[0], signal.SIGKILL)
        for pump in pumps:
            pump.join(timeout=2.0)  # its last lines (a traceback) belong in the log before the verdict
        self._exits.put((worker, procs[0], code, failed))

    @staticmethod
    def _wait_group(procs: list[subprocess.Popen]) -> tuple[int, int]:
        """Wait for every process of a group; return the first failure (status, index in the
        group), or (0, 0) if all K exited 0. The first failure kills the whole process group."""
        done: queue.Queue[tuple[int, int]] = queue.Queue()
        for j, p in enumerate(procs):
            threading.Thread(target=lambda j=j, p=p: done.put((j, p.wait())), daemon=True).start()
        first: tuple[int, int] | None = None
        for _ in procs:
            j, code = done.get()
            if code != 0 and first is None:
                first = (code, j)
                _signal_group(procs[0], signal.SIGKILL)
        return first or (0, 0)

    def _pump(self, worker: Worker, stream: IO[bytes], number: int, logfile: IO[bytes], index: int = 0) -> None:
        """Copy one of a worker's streams (``number`` 1: stdout, 2: stderr) to its log, and to the
        console if the worker is shown and ``--tee`` takes the stream, or if the line looks like an
        error, until the pipe closes. The lines of a replica group's process j > 0 go to the slot's
        log prefixed ``[pj] ``, never to the console."""
        prefix = f"[p{index}] ".encode() if index else b""
        for line in iter(stream.readline, b""):
            logfile.write(prefix + line)
            if index:
                continue
            text = line.decode(errors="replace")
            leader = self._leader_member()
            if text.startswith(JOB_CANNOT_GO_ON):
                continue  # the launcher's last line says it
            if (number & self.settings.tee and worker.local_rank in self._console_ranks(leader)) or looks_like_an_error(text):
                tag = " leader" if leader is not None and worker.member_id == leader else ""
                shown = for_console(text, f"workers/w{worker.local_rank}.log")
                with self._console_lock:
                    sys.stdout.write(f"[w{worker.local_rank}{tag}] {shown}")
                    sys.stdout.flush()
        logfile.close()

    def _leader_member(self) -> str | None:
        """The member that leads the newest generation known here: from the marks this node's
        workers wrote when they formed it, or from the coordinator's last answer if that names a
        newer generation (led from another node)."""
        polled = getattr(self, "_leader", None)
        marked = leader_mark.newest_leader(self.run_dir, [w.member_id for w in self.workers])
        newest = max((x for x in (polled, marked) if x is not None), default=None, key=lambda x: x[0])
        return newest[1] if newest is not None else None

    def _console_ranks(self, leader: str | None) -> tuple[int, ...]:
        """The workers whose output the console shows: ``--local-ranks-filter``'s, else the job's
        ``leader`` when it is one of this node's workers (the leader changes with generations),
        else the lowest local rank that runs."""
        if self.settings.console_ranks is not None:
            return self.settings.console_ranks
        for w in self.workers:
            if leader is not None and w.member_id == leader and w.state is WorkerState.RUNNING:
                return (w.local_rank,)
        for w in self.workers:
            if w.state is WorkerState.RUNNING and w.proc is not None and w.proc.poll() is None:
                return (w.local_rank,)
        return ()

    def _log_tail(self, worker: Worker, lines: int = 3) -> str:
        path = os.path.join(self.run_dir, "workers", f"w{worker.local_rank}.log")
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 4096))
                tail = [l for l in f.read().decode(errors="replace").splitlines() if l.strip()][-lines:]
        except OSError:
            return ""
        return ("; its log ends with: " + " | ".join(t.strip() for t in tail)) if tail else ""

    def _shutdown(self) -> None:
        """Stop every worker still running: SIGTERM, then SIGKILL after the grace period (to the
        process group: every process of a replica group)."""
        if self._stop_signal is not None:  # a Ctrl-C or SIGTERM: what follows is a stop, not failures
            self.events.emit("shutdown", node=self.settings.node, signal=signal.Signals(self._stop_signal).name)
            import logging  # the embedded coordinator's verdicts on the workers stopped here are expected

            logging.getLogger("unbroken.coordinator").setLevel(logging.ERROR)
        running: list[Worker] = []
        for w in self.workers:
            if w.proc is not None and any(p.poll() is None for p in w.procs or [w.proc]):
                running.append(w)
                w.state = WorkerState.STOPPED
            elif w.state in (WorkerState.RUNNING, WorkerState.BACKOFF, WorkerState.QUARANTINED):
                w.state = WorkerState.STOPPED
        for w in running:
            _signal_group(w.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown_grace
        for w in running:
            for proc in w.procs or [w.proc]:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for w in running:
            _signal_group(w.proc, signal.SIGKILL)
            for proc in w.procs or [w.proc]:
                proc.wait()
            _signal_group(w.proc, signal.SIGKILL)  # children the worker started die with it
            code = w.proc.returncode
            self._on_exit(w, w.proc, code if code is not None else -signal.SIGKILL)  # its worker_exit, its exits entry
