"""What a ``Trainer`` may be given under :class:`~unbroken.integrations.lightning.UnbrokenStrategy`.

Lightning's Trainer takes arguments that a strategy of its own honours and ours cannot: several
devices or nodes per Trainer (under unbroken, ``unbroken run`` starts one process per worker), an
accumulation that changes by epoch (unbroken fixes each step's global batch and splits it among
the live workers), fp16 loss scaling (unbroken backpropagates and commits each step itself).
Ignored, each would train another model than the script says, or on fewer devices than asked;
:func:`check_trainer` refuses them by name at the strategy's setup, before the first step, saying
what to write instead.
"""

from __future__ import annotations

from typing import Any

from unbroken.integrations.driven_loop import UnsupportedFeature

_GUIDE = "see docs/guide/lightning.md"
_DEVICES_GIVEN = "_unbroken_devices_given"
"""The connector's attribute that keeps ``Trainer(devices=...)`` as the script wrote it."""


def record_devices_argument() -> None:
    """Make Lightning's accelerator connector keep ``Trainer(devices=...)`` as given.

    Lightning resolves the argument before a strategy sees it, and its default ``"auto"`` becomes
    every GPU of the node: indistinguishable, once resolved, from ``devices=N``. Patched once for
    this process, by the strategy's constructor (which runs before the Trainer given the strategy
    makes its connector); it only records the argument. Without the private method (another
    Lightning version), nothing is patched and :func:`check_trainer` judges the resolved count."""
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    plain = getattr(_AcceleratorConnector, "_check_device_config_and_set_final_flags", None)
    if plain is None or getattr(_AcceleratorConnector, "_unbroken_records_devices", False):
        return

    def check_device_config(connector: Any, devices: Any, num_nodes: int) -> None:
        setattr(connector, _DEVICES_GIVEN, devices)
        plain(connector, devices=devices, num_nodes=num_nodes)

    _AcceleratorConnector._check_device_config_and_set_final_flags = check_device_config
    _AcceleratorConnector._unbroken_records_devices = True


def check_trainer(trainer: Any, precision_plugin: Any) -> None:
    """Refuse what ``trainer`` was given that UnbrokenStrategy cannot honour (see the module's
    docstring): :class:`UnsupportedFeature` naming it and what to do instead."""
    _check_devices(trainer._accelerator_connector)
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
        raise UnsupportedFeature(
            "UnbrokenStrategy does not support GradientAccumulationScheduler: unbroken fixes each step's global batch for"
            " the whole job and splits it among the live workers, so an accumulation that changes by epoch cannot be"
            " honoured. Remove the callback and set the step's size once: UnbrokenStrategy(global_batch_size=N), or"
            f" Trainer(accumulate_grad_batches=N) for N micro-batches of the loader's batch_size ({_GUIDE})")
    if getattr(precision_plugin, "scaler", None) is not None:
        raise UnsupportedFeature(
            f"UnbrokenStrategy does not support precision={getattr(precision_plugin, 'precision', '16-mixed')!r} with a"
            " GradScaler: unbroken backpropagates and commits each step itself, so Lightning's loss scaling would not"
            " run and fp16 gradients could underflow. Use precision='bf16-mixed' (it needs no scaler), 'bf16-true',"
            f" '32-true' or '64-true' ({_GUIDE})")


def _check_devices(connector: Any) -> None:
    """One device and one node per Trainer: ``unbroken run`` starts the workers."""
    count = len(getattr(connector, "_parallel_devices", None) or [None])
    given = getattr(connector, _DEVICES_GIVEN, None)
    if given is None:  # not recorded (see record_devices_argument): "auto" resolved to every device there is
        given = "auto" if count == connector.accelerator.auto_device_count() else count
    if given != "auto" and count > 1:  # "auto" is Lightning's default: each worker takes its own device
        raise UnsupportedFeature(
            f"UnbrokenStrategy trains on one device per worker, but the Trainer was given devices={given!r}: unbroken"
            f" runs one process per worker. Give the Trainer devices=1 (or leave the default, \"auto\") and start"
            f" {count} workers with `unbroken run --nproc-per-node {count} script.py` ({_GUIDE})")
    nodes = getattr(connector, "_num_nodes_flag", 1)
    if nodes != 1:
        raise UnsupportedFeature(
            f"UnbrokenStrategy does not support num_nodes={nodes!r}: unbroken joins the nodes itself. Give the Trainer"
            f" num_nodes=1 and run `unbroken run --nnodes {nodes} --rdzv-endpoint HOST:PORT ...` on each node"
            f" (see docs/guide/several-hosts.md)")


def quiet_sync_dist_advice() -> None:
    """Lightning advises ``self.log(..., sync_dist=True)`` for every epoch-level metric logged
    while torch.distributed is initialised, which it is inside unbroken's loop (each generation is
    the default group). Under :class:`~unbroken.integrations.lightning.UnbrokenStrategy` the advice
    is wrong: every worker validates the whole validation set and ``sync_dist`` is local
    (docs/guide/lightning.md), so the warning is filtered in this process, that one message only."""
    import warnings

    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\(", category=PossibleUserWarning)
