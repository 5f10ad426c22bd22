"""The input pipeline (issue 15): loader workers and prefetching deliver exactly the planned
samples, with per-position randomness, named errors, and no process left behind."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch

from unbroken.data.data_plan import DataPlan
from unbroken.errors import ConfigError, SampleError
from unbroken.data.loader import Loader, current_sample, sample_rng, sample_seed, sample_seed_for
from unbroken.worker.runtime import Job

torch.set_num_threads(1)

N, G, M = 37, 10, 3  # data set, global batch, micro-batch


@pytest.fixture(autouse=True)
def _no_unbroken_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("UNBROKEN_"):
            monkeypatch.delenv(name)


class Indexed(torch.utils.data.Dataset):
    """Sample i is (i, draws from every global generator): what was loaded, and its randomness."""

    def __init__(self, n: int = N, bad: int | None = None) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.bad:
            raise ValueError(f"record {i} is corrupt")
        draws = torch.tensor([torch.rand(()).item(), random.random(), float(np.random.rand())], dtype=torch.float64)
        return torch.tensor(i), draws


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pids, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(params=[0, 2], ids=["in-thread", "2-workers"])
def loader(request):
    made = []

    def make(dataset=None, total=8, **kwargs):
        kwargs.setdefault("num_workers", request.param)
        if kwargs["num_workers"]:
            kwargs.setdefault("prefetch", 2)
        plan = DataPlan(N, G, M, seed=5)
        result = Loader(dataset if dataset is not None else Indexed(), plan, **kwargs)
        result.start(total)
        made.append(result)
        return result

    yield make
    for result in made:
        pids = result.pids()
        result.close()
        assert _gone(pids)


# A failure-free run, then a member lost mid-step 3 (2 -> 3 members is a join, 3 -> 2 a loss),
# step 3 redone by the new generation, a redo of step 5 with the same share, and a jump back.
REQUESTS = [(s, 0, 2) for s in range(3)] + [(3, 0, 2, "half"), (3, 1, 3), (4, 1, 3), (5, 1, 3, "half"), (5, 1, 3), (6, 0, 1), (1, 2, 3)]


def _requests():
    for request in REQUESTS:
        step, member, members = request[:3]
        micro = DataPlan(N, G, M, seed=5).micro_batches(step, member, members)
        yield step, member, members, len(micro) // 2 if len(request) > 3 else len(micro)


def test_every_micro_batch_holds_exactly_the_planned_samples_whatever_was_prefetched(loader):
    made = loader()
    plan = made.plan
    for step, member, members, count in _requests():
        for k in range(count):
            indices, _ = made.get(step, member, members, k)
            expected = plan.indices(plan.micro_batches(step, member, members)[k])
            assert indices.tolist() == expected.tolist(), (step, member, members, k)


def test_prefetching_runs_ahead_across_steps_and_starts_again_only_when_the_share_changes():
    made = Loader(Indexed(), DataPlan(N, G, M, seed=5), num_workers=2, prefetch=2)
    made.start(8)
    try:
        for step in range(4):
            for k in range(len(made.plan.micro_batches(step, 1, 2))):
                made.get(step, 1, 2, k)
        assert made.resets == 1  # the first request only: every later one had been prepared
        made.get(4, 0, 3, 0)  # a new generation: what was prepared for the old share is dropped
        made.get(4, 0, 3, 1)
        assert made.resets == 2
        made.get(4, 0, 3, 0)  # the step redone with the same share: loaded again
        assert made.resets == 3
    finally:
        made.close()


def test_a_step_past_the_announced_total_is_still_loaded():
    made = Loader(Indexed(), DataPlan(N, G, M, seed=5), num_workers=2)
    made.start(2)
    try:
        indices, _ = made.get(5, 0, 1, 1)
    finally:
        made.close()
    assert indices.tolist() == made.plan.indices(made.plan.micro_batches(5, 0, 1)[1]).tolist()


def _draws_by_position(made: Loader, shares) -> dict[int, list[float]]:
    """Stream position -> the random draws its sample saw, over the given (step, member, members)."""
    plan, seen = made.plan, {}
    for step, member, members in shares:
        for k, positions in enumerate(plan.micro_batches(step, member, members)):
            _, draws = made.get(step, member, members, k)
            for position, row in zip(positions, draws.tolist()):
                seen[position] = row
    return seen


def test_augmentations_depend_only_on_the_stream_position_not_on_members_workers_or_redos(loader):
    alone = _draws_by_position(loader(), [(s, 0, 1) for s in range(4)])
    shared = _draws_by_position(loader(), [(s, i, 3) for s in range(4) for i in range(3)])
    redone = _draws_by_position(loader(), [(2, 1, 2), (0, 0, 2), (2, 1, 2), (1, 1, 2), (2, 1, 2)])
    assert shared == alone
    assert all(redone[p] == alone[p] for p in redone)
    with_workers = _draws_by_position(loader(num_workers=2), [(s, 0, 1) for s in range(4)])
    assert with_workers == alone
    assert len({tuple(v) for v in alone.values()}) == len(alone)  # positions differ, even of one index


def test_loading_in_the_training_thread_leaves_the_trainings_random_streams_alone():
    made = Loader(Indexed(), DataPlan(N, G, M, seed=5))
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = [(torch.rand(()).item(), random.random(), np.random.rand()) for _ in range(3)]
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    got = []
    for k in range(3):
        made.get(0, 0, 1, k)
        got.append((torch.rand(()).item(), random.random(), np.random.rand()))
    assert got == expected


class Explicit(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        info = current_sample()
        assert info.index == i and info.seed == sample_seed() == sample_seed_for(5, info.position)
        return torch.tensor([info.position, info.step]), torch.rand(2, generator=sample_rng())


def test_a_data_set_can_ask_for_its_sample_and_a_generator_seeded_for_it(loader):
    made = loader(Explicit())
    positions, draws = made.get(2, 1, 2, 0)
    assert positions[:, 1].tolist() == [2] * len(positions)
    assert positions[:, 0].tolist() == list(made.plan.micro_batches(2, 1, 2)[0])
    again = torch.stack([torch.rand(2, generator=torch.Generator().manual_seed(sample_seed_for(5, int(p)))) for p in positions[:, 0]])
    assert torch.equal(draws, again)
    with pytest.raises(RuntimeError, match="no sample is being loaded"):
        current_sample()


def test_a_sample_that_raises_names_its_index_stream_position_and_step(loader):
    plan = DataPlan(N, G, M, seed=5)
    bad_position = next(p for p in range(3 * G, 4 * G) if plan.indices(range(p, p + 1)).item() not in plan.indices(range(0, 3 * G)).tolist())
    bad = plan.indices(range(bad_position, bad_position + 1)).item()
    made = loader(Indexed(bad=bad))
    for step in range(3):  # prefetching step 3 meanwhile: its error waits for its micro-batch
        for k in range(len(plan.micro_batches(step, 0, 1))):
            made.get(step, 0, 1, k)
    with pytest.raises(SampleError) as caught:
        for k in range(len(plan.micro_batches(3, 0, 1))):
            made.get(3, 0, 1, k)
    error = caught.value
    assert (error.index, error.position, error.step) == (bad, bad_position, 3)
    message = str(error)
    assert f"dataset[{bad}]" in message and f"stream position {bad_position}" in message and "step 3" in message
    assert f"ValueError: record {bad} is corrupt" in message


def test_a_collate_function_that_raises_names_the_micro_batch_and_step(loader):
    def collate(items):
        raise TypeError("cannot stack these")

    made = loader(collate_fn=collate)
    with pytest.raises(SampleError, match=r"collating micro-batch 1 of step 2 \(member 0 of 2.*TypeError: cannot stack these"):
        made.get(2, 0, 2, 1)


def _worker_info(_worker_id):
    # what a worker_init_fn sees, handed back through the environment of the worker
    os.environ["TEST_LOADER_INIT"] = f"{_worker_id}:{torch.get_num_threads()}"


class Environment(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.tensor([os.getpid(), int(os.environ.get("TEST_LOADER_INIT", "-1:0").split(":")[1]), torch.get_num_threads()])


def test_loader_workers_run_the_init_function_with_one_torch_thread():
    made = Loader(Environment(), DataPlan(N, G, M), num_workers=2, worker_init_fn=_worker_info)
    made.start(4)
    try:
        rows = torch.cat([made.get(s, 0, 1, k) for s in range(2) for k in range(4)])
        pids = made.pids()
    finally:
        made.close()
    assert set(rows[:, 0].tolist()) == set(pids) and len(pids) == 2  # loaded by the workers
    assert set(rows[:, 1].tolist()) == {1} and set(rows[:, 2].tolist()) == {1}


def _job(dataset=None, **kwargs) -> Job:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    return Job(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset if dataset is not None else Noisy(), global_batch_size=G, micro_batch_size=M, seed=2, **kwargs)


class Noisy(torch.utils.data.Dataset):
    """A regression sample plus an augmentation drawn from the global generator."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(N, 3, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        x = self.x[i] + 0.1 * torch.randn(3, dtype=torch.float64)
        return x, x.sum(0, keepdim=True)


