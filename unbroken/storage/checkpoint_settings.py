"""Where and how often a job saves durable checkpoints: :class:`CheckpointSettings`.

Apart from the store (:mod:`unbroken.storage.checkpoint`) because it imports no torch: ``unbroken
run`` validates the checkpoint flags before it starts anything, and a launcher that imported torch
for that would start its zygote (which imports torch for the workers) 1.5 s later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from unbroken.errors import ConfigError
from unbroken.storage.checkpoint_schedule import DEFAULT_MAX_INTERVAL


@dataclass(frozen=True)
class CheckpointSettings:
    """Where and how often to save. ``every`` is a number of steps, ``"auto"`` or None (never)."""

    directory: str | None = None
    """Local path or fsspec URL (``UNBROKEN_CHECKPOINT_DIR``)."""
    every: int | str | None = None
    """Save every this many steps, or ``auto`` (Young/Daly) (``UNBROKEN_CHECKPOINT_EVERY``)."""
    keep: int = 3
    """Complete checkpoints to keep (``UNBROKEN_CHECKPOINT_KEEP``)."""
    mtbf: float = 3600.0
    """The mean time, in seconds, between losses of every live copy of the state that ``auto``
    assumes before the job has run for long (``UNBROKEN_CHECKPOINT_MTBF``; :class:`Schedule`)."""
    max_interval: float = DEFAULT_MAX_INTERVAL
    """The longest ``auto`` interval in seconds: at most this much training is redone after a loss
    nobody could foresee (``UNBROKEN_CHECKPOINT_MAX_INTERVAL``)."""
    part_timeout: float = 600.0
    """With ``shard_optimizer``: how long rank 0 waits for a member's part of a checkpoint while that
    member is still in the save's generation; the checkpoint is then not published
    (``UNBROKEN_CHECKPOINT_PART_TIMEOUT``; a member that left is not waited for)."""

    def __post_init__(self) -> None:
        if self.every is not None and self.every != "auto":
            if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
                raise ConfigError(f"checkpoint every must be a positive number of steps or 'auto', got {self.every!r}")
        if self.every is not None and not self.directory:
            raise ConfigError("a checkpoint interval needs a checkpoint directory (--checkpoint-dir)")
        if self.keep < 1:
            raise ConfigError(f"checkpoint keep must be at least 1, got {self.keep}")
        if self.mtbf <= 0:
            raise ConfigError("checkpoint mtbf must be positive")
        if not self.max_interval > 0:
            raise ConfigError(f"checkpoint max interval must be a positive number of seconds, got {self.max_interval!r}")
        if not self.part_timeout > 0:
            raise ConfigError(f"checkpoint part timeout must be a positive number of seconds, got {self.part_timeout!r}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "CheckpointSettings":
        env = dict(os.environ if env is None else env)
        every: int | str | None = env.get("UNBROKEN_CHECKPOINT_EVERY") or None
        if every is not None and every != "auto":
            try:
                every = int(every)
            except ValueError:
                raise ConfigError(f"UNBROKEN_CHECKPOINT_EVERY must be a number of steps or 'auto', got {every!r}") from None
        try:
            keep = int(env.get("UNBROKEN_CHECKPOINT_KEEP", "3"))
            mtbf = float(env.get("UNBROKEN_CHECKPOINT_MTBF", "3600"))
            max_interval = float(env.get("UNBROKEN_CHECKPOINT_MAX_INTERVAL", str(DEFAULT_MAX_INTERVAL)))
            part_timeout = float(env.get("UNBROKEN_CHECKPOINT_PART_TIMEOUT", "600"))
        except ValueError as exc:
            raise ConfigError("bad UNBROKEN_CHECKPOINT_KEEP, UNBROKEN_CHECKPOINT_MTBF, UNBROKEN_CHECKPOINT_MAX_INTERVAL or"
                              f" UNBROKEN_CHECKPOINT_PART_TIMEOUT: {exc}") from None
        return cls(env.get("UNBROKEN_CHECKPOINT_DIR") or None, every, keep, mtbf, max_interval, part_timeout)
