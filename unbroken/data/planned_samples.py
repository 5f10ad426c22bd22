"""A micro-batch as the loader builds it: what travels between the training process and the
loader workers, and the user's data set wrapped to load a key's samples.

A :class:`Key` names a micro-batch of a member's share (:class:`Where`) and its data set indices;
:class:`PlannedSamples` loads them, each sample with the global generators seeded for its stream
position (:mod:`unbroken.data.sample_randomness`), and answers with a :class:`Delivery`: the
batch, or a :class:`Failure` that the training process raises as the
:class:`~unbroken.errors.SampleError` naming the sample (:func:`_error`). Kept apart from the
:class:`~unbroken.data.loader.Loader`, which decides which keys to hand out and when.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, NamedTuple

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from unbroken.data import sample_randomness
from unbroken.data.sample_randomness import SampleInfo, _batch_seed, _seed_globals, sample_seed_for
from unbroken.errors import SampleError


class Where(NamedTuple):
    """A micro-batch of a member's share: the request a batch answers."""

    step: int
    member: int
    members: int
    micro: int


class Key(NamedTuple):
    """What the batch sampler hands a loader worker: a micro-batch and its data set indices."""

    version: int
    where: Where
    start: int
    """Stream position of the first sample."""
    indices: tuple[int, ...]


class Failure(NamedTuple):
    """Why a micro-batch could not be built (a sample raised, or the collate function did)."""

    index: int | None
    position: int | None
    error: str
    details: str


class Delivery(NamedTuple):
    """A loader worker's answer: the batch, a failure, or neither (a stale key, skipped)."""

    where: Where
    batch: Any
    failure: Failure | None


def _identity(delivery: Delivery) -> Delivery:
    return delivery


class PlannedSamples(Dataset):
    """The user's data set as loader workers see it: given a :class:`Key`, the micro-batch.

    Each sample is loaded with the global generators seeded for its stream position; an error
    becomes a :class:`Failure` (raised where the batch is consumed, not in the worker)."""

    def __init__(self, dataset: Any, seed: int, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.dataset = dataset
        self.seed = seed
        self.collate_fn = collate_fn
        self.version: Any = None  # shared with the workers: keys of another version are skipped

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, key: Key) -> Delivery:
        if self.version is not None and key.version != self.version.value:
            return Delivery(key.where, None, None)
        return self.load(key)

    def load(self, key: Key, here: bool = False) -> Delivery:
        """The micro-batch of ``key``. ``here``: in the training thread, raise at once (keeping
        the traceback) instead of returning a failure."""
        if self.collate_fn is None and isinstance(self.dataset, TensorDataset):
            index = torch.tensor(key.indices, dtype=torch.long)
            return Delivery(key.where, tuple(t[index] for t in self.dataset.tensors), None)
        if not key.indices:
            return Delivery(key.where, self._empty(key), None)
        items = []
        position, index = key.start, None
        try:
            for offset, index in enumerate(key.indices):
                position = key.start + offset
                # what current_sample() answers while the data set's __getitem__ runs
                sample_randomness._current = SampleInfo(position, index, key.where.step, sample_seed_for(self.seed, position))
                _seed_globals(sample_randomness._current.seed)
                items.append(self.dataset[index])
            sample_randomness._current = None
            position, index = None, None
            # a micro-batch's own randomness (mixing samples) follows its first position and size
            _seed_globals(_batch_seed(self.seed, key.start, len(key.indices)))
            batch = self.collate_fn(items) if self.collate_fn is not None else default_collate(items)
        except Exception as exc:
            if here:
                raise _error(key.where, index, position, f"{type(exc).__name__}: {exc}") from exc
            return Delivery(key.where, None, Failure(index, position, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        finally:
            sample_randomness._current = None
        return Delivery(key.where, batch, None)


    def _empty(self, key: Key) -> Any:
        """An empty micro-batch shaped like a real one (a process of a replica group whose part of
        a step is shorter than the others' still runs a forward and backward, on nothing): one
        sample collated, every tensor in it cut to length 0. ``collate([])`` has no shape to give."""
        _seed_globals(_batch_seed(self.seed, key.start, 0))
        try:
            batch = self.collate_fn([self.dataset[0]]) if self.collate_fn is not None else default_collate([self.dataset[0]])
        except Exception as exc:
            raise _error(key.where, 0, None, f"an empty micro-batch is shaped like sample 0, which failed: {type(exc).__name__}: {exc}") from exc
        return _emptied(batch)


def _emptied(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_emptied(b) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_emptied(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _emptied(v) for k, v in batch.items()}
    return batch


class LoaderWorkerTraceback(Exception):
    """The traceback of an error in a loader worker process, as text: the cause of the
    :class:`SampleError` raised in the training process (printed before it)."""

    def __str__(self) -> str:
        return f"in the loader worker process:\n{self.args[0].rstrip()}"


def _error(where: Where, index: int | None, position: int | None, error: str) -> SampleError:
    member = f"member {where.member} of {where.members}, micro-batch {where.micro}"
    if index is not None:
        what = f"loading dataset[{index}] (stream position {position}) for step {where.step} ({member}) failed"
        hint = "; a sample that cannot be loaded is not skipped (that would break exactly-once): fix or remove it"
    else:
        what = f"collating micro-batch {where.micro} of step {where.step} ({member}) failed"
        hint = ""
    return SampleError(f"{what}: {error}{hint}", step=where.step, index=index, position=position)

