"""The worker runtime: the training-loop API that a user's script calls.

::

    job = unbroken.Job(model, optimizer, dataset, global_batch_size=256, micro_batch_size=64)
    for step in job.steps(total=500):
        for x, y in step.micro_batches():
            step.backward(loss_fn(model(x), y))
        step.commit()

Under ``unbroken run`` each step follows the protocol of DESIGN.md: the member learns its
generation from the coordinator (joining and healing when it changed), processes its share of
the step's fixed global batch, allreduces share-weighted gradients in buckets overlapped with
backward, and then either commits (optimizer step) or, if the allreduce failed, leaves its
parameters untouched and redoes the step in the next generation. Run as a plain single process
(no coordinator in the environment) the same script trains on the whole global batch, which is
the reference every distributed run must match.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from unbroken import healing
from unbroken.chaos import Chaos
from unbroken.data_plan import DataPlan
from unbroken.errors import EXIT_MISMATCH, ConfigError, GenerationFailed, LoopMisuse, ReplicaDivergence, Unauthorized, UnbrokenError
from unbroken.randomness import seed_member
from unbroken.telemetry import RUN_DIR_ENV, EventLog

if TYPE_CHECKING:
    from unbroken.checkpoint import CheckpointSettings

log = logging.getLogger(__name__)


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
    lease: float = 5.0
    """Seconds without a reply from the coordinator after which this member stops committing and
    abandons its generation (``UNBROKEN_LEASE``); keep it at most the coordinator's heartbeat
    timeout, so that a member cut off by a partition stops before the others go on without it."""
    coordinator_timeout: float = 60.0
    """How long an unreachable coordinator is retried before giving up (``UNBROKEN_COORDINATOR_TIMEOUT``)."""
    join_timeout: float = 600.0
    """Longest wait for a generation to form (``UNBROKEN_JOIN_TIMEOUT``)."""
    bucket_cap_mb: float = 25.0
    """Size of a gradient allreduce bucket in MB (``UNBROKEN_BUCKET_CAP_MB``)."""
    verify_every: int = 0
    """Also compare a hash of every member's parameters and buffers every this many steps
    (``UNBROKEN_VERIFY_EVERY``); 0 compares them only at the end. Costs a hash and a small allreduce."""
    token: str | None = field(default=None, repr=False)
    """The job's shared secret for the coordinator (``UNBROKEN_TOKEN``; the launcher sets it)."""
    record_samples: bool = False
    """Log the stream positions of every step attempt to ``<run dir>/samples`` (``UNBROKEN_RECORD_SAMPLES``)."""

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval < self.collective_timeout:
            raise ConfigError("need 0 < heartbeat_interval < collective_timeout")
        if not self.heartbeat_interval < self.lease:
            raise ConfigError(f"need heartbeat_interval ({self.heartbeat_interval}) < lease ({self.lease})")
        for name in ("coordinator_timeout", "join_timeout", "bucket_cap_mb"):
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


def _check_dataset(dataset: Any) -> int:
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ConfigError(
            f"dataset must support len() and indexing (a map-style torch Dataset), got {type(dataset).__name__};"
            " an iterable-only dataset has no fixed order to split among members"
        )
    try:
        length = len(dataset)
    except TypeError as exc:
        raise ConfigError(f"dataset must support len(): {exc}") from None
    if length <= 0:
        raise ConfigError("dataset is empty")
    return length


