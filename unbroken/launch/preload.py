"""What the zygote loads and settles before it forks: the work every worker would repeat.

Two costs each worker paid on its own before, measured with py-spy on this project's 2-core
machines (4 workers of ``testbed/scripts/train_exact.py``):

- ``torch.optim.Optimizer.__init__`` imports ``torch._dynamo`` on first use, 1.4 s of CPU in the
  first line of ``optimizer = AdamW(...)``: 90 % of a worker's start-up, 3 s of wall time before
  four workers could join. Imported once here, it is every worker's for free.
- the interpreter's last cyclic collection at exit walked all of torch's objects, 2 s of each
  worker's exit. After ``gc.collect(); gc.freeze()`` (what Python's documentation advises before a
  fork without exec) the inherited heap is out of the collector's sight: a worker's collections
  walk only what it made, and no page of the zygote is copied on write because the collector
  touched it.

Neither starts a thread or touches a device.
"""

from __future__ import annotations

import gc


def prepare_for_forking() -> None:
    """Everything the zygote does between importing torch and serving its first fork: import what
    a torch optimizer's constructor imports (a torch without it is not an error), then collect
    and freeze what survives."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - a build without it: the workers import what they need
        pass
    gc.collect()
    gc.freeze()
