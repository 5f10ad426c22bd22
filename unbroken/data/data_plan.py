"""The data plan: which sample indices a member processes in a step.

The global batch of step ``s`` is the positions ``[s*G, (s+1)*G)`` of an endless stream made of
one seeded permutation of the data set per epoch. The member at index ``i`` of ``n`` takes a
contiguous share of that batch (share sizes differ by at most one) and splits it into
micro-batches no larger than the configured size. Everything here is a pure function of
``(seed, step, member index, member count)``, so any member, in any generation, computes the
same plan and a redone step processes exactly the samples of the failed attempt.

A :class:`Split` replaces the member count when the members' shares are not equal (a slow member
given fewer micro-batches, :mod:`unbroken.data.balance`): the shares are then the split's sizes,
in member order, still a partition of the global batch, so the samples and their order do not
change, only who computes which.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from unbroken.errors import ConfigError


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Split:
    """Unequal shares of a global batch: ``sizes[i]`` samples for the member at index ``i``."""

    sizes: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.sizes)

    def __str__(self) -> str:
        return f"{len(self.sizes)} (shares {'/'.join(map(str, self.sizes))})"

    def digest(self) -> int:
        """A number below 2**40 that names these sizes: members compare it to agree on a split."""
        value = 1469598103934665603
        for size in self.sizes:
            value = ((value ^ size) * 1099511628211) & 0xFFFF_FFFF_FFFF_FFFF
        return (value >> 24) or 1


@dataclass(frozen=True)
class DataPlan:
    """The sample stream of one job: data set length, global batch size, micro-batch size, seed."""

    dataset_len: int
    global_batch_size: int
    micro_batch_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        _positive_int("dataset length", self.dataset_len)
        _positive_int("global_batch_size", self.global_batch_size)
        _positive_int("micro_batch_size", self.micro_batch_size)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")

    def share(self, step: int, index: int, count: "int | Split") -> range:
        """Stream positions of ``step`` that member ``index`` of ``count`` processes (equal
        shares), or of a :class:`Split`'s ``len`` members (the split's shares)."""
        members = len(count) if isinstance(count, Split) else count
        if members <= 0 or not 0 <= index < members:
            raise ValueError(f"member index {index} is not in a generation of {count}")
        g = self.global_batch_size
        if isinstance(count, Split):
            if sum(count.sizes) != g or min(count.sizes) < 0:
                raise ValueError(f"the split {count} is not a partition of the global batch of {g}")
            start = sum(count.sizes[:index])
            return range(step * g + start, step * g + start + count.sizes[index])
        base, extra = divmod(g, count)
        start = index * base + min(index, extra)
        size = base + (1 if index < extra else 0)
        first = step * g
        return range(first + start, first + start + size)

    def micro_batches(self, step: int, index: int, count: "int | Split") -> list[range]:
        """The member's share of ``step`` cut into micro-batches of at most the configured size."""
        share = self.share(step, index, count)
        m = self.micro_batch_size
        return [share[i : i + m] for i in range(0, len(share), m)]

    def indices(self, positions: range) -> torch.Tensor:
        """Data set indices of consecutive stream positions (they may span epochs)."""
        n = self.dataset_len
        parts = []
        pos = positions.start
        while pos < positions.stop:
            epoch, offset = divmod(pos, n)
            take = min(positions.stop - pos, n - offset)
            parts.append(_permutation(self.seed, epoch, n)[offset : offset + take])
            pos += take
        if not parts:
            return torch.empty(0, dtype=torch.long)
        # cat copies; a lone slice is cloned so that callers never share the cached permutation
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randperm(n, generator=generator)
