"""``examples/train_fsdp.py`` with the ``slowfile://`` checkpoint store registered (slowfs.py):
every file written takes ``UNBROKEN_TEST_WRITE_SECONDS`` longer (a store that needs a minute,
scaled down). Arguments are the example's."""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import slowfs  # noqa: E402,F401  (registers slowfile://)

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "train_fsdp.py"),
               run_name="__main__")
