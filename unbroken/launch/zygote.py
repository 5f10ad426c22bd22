"""Starting workers by fork from a process that imported torch already: the launcher's *zygote*.

Most of a worker's start is importing torch (about 1.6 s of CPU on this project's machines): a
restarted worker pays it again before it can rejoin, and N workers starting together pay it N
times over the node's cores. The launcher instead starts one zygote (``python -m
unbroken.launch.zygote FD``) that imports ``torch``, ``torch.distributed`` and what a torch optimizer's
constructor imports (``torch._dynamo``) once, and then forks
each worker. The child takes the worker's environment, working directory, session or process
group and output pipes (passed over a Unix socket), and runs the script as ``python SCRIPT ARGS``
or ``python -m MODULE ARGS`` would (:mod:`runpy`, as ``__main__``, ``sys.argv`` and ``sys.path[0]``
set the same way). The zygote reaps its children and reports each exit status to the launcher,
which sees a forked worker through :class:`ForkedProcess`, a ``subprocess.Popen`` look-alike.

What a forked worker shares with the zygote, and why it is safe:

- the zygote never touches CUDA (no device count, no context): a CUDA context cannot survive a
  fork, and torch's import does not make one. It runs no torch operation either, so no thread
  pool exists to be lost in the fork.
- the interpreter's start-up settings (``PYTHON*`` variables, the hash seed): the zygote starts
  with the workers' environment less the variables that differ per worker
  (:data:`PER_WORKER`); a worker whose environment differs in anything else is started as a
  fresh interpreter instead (:meth:`Zygote.can_start`).
- its name: the zygote names itself ``unbroken-zygote`` (``/proc/PID/comm``, what ``top`` and
  ``ps -o comm`` show); a forked worker takes back its interpreter's name.
- the heap: before serving, the zygote collects and then freezes what it holds (``gc.freeze()``,
  as Python's documentation advises before a fork without exec), so a worker's garbage
  collections skip the modules it inherited.
- random state: Python's ``random`` reseeds itself in a forked child; numpy's global generator,
  if imported, is reseeded from the OS here; torch's default seed is the same fixed value as in
  a fresh interpreter.

``unbroken run --no-zygote`` (``UNBROKEN_ZYGOTE=0``) starts every worker as a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from unbroken.launch.worker_start import run_worker as _run_worker
from unbroken.launch.worker_start import set_command_line as _set_command_line
from unbroken.launch.worker_start import set_name as _set_name

from unbroken.launch.preload import prepare_for_forking
from unbroken.parent_death import die_with

PER_WORKER = ("LOCAL_RANK", "UNBROKEN_MEMBER_ID", "UNBROKEN_RESTART_COUNT", "UNBROKEN_RANK_IN_GROUP",
              "UNBROKEN_GROUP_PREFIX", "UNBROKEN_GROUP_STORE", "UNBROKEN_GROUP_TIMEOUT", "UNBROKEN_COORDINATOR",
              "UNBROKEN_TOKEN")
"""Variables that may differ between two workers of one launcher without a fresh interpreter:
none is read before the script runs."""

ZYGOTE_NAME = "unbroken-zygote"
"""The zygote's process name (``/proc/PID/comm``): its command line is every forked worker's too."""

_READY_TIMEOUT = 30.0
"""Seconds the launcher waits for the zygote to import torch, or for a forked child to be set up."""


class ZygoteError(RuntimeError):
    """The zygote is gone or answered nonsense: the launcher starts workers as fresh interpreters."""


# -- the launcher's side -------------------------------------------------------------------------


class ForkedProcess:
    """A worker forked by the zygote, seen as a ``subprocess.Popen``: ``pid``, ``stdout`` and
    ``stderr`` (its output pipes), ``poll()``, ``wait()``, ``returncode`` (negative: the signal)."""

    def __init__(self, pid: int, stdout: Any, stderr: Any) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The launcher's handle on its zygote: fork a worker (:meth:`start`), learn of its exit."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = {k: v for k, v in env.items() if k not in PER_WORKER}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = ours
        self._lock = threading.Lock()
        self._replies: list[dict[str, Any]] = []
        self._replied = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before the start's reply was read
        self.alive = True
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "unbroken.launch.zygote", str(theirs.fileno()), str(os.getpid())],
            env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self._ready = False
        self._reader = threading.Thread(target=self._read, name="unbroken-zygote", daemon=True)
        self._reader.start()

    def can_start(self, env: dict[str, str]) -> bool:
        """Whether a worker with ``env`` may be forked: alive, and no variable but
        :data:`PER_WORKER` differs from the zygote's own environment."""
        if not self.alive:
            return False
        return {k: v for k, v in env.items() if k not in PER_WORKER} == self.env

    def start(self, argv: list[str], module: bool, env: dict[str, str], session: int | None = None) -> ForkedProcess:
        """Fork a worker running ``argv`` (script or module first) with ``env``; ``session`` None:
        a session of its own, 0: a new process group leading itself, else that process group."""
        (out_read, out_write), (err_read, err_write) = os.pipe(), os.pipe()
        try:
            request = {"argv": argv, "module": module, "env": env, "cwd": os.getcwd(), "group": session}
            with self._lock:
                if not self._ready:  # the zygote imports torch first (it started with the launcher)
                    self._reply("its start-up (importing torch)")
                    self._ready = True
                data = json.dumps(request).encode() + b"\n"
                try:
                    sent = socket.send_fds(self._sock, [data], [out_write, err_write])
                    self._sock.sendall(data[sent:])
                except OSError as exc:
                    self.alive = False
                    raise ZygoteError(f"the zygote is gone: {exc}") from None
                reply = self._reply("forking a worker")
        finally:
            os.close(out_write)
            os.close(err_write)
        if "error" in reply:
            os.close(out_read)
            os.close(err_read)
            raise ZygoteError(f"the zygote could not start the worker: {reply['error']}")
        proc = ForkedProcess(int(reply["pid"]), os.fdopen(out_read, "rb"), os.fdopen(err_read, "rb"))
        with self._replied:
            self._children[proc.pid] = proc
            if proc.pid in self._early:
                proc._exited(self._early.pop(proc.pid))
        return proc

    def close(self) -> None:
        """End the zygote (its children are the launcher's to end)."""
        self.alive = False
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._sock.close()

    def _reply(self, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + _READY_TIMEOUT
        with self._replied:
            while not self._replies:
                if not self.alive:
                    raise ZygoteError(f"the zygote ended during {what}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.alive = False
                    raise ZygoteError(f"the zygote did not answer within {_READY_TIMEOUT:.0f} s ({what})")
                self._replied.wait(remaining)
            return self._replies.pop(0)

    def _read(self) -> None:
        buffered = b""
        while True:
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                message = json.loads(line)
                with self._replied:
                    if "exit" in message:
                        child = self._children.pop(message["exit"], None)
                        if child is None:
                            self._early[message["exit"]] = message["code"]
                        else:
                            child._exited(message["code"])
                    else:
                        self._replies.append(message)
                        self._replied.notify_all()
        # The zygote is gone: nobody can reap its children or report their exits. Kill them (the
        # launcher would restart them anyway) and report them killed.
        with self._replied:
            self.alive = False
            orphans, self._children = list(self._children.values()), {}
            self._replied.notify_all()
        for child in orphans:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                pass
            child._exited(-signal.SIGKILL)


# -- the zygote's side ---------------------------------------------------------------------------


class _BecomeWorker(Exception):
    """Raised in a forked child to leave the zygote's loop for :func:`main`, which runs the script."""

    def __init__(self, request: dict[str, Any]) -> None:
        super().__init__()
        self.request = request


def _serve(sock: socket.socket) -> None:
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wake-up fd is written
    sock.sendall(b'{"ready": true}\n')
    buffered = b""
    fds: list[int] = []  # a request's two pipes (stdout, stderr) arrive with its first bytes
    while True:
        ready, _, _ = select.select([sock, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
        _report_exits(sock)
        if sock not in ready:
            continue
        message, received, _, _ = socket.recv_fds(sock, 1 << 20, 8)
        if not message:
            return  # the launcher is gone: its workers die with it (their parent-death signal is ours)
        fds.extend(received)
        buffered += message
        *lines, buffered = buffered.split(b"\n")
        for line in lines:
            out_fd, err_fd = fds.pop(0), fds.pop(0)
            _fork(sock, json.loads(line), (out_fd, err_fd), (wake_read, wake_write))


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.sendall(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _fork(sock: socket.socket, request: dict[str, Any], outputs: tuple[int, int], wake: tuple[int, int]) -> None:
    ready_read, ready_write = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in outputs:
            os.close(fd)
        sock.sendall(json.dumps({"error": f"fork: {exc}"}).encode() + b"\n")
        return
    if pid == 0:
        os.close(ready_read)
        _become_child(sock, request, outputs, wake, ready_write)
    for fd in outputs:
        os.close(fd)
    os.close(ready_write)
    group = request.get("group")
    if group is not None:
        try:  # as Popen does in both processes: no race with a sibling joining the group
            os.setpgid(pid, group or pid)
        except OSError:
            pass
    # the child has its session, process group and output before the launcher hears its pid
    select.select([ready_read], [], [], _READY_TIMEOUT)
    os.close(ready_read)
    sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")


_SHIELDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals the zygote ignores: Ctrl-C reaches the launcher's whole process group, the zygote's
too, and the launcher's own shutdown (SIGTERM to each worker, then SIGKILL after the grace)
must not be cut short by the zygote's death, which kills every worker at once. The zygote ends
when the launcher closes its socket, or dies with it."""


def _become_child(sock: socket.socket, request: dict[str, Any], outputs: tuple[int, int], wake: tuple[int, int], ready: int) -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's dispositions
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    for fd in wake:
        os.close(fd)
    sock.close()
    group = request.get("group")
    if group is None:
        os.setsid()
    else:
        try:
            os.setpgid(0, group)
        except OSError:
            pass
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(outputs[0], 1)
    os.dup2(outputs[1], 2)
    for fd in outputs:
        os.close(fd)
    os.chdir(request.get("cwd") or os.getcwd())
    env = dict(request["env"])
    # a forked worker's parent is the zygote: it dies with it (and the zygote with the launcher)
    if "UNBROKEN_LAUNCHER_PID" in env:
        env["UNBROKEN_LAUNCHER_PID"] = str(os.getppid())
    _set_command_line(request)  # before the environment is replaced (setproctitle moves it)
    os.environ.clear()
    os.environ.update(env)
    _set_name(os.path.basename(sys.executable))
    os.close(ready)
    raise _BecomeWorker(request)


def main(argv: list[str]) -> None:
    """The zygote: import torch, tell the launcher it is ready, fork workers until it goes."""
    import warnings

    sock = socket.socket(fileno=int(argv[0]))
    for shielded in _SHIELDED:
        signal.signal(shielded, signal.SIG_IGN)
    die_with(int(argv[1]))
    _set_name(ZYGOTE_NAME)
    # torch's import leaves one idle thread; a fork from the main thread is what DataLoader's
    # workers do after it too (Python 3.12 warns about any fork in a process with threads)
    warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to deadlocks")
    import torch
    import torch.distributed  # noqa: F401 - what every worker imports next

    prepare_for_forking()  # torch._dynamo imported, the heap frozen: see unbroken.launch.preload

    assert not torch.cuda.is_initialized()  # never touch CUDA here: a context cannot survive a fork
    request = None
    try:
        _serve(sock)
    except _BecomeWorker as become:
        request = become.request
    except (BrokenPipeError, ConnectionResetError):
        return  # the launcher is gone (it refused its flags or its coordinator while torch was imported)
    # the worker runs outside the handler: the script must see no exception in flight
    # (sys.exc_info(): an integration takes one for an error), and its own errors must not be
    # printed as raised "during handling of" the zygote's
    del sock
    if request is not None:
        _run_worker(request)


if __name__ == "__main__":
    main(sys.argv[1:])