def _train(job: Job, total: int):
    for step in job.steps(total=total):
        for x, y in step.micro_batches():
            step.backward(torch.nn.functional.mse_loss(job.model(x), y))
        step.commit()
    return job.model.weight.detach().clone()


def test_a_job_with_loader_workers_trains_the_same_model_as_without_and_stops_them_at_the_end():
    job = _job(num_workers=2, prefetch=3)
    pids = []
    for step in job.steps(total=6):
        pids = pids or job._loader.pids()
        for x, y in step.micro_batches():
            step.backward(torch.nn.functional.mse_loss(job.model(x), y))
        step.commit()
    assert len(pids) == 2 and _gone(pids, timeout=0.1)  # stopped as the loop ended, not later
    assert torch.equal(job.model.weight.detach(), _train(_job(), 6))


def test_loader_workers_stop_when_the_loop_is_left_by_an_exception():
    job = _job(num_workers=2)
    with pytest.raises(KeyError):
        for step in job.steps(total=6):
            pids = job._loader.pids()
            next(iter(step.micro_batches()))
            raise KeyError("the script's own bug")
    # the loop's generator is dropped with the loop, which closes it: its finally stops the workers
    assert len(pids) == 2 and _gone(pids, timeout=0.1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_workers": -1}, "num_workers must be a non-negative integer"),
        ({"num_workers": 1.5}, "num_workers must be a non-negative integer"),
        ({"num_workers": 2, "prefetch": 0}, "prefetch must be a positive integer"),
        ({"prefetch": 2}, "prefetch needs num_workers > 0"),
        ({"num_workers": 2, "worker_init_fn": 3}, "worker_init_fn must be callable"),
        ({"worker_init_fn": print}, "worker_init_fn needs num_workers > 0"),
    ],
)
def test_bad_loader_settings_are_config_errors_naming_them(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        _job(**kwargs)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(10))


