"""A local etcd cluster for tests: three members on 127.0.0.1, started and stopped by the test
(skipped with a reason where the etcd binary is missing; `.ci/run` installs Debian's
etcd-server). Every member is a process of ours, ended by its pid in every outcome."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import json
import time
import urllib.request
from contextlib import contextmanager
from typing import Iterator

from unbroken.launch.etcd_member import EtcdMember, MemberSpec


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
    """``size`` members on ``host`` (127.0.0.1, or a test host's address), with fast elections."""

    def __init__(self, directory: str, size: int = 3, hosts: list[str] | None = None) -> None:
        hosts = hosts or ["127.0.0.1"] * size
        if len(set(hosts)) == 1:
            ports = _free_ports(2 * size)
            client_ports, peer_ports = ports[:size], ports[size:]
        else:  # one member per host: the usual ports
            client_ports, peer_ports = [2379] * size, [2380] * size
        names = [f"e{i}" for i in range(size)]
        initial = ",".join(f"{n}=http://{h}:{p}" for n, h, p in zip(names, hosts, peer_ports))
        self.specs = [
            MemberSpec(n, h, c, p, initial, os.path.basename(directory), election_timeout_ms=500, heartbeat_interval_ms=50)
            for n, h, c, p in zip(names, hosts, client_ports, peer_ports)
        ]
        self.directory = directory
        self.members: list[EtcdMember | None] = [None] * size

    @property
    def endpoints(self) -> list[str]:
        return [f"{s.host}:{s.client_port}" for s in self.specs]

    def member(self, index: int, popen=subprocess.Popen) -> EtcdMember:
        spec = self.specs[index]
        return EtcdMember(spec, os.path.join(self.directory, spec.name), os.path.join(self.directory, f"{spec.name}.log"), popen)

    def start(self, index: int, state: str = "new", popen=subprocess.Popen) -> None:
        """Start member ``index`` (``popen`` may start it inside a test host)."""
        self.members[index] = self.member(index, popen).start(state)

    def stop(self, index: int) -> None:
        member = self.members[index]
        if member is not None:
            member.stop()
        self.members[index] = None

    def healthy(self, index: int) -> bool:
        return self.member(index).healthy()

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(m.healthy() for m in self.members if m is not None):
                return
            time.sleep(0.1)
        raise AssertionError(f"etcd did not become healthy within {timeout} s")


@contextmanager
def cluster(directory: str, size: int = 3, hosts: list[str] | None = None, popen_for=lambda index: subprocess.Popen) -> Iterator[Cluster]:
    """A running cluster, stopped in every outcome; ``popen_for(i)`` starts member i (in a test host)."""
    made = Cluster(directory, size, hosts)
    try:
        for i in range(size):
            made.start(i, popen=popen_for(i))
        made.wait_healthy()
        yield made
    finally:
        for i in range(size):
            made.stop(i)


def _post(endpoint: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://{endpoint}/v3/{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=5) as reply:
        return json.loads(reply.read())


def leader_index(endpoints: list[str]) -> int:
    """Which member leads etcd's own Raft group."""
    for endpoint in endpoints:
        try:
            status = _post(endpoint, "maintenance/status", {})
        except OSError:
            continue
        ids = [_post(e, "maintenance/status", {})["header"]["member_id"] for e in endpoints]
        return ids.index(status["leader"])
    raise AssertionError("no etcd member answered")


def move_leader(endpoints: list[str], to: int, timeout: float = 20.0) -> None:
    """Make member ``to`` etcd's Raft leader (so that one host holds both leaders)."""
    deadline = time.monotonic() + timeout
    while (current := leader_index(endpoints)) != to:
        assert time.monotonic() < deadline, f"etcd leadership did not move to member {to}"
        target = _post(endpoints[to], "maintenance/status", {})["header"]["member_id"]
        try:
            _post(endpoints[current], "maintenance/transfer-leadership", {"targetID": target})
        except OSError:
            time.sleep(0.2)
