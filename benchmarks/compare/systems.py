"""How each compared system is started, watched, signalled and stopped.

Every process is started in a session of its own with its output in the run directory. The
harness makes itself a child subreaper, so that workers which left their launcher's process
group (torchrun's do) are still its descendants, and ``Run.stop`` ends every one of them.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

from benchmarks.compare import envs
from unbroken.launch.launch_settings import LaunchSettings

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = 3
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned descendants are reparented to this process instead of init."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tail:
    """Follows the step logs of a run incrementally."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._offsets: dict[str, int] = {}
        self.records: list[dict] = []
        self.latest: dict[int, dict] = {}  # pid -> its latest step record
        self.top = -1  # highest step committed so far

    def poll(self) -> list[dict]:
        new = []
        for path in glob.glob(os.path.join(self.directory, "w_*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            cut = data.rfind(b"\n") + 1
            self._offsets[path] = offset + cut
            for line in data[:cut].splitlines():
                try:
                    new.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        new.sort(key=lambda r: r["t"])
        for r in new:
            if r["k"] == "step":
                self.latest[r["pid"]] = r
                self.top = max(self.top, r["step"])
        self.records.extend(new)
        return new

    def member(self, rank: int) -> int | None:
        """The live process whose latest commit was as member ``rank``."""
        live = [r for pid, r in self.latest.items() if alive(pid)]
        live.sort(key=lambda r: -r["t"])
        for r in live:
            if r["rank"] == rank:
                return r["pid"]
        return None

    def members(self) -> list[int]:
        newest = max((r["t"] for r in self.latest.values()), default=0)
        return sorted(pid for pid, r in self.latest.items() if alive(pid) and r["t"] > newest - 5)


@dataclass
class Run:
    """One launch of one system: its processes and its logs."""

    system: "System"
    directory: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    ending: bool = False
    tail: Tail = field(init=False)

    def __post_init__(self) -> None:
        self.directory = os.path.abspath(self.directory)  # the processes run inside it
        if os.path.exists(self.directory):  # logs of an earlier run would mix with this one's
            shutil.rmtree(self.directory)
        os.makedirs(self.log_dir)
        self.tail = Tail(self.log_dir)

    @property
    def log_dir(self) -> str:
        return os.path.join(self.directory, "log")

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        out = open(os.path.join(self.directory, f"{name}.out"), "ab")
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True, cwd=self.directory)
        out.close()
        self.procs.append(proc)
        return proc

    def done(self) -> bool:
        return self.system.done(self)

    def finished(self) -> bool:
        """Ended by itself, every process with status 0 and every member's ``done`` record written."""
        return self.system.finished(self)

    def stop(self) -> None:
        """End every process of this run: its launchers' groups, then any descendant left."""
        self.ending = True
        for proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.1)
        for proc in self.procs:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        for _ in range(50):
            left = descendants(os.getpid())
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _reap()
            time.sleep(0.1)
        raise RuntimeError(f"processes left after stopping {self.system.name}: {descendants(os.getpid())}")


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class System:
    """A compared system. ``restarts`` says whether a killed member comes back by itself."""

    name = ""
    label = ""
    env = ""
    governs_hang = ""  # what decides how long a hung member stalls the others

    def launch(self, run: Run, steps: int) -> None:
        raise NotImplementedError

    def done(self, run: Run) -> bool:
        return all(p.poll() is not None for p in run.procs)

    def finished(self, run: Run) -> bool:
        if not self.done(run) or any(p.returncode != 0 for p in run.procs):
            return False
        done = {r["pid"] for r in run.tail.records if r["k"] == "done"}
        return len(done) >= WORKERS

    def script(self, name: str) -> str:
        return os.path.join(HERE, name)


def _default_seconds(field: str) -> str:
    """A ``LaunchSettings`` default of this checkout (the unbroken the benchmark installs), as ``3 s``."""
    return f"{LaunchSettings.__dataclass_fields__[field].default:g} s"


class Unbroken(System):
    name, label, env = "unbroken", "unbroken", "unbroken"
    governs_hang = f"heartbeat timeout ({_default_seconds('heartbeat_timeout')} default)"

    def launch(self, run: Run, steps: int) -> None:
        unbroken = os.path.join(os.path.dirname(envs.python(self.env)), "unbroken")
        run.spawn("launcher", [unbroken, "run", "--nproc-per-node", str(WORKERS), "--max-restarts", "1000", "--run-dir", os.path.join(run.directory, "unbroken"), "--progress-interval", "3600", self.script("train_unbroken.py"), "--step-log", run.log_dir, "--steps", str(steps)])


