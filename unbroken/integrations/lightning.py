"""PyTorch Lightning's ``Trainer`` under unbroken: one strategy, the LightningModule unchanged.

::

    from unbroken.integrations.lightning import UnbrokenStrategy

    trainer = L.Trainer(strategy=UnbrokenStrategy(), accelerator="cpu", devices=1, max_steps=200,
                        accumulate_grad_batches=2, gradient_clip_val=1.0)
    trainer.fit(model, train_loader, val_loader)

Every worker that ``unbroken run`` starts runs this ``Trainer`` on one device; the strategy makes
them one job. Each batch Lightning's loop sees is one of unbroken's steps: the strategy's
``training_step`` runs the module's ``training_step`` on this worker's share of the step, in
micro-batches of the loader's ``batch_size`` (the step's global batch is ``batch_size x
accumulate_grad_batches`` samples, whatever the number of workers), backpropagates each loss
weighted by its share and reduces the gradients over every worker. A step whose reduce failed (a
worker was lost) is redone inside it, over the new generation, so Lightning's loop never sees the
failure: ``trainer.global_step`` counts committed steps, schedulers and callbacks run once per
step. Lightning then clips the reduced gradients (``gradient_clip_val``) and the optimizer step
is unbroken's commit. Lightning itself runs on each worker as if alone, with no collective of
its own: validation loaders are not sharded (every worker validates all of it, so its metrics
need no sync), and a worker healed into the job mid-way gets Lightning's step and epoch counters
set to the job's, so that every worker's Lightning takes the same decisions at the same steps.
``is_global_zero`` and ``rank_zero_only`` follow the current leader.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterator

import torch

from unbroken.errors import ConfigError, UnbrokenError

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.trainer.states import RunningStage
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError(f"unbroken.integrations.lightning needs PyTorch Lightning: pip install 'unbroken[lightning]' ({exc})") from None

from unbroken.integrations.driven_loop import DrivenLoop, UnsupportedFeature, refuse
from unbroken.integrations.lightning_parts import check_trainer, quiet_sync_dist_advice, record_devices_argument


def _refuse(feature: str) -> UnsupportedFeature:
    return refuse("UnbrokenStrategy", feature, "docs/guide/lightning.md")


class _Token:
    """What Lightning's loop takes for a batch: the next step, whose batches the strategy loads."""

    def __init__(self, index: int) -> None:
        self.index = index


class _Steps:
    """The training loader Lightning iterates: one token per step of an epoch (prefetched
    freely: a token loads nothing)."""

    def __init__(self, steps_per_epoch: int) -> None:
        self.steps_per_epoch = steps_per_epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[_Token]:
        return (_Token(i) for i in range(self.steps_per_epoch))


