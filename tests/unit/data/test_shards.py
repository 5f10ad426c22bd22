"""Data sets larger than memory (issue 15): records in memory-mapped shard files, and a plain numpy
memmap, as map-style data sets that loader workers read."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from unbroken.errors import ConfigError
from unbroken.worker.runtime import Job
from unbroken.data.shards import ShardedArrays

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[3]
LENGTHS = [7, 1, 12, 5]  # shards of different sizes, one with a single record


@pytest.fixture(autouse=True)
def _no_unbroken_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("UNBROKEN_"):
            monkeypatch.delenv(name)


@pytest.fixture
def shards(tmp_path):
    """Shard files of rows [i, i*0.5, -i] for the global record number i, and all rows together."""
    paths, start = [], 0
    for k, n in enumerate(LENGTHS):
        rows = np.stack([np.arange(start, start + n), np.arange(start, start + n) * 0.5, -np.arange(start, start + n)], axis=1)
        path = tmp_path / f"shard-{k}.npy"
        np.save(path, rows.astype(np.float64))
        paths.append(path)
        start += n
    return paths


def test_index_maps_to_shard_and_offset_across_every_shard_boundary(shards):
    data = ShardedArrays(shards)
    assert len(data) == sum(LENGTHS)
    assert [data.locate(i) for i in (0, 6, 7, 8, 19, 20, 24)] == [(0, 0), (0, 6), (1, 0), (2, 0), (2, 11), (3, 0), (3, 4)]
    assert [data[i][0].item() for i in range(len(data))] == list(range(len(data)))
    with pytest.raises(IndexError, match="out of range"):
        data[len(data)]


def test_shards_are_memory_mapped_lazily_and_pickled_without_their_maps(shards):
    data = ShardedArrays(shards)
    assert data._maps == {}  # the constructor reads the headers only
    data[8]
    assert list(data._maps) == [2] and isinstance(data._maps[2], np.memmap)
    copy = pickle.loads(pickle.dumps(data))  # what a spawned loader worker gets
    assert copy._maps == {} and copy[8].tolist() == data[8].tolist()


def test_shards_that_disagree_or_are_not_arrays_are_config_errors(tmp_path, shards):
    np.save(tmp_path / "wide.npy", np.zeros((3, 4)))
    with pytest.raises(ConfigError, match="wide.npy holds records of float64 \\(4,\\)"):
        ShardedArrays([*shards, tmp_path / "wide.npy"])
    (tmp_path / "text.npy").write_text("not an array")
    with pytest.raises(ConfigError, match="text.npy is not a readable .npy array"):
        ShardedArrays([tmp_path / "text.npy"])
    with pytest.raises(ConfigError, match="at least one shard"):
        ShardedArrays([])


class Memmap(torch.utils.data.Dataset):
    """The plainest large data set: fixed-size records in one raw file, through numpy.memmap."""

    def __init__(self, path: str, records: int, width: int) -> None:
        self.path, self.shape = path, (records, width)
        self._map = None

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int):
        if self._map is None:  # opened in the process that reads (a loader worker)
            self._map = np.memmap(self.path, dtype=np.float32, mode="r", shape=self.shape)
        row = torch.from_numpy(np.array(self._map[i], dtype=np.float64))
        row = row + 0.01 * torch.randn(row.shape, dtype=torch.float64)  # an augmentation
        return row[:-1], row[-1:]


def _train(dataset, num_workers: int, steps: int = 5) -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    job = Job(model, torch.optim.SGD(model.parameters(), lr=0.05), dataset, global_batch_size=8, micro_batch_size=3, seed=1, num_workers=num_workers)
    for step in job.steps(total=steps):
        for x, y in step.micro_batches():
            step.backward(torch.nn.functional.mse_loss(model(x), y))
        step.commit()
    return model.weight.detach().clone()


def test_a_job_over_shards_or_a_memmap_trains_the_same_model_with_loader_workers_as_without(tmp_path, shards):
    rows = np.random.default_rng(0).standard_normal((30, 4)).astype(np.float32)
    rows.tofile(tmp_path / "records.bin")
    memmap = Memmap(str(tmp_path / "records.bin"), 30, 4)
    assert torch.equal(_train(memmap, 2), _train(memmap, 0))

    def two_features(r):
        return torch.from_numpy(np.array(r[:3])), torch.from_numpy(np.array(r[2:]))

    sharded = ShardedArrays(shards, transform=two_features)
    assert torch.equal(_train(sharded, 2), _train(sharded, 0))


def test_the_sharded_example_trains_in_a_single_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_shards.py"), "--data", str(tmp_path / "data"), "--shards", "3",
         "--records-per-shard", "200", "--steps", "3", "--log-every", "1"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2  loss" in proc.stdout and "600 records in 3 shards" in proc.stdout
    assert sorted(os.listdir(tmp_path / "data")) == [f"tokens-{k:05d}.npy" for k in range(3)]
