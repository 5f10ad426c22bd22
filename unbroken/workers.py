"""A launcher's worker processes: starting one, copying its output, reaping it, stopping them all.

Each local rank is a slot (:class:`Worker`) whose process is started again after a crash; its
state is a :class:`WorkerState` (the transitions are drawn in :mod:`unbroken.launcher`). A worker
runs in a process group of its own, so that whatever it started dies with it. Its output goes to
``<run dir>/workers/w<local rank>.log`` and, for one rank, to the console; its exit is reported
to the launcher's queue the moment it happens.
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

from unbroken.restarts import SlotBudget

if TYPE_CHECKING:
    from unbroken.launch_settings import LaunchSettings
    from unbroken.telemetry import EventLog


class WorkerState(enum.Enum):
    RUNNING = "running"
    BACKOFF = "backoff"
    QUARANTINED = "quarantined"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


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


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class WorkerProcesses:
    """The process side of :class:`~unbroken.launcher.Launcher`, which it is a base of: the
    methods that start, watch and stop worker processes, on the launcher's own state."""

    settings: LaunchSettings
    run_dir: str
    token: str | None
    client: Any
    events: EventLog
    workers: list[Worker]
    _exits: queue.Queue[tuple[Worker, subprocess.Popen, int]]
    _console_lock: threading.Lock

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
                # as torchrun: the worker picks cuda:LOCAL_RANK (unbroken.devices.local_device());
                # CUDA_VISIBLE_DEVICES is passed on as it is, never narrowed per worker
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
        env["UNBROKEN_BACKEND"] = s.backend
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