class _LightningState:
    """What Lightning keeps between steps, healed and checkpointed with the model: the
    learning-rate schedulers it steps, and every callback's state (``EarlyStopping``'s wait count
    and best score, ``ModelCheckpoint``'s best checkpoints...), as Lightning's own checkpoints
    keep them (keyed by ``Callback.state_key``). A worker healed into the job then takes the
    same decisions as the others: it stops when they stop, and as a new leader it knows which
    checkpoint files its predecessor kept and writes its logs in the same version directory."""

    def __init__(self, trainer: "pl.Trainer") -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        from lightning.pytorch.trainer import call

        return {"schedulers": [c.scheduler.state_dict() for c in self._trainer.lr_scheduler_configs],
                "callbacks": call._call_callbacks_state_dict(self._trainer),
                # the version directory each logger writes to: the first heal gives every member the
                # leader's, so a later leader continues its version_N (it chose the next free one)
                "logger_versions": [getattr(logger, "version", None) for logger in self._trainer.loggers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from lightning.pytorch.trainer import call

        for config, saved in zip(self._trainer.lr_scheduler_configs, state["schedulers"]):
            config.scheduler.load_state_dict(saved)
        if state.get("callbacks"):  # absent from states of earlier versions
            call._call_callbacks_load_state_dict(self._trainer, {"callbacks": state["callbacks"]})
        for logger, version in zip(self._trainer.loggers, state.get("logger_versions") or ()):
            if version is not None and hasattr(logger, "_version") and logger._version != version:
                logger._version = version
                # an experiment made before (a fresh launch resuming from a checkpoint made one in
                # the next free version at setup) writes where the version no longer says
                if getattr(logger, "_experiment", None) is not None:
                    logger._experiment = None


def _tokens_skip_the_batch_hooks() -> None:
    """Lightning's loop calls the module's ``on_before_batch_transfer`` hook on each batch it
    loads, here a step's token: the hook would get the token (and a hook that transforms the batch
    would fail on it) instead of the real micro-batches, which :meth:`UnbrokenStrategy.training_step`
    loads through the same hooks. Patched once, for the LightningModules of this process: a token
    passes through unchanged, any other batch goes to the hook as before."""
    plain = pl.LightningModule._on_before_batch_transfer
    if getattr(plain, "_unbroken_skips_tokens", False):
        return

    def on_before_batch_transfer(module: Any, batch: Any, dataloader_idx: int = 0) -> Any:
        return batch if isinstance(batch, _Token) else plain(module, batch, dataloader_idx)

    on_before_batch_transfer._unbroken_skips_tokens = True
    pl.LightningModule._on_before_batch_transfer = on_before_batch_transfer


def _continue_csv_logs() -> None:
    """Lightning's CSV logger writes on rank zero only, and a writer made in a directory that holds
    a ``metrics.csv`` deletes it; one that appends columns rewrites the file with its own header.
    Under unbroken the leader changes when workers are lost, and a new leader's writer would
    delete its predecessor's metrics, or fail on their columns (``ValueError: dict contains fields
    not in fieldnames``). Patched once, for the CSV writers of this process: a writer continues
    the file it finds, its header included."""
    from lightning.fabric.loggers.csv_logs import _ExperimentWriter

    if getattr(_ExperimentWriter, "_unbroken_continues", False):
        return

    def existing_keys(writer: Any) -> list[str]:
        if not writer._fs.isfile(writer.metrics_file_path):
            return []
        import csv

        with writer._fs.open(writer.metrics_file_path, "r", newline="") as file:
            return next(csv.reader(file), [])

    def keep_existing(writer: Any) -> None:  # instead of deleting the metrics another leader wrote
        writer.metrics_keys = sorted(set(writer.metrics_keys) | set(existing_keys(writer)))

    plain_save = _ExperimentWriter.save

    def save(writer: Any) -> None:  # another leader may have added columns since this one last wrote
        keep_existing(writer)
        plain_save(writer)

    _ExperimentWriter._check_log_dir_exists = keep_existing
    _ExperimentWriter.save = save
    _ExperimentWriter._unbroken_continues = True


class UnbrokenStrategy(SingleDeviceStrategy):
    """Lightning's strategy for a job that survives lost workers (see the module's docstring).

    Args:
        device: this worker's device (default: the CPU, or ``cuda:LOCAL_RANK`` where a GPU is).
        global_batch_size: samples per step over all workers (default: the training loader's
            ``batch_size`` times the Trainer's ``accumulate_grad_batches``).
        seed: seeds the sample order (unbroken plans it: the loader's sampler is not used).
    """

    strategy_name = "unbroken"

    def __init__(self, device: Any = None, *, global_batch_size: int | None = None, seed: int = 0, **kwargs: Any) -> None:
        if device is None:
            from unbroken.worker.devices import local_device

            device = local_device() if torch.cuda.is_available() else torch.device("cpu")
        super().__init__(device=device, **kwargs)
        record_devices_argument()  # before the Trainer that takes this strategy resolves its devices
        self._global_batch_size, self._seed = global_batch_size, seed
        self._loop: DrivenLoop | None = None
        self._pending: Any = None  # the first step, taken before Lightning's loop starts

    # -- who is who ----------------------------------------------------------------------------

    @property
    def job(self) -> Any:
        """The :class:`~unbroken.Job` behind the loop (``on_leader``, ``stop``, ``next_step``)."""
        if self._loop is None:
            raise ConfigError("the job starts when trainer.fit() sets up its training data")
        return self._loop.job


    @property
    def is_global_zero(self) -> bool:
        return self._loop is None or self._loop.job.is_leader

    def setup_environment(self) -> None:
        """A restarted worker is not rank zero until it joins (the generation tells it its rank):
        before, its local rank 0 would make it create a logger's experiment in the next free
        version directory (``version_1``, left empty: the heal gives it the leader's version),
        and log the hyperparameters there, before it knows whether it leads."""
        super().setup_environment()
        if self._loop is None and int(os.environ.get("UNBROKEN_RESTART_COUNT", "0") or 0) > 0:
            from unbroken.worker.default_group import tell_rank_zero_helpers

            tell_rank_zero_helpers(1)

    def setup(self, trainer: "pl.Trainer") -> None:
        check_trainer(trainer, self.precision_plugin)  # before the model is converted and anything trains
        _continue_csv_logs()
        _tokens_skip_the_batch_hooks()
        quiet_sync_dist_advice()
        # unbroken plans the training samples, and validation loaders are not sharded: no
        # DistributedSampler for any loader
        trainer._accelerator_connector.use_distributed_sampler = False
        super().setup(trainer)  # converts the model to the precision plugin's dtype (convert_module), as Lightning does

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True  # the strategy's steps hold the accumulation: Lightning steps the optimizer once per step

    # -- the training data ---------------------------------------------------------------------

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if self._loop is not None:
            raise _refuse("a second training loader (or reloading it every epoch)")
        loader = dataloader
        if not isinstance(loader, torch.utils.data.DataLoader) or isinstance(loader.dataset, torch.utils.data.IterableDataset):
            raise _refuse("a training loader that is not a torch DataLoader over a map-style data set")
        if loader.batch_size is None:
            raise _refuse("a training loader without batch_size (a batch sampler)")
        if len(self.optimizers) != 1:
            raise _refuse(f"{len(self.optimizers)} optimizers (one optimizer per job)")
        if not self.lightning_module.automatic_optimization:
            raise _refuse("manual optimization (self.automatic_optimization = False)")
        global_batch = self._global_batch_size or loader.batch_size * trainer.accumulate_grad_batches
        trainer.accumulate_grad_batches = 1  # each of Lightning's batches is one whole step
        steps_per_epoch = len(loader.dataset) // global_batch
        if steps_per_epoch < 1:
            raise ConfigError(f"the training data set holds {len(loader.dataset)} samples, fewer than one step's global"
                              f" batch of {global_batch}")
        total = _total_steps(trainer, steps_per_epoch)
        self._loop = DrivenLoop(
            total, model=self.lightning_module, optimizer=self.optimizers[0], dataset=loader.dataset,
            global_batch_size=global_batch, micro_batch_size=loader.batch_size, seed=self._seed,
            collate_fn=None if loader.collate_fn is torch.utils.data.default_collate else loader.collate_fn,
            extra_state=_LightningState(trainer),
        )
        # Join the job now, before Lightning's loop starts: a worker healed into a job under way
        # (restarted, or new) starts at its step, and Lightning's counters are set to match.
        self._pending = self._loop.next()
        if self._pending is not None and self._pending.index > 0:
            trainer.fit_loop.load_state_dict(_loop_state_at(trainer, self._pending.index, steps_per_epoch))
        return _Steps(steps_per_epoch)

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if isinstance(batch, _Token):
            return batch
        return super().batch_to_device(batch, device, dataloader_idx)

    # -- the step ------------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """One of unbroken's steps: the module's ``training_step`` on each micro-batch of this
        worker's share, each loss backpropagated with its weight, the gradients reduced; a step
        whose reduce failed is redone here. Returns the step's global loss (already backpropagated)."""
        token, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        if not isinstance(token, _Token):
            return super().training_step(*args, **kwargs)
        loop = self._loop
        while True:
            step, self._pending = self._pending or loop.next(), None
            if step is None:  # the job ended (job.stop on a member, or it finished without this one): so does Lightning
                self.lightning_module.trainer.should_stop = True
                return None
            for micro in step.micro_batches():
                micro = self._load(micro)
                with self.precision_plugin.train_step_context():
                    out = self.lightning_module.training_step(micro, batch_idx)
                loss = out["loss"] if isinstance(out, dict) else out
                if loss is None:
                    raise _refuse("a training_step that returns None (skipping a batch would leave its samples out)")
                step.backward(loss)
            if step.reduce():
                return torch.tensor(step.loss, dtype=torch.float32, device=self.root_device, requires_grad=True)

    def _load(self, micro: Any) -> Any:
        """A micro-batch as Lightning's loop loads each batch: converted to the precision's dtype,
        then the module's (or datamodule's) ``on_before_batch_transfer``, ``transfer_batch_to_device``
        and ``on_after_batch_transfer`` hooks, in that order (the step's token skips them). It is
        then the batch ``self.log`` sees (an epoch mean weighs each value by its batch's size)."""
        micro = self.precision_plugin.convert_input(micro)
        micro = self.lightning_module._on_before_batch_transfer(micro, dataloader_idx=0)
        micro = self.batch_to_device(micro, dataloader_idx=0)
        results = self.lightning_module.trainer._results
        if results is not None:  # as Lightning's logger connector attaches each batch it loads (it got the token)
            results.batch, results.batch_size = micro, None
        return micro

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The step's losses were backpropagated in :meth:`training_step`: run the hooks only."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Run the step (the closure: zero_grad, :meth:`training_step`, the backward hooks, then
        Lightning's clipping of the reduced gradients) and commit it; a commit refused (a worker
        was lost between the reduce and the commit) runs the closure again on the redone step."""
        model = model or self.lightning_module
        loop = self._loop
        if hasattr(closure, "_zero_grad_fn"):
            closure._zero_grad_fn = None  # Lightning zeroes between training_step and backward: the commit zeroes after the step
        while True:
            result = self.precision_plugin._wrap_closure(model, optimizer, closure)
            if loop.step is None:  # the job ended before this step (see training_step)
                return result
            # Lightning's step counter is a copy of the job's: they agree before anything commits
            trainer = self.lightning_module.trainer
            if trainer.global_step != loop.step.index:
                raise UnbrokenError(f"Lightning's global_step {trainer.global_step} and unbroken's step {loop.step.index}"
                                    " disagree: refusing to commit (a bug in UnbrokenStrategy; please report it)")
            if loop.step.commit():
                loop.after_commit()
                if loop.finished:
                    self.lightning_module.trainer.should_stop = True
                return result

    # -- Lightning's own collectives: none --------------------------------------------------------
    # Every worker runs Lightning's loop as if alone: the same model, the same validation data and
    # the same step counter make its decisions (early stopping, checkpoint paths) the same
    # everywhere, and a worker healed into the job mid-way can never be inside one of Lightning's
    # collectives while the others are in a step's. So reduce, gather and broadcast are local.

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Local: validation is not sharded (every worker holds the value), and a training step's
        loss is reduced by unbroken (``step.loss``, what the progress bar shows)."""
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        return decision

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: no worker needs to wait for the others (the leader saves alone)."""

    def teardown(self) -> None:
        if self._loop is not None:
            self._loop.finish()
        super().teardown()


def _loop_state_at(trainer: "pl.Trainer", step: int, steps_per_epoch: int) -> dict[str, Any]:
    """Lightning's fit-loop state as a checkpoint saved after ``step`` committed steps would hold
    it: the epoch, the batch within it, the optimizer steps (``global_step``)."""
    epoch, batch = divmod(step, steps_per_epoch)
    state = trainer.fit_loop.state_dict()

    def counts(total: int, current: int, *names: str) -> dict[str, Any]:
        return {"total": {n: total for n in names}, "current": {n: current for n in names}}

    state["epoch_progress"] = counts(epoch + 1, epoch + 1, "ready", "started")
    for n in ("processed", "completed"):
        state["epoch_progress"]["total"][n] = state["epoch_progress"]["current"][n] = epoch
    state["epoch_loop.batch_progress"] = {**counts(step, batch, "ready", "started", "processed", "completed"), "is_last_batch": False}
    state["epoch_loop.state_dict"] = {**state.get("epoch_loop.state_dict", {}), "_batches_that_stepped": step}
    state["epoch_loop.automatic_optimization.optim_progress"] = {
        "optimizer": {"step": counts(step, batch, "ready", "completed"), "zero_grad": counts(step, batch, "ready", "started", "completed")},
    }
    return state


def _total_steps(trainer: "pl.Trainer", steps_per_epoch: int) -> int:
    """The job's steps: Lightning's ``max_steps``, or ``max_epochs`` passes, whichever ends first."""
    limits = []
    if trainer.max_steps is not None and trainer.max_steps > 0:
        limits.append(trainer.max_steps)
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        limits.append(trainer.max_epochs * steps_per_epoch)
    if not limits:
        raise ConfigError("UnbrokenStrategy needs max_steps or max_epochs: the job's steps are planned ahead")
    return min(limits) if math.isfinite(min(limits)) else limits[0]
