"""Which stream positions a member trains on: the one rule every system's script and the analysis share."""


def share(step: int, rank: int, world: int, global_batch: int) -> tuple[int, int]:
    """Stream positions [a, b) of ``step`` for member ``rank`` of ``world``: contiguous shares."""
    base, extra = divmod(global_batch, world)
    start = step * global_batch + rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