class SizedStream(Stream):
    def __len__(self) -> int:
        return 10


@pytest.mark.parametrize("dataset", [Stream(), SizedStream()], ids=["iterable", "iterable-with-len"])
def test_an_iterable_dataset_is_refused_at_construction_saying_what_to_do(dataset):
    with pytest.raises(ConfigError) as caught:
        _job(dataset=dataset)
    message = str(caught.value)
    assert "IterableDataset" in message and "map-style" in message and "(shard, offset)" in message


@pytest.mark.parametrize("workers", [0, 2], ids=["in-thread", "2-workers"])
def test_a_replica_group_process_with_a_short_or_empty_part_gets_empty_batches_shaped_like_real_ones(workers):
    from unbroken.replica_groups.sharding import ProcessPlan

    # G=5, micro-batch 1, 2 groups of 2: group 0 has 3 samples, parts 2 and 1 (the second padded with an empty one);
    # with 3 groups of 2, group 2's share is 1 sample and its process 1 has nothing at all
    for groups, group, process in [(2, 0, 1), (3, 2, 1)]:
        plan = ProcessPlan(N, 5, 1, 5, group_size=2, process=process)
        made = Loader(Indexed(), plan, num_workers=workers, prefetch=2 if workers else None)
        made.start(4)
        try:
            for step in range(3):
                parts = plan.micro_batches(step, group, groups)
                for micro, positions in enumerate(parts):
                    index, draws = made.get(step, group, groups, micro)
                    assert index.tolist() == plan.indices(positions).tolist()
                    assert draws.shape == (len(positions), 3) and draws.dtype == torch.float64
                assert any(len(p) == 0 for p in parts)  # at least one empty micro-batch was asked for
        finally:
            pids = made.pids()
            made.close()
            assert _gone(pids)


