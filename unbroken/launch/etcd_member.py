"""One member of an etcd cluster, run as a child process: what ``unbroken run --ha`` starts on each
of the first three nodes of a SLURM job, so that nobody has to run etcd for the replicated
coordinator. The ``etcd`` binary comes from the system (Debian: ``apt-get install etcd-server``).

Three members survive the loss of any one of them; with one or two hosts, losing the one that
holds etcd's majority stops every decision (training already under way goes on until its members'
leases run out), which is why ``--ha`` needs at least three nodes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass

from unbroken.errors import ConfigError, UnbrokenError

CLIENT_PORT = 2379
"""etcd's usual client port; the peer port is the next one."""


class EtcdFailed(UnbrokenError):
    """The etcd member did not start, or did not become healthy in time."""


def require_binary() -> str:
    """The path of the ``etcd`` binary, or a clear error saying how to get it."""
    path = shutil.which("etcd")
    if path is None:
        raise ConfigError(
            "--ha needs the etcd binary on PATH on the first three nodes (Debian/Ubuntu: apt-get install etcd-server;"
            " or any etcd 3.4+ release), or run an etcd cluster yourself and pass --etcd HOST:PORT,..."
        )
    return path


@dataclass(frozen=True)
class MemberSpec:
    """Where one member listens and which cluster it belongs to."""

    name: str
    host: str
    """The address other members and clients reach it at."""
    client_port: int
    peer_port: int
    initial_cluster: str
    """``name=http://host:peer_port,...`` for every member."""
    token: str
    """Names the cluster, so that members of two jobs never mix."""
    listen_host: str | None = None
    """The address to bind (default: ``host``); ``0.0.0.0`` for every interface."""
    election_timeout_ms: int = 500
    """etcd's own failure detection (its default is 1000 ms; 10x the heartbeat suits a LAN). A
    lost etcd leader costs about this much, and etcd extends every lease by it on a new leader."""
    heartbeat_interval_ms: int = 50

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def argv(self, binary: str, data_dir: str, state: str = "new") -> list[str]:
        listen = self.listen_host or self.host
        return [
            binary, "--name", self.name, "--data-dir", data_dir,
            "--listen-client-urls", f"http://{listen}:{self.client_port}",
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", f"http://{listen}:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://{self.host}:{self.peer_port}",
            "--initial-cluster", self.initial_cluster, "--initial-cluster-state", state,
            "--initial-cluster-token", self.token,
            "--election-timeout", str(self.election_timeout_ms), "--heartbeat-interval", str(self.heartbeat_interval_ms),
            "--pre-vote=true",
        ]


def cluster_specs(hosts: list[str], token: str, client_port: int = CLIENT_PORT, **kwargs) -> list[MemberSpec]:
    """One member per host (client port and the next one for peers on each)."""
    names = [f"m{i}" for i in range(len(hosts))]
    initial = ",".join(f"{n}=http://{h}:{client_port + 1}" for n, h in zip(names, hosts))
    return [MemberSpec(n, h, client_port, client_port + 1, initial, token, **kwargs) for n, h in zip(names, hosts)]


class EtcdMember:
    """A running etcd member; :meth:`stop` ends it (and only it, by its process group)."""

    def __init__(self, spec: MemberSpec, data_dir: str, log_path: str, popen=subprocess.Popen) -> None:
        self.spec = spec
        self.data_dir = data_dir
        self.log_path = log_path
        self._popen = popen
        self.proc: subprocess.Popen | None = None

    def start(self, state: str = "new") -> "EtcdMember":
        binary = require_binary()
        os.makedirs(self.data_dir, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = self._popen(
                self.spec.argv(binary, self.data_dir, state),
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.spec.host}:{self.spec.client_port}/health", timeout=1) as reply:
                return b'"health":"true"' in reply.read().replace(b" ", b"")
        except OSError:
            return False

    def wait_healthy(self, timeout: float) -> None:
        """Until the cluster this member belongs to answers (it needs a majority of members up)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise EtcdFailed(f"etcd member {self.spec.name} exited with {self.proc.returncode}; see {self.log_path}")
            if self.healthy():
                return
            time.sleep(0.1)
        raise EtcdFailed(f"etcd member {self.spec.name} was not healthy within {timeout:.0f} s; see {self.log_path}")

    def stop(self, sig: int = signal.SIGKILL, grace: float = 5.0) -> None:
        """Send ``sig`` to the member's process group; SIGKILL after ``grace`` seconds."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for signal_now in (sig, signal.SIGKILL):
            try:
                os.killpg(proc.pid, signal_now)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue
        proc.wait()
