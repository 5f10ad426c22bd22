"""The settings of ``unbroken run``: :class:`LaunchSettings`, one field per flag, and their checks.

:func:`unbroken.cli.launch_settings` builds them from the flags (and SLURM's environment); the
:class:`~unbroken.launch.launcher.Launcher` runs one node with them. Every check is made when they are
built, so a wrong flag fails before anything starts.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from unbroken.errors import ConfigError
from unbroken.launch.restarts import RestartPolicy
from unbroken.worker.backend_names import check_backend_name

log = logging.getLogger("unbroken.launch.launcher")  # moved out of the launcher; its messages keep their logger


def check_group_size(nproc_per_node: int, group_size: int) -> None:
    """Refuse a ``--group-size`` that is not a positive integer or does not divide ``--nproc-per-node``."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"--group-size must be a positive integer, got {group_size!r}")
    if nproc_per_node % group_size:
        raise ConfigError(
            f"--nproc-per-node {nproc_per_node} is not a multiple of --group-size {group_size}: a replica group is"
            " --group-size processes of one node, so a node runs whole groups only"
        )


@dataclass(frozen=True)
class LaunchSettings:
    """Everything ``unbroken run`` needs; the CLI flags map one to one onto these fields."""

    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    """``script`` names a module, run as ``python -m script`` (torchrun's ``-m``)."""
    nproc_per_node: int = 1
    """Worker processes on this node."""
    group_size: int = 1
    """Processes per replica group: K consecutive local ranks that shard one model replica (FSDP)
    and are one member for the coordinator. The node runs ``nproc_per_node // group_size`` slots;
    ``nproc_per_node`` must be a multiple of it. 1: every process is a member of its own."""
    max_restarts: int = 5
    """Restarts allowed per worker slot within ``restart_window``; one failure more quarantines it."""
    restart_window: float = 300.0
    """Seconds over which a slot's failures are counted (see :mod:`unbroken.launch.restarts` for why
    these defaults)."""
    quarantine_cooloff: float = 600.0
    """Seconds a quarantined slot is not started; then it starts again with a fresh budget."""
    restart_backoff: float = 0.1
    """Delay before restarting a slot after its first failure within the window; doubles with each
    further failure within the window."""
    max_restart_backoff: float = 10.0
    """Upper bound of the restart delay."""
    run_dir: str | None = None
    """Where logs and events go (default: ``unbroken-runs/<time>-<pid>``)."""
    coordinator: str | None = None
    """``HOST:PORT`` of an external coordinator; None starts one inside the launcher."""
    coordinator_host: str = "127.0.0.1"
    """Address the embedded coordinator binds."""
    coordinator_port: int = 0
    """Port of the embedded coordinator (0: any free port)."""
    coordinator_advertise: str | None = None
    """Host name other nodes use to reach the embedded coordinator's store (default: its bind address)."""
    expected_members: int | None = None
    """Workers the embedded coordinator's first generation waits for (default: this node's, or --min-members)."""
    node: str = field(default_factory=socket.gethostname)
    """Name of this node in member ids."""
    heartbeat_interval: float = 0.5
    """Seconds between a worker's heartbeats."""
    heartbeat_timeout: float = 3.0
    """Seconds of silence after which the coordinator declares a worker dead."""
    collective_timeout: float = 30.0
    """Longest wait of one collective when no verdict ends it sooner."""
    checkpoint_dir: str | None = None
    """Durable checkpoints go here: a path or fsspec URL (s3://...)."""
    checkpoint_every: int | str | None = None
    """Save every this many steps, or ``auto`` (Young/Daly); None: never (with a directory, the
    job still resumes from what is there)."""
    checkpoint_keep: int = 3
    """Complete checkpoints to keep."""
    min_members: int = 1
    """The embedded coordinator forms no generation below this many workers."""
    max_members: int | None = None
    """The embedded coordinator puts at most this many workers in a generation."""
    progress_timeout: float = 20.0
    """A worker whose progress (micro-batches, gradients, collectives) stops for this long while
    its peers wait for it is declared dead and restarted; a long step that moves is never stuck."""
    warmup_timeout: float = 600.0
    """The same for a worker that has not committed its first step yet (compilation, loading)."""
    busy_timeout: float = 3600.0
    """Longest work a worker marks busy (a checkpoint, an on_leader call, warming memory for a heal, leaving) before it is declared
    dead and restarted, with a reason naming the work (a write stuck on a hung mount)."""
    quorum_timeout: float = 300.0
    """The job fails if live workers stay below ``min_members`` this long."""
    start_grace: float = 30.0
    """The first generation waits this long for every expected worker before starting with fewer."""
    shutdown_grace: float = 5.0
    """Seconds workers get to exit after SIGTERM before SIGKILL; and, once the job finished, how
    long a worker that has not left ``job.steps()`` gets before SIGKILL."""
    console_ranks: tuple[int, ...] | None = None
    """Slots whose output the console shows (torchrun's ``--local-ranks-filter``; default: the
    job's leader when it runs on this node, else the lowest one alive); with ``group_size`` 1 a
    slot is a local rank, else a replica group (the console shows its process 0)."""
    tee: int = 3
    """Which of the shown workers' streams reach the console, as torchrun's ``--tee``: 1 stdout, 2
    stderr, 3 both, 0 neither (every worker's errors are shown whatever this says; both streams
    always go to the worker's log)."""
    progress_interval: float = 10.0
    """Seconds between plain progress lines when the output is not a terminal (a terminal gets a
    live progress bar); 0 turns both off."""
    chaos: str | None = None
    """Fault schedule for the workers (see ``unbroken.worker.chaos``)."""
    record_samples: bool = False
    """Workers log the stream positions of every step attempt (for exactly-once checks)."""
    zygote: bool = True
    """Start workers by fork from one process per launcher that imported torch already
    (:mod:`unbroken.launch.zygote`): a restarted worker skips torch's import. False (``--no-zygote``,
    ``UNBROKEN_ZYGOTE=0``): every worker is a fresh interpreter."""
    backend: str = "auto"
    """Collective backend of the workers (``--backend``, passed as ``UNBROKEN_BACKEND``): ``gloo``,
    ``nccl`` or ``auto`` (NCCL when the model is on a GPU). ``nccl`` on a machine without CUDA is
    refused before any worker starts."""
    stragglers: str = "balance"
    """What the workers do about a slow member (``--stragglers``, passed as ``UNBROKEN_STRAGGLERS``):
    ``balance`` (fewer micro-batches for it, flagged), ``report`` (flagged only), ``evict`` (also
    ended when it stays below half the median pace for 20 steps) or ``off``."""
    shard_optimizer: bool = False
    """Workers shard the optimizer's state, each part held by two members (``--shard-optimizer``,
    passed as ``UNBROKEN_SHARD_OPTIMIZER``; :mod:`unbroken.worker.sharded_optimizer`)."""
    etcd: str | None = None
    """``HOST:PORT,...`` of an etcd cluster: the embedded coordinator is then one of several
    candidates (one per launcher), the one that leads serves, and the job survives the loss of
    any host, this one's included. Needs ``job_id``."""
    job_id: str | None = None
    """Names the job in etcd; the same on every node."""
    leader_lease: float = 2.0
    """With ``etcd``: seconds after which a lost leading candidate is replaced."""
    etcd_member: Any = None
    """With ``--ha`` under SLURM: the :class:`~unbroken.launch.etcd_member.MemberSpec` of the etcd member
    this launcher runs for the job (on the first three nodes), else None."""
    token: str | None = field(default=None, repr=False)
    """Shared secret for the coordinator (``--token``/``UNBROKEN_TOKEN``). The embedded coordinator
    makes one up when none is given; an external one needs the token it was started with."""

    def __post_init__(self) -> None:
        if isinstance(self.nproc_per_node, bool) or not isinstance(self.nproc_per_node, int) or self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be a positive integer, got {self.nproc_per_node!r}")
        check_group_size(self.nproc_per_node, self.group_size)
        self.restart_policy()  # validates
        if not 0 < self.heartbeat_interval < self.heartbeat_timeout:
            raise ConfigError("need 0 < --heartbeat-interval < --heartbeat-timeout")
        if self.heartbeat_timeout >= self.collective_timeout:
            raise ConfigError("need --heartbeat-timeout < --collective-timeout")
        if not self.heartbeat_timeout > 2 * self.heartbeat_interval:
            raise ConfigError("need --heartbeat-timeout > 2 x --heartbeat-interval (a worker's lease is their difference)")
        if not 0 < self.heartbeat_timeout <= self.progress_timeout:
            raise ConfigError("need --heartbeat-timeout <= --progress-timeout, so that a stopped worker is judged by its heartbeats")
        if self.quorum_timeout <= 0:
            raise ConfigError("--quorum-timeout must be positive")
        if self.warmup_timeout < self.progress_timeout:
            raise ConfigError("need --warmup-timeout >= --progress-timeout")
        if self.busy_timeout < self.progress_timeout:
            raise ConfigError("need --busy-timeout >= --progress-timeout")
        if self.progress_timeout >= self.collective_timeout:
            raise ConfigError("need --progress-timeout < --collective-timeout, so that a stuck worker is evicted before its peers give up")
        if self.min_members < 1 or (self.max_members is not None and self.max_members < self.min_members):
            raise ConfigError(f"need 1 <= --min-members <= --max-members, got {self.min_members} and {self.max_members}")
        for name in ("restart_backoff", "max_restart_backoff", "shutdown_grace", "quorum_timeout", "start_grace", "progress_interval"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must not be negative")
        for rank in self.console_ranks or ():
            if not 0 <= rank < self.slots:
                what = "local rank" if self.group_size == 1 else "slot (replica group)"
                raise ConfigError(f"--local-ranks-filter must name a {what} in 0..{self.slots - 1}, got {rank}")
        if self.tee not in (0, 1, 2, 3):
            raise ConfigError(f"--tee takes torchrun's streams: 0 none, 1 stdout, 2 stderr, 3 both; got {self.tee}"
                              " (the worker the console shows is --local-ranks-filter)")
        if self.module:
            _check_module(self.script)
        elif not os.path.isfile(self.script):
            raise ConfigError(f"training script not found: {self.script!r}")
        # no torch for flags: the zygote starts only once they are checked (worker.backend_names)
        check_backend_name(self.backend)
        if self.backend == "nccl":
            from unbroken.worker.devices import check_backend_available

            check_backend_available(self.backend)
        if self.chaos:
            from unbroken.worker.chaos import check_reachable, parse

            check_reachable(parse(self.chaos), self.nproc_per_node)
        from unbroken.storage.checkpoint_settings import CheckpointSettings

        CheckpointSettings(self.checkpoint_dir, self.checkpoint_every, self.checkpoint_keep)  # validates
        if self.etcd:
            from unbroken.coordinator.replicated import leadership_from_flags

            leadership_from_flags(self.etcd, self.job_id, self.leader_lease)  # validates
            if self.leader_lease >= self.heartbeat_timeout + 1:
                log.warning(
                    "--leader-lease %.1f s is well above --heartbeat-timeout %.1f s: losing the leading coordinator"
                    " will stall training longer than losing a worker", self.leader_lease, self.heartbeat_timeout,
                )

    @property
    def slots(self) -> int:
        """Worker slots of this node: one per replica group, each one member of the job."""
        return self.nproc_per_node // self.group_size

    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(
            max_restarts=self.max_restarts,
            window=self.restart_window,
            backoff=self.restart_backoff,
            max_backoff=self.max_restart_backoff,
            cooloff=self.quarantine_cooloff,
        )


def _check_module(name: str) -> None:
    """Refuse ``-m NAME`` when the workers could not import it (found from the current directory,
    as ``python -m`` finds it), before any worker starts and fails."""
    import importlib.util
    import sys

    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path.pop(0)
    if not found:
        raise ConfigError(f"-m {name}: no module of that name can be imported from {os.getcwd()}")
