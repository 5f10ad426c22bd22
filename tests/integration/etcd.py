"""A local etcd cluster for tests: three members on 127.0.0.1, started and stopped by the test
(skipped with a reason where the etcd binary is missing; `.ci/run` installs Debian's
etcd-server). Every member is a process of ours, ended by its pid in every outcome."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from typing import Iterator


def why_not_available() -> str | None:
    if shutil.which("etcd") is None:
        return "the etcd binary is not installed (Debian: apt-get install etcd-server)"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Cluster:
    def __init__(self, directory: str, size: int = 3) -> None:
        ports = _free_ports(2 * size)
        self.client_ports, self.peer_ports = ports[:size], ports[size:]
        self.names = [f"e{i}" for i in range(size)]
        self.directory = directory
        self.procs: list[subprocess.Popen | None] = [None] * size
        self.initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports))

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    def start(self, index: int, state: str = "new") -> None:
        name = self.names[index]
        log = open(os.path.join(self.directory, f"{name}.log"), "ab")
        self.procs[index] = subprocess.Popen(
            ["etcd", "--name", name, "--data-dir", os.path.join(self.directory, name),
             "--listen-client-urls", f"http://127.0.0.1:{self.client_ports[index]}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.client_ports[index]}",
             "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[index]}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[index]}",
             "--initial-cluster", self.initial, "--initial-cluster-state", state,
             "--initial-cluster-token", os.path.basename(self.directory),
             "--election-timeout", "500", "--heartbeat-interval", "50", "--pre-vote=true"],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()

    def stop(self, index: int) -> None:
        proc = self.procs[index]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.procs[index] = None

    def healthy(self, index: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client_ports[index]}/health", timeout=1) as r:
                return b'"health":"true"' in r.read().replace(b" ", b"")
        except OSError:
            return False

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.healthy(i) for i, p in enumerate(self.procs) if p is not None):
                return
            time.sleep(0.1)
        raise AssertionError(f"etcd did not become healthy within {timeout} s")


@contextmanager
def cluster(directory: str, size: int = 3) -> Iterator[Cluster]:
    made = Cluster(directory, size)
    try:
        for i in range(size):
            made.start(i)
        made.wait_healthy()
        yield made
    finally:
        for i in range(size):
            made.stop(i)
