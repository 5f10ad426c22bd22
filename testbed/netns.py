"""Test hosts as network namespaces on one machine: a bridge, one namespace per host with a veth
pair into the bridge and an address of its own on a subnet made for the test.

The hosts talk only among themselves. Everything is removed in every outcome (the context
manager's exit), and only processes started inside these namespaces are ever killed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from contextlib import contextmanager
from typing import Iterator


def why_not_available() -> str | None:
    """A reason to skip, or None when namespaces can be made here."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"ubprobe{os.getpid() % 10000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _subnet() -> int:
    """The third byte of this test's subnet, 10..249: different in every process that makes hosts
    at the same time, pytest-xdist's workers included (worker i of n takes the numbers equal to
    i modulo n; within a worker, tests make hosts one after another)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    return 10 + (os.getpid() % (240 // count)) * count + index % count


class Hosts:
    def __init__(self, count: int) -> None:
        tag = f"ub{os.getpid() % 10000}"
        self.bridge = f"{tag}br"
        self.names = [f"{tag}h{i}" for i in range(count)]
        self.links = [f"{tag}v{i}" for i in range(count)]
        subnet = _subnet()
        self.addresses = [f"10.213.{subnet}.{i + 1}" for i in range(count)]
        self.bridge_address = f"10.213.{subnet}.254"
        """The test process's own address on the bridge: it can reach every host (to probe etcd
        or a coordinator); a cut host is cut off from it too."""

    def _ip(self, *args: str, ns: str | None = None) -> None:
        cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def create(self) -> None:
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("link", "set", self.bridge, "up")
        self._ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        for ns, link, address in zip(self.names, self.links, self.addresses):
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
            self._ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("link", "set", link, "master", self.bridge)
            self._ip("link", "set", link, "up")
            self._ip("addr", "add", f"{address}/24", "dev", "eth0", ns=ns)
            self._ip("link", "set", "eth0", "up", ns=ns)
            self._ip("link", "set", "lo", "up", ns=ns)

    def cut(self, index: int) -> None:
        """Partition a host: its link into the bridge goes down."""
        self._ip("link", "set", self.links[index], "down")

    def restore(self, index: int) -> None:
        self._ip("link", "set", self.links[index], "up")

    def cut_route(self, index: int, to: int) -> None:
        """Host ``index`` can no longer reach host ``to`` (and sees no reply from it); both still
        reach every other host."""
        self._ip("route", "add", "blackhole", f"{self.addresses[to]}/32", ns=self.names[index])

    def restore_route(self, index: int, to: int) -> None:
        self._ip("route", "del", "blackhole", f"{self.addresses[to]}/32", ns=self.names[index])

    def popen(self, index: int, argv: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        env = dict(env or os.environ, GLOO_SOCKET_IFNAME="eth0")
        kwargs.pop("start_new_session", None)  # always a session of its own
        return subprocess.Popen(["ip", "netns", "exec", self.names[index], *argv], env=env, start_new_session=True, **kwargs)

    def pids(self, index: int) -> list[int]:
        """Every process running in host ``index``."""
        out = subprocess.run(["ip", "netns", "pids", self.names[index]], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def signal_all(self, index: int, sig: int) -> None:
        """Send ``sig`` to every process of host ``index`` (SIGKILL: the host is lost)."""
        for pid in self.pids(index):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def destroy(self) -> None:
        for ns in self.names:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@contextmanager
def hosts(count: int) -> Iterator[Hosts]:
    made = Hosts(count)
    try:
        made.create()
        yield made
    finally:
        made.destroy()