class Step:
    """One training step: its micro-batches, its backward, its reduce and its commit."""

    def __init__(self, job: "Job", index: int) -> None:
        self.job = job
        self.index = index
        self.generation = job.generation
        self.rank = job.member_index
        self.members = job.member_count
        self.positions = job.plan.share(index, self.rank, self.members)
        self._micro = job.plan.micro_batches(index, self.rank, self.members)
        self._backwards = 0
        self._loss_sum: torch.Tensor | None = None
        self._armed = False
        self._stale: str | None = None
        self._reduced: bool | None = None
        self.reconfigure = False
        self.loss: float | None = None
        self.committed = False
        self.failed = False
        self.error: Exception | None = None
        self.started = time.monotonic()
        self._grads_at_start = job._grad_count()
        self._grads_in_backward = 0
        self._counting: bool | None = None  # backward(count=...) used in this step
        self._count = 0.0
        # Buffers (BatchNorm statistics) change in the forward pass: keep a copy so that a failed
        # attempt leaves them as they were, like the parameters.
        self._saved_buffers = [b.detach().clone() for b in job._buffers] if job._reducer is not None else []

    @property
    def samples(self) -> int:
        """Samples this member processes in this step (its share)."""
        return len(self.positions)

    def micro_batches(self) -> Iterator[Any]:
        """This member's share of the step's global batch, in micro-batches.

        Stops early when the generation broke meanwhile (a peer failed): :meth:`reduce` then
        returns False at once, so a long step is left within one micro-batch, not at its end."""
        job = self.job
        for positions in self._micro:
            if job._reducer is not None and not self._stale:
                self._stale = job._abandon_reason(self.generation)
            if self._stale:
                return
            batch = job._batch(positions)
            job._ticks += 1
            yield batch

    def backward(self, loss: torch.Tensor, count: float | torch.Tensor | None = None) -> None:
        """Backpropagate a micro-batch's loss.

        Without ``count``, ``loss`` is the mean over the micro-batch's samples; it is weighted by
        the micro-batch's share of the global batch. With ``count`` (say, the number of tokens
        that are not padding), ``loss`` is the *sum* of the per-item losses over ``count`` items:
        the counts of every member are summed with the gradients, which are then divided by that
        global count, so a token-normalised loss gives the same model at any member count. Use
        one form for every micro-batch of a job."""
        if self._backwards >= len(self._micro):
            raise LoopMisuse(f"step {self.index}: backward called more times than there are micro-batches ({len(self._micro)})")
        counting = count is not None
        if self._counting is None:
            self._counting = counting
        elif self._counting != counting:
            raise LoopMisuse(f"step {self.index}: step.backward was called with and without count= in one step; use one form")
        if counting:
            value = float(count.detach().sum()) if isinstance(count, torch.Tensor) else float(count)
            if not value >= 0:
                raise LoopMisuse(f"step {self.index}: count must be a non-negative number of items, got {count!r}")
            self._count += value
            weight = 1.0
        else:
            weight = len(self._micro[self._backwards]) / self.job.plan.global_batch_size
        self._backwards += 1
        self.job._ticks += 1
        weighted = loss * weight
        detached = weighted.detach()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        if self._backwards == len(self._micro):
            self._arm()
        before = self.job._grad_count()
        weighted.backward()
        self._grads_in_backward += self.job._grad_count() - before

    def _check_loop(self) -> None:
        """Refuse a step whose gradients are not the share-weighted sum the protocol needs."""
        if self._stale:
            return  # left early because the generation broke: redone anyway
        outside = self.job._grad_count() - self._grads_at_start - self._grads_in_backward
        if outside:
            raise LoopMisuse(
                f"step {self.index}: gradients were computed outside step.backward ({outside} gradient"
                " update(s), e.g. loss.backward()); pass each micro-batch's loss to step.backward, which"
                " weights it by its share of the global batch so that the model does not depend on the"
                " number of members"
            )
        if self._backwards != len(self._micro):
            raise LoopMisuse(
                f"step {self.index}: step.backward was called {self._backwards} time(s) for {len(self._micro)}"
                " micro-batch(es); call it exactly once per micro-batch that step.micro_batches() yields"
                " (a skipped micro-batch would leave its samples out of the global batch)"
            )

    def _arm(self) -> None:
        job = self.job
        if job._reducer is None or self._armed:
            return
        self._armed = True
        # A member that was stopped while its generation moved on must not send anything into
        # that generation (its peers' abandoned collectives would complete with it).
        self._stale = self._stale or job._abandon_reason(self.generation)
        if self._stale:
            return
        job._record_attempt(self)
        job._reducer.arm(job._group, job._reconfigure_wanted(), self._loss_sum, self._count if self._counting else None)

    def reduce(self) -> bool:
        """Allreduce the gradients; afterwards ``.grad`` holds the global-batch gradient on every member.

        Returns False if a peer failed: the gradients are then zeroed and the step will be
        redone by the next generation, so skip straight to the next iteration.
        """
        if self._reduced is not None:
            return self._reduced
        self._check_loop()
        job = self.job
        if job._reducer is None:
            loss = float(self._loss_sum) if self._loss_sum is not None else 0.0
            self.loss = self._normalise(loss, self._count, 1.0 if self._counting else 0.0)
            self._reduced = True
            return True
        try:
            self._arm()
            if self._stale:
                raise GenerationFailed(f"step {self.index} not sent: {self._stale}")
            flag, loss, count, counting = job._reducer.finish(lambda: job._chaos.point("allreduce", self.index))
            job._sync_buffers()
            self.reconfigure = flag > 0
            self.loss = self._normalise(loss, count, counting)
            self._reduced = True
        except GenerationFailed as exc:
            job._reducer.disarm()
            # without its traceback, whose frames hold the failed collectives (and through them
            # the abandoned group's sockets) in a cycle with this step
            self.failed, self.error, self._reduced = True, exc.with_traceback(None), False
            self._discard()
        return self._reduced

    def _normalise(self, loss: float, count: float, counting: float) -> float:
        """Divide the summed gradients and loss by the global count when backward(count=) was
        used (by any member: those with an empty share follow the others)."""
        if not counting:
            return loss
        if count <= 0:
            raise LoopMisuse(f"step {self.index}: the counts passed to step.backward sum to {count} over the global batch; nothing to normalise by")
        with torch.no_grad():
            for p in self.job.optimizer.param_groups:
                for param in p["params"]:
                    if param.grad is not None:
                        param.grad.div_(count)
        return loss / count

    def _discard(self) -> None:
        """Undo what a failed attempt changed: gradients and buffers."""
        self.job.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, saved in zip(self.job._buffers, self._saved_buffers):
                buffer.copy_(saved)

    def commit(self) -> bool:
        """Reduce if not done yet, then apply the optimizer (and scheduler). True if committed."""
        if self.committed:
            return True
        if not self.reduce():
            return False
        job = self.job
        if job._reducer is not None:
            try:
                job._chaos.point("commit", self.index)
            except GenerationFailed as exc:
                self.failed, self.error = True, exc.with_traceback(None)
                self._discard()
                return False
            reason = job._abandon_reason(self.generation, for_commit=True)
            if reason:
                self.failed, self.error = True, GenerationFailed(f"step {self.index} not committed: {reason}")
                self._discard()
                return False
        job.optimizer.step()
        if job.scheduler is not None:
            job.scheduler.step()
        job.optimizer.zero_grad(set_to_none=True)
        job._committed(self)
        self.committed = True
        return True