class PlainDDP(System):
    name, label, env = "ddp", "plain DDP (torchrun)", "torch"
    governs_hang = "Gloo collective timeout (30 min default)"

    def args(self, run: Run) -> tuple[list[str], list[str], dict[str, str]]:
        return [], [], {}

    def launch(self, run: Run, steps: int) -> None:
        launcher, script, env = self.args(run)
        cmd = [envs.python(self.env), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORKERS), *launcher]
        run.spawn("torchrun", [*cmd, self.script("train_ddp.py"), "--step-log", run.log_dir, "--steps", str(steps), *script], env)


class TorchrunElastic(PlainDDP):
    name, label = "torchrun", "torchrun elastic, checkpoint every 20"
    governs_hang = "Gloo collective timeout (30 min default); torchrun watches only exits"

    def args(self, run: Run) -> tuple[list[str], list[str], dict[str, str]]:
        # A new rendezvous store per round: with the stock shared store, torch 2.13's restart
        # reads the dead round's addresses and failed or hung in 3 of 5 trials (torchrun anchor).
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        return ["--max-restarts", "1000"], ["--checkpoint-dir", os.path.join(run.directory, "checkpoints"), "--checkpoint-every", "20"], env


class Torchft(System):
    """torchft 0.2.0: a lighthouse and one replica group per process, restarted when it dies."""

    name, label, env = "torchft", "torchft 0.2.0 (manager.allreduce)", "torchft"
    wrapper = "manual"
    governs_hang = "max(Gloo timeout 5 s, lighthouse heartbeat timeout 5 s)"

    def launch(self, run: Run, steps: int) -> None:
        lighthouse = os.path.join(os.path.dirname(envs.python(self.env)), "torchft_lighthouse")
        for _ in range(5):
            port = free_port()
            proc = run.spawn("lighthouse", [lighthouse, "--bind", f"127.0.0.1:{port}", "--min_replicas", "2", "--join_timeout_ms", "10000", "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", "5000"], {"RUST_LOG": "warn"})
            if _wait_port(port, proc):
                break
            run.procs.remove(proc)
        else:
            raise RuntimeError("the torchft lighthouse did not start; see lighthouse.out")
        run.lighthouse = proc
        run.replicas = {}
        for replica in range(WORKERS):
            run.replicas[replica] = self._replica(run, replica, port, steps)
        threading.Thread(target=self._supervise, args=(run, port, steps), daemon=True).start()

    def _replica(self, run: Run, replica: int, port: int, steps: int) -> subprocess.Popen:
        cmd = [envs.python(self.env), self.script("train_torchft.py"), "--step-log", run.log_dir, "--steps", str(steps), "--replica", str(replica), "--lighthouse", f"http://127.0.0.1:{port}", "--wrapper", self.wrapper]
        return run.spawn(f"replica{replica}", cmd, {"RUST_LOG": "warn", "GLOO_SOCKET_IFNAME": "lo"})

    def _supervise(self, run: Run, port: int, steps: int) -> None:
        """What a cluster scheduler does for torchft: restart a replica group that died."""
        while not run.ending:
            for replica, proc in list(run.replicas.items()):
                if proc.poll() not in (None, 0) and not run.ending:
                    run.replicas[replica] = self._replica(run, replica, port, steps)
            if all(p.poll() == 0 for p in run.replicas.values()):
                break
            time.sleep(0.05)

    def done(self, run: Run) -> bool:
        replicas = getattr(run, "replicas", {})
        ended = all(p.poll() is not None for p in replicas.values())
        return ended and (all(p.poll() == 0 for p in replicas.values()) or run.ending)

    def finished(self, run: Run) -> bool:
        replicas = getattr(run, "replicas", {})
        if not replicas or not all(p.poll() == 0 for p in replicas.values()):
            return False
        return len({r["pid"] for r in run.tail.records if r["k"] == "done"}) >= WORKERS


class TorchftDDP(Torchft):
    name, label = "torchft-ddp", "torchft 0.2.0 (its DDP wrapper)"
    wrapper = "ddp"


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


class RayTrain(System):
    """Ray Train 2.60: the driver owns a local 3-CPU cluster and shuts it down at the end."""

    name, label, env = "ray", "Ray Train 2.60, checkpoint every 300", "ray"
    governs_hang = "worker health-check timeout (600 s default)"
    # Every ray.train.report waits for the controller's next poll (2 s): at 20 steps between
    # checkpoints a step costs 15x plain DDP (Ray anchor). 300 steps is about one poll interval.
    checkpoint_every = 300

    def launch(self, run: Run, steps: int) -> None:
        cmd = [envs.python(self.env), self.script("train_ray.py"), "--step-log", run.log_dir, "--steps", str(steps), "--storage", os.path.join(run.directory, "storage"), "--checkpoint-every", str(self.checkpoint_every)]
        run.spawn("driver", cmd, {"RAY_DEDUP_LOGS": "1", "RAY_USAGE_STATS_ENABLED": "0"})


SYSTEMS: dict[str, System] = {s.name: s for s in (Unbroken(), PlainDDP(), TorchrunElastic(), Torchft(), TorchftDDP(), RayTrain())}
