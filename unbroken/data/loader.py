"""The input pipeline: each member's micro-batches, loaded ahead by DataLoader worker processes.

The data plan (:mod:`unbroken.data.data_plan`) says which stream positions, hence which data set
indices, member ``i`` of ``n`` processes in each micro-batch of each step. A :class:`Loader`
turns those into batches. With ``num_workers=0`` it loads each micro-batch in the training
thread when it is asked for. With ``num_workers=k`` it keeps one persistent
:class:`torch.utils.data.DataLoader` whose batch sampler is the plan itself: starting from the
micro-batch asked for, it hands the next micro-batches of this member's share, step after step,
to ``k`` worker processes, ``prefetch`` of them per worker in flight, so that the batches of the
next steps are built while this one trains.

Each request names its micro-batch (step, member index, member count, micro-batch). If it is the
one the loader prepared next, it is returned; if not (the generation changed, so the share did;
a failed step is redone; the job resumed elsewhere), everything prepared is dropped and the
loader starts again at the micro-batch asked for. Dropping is cheap: a worker skips a key whose
version is not the current one without loading anything. So a member always processes exactly
the positions the plan gives its share, whatever was prefetched.

Randomness: while a sample is loaded, torch's default CPU generator, Python's ``random`` and
numpy's global generator are seeded from (job seed, stream position) (:func:`sample_seed_for`),
in a worker process as in the training thread (whose generators are put back afterwards). An
augmentation drawn from them depends only on the sample's position: a redone step sees the same
augmentations, and a run gives the same batches whatever the member count and ``num_workers``.
:func:`sample_rng` and :func:`sample_seed` give a dedicated generator or seed for the same
(all in :mod:`unbroken.data.sample_randomness`, and offered here too).

A sample whose ``__getitem__`` raises is not retried: the request for its micro-batch raises
:class:`~unbroken.errors.SampleError` naming the data set index, the stream position and the step.
An error met while prefetching is kept until its micro-batch is asked for.

Worker processes are forked once (before the runtime starts any thread), run with one torch
thread each, die with their parent (Linux's parent-death signal) and are shut down by
:meth:`Loader.close` when the job's loop ends, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import collections
import functools
import gc
import multiprocessing
import os
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from unbroken.data.data_plan import DataPlan
from unbroken.data.planned_samples import Key, LoaderWorkerTraceback, PlannedSamples, Where, _error, _identity
from unbroken.data.sample_randomness import (  # the per-sample names, offered here as before
    SampleInfo,
    _rng_state,
    _set_rng_state,
    current_sample,
    sample_rng,
    sample_seed,
    sample_seed_for,
)
from unbroken.errors import ConfigError
from unbroken.parent_death import die_with

__all__ = ["Loader", "SampleInfo", "check_dataset", "current_sample", "sample_rng", "sample_seed", "sample_seed_for"]


# -- the loader ------------------------------------------------------------------------------------


def check_dataset(dataset: Any) -> int:
    """The length of a map-style data set; a :class:`ConfigError` saying what to do otherwise."""
    if isinstance(dataset, IterableDataset):
        raise ConfigError(
            f"dataset must support len() and indexing (a map-style torch Dataset), got {type(dataset).__name__}, an"
            " IterableDataset, which has no random access. The data plan fixes which sample every member processes"
            " at every stream position, so that a step redone by other members reads the same samples: wrap the data"
            " in a map-style Dataset (len() and dataset[i] for 0 <= i < len); for shards on disk, compute (shard,"
            " offset) from the index (unbroken.data.shards.ShardedArrays; see docs/guide/input-pipelines.md)"
        )
    getitem = getattr(type(dataset), "__getitem__", None)
    if not hasattr(dataset, "__len__") or getitem is None or getitem is Dataset.__getitem__:
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


def _init_worker(parent: int, user_init: Callable[[int], None] | None, worker_id: int) -> None:
    torch.set_num_threads(1)  # k workers next to the training process: no thread pools fighting
    die_with(parent)
    if user_init is not None:
        user_init(worker_id)


class _Schedule:
    """The DataLoader's batch sampler: the loader's keys from its cursor on (read at each reset)."""

    def __init__(self, loader: "Loader") -> None:
        self._loader = loader

    def __iter__(self) -> Iterator[Key]:
        return self._loader._keys()


def _non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
    return value


class Loader:
    """The micro-batches of a member's shares, from the data set, in order or prefetched.

    Args:
        dataset: a map-style data set.
        plan: the job's data plan.
        num_workers: loader worker processes (0: load in the training thread, no prefetching).
        prefetch: micro-batches in flight per worker (default 2, DataLoader's ``prefetch_factor``);
            only with ``num_workers > 0``.
        pin_memory: put batches in page-locked memory (for a fast copy to a GPU).
        collate_fn: turns a list of samples into a batch (default ``default_collate``).
        worker_init_fn: called with the worker id in each loader worker once it started (open
            files or connections there); randomness is seeded per sample, not here.

    Raises:
        ConfigError: a setting is invalid.
    """

    def __init__(
        self,
        dataset: Any,
        plan: DataPlan,
        *,
        num_workers: int = 0,
        prefetch: int | None = None,
        pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
    ) -> None:
        self.num_workers = _non_negative_int("num_workers", num_workers)
        if prefetch is not None:
            if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
                raise ConfigError(f"prefetch must be a positive integer (micro-batches in flight per loader worker), got {prefetch!r}")
            if num_workers == 0:
                raise ConfigError("prefetch needs num_workers > 0: without loader workers, batches are built when they are asked for")
        for name, fn in (("collate_fn", collate_fn), ("worker_init_fn", worker_init_fn)):
            if fn is not None and not callable(fn):
                raise ConfigError(f"{name} must be callable, got {fn!r}")
        if worker_init_fn is not None and num_workers == 0:
            raise ConfigError("worker_init_fn needs num_workers > 0: there are no loader workers to initialise")
        self.prefetch = prefetch if prefetch is not None else 2
        self.pin_memory = bool(pin_memory)
        self.plan = plan
        self.samples = PlannedSamples(dataset, plan.seed, collate_fn)
        self.total: int | None = None
        self.resets = 0
        """How many times prepared batches were dropped to start again elsewhere."""
        self._worker_init_fn = worker_init_fn
        self._loader: DataLoader | None = None
        self._iterator: Any = None
        self._cursor: Where | None = None
        self._version = 0
        self._expected: collections.deque[Where] = collections.deque()

    # -- life ----------------------------------------------------------------------------------

    def start(self, total: int | None) -> None:
        """Prepare micro-batches of steps below ``total`` (None: no end). With workers, start
        them now, idle until the first request; calling it again only moves ``total``."""
        self.total = total
        if self.num_workers == 0 or self._iterator is not None:
            return
        self.samples.version = multiprocessing.RawValue("q", 0)
        self._version, self._cursor = 0, None
        self._expected.clear()
        self._loader = DataLoader(
            self.samples,
            batch_sampler=_Schedule(self),
            num_workers=self.num_workers,
            collate_fn=_identity,
            pin_memory=self.pin_memory,
            worker_init_fn=functools.partial(_init_worker, os.getpid(), self._worker_init_fn),
            prefetch_factor=self.prefetch,
            persistent_workers=True,
            # the workers' base seed is drawn from this, not from the training's global generator
            generator=torch.Generator().manual_seed(self.plan.seed),
        )
        # Garbage first: a cycle that still holds a process group or a store (a notebook's or a
        # test's earlier job) would be collected in a forked worker, whose C++ destructor then
        # joins threads that do not exist there: the worker hangs or aborts ("std::system_error").
        gc.collect()
        self._iterator = iter(self._loader)  # forks the workers; nothing to load yet
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the worker processes (waiting for them) and drop what they prepared; idempotent."""
        iterator, self._iterator, self._loader = self._iterator, None, None
        self._expected.clear()
        if iterator is not None:
            atexit.unregister(self.close)
            iterator._shutdown_workers()

    def pids(self) -> list[int]:
        """Process ids of the loader workers (none before :meth:`start` or after :meth:`close`)."""
        return [w.pid for w in self._iterator._workers] if self._iterator is not None else []

    # -- batches -------------------------------------------------------------------------------

    def get(self, step: int, member: int, members: int, micro: int) -> Any:
        """Micro-batch ``micro`` of member ``member`` of ``members``'s share of ``step``.

        Raises:
            SampleError: a sample of it could not be loaded, or the batch not collated.
        """
        where = Where(step, member, members, micro)
        if self.num_workers == 0:
            return self._load_here(where)
        if self._iterator is None:
            self.start(self.total)
        if not self._expected or self._expected[0] != where:
            self._restart(where)
        self._expected.popleft()
        delivery = next(self._iterator)
        assert delivery.where == where, f"the loader delivered {delivery.where} for {where}"
        if delivery.failure is not None:
            f = delivery.failure
            # the worker's traceback is printed first, the error naming the sample last
            raise _error(where, f.index, f.position, f.error) from LoaderWorkerTraceback(f.details)
        return delivery.batch

    def _key(self, where: Where, version: int) -> Key:
        positions = self.plan.micro_batches(where.step, where.member, where.members)[where.micro]
        return Key(version, where, positions.start, tuple(self.plan.indices(positions).tolist()))

    def _load_here(self, where: Where) -> Any:
        key = self._key(where, 0)
        if self.samples.collate_fn is None and isinstance(self.samples.dataset, TensorDataset):
            return self.samples.load(key, here=True).batch
        state = _rng_state()  # the training's own streams (dropout) must not see the loading
        try:
            batch = self.samples.load(key, here=True).batch
        finally:
            _set_rng_state(state)
        if self.pin_memory and torch.cuda.is_available():
            from torch.utils.data._utils.pin_memory import pin_memory

            batch = pin_memory(batch)
        return batch

    def _restart(self, where: Where) -> None:
        """Drop every prepared micro-batch and prepare from ``where`` on."""
        self._version += 1
        self.samples.version.value = self._version  # workers skip the old keys still queued
        self._expected.clear()
        self._cursor = where
        self.resets += 1
        self._iterator = iter(self._loader)  # persistent workers: waits for the skipped keys

    def _keys(self) -> Iterator[Key]:
        """The keys from the cursor on: the rest of its step's share, then the next steps'."""
        if self._cursor is None:
            return
        version, (step, member, members, micro) = self._version, self._cursor
        if not self.plan.micro_batches(step, member, members):
            return  # an empty share has no micro-batches at any step (a replica group's process has empty ones)
        end = None if self.total is None else max(self.total, step + 1)  # the step asked for, at least
        while end is None or step < end:
            parts = self.plan.micro_batches(step, member, members)
            for k in range(micro, len(parts)):
                key = self._key(Where(step, member, members, k), version)
                self._expected.append(key.where)
                yield key
            step, micro = step + 1, 0
