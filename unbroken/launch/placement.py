"""Where a node's coordinator is, or runs, for ``unbroken run``: from the flags, completed from
SLURM's environment under srun.

Outside SLURM the flags say it all: ``--coordinator`` names one elsewhere, or the launcher starts
one on ``--coordinator-host`` (with ``--etcd``: a candidate, reachable by the other nodes), or
``--rdzv-endpoint HOST:PORT`` (torchrun's spelling, the same command on every node) hosts it on
the node whose address HOST is and joins it from the others. Under
srun the first node hosts the coordinator and the others reach it there; with ``--ha`` every node
runs a candidate and the first three an etcd member (see :mod:`unbroken.launch.slurm`).
"""

from __future__ import annotations

import argparse
import socket
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from unbroken.launch import slurm
from unbroken.errors import ConfigError
from unbroken.launch.slurm import SlurmNode


@dataclass
class Placement:
    """Where this node's coordinator is (or runs), and this node's name in the job."""

    coordinator: str | None
    host: str | None
    port: int
    node: str
    advertise: str | None = None
    expected: int | None = None
    etcd: str | None = None
    job_id: str | None = None
    etcd_member: Any = None


COORDINATOR_FLAGS = {
    "min_members": ("--min-members", 1),
    "max_members": ("--max-members", None),
    "nnodes": ("--nnodes", None),
    "progress_timeout": ("--progress-timeout", 20.0),
    "warmup_timeout": ("--warmup-timeout", 600.0),
    "busy_timeout": ("--busy-timeout", 3600.0),
    "quorum_timeout": ("--quorum-timeout", 300.0),
    "start_grace": ("--start-grace", 30.0),
    "coordinator_host": ("--coordinator-host", None),
    "coordinator_port": ("--coordinator-port", 0),
    "coordinator_advertise": ("--coordinator-advertise", None),
}
"""Flags read only where the coordinator runs (attribute -> flag, default): a node that joins
another node's coordinator ignores them, and says so."""


def placement(args: argparse.Namespace, env: Mapping[str, str], nproc: int, warn: Any = None) -> Placement:
    """The coordinator's placement from the flags, completed from SLURM's environment under srun."""
    place = Placement(
        args.coordinator, args.coordinator_host, args.coordinator_port, args.node_name or socket.gethostname(),
        etcd=args.etcd, job_id=args.job_id,
    )
    rdzv = getattr(args, "rdzv_endpoint", None)
    if rdzv:
        _rendezvous(place, args, rdzv)
    under_slurm = slurm.from_env(env) if (args.coordinator is None and not rdzv) or args.ha else None
    if args.ha and under_slurm is None:
        raise ConfigError("--ha works under SLURM (srun); elsewhere run an etcd cluster and pass --etcd HOST:PORT,... --job-id J")
    if under_slurm is not None:
        _under_slurm(place, args, env, under_slurm, nproc)
    if place.etcd and place.host is None:
        place.host, place.advertise = "0.0.0.0", place.advertise or place.node
    place.advertise = args.coordinator_advertise or place.advertise
    place.host = place.host or "127.0.0.1"
    if place.coordinator is not None and not place.etcd:
        _warn_ignored(args, place.coordinator, warn or (lambda line: print(line, file=sys.stderr, flush=True)))
    return place


def _warn_ignored(args: argparse.Namespace, coordinator: str, warn: Any) -> None:
    """One line for every coordinator's flag given to a node that joins another's coordinator."""
    rdzv = getattr(args, "rdzv_endpoint", None)
    for name, (flag, default) in COORDINATOR_FLAGS.items():
        value = getattr(args, name, default)
        if rdzv and name in ("coordinator_host", "coordinator_port", "coordinator_advertise"):
            continue  # refused with --rdzv-endpoint already
        if value != default and value is not None:
            warn(f"[unbroken] warning: {flag} {value} is ignored on this node: it joins the coordinator at {coordinator},"
                 " which the node that hosts it runs with its own flags (give it there)")


def _rendezvous(place: Placement, args: argparse.Namespace, endpoint: str) -> None:
    """``--rdzv-endpoint HOST:PORT``, torchrun's spelling: the same command on every node. The node
    whose address HOST is (and whose PORT is free) hosts the coordinator there; the others join it."""
    if args.coordinator or args.coordinator_host or args.coordinator_port or args.etcd:
        raise ConfigError("--rdzv-endpoint says where the coordinator is: drop --coordinator, --coordinator-host,"
                          " --coordinator-port and --etcd (one way to name it)")
    host, _, port_text = endpoint.rpartition(":")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got {endpoint!r}"
                          " (for example node0:29400, the same on every node)")
    port = int(port_text)
    if is_local_address(host) and port_free(port):
        place.host, place.port, place.advertise = "0.0.0.0", port, host
    else:
        place.coordinator = f"{host}:{port}"


def is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine: one of its addresses can be bound here."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"--rdzv-endpoint: cannot resolve {host!r} ({exc}); use a name or address every node resolves") from None
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


def port_free(port: int) -> bool:
    """Whether no process here listens on ``port`` yet (another launcher on this machine may
    host the coordinator already: this one then joins it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def _under_slurm(place: Placement, args: argparse.Namespace, env: Mapping[str, str], under_slurm: SlurmNode, nproc: int) -> None:
    """Under srun: the node's name and the coordinator's port from SLURM; the first node hosts the
    coordinator, or with ``--ha`` every node runs a candidate and the first three an etcd member."""
    place.node = args.node_name or under_slurm.node
    place.port = args.coordinator_port or under_slurm.port  # the same on every node
    if args.ha:
        place.etcd, job_id, place.etcd_member = slurm.ha_plan(under_slurm, env, args.etcd_port)
        place.job_id = args.job_id or job_id
        place.coordinator = ",".join(f"{n}:{place.port}" for n in under_slurm.nodes)  # every node runs a candidate
        place.host, place.advertise = place.host or "0.0.0.0", under_slurm.nodes[under_slurm.node_index]
        place.expected = len(under_slurm.nodes) * nproc
    elif under_slurm.hosts_coordinator:
        place.host = "0.0.0.0"
        place.advertise = under_slurm.nodes[0]
        place.expected = len(under_slurm.nodes) * nproc
    else:
        place.coordinator = f"{under_slurm.nodes[0]}:{place.port}"