class _Windows(torch.utils.data.Dataset):
    """nanoGPT's random windows as a map-style data set (docs/guide/input-pipelines.md)."""

    def __init__(self, data: torch.Tensor, block_size: int, windows: int) -> None:
        self.data, self.block_size, self.n = data, block_size, windows

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        start = int(torch.randint(len(self.data) - self.block_size, (1,), generator=sample_rng()))
        chunk = self.data[start:start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def test_random_windows_drawn_per_position_are_the_same_whoever_draws_them():
    """The torch.randint pattern made exactly once: one window per stream position, from its seed,
    the same for any split into members and micro-batches and whatever the global RNG holds."""
    data = torch.arange(1000)
    dataset = _Windows(data, block_size=8, windows=50)

    def windows(members: int, micro: int) -> list[list[int]]:
        cut = DataPlan(len(dataset), 12, micro, seed=5)
        loader = Loader(dataset, cut)
        got = []
        try:
            loader.start(3)
            for step in range(3):
                for rank in range(members):
                    for m in range(len(cut.micro_batches(step, rank, members))):
                        torch.manual_seed(1000 * step + rank)  # the global generator must not matter
                        xb, _ = loader.get(step, rank, members, m)
                        got += [int(row[0]) for row in xb]
        finally:
            loader.close()
        return got

    one = windows(1, 12)
    assert one == windows(3, 2) == windows(4, 3)
    assert len(one) == 36 and len(set(one)) > 30  # random starts, not one window again and again


GARBAGE_BEFORE_FORK = """
import datetime, gc, sys, torch, torch.distributed as dist
from unbroken.worker.runtime import Job
torch.set_num_threads(1)

class Cycle:  # an earlier job's process group and store, unreachable but not yet collected
    pass

gc.disable()  # no automatic collection in this process before the fork: where it happens is luck
store = dist.TCPStore("127.0.0.1", 0, 1, True)
cycle = Cycle()
cycle.group, cycle.store, cycle.me = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=10)), store, cycle
del cycle, store

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 24
    def __getitem__(self, i):
        gc.collect()  # in the loader worker, as an allocation-heavy __getitem__ makes it run
        return torch.full((2,), float(i)), torch.ones(1)

model = torch.nn.Linear(2, 1)
job = Job(model, torch.optim.SGD(model.parameters(), lr=0.01), Data(), global_batch_size=8, micro_batch_size=4, num_workers=2)
for step in job.steps(total=3):
    for x, y in step.micro_batches():
        step.backward(torch.nn.functional.mse_loss(model(x), y))
    step.commit()
print("trained", job.next_step)
"""


def test_loader_workers_forked_beside_uncollected_distributed_objects_neither_hang_nor_abort(tmp_path):
    """A fresh process (what it leaves behind cannot reach other tests): garbage that holds a Gloo
    group is collected before the fork, not in a worker, where its destructor hung (or aborted
    with "terminate called after throwing an instance of 'std::system_error'")."""
    import subprocess
    import sys

    script = tmp_path / "garbage_before_fork.py"
    script.write_text(GARBAGE_BEFORE_FORK)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        pytest.fail("the loader workers hung")
    assert proc.returncode == 0 and "trained 3" in out, err[-2000:]
