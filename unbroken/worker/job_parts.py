"""What each of the :class:`~unbroken.worker.runtime.Job`'s helpers uses of it, as a :class:`typing.Protocol`.

The Job hands itself to its helpers (:class:`~unbroken.worker.step.Step`,
:class:`~unbroken.worker.joining.Joiner`, :class:`~unbroken.worker.healer.Healer`,
:class:`~unbroken.worker.checkpointing.Checkpointing`, and the donor and newcomer of
:mod:`unbroken.worker.catch_up`) and its loop to :mod:`unbroken.worker.step_loop`. Each names here exactly the attributes and methods of the job
that it reads, writes or calls, and nothing imports the runtime for it: no import cycle. Types only
(the helpers import this module under ``TYPE_CHECKING``); a member is ``Any`` where the Job's own
is, or where its type would need an import of a helper or of the runtime (a cycle). The Job's own
parts are named with the helper that holds them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from unbroken.worker.lifetime import Guarded

if TYPE_CHECKING:
    import torch

    from unbroken.data.data_plan import DataPlan
    from unbroken.data.loader import Loader
    from unbroken.observe.events import EventLog
    from unbroken.storage.checkpoint import CheckpointSettings
    from unbroken.worker.chaos import Chaos
    from unbroken.worker.loop_rules import LoopGuard
    from unbroken.worker.pacing import Pacing
    from unbroken.worker.runtime_settings import RuntimeSettings
    from unbroken.worker.sample_record import SampleRecord


class SteppingJob(Protocol):
    """What a :class:`~unbroken.worker.step.Step` uses of a Job: where the generation stands, the
    training objects, the data plan and loader, the reducer and the group, the parts a step drives
    (pacing, sample record, chaos, the joiner, the donor) and the commit's record."""

    generation: int
    member_index: int
    member_count: int
    plan: DataPlan
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    stop_reason: str | None
    _durable_stop: dict | None
    _reducer: Any  # a GradientReducer, or None alone
    _group: Any  # a replica group's GroupMember, or None
    _device: torch.device
    _buffers: list[torch.Tensor]
    _inputs_checked: bool
    _committing: bool
    _ticks: int
    _pacing: Pacing
    _samples: SampleRecord
    _chaos: Chaos
    _joiner: Any  # a Joiner (unbroken.worker.joining)
    _donor: Any  # a Donor (unbroken.worker.catch_up)
    _default_group: Any  # a DefaultGroup (unbroken.worker.default_group), or None

    def _grad_count(self) -> int: ...

    def _abandon_reason(self, number: int, for_commit: bool = False) -> str | None: ...

    def _batch(self, step: Any, micro: int) -> Any: ...

    def _vote(self, ok: bool, generation: int, extra: list[float] | None = None) -> tuple[bool, list[float]]: ...

    def _committed(self, step: Any) -> None: ...


class LoopingJob(SteppingJob, Protocol):
    """What the loop of :mod:`unbroken.worker.step_loop` uses of a Job: its settings and identity,
    where it stands (next step, freshness, a stop asked for), the loader it starts and closes, the
    loop guard it keeps up to date, the joiner and checkpointing it drives, the first step's
    barrier, the replica checks, the group's decisions together, abandoning a generation and the
    job's end. It also hands the job to each :class:`~unbroken.worker.step.Step` it yields
    (:class:`SteppingJob`)."""

    settings: RuntimeSettings
    member_id: str
    next_step: int
    fresh: bool
    _loader: Loader
    _loop_guard: LoopGuard
    _left_on_error: bool
    _started_generation: int
    _checkpointing: Any  # a Checkpointing (unbroken.worker.checkpointing)

    def stop(self, reason: str = "stopped by the script") -> None: ...

    def _together(self, ok: bool, what: str) -> bool: ...

    def _verify_replicas(self) -> bool: ...

    def _abandon(self, reason: str) -> None: ...

    def _stop(self, finished: bool) -> None: ...