class Job:
    """A training job whose steps survive the loss of members.

    Args:
        model: the module to train; every member builds the same architecture.
        optimizer: any ``torch.optim`` optimizer over the model's parameters.
        dataset: a map-style data set (``len()`` and indexing).
        global_batch_size: samples per step over all members, fixed whatever the member count.
        micro_batch_size: largest batch one forward/backward sees (default: the global batch).
        seed: seeds the sample order (one permutation per epoch).
        scheduler: an optional learning-rate scheduler, stepped after each commit.
        collate_fn: turns a list of samples into a batch (default: ``default_collate``).
        extra_state: any object with ``state_dict``/``load_state_dict`` healed with the model.
        settings: runtime settings (default: from the environment ``unbroken run`` sets).
        checkpoint: durable checkpoints (default: from ``UNBROKEN_CHECKPOINT_*``, which
            ``unbroken run --checkpoint-dir/--checkpoint-every`` set): where, how often, how many.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        *,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        seed: int = 0,
        scheduler: Any = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        extra_state: Any = None,
        settings: RuntimeSettings | None = None,
        checkpoint: "CheckpointSettings | None" = None,
    ) -> None:
        self.plan = DataPlan(
            _check_dataset(dataset),
            global_batch_size,
            global_batch_size if micro_batch_size is None else micro_batch_size,
            seed,
        )
        self.model = model
        self.optimizer = optimizer
        self.dataset = dataset
        self.scheduler = scheduler
        self.extra_state = extra_state
        self.collate_fn = collate_fn
        self.settings = settings or RuntimeSettings.from_env()
        self.distributed = self.settings.coordinator is not None
        self.member_id = self.settings.member_id or f"{socket.gethostname()}-{os.getpid()}"
        self.next_step = 0
        self.lineage: list[int] = []
        self._digest = 0  # healing.lineage_digest(self.lineage), kept up to date
        self.fresh = True
        self.generation = 0
        self.member_index = 0
        self.member_count = 1
        self.replica_hash: str | None = None
        self.total: int | None = None
        self._group: Any = None
        from unbroken.group import Graveyard

        self._graveyard = Graveyard()
        self._ticks = 0  # progress: micro-batches, backwards, collectives entered (see _progress)
        self._generation_floor = 0  # the generation of a checkpoint resumed from
        self._preflight_cache: dict[str, Any] | None = None
        self._wake = threading.Event()
        self._client: Any = None
        self._heartbeat: Any = None
        self._store: Any = None
        self._store_address: tuple[str, int] | None = None
        self._incarnation: str | None = None  # of the coordinator that formed the current generation
        self._sample_fd: int | None = None
        self._chaos = Chaos.from_env()
        run_dir = self.settings.run_dir or os.environ.get(RUN_DIR_ENV)
        self.run_dir = run_dir
        self._events = EventLog.for_run_dir(run_dir if self.distributed else None, f"worker:{self.member_id}")
        from unbroken.checkpoint import CheckpointSettings

        self.checkpoint = checkpoint or CheckpointSettings.from_env()
        self._checkpoints: Any = None  # CheckpointStore, opened when steps() starts
        self._last_step_seconds: float | None = None
        self._step_ema: float | None = None
        self._save_cost = 0.0
        self._save_cost_pending = False
        self._saver: Any = None
        self._schedule: Any = None
        self._reducer = None
        self._grad_events = 0  # gradient accumulations seen by a single process's hooks
        self._buffers = [b for b in model.buffers() if b.numel()]
        if self.distributed:
            from unbroken.gradients import GradientReducer

            params = [p for p in model.parameters() if p.requires_grad]
            if not params:
                raise ConfigError("the model has no parameters that require gradients")
            self._reducer = GradientReducer(params, int(self.settings.bucket_cap_mb * (1 << 20)))
        else:
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._count_grad)

    # -- what the script sees ------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True on the member at index 0 of the current generation (and in a single process)."""
        return self.member_index == 0

    def steps(self, total: int) -> Iterator[Step]:
        """Yield steps ``next_step .. total-1``; each must end in :meth:`Step.commit` (done for you
        if the loop body does not). A step whose allreduce failed is yielded again."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ConfigError(f"total must be a non-negative integer number of steps, got {total!r}")
        self.total = total
        if not self.distributed:
            self._open_checkpoints(resume=self.fresh)
            while self.next_step < total:
                step = Step(self, self.next_step)
                yield step
                step.commit()
                self._maybe_checkpoint()
            self._final_checkpoint()
            return
        finished = False
        self._start()
        # Whether to resume from a checkpoint is decided when a generation forms (see _heal).
        self._open_checkpoints(resume=False)
        try:
            while True:
                if self._group is None:
                    if not self._join():
                        finished = True
                        break
                    continue
                if self.next_step >= total:
                    if self._verify_replicas() and self._final_checkpoint_together():
                        finished = True
                        break
                    continue
                reason = self._abandon_reason(self.generation)
                if reason:
                    self._abandon(reason)
                    continue
                try:
                    self._chaos.point("step", self.next_step)
                except GenerationFailed as exc:
                    self._abandon(str(exc))
                    continue
                step = Step(self, self.next_step)
                yield step
                if not step.committed and not step.failed:
                    step.commit()
                if step.failed:
                    self._abandon(str(step.error))
                    continue
                self._maybe_checkpoint()
                if step.reconfigure:
                    self._close_group()
                elif self.settings.verify_every and self.next_step % self.settings.verify_every == 0 and self.next_step < total:
                    self._verify_replicas()
        finally:
            self._stop(finished)

    # -- data ----------------------------------------------------------------------------------

    def _batch(self, positions: range) -> Any:
        indices = self.plan.indices(positions)
        dataset = self.dataset
        if self.collate_fn is None and isinstance(dataset, torch.utils.data.TensorDataset):
            return tuple(t[indices] for t in dataset.tensors)
        items = [dataset[i] for i in indices.tolist()]
        if self.collate_fn is not None:
            return self.collate_fn(items)
        return torch.utils.data.default_collate(items)

    def _record_attempt(self, step: Step) -> None:
        if self._sample_fd is None:
            return
        line = f'{{"g":{step.generation},"s":{step.index},"r":{step.rank},"n":{step.members},"a":{step.positions.start},"b":{step.positions.stop}}}\n'
        os.write(self._sample_fd, line.encode())

    # -- membership ----------------------------------------------------------------------------

    def _start(self) -> None:
        from unbroken.client import CoordinatorClient, Heartbeat

        assert self.settings.coordinator is not None
        _die_with_launcher()
        self._client = CoordinatorClient(self.settings.coordinator, self.settings.coordinator_timeout, self.settings.token)
        self._heartbeat = Heartbeat(self._client, self.member_id, self.settings.heartbeat_interval, self._on_view, max_age=self.settings.lease)
        self._heartbeat.progress = self._progress
        self._heartbeat.start()
        if self.settings.record_samples and self.run_dir:
            path = os.path.join(self.run_dir, "samples", f"{self.member_id}.jsonl")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._sample_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _ExitGuard.install(self)

    def _on_view(self, view: dict[str, Any]) -> None:
        if view.get("fence"):
            # Declared dead for making no progress (stuck in user code or a device): this process
            # cannot be trusted to reach a step boundary, so it ends itself and its launcher
            # starts a fresh one, which rejoins and is healed.
            print(f"unbroken: {self.member_id}: {view.get('reason')}; ending this process", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        self._wake.set()

    def _count_grad(self, _: torch.Tensor) -> None:
        self._grad_events += 1

    def _grad_count(self) -> int:
        """Gradient accumulations so far (to tell step.backward's from any other backward)."""
        return self._reducer.ticks if self._reducer is not None else self._grad_events

    def _progress(self) -> int:
        """A counter that moves whenever this member works on a step: micro-batches, backwards,
        gradients that became final, collectives entered, state sent. Read by the heartbeat
        thread; the coordinator's watchdog fences only a member whose counter stopped."""
        return self._ticks + (self._reducer.ticks if self._reducer is not None else 0)

    @contextlib.contextmanager
    def _busy(self, what: str) -> Iterator[None]:
        """Mark deliberate work that makes no step progress (never taken for stuck); nests."""
        if self._heartbeat is None:
            yield
            return
        previous = self._heartbeat.busy
        self._heartbeat.busy = previous or what
        try:
            yield
        finally:
            self._heartbeat.busy = previous

    def _preflight(self) -> dict[str, Any]:
        """What every member must agree on, or the collectives mismatch (a livelock, or the wrong
        parameters summed together): sent with every join, compared by the coordinator."""
        if self._preflight_cache is None:
            import unbroken

            script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
            try:
                with open(script, "rb") as f:
                    script_hash = hashlib.sha256(f.read()).hexdigest()[:16]
            except OSError:
                script_hash = "-"
            layout = [] if self._reducer is None else [
                f"{b.flat.dtype}x{b.numel}/{len(b.params)}" for b in self._reducer.buckets
            ]
            self._preflight_cache = {
                "gradient buckets": hashlib.sha256(";".join(layout).encode()).hexdigest()[:16] + f" ({len(layout)} buckets)",
                "bucket_cap_mb": str(self.settings.bucket_cap_mb),
                "verify_every": str(self.settings.verify_every),
                "total steps": str(self.total),
                "data plan": (
                    f"dataset {self.plan.dataset_len}, global batch {self.plan.global_batch_size},"
                    f" micro-batch {self.plan.micro_batch_size}, seed {self.plan.seed}"
                ),
                "torch": torch.__version__,
                "unbroken": unbroken.__version__,
                "script": f"{os.path.basename(script)} sha256 {script_hash}",
            }
        return self._preflight_cache

    def _reconfigure_wanted(self) -> bool:
        view = self._heartbeat.view if self._heartbeat else {}
        return bool(view.get("reconfigure")) and view.get("generation") == self.generation

    def _abandon_reason(self, number: int, for_commit: bool = False) -> str | None:
        view = self._heartbeat.view if self._heartbeat else {}
        silent = time.monotonic() - self._client.last_ok if self._client else 0.0
        if silent > self.settings.lease:
            return f"no reply from the coordinator for {silent:.1f} s (lease {self.settings.lease:.1f} s)"
        if view.get("state") == "dead":
            return "the coordinator declared this member dead"
        # A restarted coordinator (or a new leader) has another incarnation and does not know
        # this member. An "unknown" from the incarnation that formed this generation only means a
        # heartbeat sent before this member joined was answered late: not a reason to leave.
        incarnation = view.get("incarnation")
        if self._incarnation is not None and incarnation is not None and incarnation != self._incarnation:
            return f"the coordinator restarted (incarnation {incarnation}; generation {number} was formed by {self._incarnation})"
        current = view.get("generation", 0)
        if current > number:
            return f"generation {current} has formed"
        if current == number and view.get("broken") and not for_commit:
            return "a member of this generation failed"
        return None

    def _join(self) -> bool:
        from unbroken.group import GenerationGroup

        deadline = time.monotonic() + self.settings.join_timeout
        while True:
            try:
                reply = self._client.post(
                    "/v1/join",
                    read_timeout=30.0,
                    member=self.member_id,
                    node=self.settings.node,
                    pid=os.getpid(),
                    step=self.next_step,
                    after=max(self.generation, self._generation_floor),
                    warm=bool(self._heartbeat.warm),
                    preflight=self._preflight(),
                )
            except Unauthorized as exc:
                self._refused(f"unbroken: error: {self.member_id}: {exc}", EXIT_MISMATCH)
            if reply["status"] == "finished":
                if self.fresh or self.total is None or self.next_step < self.total:
                    # A member that is behind (restarted, late, or cut off until the end): the job
                    # ended without it. End the process quietly rather than let the script go on
                    # with a stale model as if it had trained.
                    print(f"unbroken: {self.member_id}: the job finished before this member could rejoin; exiting", file=sys.stderr, flush=True)
                    self._stop(finished=False)
                    raise SystemExit(0)
                log.info("%s: the job has finished; nothing to join", self.member_id)
                return False
            if reply["status"] == "failed":
                raise UnbrokenError(f"the job cannot go on: {reply.get('reason')}")
            if reply["status"] == "mismatch":
                self._refused(
                    f"unbroken: error: {self.member_id} does not match the job, so the coordinator refused it:"
                    f" {reply.get('reason')}. Run every node with the same script, settings and versions.",
                    EXIT_MISMATCH,
                )
            if reply["status"] == "refused":
                self._refused(f"unbroken: {self.member_id}: the coordinator refuses this member: {reply.get('reason')}", 1)
            if reply["status"] != "formed":
                if time.monotonic() > deadline:
                    raise UnbrokenError(
                        f"no generation formed within join_timeout={self.settings.join_timeout:.0f} s; the coordinator"
                        " may be waiting for more members than have started (see `unbroken status HOST:PORT`)"
                    )
                continue
            number = reply["generation"]
            self.generation = number
            self._incarnation = reply.get("incarnation")
            group = GenerationGroup(
                number,
                reply["rank"],
                len(reply["members"]),
                reply["members"],
                abandoned=lambda n=number: self._abandon_reason(n),
                wake=self._wake,
                timeout=self.settings.collective_timeout,
                blocked=self._blocked,
            )
            try:
                group.connect(self._store_for(reply["store_host"], reply["store_port"]), reply["prefix"], reply["store_host"])
                self._heal(group)
            except GenerationFailed as exc:
                self._store = None  # a broken store connection must not break every later generation
                self._report_failure(number, str(exc))
                self._graveyard.park(group)
                continue
            self._group = group
            self.member_index, self.member_count = group.rank, group.size
            log.info("%s: generation %d, member %d of %d, at step %d", self.member_id, number, group.rank, group.size, self.next_step)
            return True

    def _refused(self, message: str, code: int) -> None:
        """End this worker because the coordinator will not take it (wrong token, a mismatch, a
        quarantined slot): say why, leave, and exit with ``code`` for the launcher to act on."""
        print(message, file=sys.stderr, flush=True)
        self._stop(finished=False)
        raise SystemExit(code)

    def _sync_buffers(self) -> None:
        """Give every member the buffers (BatchNorm statistics, ...) of the generation's rank 0,
        as DDP does, so that replicas stay identical."""
        buffers = self._buffers
        if not buffers:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        for dtype, group in by_dtype.items():
            flat = torch.cat([b.detach().reshape(-1) for b in group])
            if self.member_index != 0:
                flat.zero_()
            self._group.allreduce(flat, "buffer broadcast")
            offset = 0
            with torch.no_grad():
                for b in group:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()

    def _blocked(self, what: str | None) -> None:
        if what is not None:
            self._ticks += 1  # entering a collective is progress
        if self._heartbeat is not None:
            self._heartbeat.blocked_on = what

    def _store_for(self, host: str, port: int) -> Any:
        if self._store is not None and self._store_address != (host, port):
            self._store = None  # the store moved (a restarted coordinator)
        if self._store is None:
            self._store_address = (host, port)
            import datetime

            import torch.distributed as dist

            try:
                self._store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=self.settings.collective_timeout))
            except Exception as exc:  # DistNetworkError / RuntimeError from torch
                raise GenerationFailed(f"cannot reach the process-group store at {host}:{port}: {exc}") from None
        return self._store

    def _exchange_status(self, group: Any) -> list[tuple[int, bool, int]]:
        row = torch.tensor([self.next_step, int(self.fresh), self._digest], dtype=torch.int64)
        table = group.allgather_rows(row, "state exchange")
        return [(int(step), bool(fresh), int(digest)) for step, fresh, digest in table.tolist()]

    def _heal(self, group: Any) -> None:
        statuses = self._exchange_status(group)
        if self._checkpoints is not None and all(fresh for _, fresh, _ in statuses):
            # Nobody in this generation holds live state (the start of a job, or every holder
            # died): its rank 0 reads the newest checkpoint and heals the others from it. The
            # others wait on a store flag, which no collective timeout cuts short.
            if group.rank == 0:
                with self._busy("reading a checkpoint"):
                    self._resume_from_checkpoint()
                group.set_flag("resume-read")
            else:
                group.wait_flag("resume-read", "waiting for a checkpoint to be read")
            statuses = self._exchange_status(group)
        plan = healing.plan(statuses)
        if plan.receivers:
            self._transfer(group, plan)
        # Healing copied one member's RNG states to the others: give every member its own.
        seed_member(self.plan.seed, self.next_step, group.rank)

    def _transfer(self, group: Any, plan: Any) -> None:
        started = time.monotonic()
        if group.rank == plan.source:
            state = self._state()
            sent = 0
            for receiver in plan.receivers:
                sent += healing.send_state(group, state, receiver, lambda: self._chaos.point("heal", self.next_step), self._tick)
            self.fresh = False
            self._events.emit(
                "heal",
                generation=group.number,
                sender=self.member_id,
                receivers=[group.members[r] for r in plan.receivers],
                step=plan.step,
                bytes=sent,
                seconds=time.monotonic() - started,
            )
        elif group.rank in plan.receivers:
            state, received = healing.recv_state(group, plan.source, self._tick)
            self._load(state)
            self.fresh = False
            log.info("%s: healed to step %d from %s (%d bytes)", self.member_id, self.next_step, group.members[plan.source], received)

    def _tick(self) -> None:
        self._ticks += 1

    def _state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "extra": self.extra_state.state_dict() if self.extra_state is not None else None,
            "runtime": {"next_step": self.next_step, "lineage": list(self.lineage)},
            "plan": {"global_batch_size": self.plan.global_batch_size, "seed": self.plan.seed, "dataset_len": self.plan.dataset_len},
            "rng": healing.rng_state(),
        }

    def _load(self, state: dict[str, Any]) -> None:
        mine = {"global_batch_size": self.plan.global_batch_size, "seed": self.plan.seed, "dataset_len": self.plan.dataset_len}
        if state["plan"] != mine:
            raise ConfigError(f"members disagree on the data plan: peer has {state['plan']}, this member {mine}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.extra_state is not None and state["extra"] is not None:
            self.extra_state.load_state_dict(state["extra"])
        self.next_step = state["runtime"]["next_step"]
        self.lineage = list(state["runtime"]["lineage"])
        self._digest = healing.lineage_digest(self.lineage)
        healing.set_rng_state(state["rng"])
        if self._heartbeat is not None:
            self._heartbeat.step = self.next_step

    def _committed(self, step: Step) -> None:
        self.next_step = step.index + 1
        self._last_step_seconds = time.monotonic() - step.started
        self.lineage.append(step.generation)
        self._digest = healing.extend_digest(self._digest, step.generation)
        self.fresh = False
        if self._sample_fd is not None:  # what this member committed, for the stale-commit checks
            line = f'{{"commit":1,"g":{step.generation},"s":{step.index},"t":{time.time()!r}}}\n'
            os.write(self._sample_fd, line.encode())
        if self._heartbeat is not None:
            self._heartbeat.step = self.next_step
            self._heartbeat.warm = True
        if self._events.enabled and self.member_index == 0:
            self._events.emit(
                "step",
                step=step.index,
                generation=step.generation,
                members=step.members,
                seconds=time.monotonic() - step.started,
                loss=step.loss,
                samples=self.plan.global_batch_size,
                total=self.total,
            )

    def _report_failure(self, number: int, error: str) -> None:
        log.warning("%s: generation %d failed: %s", self.member_id, number, error)
        try:
            self._client.post("/v1/failure", member=self.member_id, generation=number, error=error[:500])
        except UnbrokenError as exc:
            log.warning("could not report the failure: %s", exc)

    # -- durable checkpoints ---------------------------------------------------------------------

    def _open_checkpoints(self, resume: bool) -> None:
        """Open the checkpoint directory; a member that starts a job (nobody holds live state)
        resumes from the newest valid checkpoint there."""
        if not self.checkpoint.directory or self._checkpoints is not None:
            return
        from unbroken.checkpoint import CheckpointStore, Saver, Schedule

        self._checkpoints = CheckpointStore(self.checkpoint.directory)
        self._saver = Saver(self._checkpoints, self.checkpoint.keep, self._checkpoint_done, lambda s: self._chaos.point("save", s))
        if self.checkpoint.every is not None:
            self._schedule = Schedule(self.checkpoint.every, self.checkpoint.mtbf, time.monotonic())
        if resume:
            self._resume_from_checkpoint()
        else:
            self._generation_floor = max(self._generation_floor, self._checkpoints.newest_generation())

    def _resume_from_checkpoint(self) -> None:
        """Load the newest checkpoint that verifies, if there is one."""
        found = self._checkpoints.load_latest()
        if found is None:
            if self._checkpoints.steps() or _has_entries(self._checkpoints):
                print(f"unbroken: warning: no valid checkpoint in {self.checkpoint.directory}; starting from step 0", flush=True)
            return
        state, manifest, location = found
        self._load(state)
        self.fresh = False
        # New generations are numbered above the one that wrote it (it may come from an earlier
        # coordinator), so that lineages never reuse a number.
        self._generation_floor = max(self._generation_floor, int(manifest.get("generation", 0)))
        print(f"unbroken: resumed from step {self.next_step} of {location}", flush=True)
        self._events.emit("resume", step=self.next_step, location=location)

    def _maybe_checkpoint(self) -> None:
        if self._schedule is None or self.member_index != 0:
            return
        now = time.monotonic()
        self._account_save_cost(now)
        if self.next_step < (self.total or 0) and self._schedule.due(self.next_step, now):
            self._save()

    def _account_save_cost(self, now: float) -> None:
        """What a save costs training: its stall plus how much longer the steps took while it was
        being written (the writer competes for cores and memory bandwidth)."""
        seconds = self._last_step_seconds
        if seconds is None:
            return
        if self._saver.busy():
            if self._step_ema is not None:
                self._save_cost += max(0.0, seconds - self._step_ema)
            return
        if self._save_cost_pending:
            self._save_cost_pending = False
            message = self._schedule.cost(self._save_cost, now)
            if message:
                log.info("%s", message)
                print(f"unbroken: {message}", flush=True)
                self._events.emit("checkpoint_interval", seconds=self._schedule.interval, cost=self._save_cost)
            return  # the step that saw the write finish is not a healthy sample
        self._step_ema = seconds if self._step_ema is None else 0.9 * self._step_ema + 0.1 * seconds

    def _save(self) -> None:
        """Snapshot the state and write it in the background; skipped (never waited for) while
        the previous write is still running, so that a slow store never holds up a collective."""
        meta = {"generation": self.generation, "members": list(self._group.members) if self._group else [self.member_id]}
        with self._busy("checkpoint snapshot"):
            stall = self._saver.save(self.next_step, self._state(), meta)
        if self._schedule is not None:
            self._schedule.began(time.monotonic())  # a skipped save waits for the next interval too
        if stall is None:
            message = f"checkpoint of step {self.next_step} skipped: the write of step {self._saver.writing} is still running"
            log.warning("%s", message)
            print(f"unbroken: {message}", flush=True)
            self._events.emit("checkpoint_skipped", step=self.next_step, writing=self._saver.writing)
        elif self._schedule is not None:
            self._save_cost, self._save_cost_pending = stall, True

    def _final_checkpoint(self) -> None:
        """A single process saves the final state and waits until it is durable."""
        if self._saver is None:
            return
        self._saver.wait()
        if self._schedule is not None:
            self._save()
        self._saver.wait()

    def _final_checkpoint_together(self) -> bool:
        """After the final replica check: rank 0 writes the final checkpoint and waits until it is
        durable, marked busy (never taken for stuck, however slow the store); the others wait for
        it on a store flag, which tolerates any write time. Every member also lets its own
        background write finish. False if the generation broke meanwhile (rejoin and redo)."""
        if self._saver is None:
            return True
        try:
            with self._busy("checkpoint write"):
                self._saver.wait()
                if self._schedule is not None and self.member_index == 0:
                    self._save()
                    self._saver.wait()
            if self._schedule is not None:
                if self.member_index == 0:
                    self._group.set_flag("final-checkpoint")
                else:
                    self._group.wait_flag("final-checkpoint", "waiting for the final checkpoint")
        except GenerationFailed as exc:
            self._abandon(str(exc))
            return False
        return True

    def _checkpoint_done(self, info: dict[str, Any]) -> None:
        self._events.emit("checkpoint", **info)

    def _abandon(self, reason: str) -> None:
        if self._reducer is not None:
            self._reducer.renew_buffers()
        if self._schedule is not None:
            self._schedule.failure()
        if self._group is not None:
            self._report_failure(self._group.number, reason)
            self._graveyard.park(self._group)
            self._group = None

    def _close_group(self) -> None:
        """Leave a healthy generation at a step boundary (someone waits to join)."""
        if self._group is not None:
            self._group.pg = None  # nothing is pending on it: safe to destroy
            self._group = None

    def _verify_replicas(self) -> bool:
        """Exchange a hash of the parameters and buffers; all members must agree.

        Returns False (after abandoning the generation) if the exchange itself failed."""
        digest = hashlib.sha256()
        for name, tensor in self.model.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        row = torch.tensor(list(digest.digest()), dtype=torch.int64)
        try:
            table = self._group.allgather_rows(row, "replica check")
        except GenerationFailed as exc:
            self._abandon(str(exc))
            return False
        rows = [bytes(r).hex() for r in table.tolist()]
        if len(set(rows)) != 1:
            by_member = ", ".join(f"{m}={h[:12]}" for m, h in zip(self._group.members, rows))
            raise ReplicaDivergence(f"members hold different parameters after step {self.next_step} (generation {self.generation}): {by_member}")
        self.replica_hash = digest.hexdigest()
        self._events.emit("replicas", generation=self.generation, members=self.member_count, hash=self.replica_hash, step=self.next_step)
        log.info("%s: %d replicas identical at step %d (sha256 %s)", self.member_id, self.member_count, self.next_step, self.replica_hash[:16])
        return True

    def _stop(self, finished: bool) -> None:
        if self.settings.record_samples and self.run_dir and finished:
            import json

            path = os.path.join(self.run_dir, "samples", f"{self.member_id}.lineage.json")
            with open(path, "w") as f:
                json.dump({"lineage": self.lineage, "hash": self.replica_hash, "next_step": self.next_step}, f)
        if self._client is not None:
            try:
                self._client.post("/v1/leave", member=self.member_id, finished=finished, step=self.next_step)
            except UnbrokenError as exc:
                log.warning("could not tell the coordinator that this member leaves: %s", exc)
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._sample_fd is not None:
            os.close(self._sample_fd)
            self._sample_fd = None
        self._close_group()
        _ExitGuard.finished = finished


def _die_with_launcher() -> None:
    """End this worker the moment its launcher dies (Linux's parent-death signal), so that no
    orphan holds a node's devices or trains on unwatched; if it died already, end now."""
    launcher = os.environ.get("UNBROKEN_LAUNCHER_PID")
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError) as exc:
        log.warning("cannot ask to die with the launcher: %s", exc)
        return
    if os.getppid() != int(launcher):
        print("unbroken: the launcher of this worker is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)


def _has_entries(store: Any) -> bool:
    try:
        return bool(store.fs.ls(store.root, detail=False))
    except FileNotFoundError:
        return False


class _ExitGuard:
    """Keeps an abandoned Gloo group from turning a finished run into a crash at exit.

    A group abandoned while a peer hung may still hold pending work; destroying it at interpreter
    exit can abort the process. If any such group exists at exit, the process ends with
    ``os._exit`` after flushing, with status 1 if an exception escaped, else 0.
    """

    jobs: list[Job] = []
    finished = False
    crashed = False
    _installed = False

    @classmethod
    def install(cls, job: Job) -> None:
        cls.jobs.append(job)
        if cls._installed:
            return
        cls._installed = True
        previous = sys.excepthook

        def hook(*args: Any) -> None:
            cls.crashed = True
            previous(*args)

        sys.excepthook = hook
        atexit.register(cls._at_exit)

    @classmethod
    def _at_exit(cls) -> None:
        if any(job._graveyard for job in cls.jobs):
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            # A script that exits with sys.exit(n) after an unfinished job must not look like
            # success; the exact status of such an exit is not known here.
            os._exit(1 if cls.crashed or not cls.finished else 0)
