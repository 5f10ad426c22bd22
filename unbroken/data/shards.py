"""Data sets larger than memory: records in shard files, read through memory maps.

:class:`ShardedArrays` is a map-style data set over several ``.npy`` files whose first axis is the
records (tokenised text cut into fixed-length sequences, pre-decoded images, feature rows). Data set
index ``i`` is found by a binary search over the shards' cumulative lengths, giving
``(shard, offset)``; the record is read from that shard's memory map, so only the pages of the
records a member processes are read from disk, and the operating system's page cache is shared
by every process of the machine.

Together with the data plan this is random access by stream position: position ``p`` of step
``s`` is data set index ``plan.indices(range(p, p + 1))``, which is ``(shard, offset)``. Each
process maps a shard the first time it reads from it: a loader worker (forked or spawned) opens
its own maps, and pickling the data set carries only the file names.
"""

from __future__ import annotations

import bisect
import os
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from unbroken.errors import ConfigError


class ShardedArrays(Dataset):
    """Records of several ``.npy`` shard files as one map-style data set.

    Args:
        paths: the shard files, in order; each holds an array whose first axis is its records.
            Every shard has the same dtype and record shape.
        transform: turns a record (a read-only numpy array) into a sample; default: a torch
            tensor copy of it.

    Raises:
        ConfigError: no shards, a file that is not a readable ``.npy`` array, or shards that
            disagree on dtype or record shape.
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], transform: Callable[[np.ndarray], Any] | None = None) -> None:
        self.paths = [os.fspath(p) for p in paths]
        if not self.paths:
            raise ConfigError("ShardedArrays needs at least one shard file")
        self.transform = transform
        lengths, layout = [], None
        for path in self.paths:
            try:
                array = np.load(path, mmap_mode="r")  # reads the header only
            except (OSError, ValueError) as exc:
                raise ConfigError(f"shard {path} is not a readable .npy array: {exc}") from None
            if array.ndim == 0:
                raise ConfigError(f"shard {path} holds a scalar; its first axis must be the records")
            if layout is None:
                layout = (array.dtype, array.shape[1:])
            elif (array.dtype, array.shape[1:]) != layout:
                raise ConfigError(
                    f"shard {path} holds records of {array.dtype} {array.shape[1:]}, the first shard {layout[0]} {layout[1]}"
                )
            lengths.append(array.shape[0])
            del array
        self.starts = [0]
        for n in lengths:
            self.starts.append(self.starts[-1] + n)
        self._maps: dict[int, np.ndarray] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, index: int) -> tuple[int, int]:
        """``(shard, offset)`` of data set index ``index``.

        Raises:
            IndexError: ``index`` is not in ``[0, len)``.
        """
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} records")
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    def __getitem__(self, index: int) -> Any:
        shard, offset = self.locate(int(index))
        record = self._map(shard)[offset]
        if self.transform is not None:
            return self.transform(record)
        return torch.from_numpy(np.array(record))  # a copy: the map stays read-only

    def _map(self, shard: int) -> np.ndarray:
        if self._pid != os.getpid():  # a forked loader worker maps the files for itself
            self._maps, self._pid = {}, os.getpid()
        array = self._maps.get(shard)
        if array is None:
            array = self._maps[shard] = np.load(self.paths[shard], mmap_mode="r")
        return array

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_maps"] = {}
        return state