class CatchingUpJob(Protocol):
    """What catching up uses of a Job (:mod:`unbroken.worker.catch_up`), on either side: whether a
    replay can be exact, the donor's snapshot, digest and record of each step, the newcomer's load
    and replay of them (the training objects, the step counter, lineage and freshness)."""

    settings: RuntimeSettings
    member_id: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    extra_state: Any
    next_step: int
    lineage: list[int]
    fresh: bool
    _unverified: str | None
    _digest: int
    _committing: bool
    _reducer: Any  # a GradientReducer, or None alone
    _group: Any  # a replica group's GroupMember, or None
    _warm: dict[Any, torch.Tensor] | None
    _chaos: Chaos
    _events: EventLog

    def _state(self) -> dict[str, Any]: ...

    def _load(self, state: dict[str, Any]) -> None: ...


class JoiningJob(CatchingUpJob, Guarded, Protocol):
    """What a :class:`~unbroken.worker.joining.Joiner` uses of a Job: its settings and identity,
    where it stands (generation, member index and count, next step, total, freshness), what a join
    carries, the parts it starts, feeds or ends (pacing, sample record, the healer, the donor, the
    default group), and the job's end. It also hands the job on to catching up
    (:class:`CatchingUpJob`) and to the exit guard (:class:`~unbroken.worker.lifetime.Guarded`)."""

    run_dir: str | None
    generation: int
    member_index: int
    member_count: int
    total: int | None
    stop_reason: str | None
    _durable_stop: dict | None
    plan: DataPlan
    _ticks: int
    _generation_floor: int
    _pacing: Pacing
    _samples: SampleRecord
    _healer: Any  # a Healer (unbroken.worker.healer)
    _donor: Any  # a Donor (unbroken.worker.catch_up)
    _default_group: Any  # a DefaultGroup (unbroken.worker.default_group), or None

    def _progress(self) -> int: ...

    def _abandon_reason(self, number: int, for_commit: bool = False) -> str | None: ...

    def _state_key(self) -> tuple[int, int, bool]: ...

    def _stop(self, finished: bool) -> None: ...


class HealingJob(Protocol):
    """What a :class:`~unbroken.worker.healer.Healer` uses of a Job: where it stands (next step,
    freshness, lineage digest), its state to send or load, the model and device a received state
    lands in (whole parameters unless in a replica group), the warmed optimizer memory, the
    checkpoint to resume from (the joiner busy meanwhile), and its progress, chaos and events."""

    member_id: str
    plan: DataPlan
    model: torch.nn.Module
    next_step: int
    fresh: bool
    _unverified: str | None
    _digest: int
    _device: torch.device
    _group: Any  # a replica group's GroupMember, or None
    _warm: dict[Any, torch.Tensor] | None
    _chaos: Chaos
    _events: EventLog
    _joiner: Any  # a Joiner (unbroken.worker.joining)
    _checkpointing: Any  # a Checkpointing (unbroken.worker.checkpointing)

    def _state(self) -> dict[str, Any]: ...

    def _load(self, state: dict[str, Any]) -> None: ...

    def _tick(self) -> None: ...

    def _stop(self, finished: bool) -> None: ...


class CheckpointingJob(Protocol):
    """What :class:`~unbroken.worker.checkpointing.Checkpointing` uses of a Job: its checkpoint
    settings, the state it saves and resumes (the training objects, the data plan, the step
    counter, lineage and freshness), where the generation stands, the joiner's group and
    heartbeat, a replica group's vote, and its chaos and events."""

    checkpoint: CheckpointSettings
    member_id: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    extra_state: Any
    scaler: Any
    plan: DataPlan
    next_step: int
    total: int | None
    lineage: list[int]
    generation: int
    member_index: int
    fresh: bool
    _digest: int
    _generation_floor: int
    _group: Any  # a replica group's GroupMember, or None
    _joiner: Any  # a Joiner (unbroken.worker.joining)
    _chaos: Chaos
    _events: EventLog

    def _state(self) -> dict[str, Any]: ...

    def _load(self, state: dict[str, Any]) -> None: ...

    def _vote(self, ok: bool, generation: int, extra: list[float] | None = None) -> tuple[bool, list[float]]: ...

    def _abandon(self, reason: str) -> None: ...
