"""A worker's runtime settings: how it reaches its job's coordinator and how long it waits.

:class:`RuntimeSettings` is part of the user API (``unbroken.RuntimeSettings``). Under
``unbroken run`` the launcher passes every field in an ``UNBROKEN_*`` variable, which
:meth:`RuntimeSettings.from_env` reads; an explicit argument beats the variable, which beats the
default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from unbroken.errors import ConfigError


@dataclass(frozen=True)
class RuntimeSettings:
    """How a worker talks to its job. Explicit arguments beat ``UNBROKEN_*`` variables beat defaults."""

    coordinator: str | None = None
    """``HOST:PORT`` of the coordinator (``UNBROKEN_COORDINATOR``); None runs a single process."""
    member_id: str | None = None
    """This process's name in the job (``UNBROKEN_MEMBER_ID``); defaults to host-pid."""
    node: str = ""
    """Name of this node (``UNBROKEN_NODE``)."""
    run_dir: str | None = None
    """Where events and logs go (``UNBROKEN_RUN_DIR``)."""
    heartbeat_interval: float = 0.5
    """Seconds between heartbeats (``UNBROKEN_HEARTBEAT_INTERVAL``)."""
    collective_timeout: float = 30.0
    """Longest wait for one collective or connect (``UNBROKEN_COLLECTIVE_TIMEOUT``); a verdict
    from the coordinator usually ends a failed wait long before."""
    lease: float = 2.5
    """Seconds without a reply from the coordinator after which this member stops committing
    (``UNBROKEN_LEASE``); keep it at most the coordinator's heartbeat timeout, so that a member cut
    off by a partition stops before the others go on without it."""
    coordinator_grace: float = 10.0
    """Seconds past its lease that a member holds a finished step uncommitted, waiting for the
    coordinator to answer again, before it abandons its generation and rejoins
    (``UNBROKEN_COORDINATOR_GRACE``). A coordinator that stalls (a long garbage collection, a
    paused VM) then costs its members a pause, not a re-formation; a commit still needs a reply
    to a request sent within the lease."""
    coordinator_timeout: float = 60.0
    """How long an unreachable coordinator is retried before giving up (``UNBROKEN_COORDINATOR_TIMEOUT``)."""
    join_timeout: float = 600.0
    """Longest wait for a generation to form (``UNBROKEN_JOIN_TIMEOUT``)."""
    bucket_cap_mb: float = 25.0
    """Size of a gradient allreduce bucket in MB (``UNBROKEN_BUCKET_CAP_MB``)."""
    heal_lanes: int = 2
    """Parallel connections a heal over Gloo sends the state's large tensors on
    (``UNBROKEN_HEAL_LANES``, :mod:`unbroken.worker.heal_lanes`): two moved 1.2 GB in 0.60-0.66x
    the time of one connection on a 2-core machine; 1 sends everything over the generation's
    group. The source's setting counts (the receiver follows it)."""
    verify_every: int = 0
    """Also compare a hash of every member's parameters and buffers every this many steps
    (``UNBROKEN_VERIFY_EVERY``); 0 compares them only at the end. Costs a hash and a small allreduce."""
    token: str | None = field(default=None, repr=False)
    """The job's shared secret for the coordinator (``UNBROKEN_TOKEN``; the launcher sets it)."""
    record_samples: bool = False
    """Log the stream positions of every step attempt to ``<run dir>/samples`` (``UNBROKEN_RECORD_SAMPLES``)."""
    backend: str = "auto"
    """Collective backend (``UNBROKEN_BACKEND``): ``gloo`` (CPU or CUDA tensors), ``nccl`` (CUDA
    tensors; a blocked collective is abandoned by aborting the generation's communicator) or
    ``auto``: NCCL when the model is on a GPU and NCCL is available, else Gloo."""
    default_group: bool = True
    """Inside the loop, make each generation torch.distributed's default group and set ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` to match (``UNBROKEN_DEFAULT_GROUP``), so
    that libraries that read the world (rank-zero loggers, metric syncs) see this member's rank
    and the generation's size; see :mod:`unbroken.worker.default_group`. Replica groups keep their own."""

    tune_malloc: bool = True
    """Fix glibc's malloc thresholds in this process (``UNBROKEN_TUNE_MALLOC``): blocks up to 32 MiB
    come from the heap and up to 64 MiB free at its top stays for reuse, so that a step's large
    temporaries do not fault in fresh pages every time (:mod:`unbroken.worker.allocator`)."""

    shard_optimizer: bool = False
    """Shard the optimizer's state across the generation's members, every partition held by two of them
    (``UNBROKEN_SHARD_OPTIMIZER``; ``unbroken run --shard-optimizer``): each member holds about 2/N of it
    and steps those parts, and the updated parameters are gathered, ZeRO-1 style; a member's loss is
    mended from the other copies, re-partitioned with no checkpoint (:mod:`unbroken.worker.sharded_optimizer`).
    Element-wise torch.optim optimizers only; not with replica groups. Every member must use the same."""

    stragglers: str = "balance"
    """What to do about a member slower than the others (``UNBROKEN_STRAGGLERS``): ``balance``
    gives it fewer micro-batches and flags it, ``report`` only flags it, ``evict`` also ends a member
    that stays below half the median pace for 20 steps, ``off`` measures nothing
    (:mod:`unbroken.data.balance`). Every member of a job must use the same."""

    def __post_init__(self) -> None:
        from unbroken.data.balance import MODES

        if self.stragglers not in MODES:
            raise ConfigError(f"stragglers must be one of {', '.join(MODES)}, got {self.stragglers!r} (UNBROKEN_STRAGGLERS)")
        if not 0 < self.heartbeat_interval < self.collective_timeout:
            raise ConfigError("need 0 < heartbeat_interval < collective_timeout")
        if not self.heartbeat_interval < self.lease:
            raise ConfigError(f"need heartbeat_interval ({self.heartbeat_interval}) < lease ({self.lease})")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"backend must be auto, gloo or nccl, got {self.backend!r}")
        if self.coordinator_grace < 0:
            raise ConfigError(f"coordinator_grace must be at least 0, got {self.coordinator_grace}")
        if not isinstance(self.heal_lanes, int) or isinstance(self.heal_lanes, bool):
            raise ConfigError(f"heal_lanes must be a whole number of connections, got {self.heal_lanes!r}")
        for name in ("coordinator_timeout", "join_timeout", "bucket_cap_mb", "heal_lanes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_env(cls, **explicit: Any) -> "RuntimeSettings":
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = os.environ.get(f"UNBROKEN_{f.name.upper()}")
            if raw is None or raw == "":
                continue
            if f.type in ("int",):
                try:
                    values[f.name] = int(raw)
                except ValueError:
                    raise ConfigError(f"UNBROKEN_{f.name.upper()}={raw!r} is not an integer (setting {f.name})") from None
            elif f.type in ("float",):
                try:
                    values[f.name] = float(raw)
                except ValueError:
                    raise ConfigError(f"UNBROKEN_{f.name.upper()}={raw!r} is not a number (setting {f.name})") from None
            elif f.type in ("bool",):
                values[f.name] = raw.lower() in ("1", "true", "yes")
            else:
                values[f.name] = raw
        values.update({k: v for k, v in explicit.items() if v is not None})
        return cls(**values)
