"""The training state as one dict: what a heal, a catch-up and a checkpoint must be able to carry."""

from __future__ import annotations

import threading

import numpy
import pytest
import torch

from unbroken.errors import ConfigError
from unbroken.worker.job_state import check_sendable


def _state(**parts):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)  # its lambda is left out of its state_dict
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "extra": {"best": numpy.float64(0.5), "seen": numpy.arange(3), "names": ["a"]}, "scaler": None,
             "runtime": {"next_step": 1}}
    state.update(parts)
    return state


def test_a_state_of_plain_data_tensors_and_numpy_is_sendable():
    check_sendable(_state())


@pytest.mark.parametrize("part, value, named", [
    ("scheduler", {"last_epoch": 3, "step": lambda: None}, "the scheduler's state_dict"),
    ("extra", {"lock": threading.Lock()}, r"extra_state.state_dict\(\)"),
    ("extra", {"custom": ConfigError("a class outside the allow-list")}, r"extra_state.state_dict\(\)"),
])
def test_a_part_that_cannot_be_pickled_or_read_back_is_named_before_the_first_step(part, value, named):
    with pytest.raises(ConfigError, match=rf"{named} cannot be sent to a peer or written to a checkpoint .*add_safe_globals"):
        check_sendable(_state(**{part: value}))
