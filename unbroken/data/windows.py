"""Random windows of a token array, drawn exactly once: nanoGPT's ``get_batch`` as a data set.

A language model's script often draws its batches itself: ``ix = torch.randint(len(data) -
block, (batch,))`` and one window per index. Those draws belong to no sample, so a step redone
after a failure draws others, and members draw on their own. :class:`RandomWindows` is the same
draw per sample: sample ``i`` of the stream takes its window's start from a generator seeded by
its stream position (:func:`unbroken.sample_rng`), so every window is drawn exactly once, the same
whatever the member count and however often a step is redone. Uniform with replacement, as
``torch.randint`` draws them; in a single process the same windows come in the same order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from unbroken.errors import ConfigError
from unbroken.data.sample_randomness import sample_rng


class RandomWindows(torch.utils.data.Dataset):
    """``length`` samples, each a random window of ``block_size + 1`` tokens of ``data`` split
    into ``(x, y)``: the tokens and the next tokens (int64 tensors).

    Args:
        data: a 1-D array of tokens (a ``numpy.memmap`` of the corpus, a tensor, a list).
        block_size: tokens per window (the model's context).
        length: samples in the data set; the job's ``steps * global_batch_size`` draws each once.
    """

    def __init__(self, data: Any, block_size: int, length: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ConfigError(f"length must be a positive integer number of samples, got {length!r} (steps * global_batch_size)")
        if len(data) < block_size + 2:
            raise ConfigError(f"the data holds {len(data)} tokens, fewer than one window of block_size + 1 = {block_size + 1} and one more")
        self.data, self.block_size, self.length = data, block_size, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(torch.randint(len(self.data) - self.block_size - 1, (1,), generator=sample_rng()))
        window = self.data[start : start + self.block_size + 1]
        tokens = torch.from_numpy(np.asarray(window, dtype=np.int64)) if not isinstance(window, torch.Tensor) else window.long()
        return tokens[:-1], tokens[1:]
