"""Where a node's coordinator is, or runs, for ``unbroken run``: from the flags, completed from
SLURM's environment under srun.

Outside SLURM the flags say it all: ``--coordinator`` names one elsewhere, or the launcher starts
one on ``--coordinator-host`` (with ``--etcd``: a candidate, reachable by the other nodes). Under
srun the first node hosts the coordinator and the others reach it there; with ``--ha`` every node
runs a candidate and the first three an etcd member (see :mod:`unbroken.slurm`).
"""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass
from typing import Any, Mapping

from unbroken import slurm
from unbroken.errors import ConfigError
from unbroken.slurm import SlurmNode


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


def placement(args: argparse.Namespace, env: Mapping[str, str], nproc: int) -> Placement:
    """The coordinator's placement from the flags, completed from SLURM's environment under srun."""
    place = Placement(
        args.coordinator, args.coordinator_host, args.coordinator_port, args.node_name or socket.gethostname(),
        etcd=args.etcd, job_id=args.job_id,
    )
    under_slurm = slurm.from_env(env) if args.coordinator is None or args.ha else None
    if args.ha and under_slurm is None:
        raise ConfigError("--ha works under SLURM (srun); elsewhere run an etcd cluster and pass --etcd HOST:PORT,... --job-id J")
    if under_slurm is not None:
        _under_slurm(place, args, env, under_slurm, nproc)
    if place.etcd and place.host is None:
        place.host, place.advertise = "0.0.0.0", place.advertise or place.node
    place.advertise = args.coordinator_advertise or place.advertise
    place.host = place.host or "127.0.0.1"
    return place


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
