"""Train a small classifier on scikit-learn's digits (no download), surviving failed workers.

The example's code is in ``unbroken/launch/demo_train.py`` (shipped with the package, so that
``unbroken demo`` has it too); this file runs it::

    unbroken run --nproc-per-node 4 examples/train_digits.py     # distributed
    python examples/train_digits.py                               # a single process, the reference
"""

import runpy

runpy.run_module("unbroken.launch.demo_train", run_name="__main__", alter_sys=True)
