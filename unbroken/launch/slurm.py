"""Running under SLURM: take the coordinator address and the node's identity from SLURM.

``srun --ntasks-per-node=1 unbroken run --nproc-per-node 8 train.py`` starts one launcher per
node. The first node of the allocation (``SLURM_NODEID`` 0) hosts the coordinator on a fixed port
(``UNBROKEN_COORDINATOR_PORT``, default 29400); every node, that one included, runs its workers
against it. The node's name is ``SLURMD_NODENAME``. Explicit flags always win over what is read
here.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping

from unbroken.errors import ConfigError

DEFAULT_PORT = 29400


@dataclass(frozen=True)
class SlurmNode:
    """What one ``unbroken run`` learns from SLURM's environment."""

    node: str
    node_index: int
    nodes: tuple[str, ...]
    coordinator: str
    hosts_coordinator: bool
    port: int


def expand_hostlist(text: str) -> list[str]:
    """Expand SLURM's compressed host list (``gpu[01-03,07],rack[1-2]-node[01-02]``) into names.

    SLURM's own ``scontrol show hostnames`` does it where it is installed (every node of a SLURM
    job); elsewhere python-hostlist, which reads the same grammar (brackets in several places of a
    name included). Neither is written here by hand."""
    text = text.strip()
    if shutil.which("scontrol"):
        try:
            done = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            done = None
        if done is not None and done.returncode == 0 and done.stdout.split():
            return done.stdout.split()
    import hostlist

    try:
        names = hostlist.expand_hostlist(text)
    except hostlist.BadHostlist as exc:
        raise ConfigError(f"cannot read the SLURM host list {text!r}: {exc}") from None
    if not names:
        raise ConfigError(f"the SLURM host list {text!r} names no host")
    return names


def from_env(env: Mapping[str, str]) -> SlurmNode | None:
    """This node under SLURM, or None outside a SLURM job step."""
    if "SLURM_JOB_ID" not in env:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError("SLURM_JOB_ID is set but SLURM_JOB_NODELIST is not: run unbroken under srun, or pass --coordinator")
    nodes = tuple(expand_hostlist(nodelist))
    try:
        index = int(env.get("SLURM_NODEID", "0"))
        port = int(env.get("UNBROKEN_COORDINATOR_PORT", str(DEFAULT_PORT)))
    except ValueError as exc:
        raise ConfigError(f"bad SLURM_NODEID or UNBROKEN_COORDINATOR_PORT: {exc}") from None
    if not 0 <= index < len(nodes):
        raise ConfigError(f"SLURM_NODEID={index} is not an index into the {len(nodes)} nodes of SLURM_JOB_NODELIST")
    name = env.get("SLURMD_NODENAME") or nodes[index]
    return SlurmNode(
        node=name,
        node_index=index,
        nodes=nodes,
        coordinator=f"{nodes[0]}:{port}",
        hosts_coordinator=index == 0,
        port=port,
    )


def ha_plan(node: SlurmNode, env: Mapping[str, str], client_port: int) -> tuple[str, str, object]:
    """``--ha``: the etcd endpoints (the first three nodes), the job id (``slurm-<SLURM_JOB_ID>``)
    and this node's etcd member (None beyond the first three nodes)."""
    from unbroken.launch.etcd_member import cluster_specs, require_binary

    if len(node.nodes) < 3:
        raise ConfigError(
            f"--ha needs at least 3 nodes, this job has {len(node.nodes)}: surviving the loss of any one host needs"
            " three etcd members on three hosts (drop --ha to run the coordinator on the first node)"
        )
    job = f"slurm-{env.get('SLURM_JOB_ID', 'job')}"
    specs = cluster_specs(list(node.nodes[:3]), token=job, client_port=client_port, listen_host="0.0.0.0")
    member = specs[node.node_index] if node.node_index < 3 else None
    if member is not None:
        require_binary()
    return ",".join(f"{s.host}:{s.client_port}" for s in specs), job, member
