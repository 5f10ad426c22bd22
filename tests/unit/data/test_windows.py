"""unbroken.RandomWindows (nanoGPT's get_batch, exactly once) and unbroken.ScriptState."""

import pytest
import torch

import unbroken
from unbroken.errors import ConfigError


def _windows_of_each_step(micro_batch_size: int) -> list[torch.Tensor]:
    data = torch.arange(1000)
    windows = unbroken.RandomWindows(data, block_size=8, length=64)
    model = torch.nn.Embedding(1000, 1)
    job = unbroken.Job(model, torch.optim.SGD(model.parameters(), lr=0.0), windows, global_batch_size=8,
                       micro_batch_size=micro_batch_size, seed=3)
    seen = []
    for step in job.steps(total=4):
        xs = []
        for x, y in step.micro_batches():
            assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)  # y is x shifted by one token
            xs.append(x)
            step.backward(model(x).sum() * 0)
        step.commit()
        seen.append(torch.cat(xs))
    return seen


def test_each_samples_window_depends_on_its_stream_position_only():
    whole, split = _windows_of_each_step(8), _windows_of_each_step(3)
    assert all(torch.equal(a, b) for a, b in zip(whole, split))  # micro-batches of 8, or of 3, 3 and 2: the same windows
    starts = torch.cat([w[:, 0] for w in whole])
    assert len(set(starts.tolist())) > 20  # random starts, not one window over and over


def test_random_windows_refuse_bad_arguments_with_what_to_do():
    with pytest.raises(ConfigError, match="block_size must be a positive integer"):
        unbroken.RandomWindows(torch.arange(100), block_size=0, length=4)
    with pytest.raises(ConfigError, match=r"length must be a positive integer .*steps \* global_batch_size"):
        unbroken.RandomWindows(torch.arange(100), block_size=4, length=0)
    with pytest.raises(ConfigError, match="fewer than one window"):
        unbroken.RandomWindows(torch.arange(5), block_size=4, length=4)


def test_script_state_round_trips_through_its_state_dict():
    progress = unbroken.ScriptState(best=float("inf"), bad=0)
    progress.bad += 2
    restored = unbroken.ScriptState()
    restored.load_state_dict(progress.state_dict())
    assert (restored.best, restored.bad) == (float("inf"), 2) and "bad=2" in repr(restored)
