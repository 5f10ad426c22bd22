"""A job's training state as one dict: gathered from its training objects, and loaded back into them.

The state a member heals others from, checkpoints and streams to a newcomer: the model's and
optimizer's state (in a replica group, this process's shards only: process j of another group
holds the same ones), the scheduler's, the ``extra_state``'s and the GradScaler's, the runtime's
record (next step, lineage, checkpoint schedule), the data plan it was trained under (checked
before anything is loaded) and the RNG states. :class:`TrainingObjects` names what it is taken
from; the :class:`~unbroken.worker.runtime.Job` builds one from its attributes whenever it takes or
loads a state, and owns the runtime's record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from unbroken.errors import ConfigError
from unbroken.worker.rng_state import rng_state, set_rng_state


@dataclass(frozen=True)
class TrainingObjects:
    """What a training state is taken from and loaded into: the job's objects as they are now."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    extra_state: Any
    scaler: Any
    plan: Any
    """The job's :class:`~unbroken.data.data_plan.DataPlan`: a state is loaded only under the same one."""
    replica: Any
    """This process's replica group (:mod:`unbroken.worker.group_member`), or None."""
    device: torch.device


def plan_record(plan: Any) -> dict[str, Any]:
    """What of the data plan a state carries, and must match to be loaded."""
    return {"global_batch_size": plan.global_batch_size, "seed": plan.seed, "dataset_len": plan.dataset_len}


def gather_state(objects: TrainingObjects, runtime: dict[str, Any]) -> dict[str, Any]:
    """The training state of ``objects``, with the runtime's record ``runtime``."""
    if objects.replica is not None:
        from unbroken.replica_groups.sharding import local_state_shards

        # A replica group: this process's shards only; process j of another group holds the same ones.
        model: Any = local_state_shards(objects.model, objects.optimizer)
        optimizer: Any = [{k: v for k, v in g.items() if k != "params"} for g in objects.optimizer.param_groups]
    else:
        model, optimizer = objects.model.state_dict(), objects.optimizer.state_dict()
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": objects.scheduler.state_dict() if objects.scheduler is not None else None,
        "extra": objects.extra_state.state_dict() if objects.extra_state is not None else None,
        "runtime": runtime,
        "plan": plan_record(objects.plan),
        "rng": rng_state(objects.device),
        "scaler": objects.scaler.state_dict() if objects.scaler is not None else None,
    }


def load_state(objects: TrainingObjects, state: dict[str, Any], restore_runtime: Callable[[dict[str, Any]], None]) -> None:
    """Load ``state`` into ``objects`` (a :class:`ConfigError` first if it was trained under
    another data plan); ``restore_runtime`` takes the runtime's record, after the scheduler's and
    the extra state's and before the scaler's and the RNG states."""
    mine = plan_record(objects.plan)
    if state["plan"] != mine:
        raise ConfigError(f"members disagree on the data plan: peer has {state['plan']}, this member {mine}")
    if objects.replica is not None:
        from unbroken.replica_groups.sharding import load_local_state_shards

        load_local_state_shards(objects.model, objects.optimizer, state["model"])
        for group, saved in zip(objects.optimizer.param_groups, state["optimizer"]):
            group.update(saved)
    else:
        objects.model.load_state_dict(state["model"])
        objects.optimizer.load_state_dict(state["optimizer"])
    if objects.scheduler is not None and state["scheduler"] is not None:
        objects.scheduler.load_state_dict(state["scheduler"])
    if objects.extra_state is not None and state["extra"] is not None:
        objects.extra_state.load_state_dict(state["extra"])
    restore_runtime(state["runtime"])
    if objects.scaler is not None and state.get("scaler"):  # absent from older states
        objects.scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"], objects.device)


_PART_NAMES = {"model": "the model's state_dict", "optimizer": "the optimizer's state_dict",
               "scheduler": "the scheduler's state_dict", "extra": "extra_state.state_dict()",
               "scaler": "the GradScaler's state_dict"}


def check_sendable(state: dict[str, Any]) -> None:
    """Refuse, before the first step, a state that no heal, catch-up or checkpoint could carry.

    Each part goes through the heal's own path (:func:`~unbroken.worker.healing.split`, then the
    receiver's restricted reader): its tensors are not copied, only the structure around them is
    pickled. Without this a survivor would meet the error only when a peer needs its state, the
    one moment the job cannot afford it, and the job would start over from its last checkpoint.

    Raises:
        ConfigError: naming the part and what in it could not be carried.
    """
    from unbroken.worker import healing

    for key, what in _PART_NAMES.items():
        if state.get(key) is None:
            continue
        try:
            skeleton, tensors = healing.split(state[key])
            healing.join(skeleton, tensors)
        except Exception as exc:  # noqa: BLE001 - any failure to pickle or to read back is the same refusal
            raise ConfigError(
                f"{what} cannot be sent to a peer or written to a checkpoint ({type(exc).__name__}: {exc}). A heal, a"
                " catch-up and a checkpoint carry the training state as plain data: numbers, strings, containers,"
                " tensors and numpy arrays (add other types with torch.serialization.add_safe_globals); keep"
                " functions, locks and open files out of it") from exc
