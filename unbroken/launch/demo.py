"""``unbroken demo``: the example, four workers, a few failures, then the report.

It runs the digits example (``examples/train_digits.py`` when the source tree is there, else the
same code shipped as :mod:`unbroken.launch.demo_train`) with 4 workers on the embedded coordinator and
:data:`SCHEDULE` as the chaos schedule, then prints ``unbroken report`` of the run directory and
the path of its timeline picture.
"""

from __future__ import annotations

import os
import sys
import time

from unbroken.errors import ConfigError

STEPS = 400
WORKERS = 4
# Two kills and a 3-second hang, at different steps and on different workers. The heartbeat
# timeout of the demo (2 s) is shorter than the hang, so the hung worker is declared dead, the
# others go on without it, and it rejoins when it wakes up. The example's steps take a few
# milliseconds, so worker 0 also sleeps 50 ms in each micro-batch, standing in for real compute:
# the killed workers' replacements (a fresh `import torch` each) then have time to rejoin before
# the end, and worker 0 is the run's one straggler (given fewer micro-batches, said once).
FAULTS = "kill@step,rank=1,step=30;hang@step,rank=2,step=110,for=3;kill@step,rank=3,step=190"
SLOW = "slow@micro,rank=0,sleep=0.05"
SCHEDULE = FAULTS + ";" + SLOW
"""The default demo's whole chaos schedule."""
HEARTBEAT_TIMEOUT = 2.0
MIN_STEPS = 40
"""The shortest demo: its three faults need room between them and before the end."""


def faults(steps: int) -> str:
    """:data:`FAULTS` for a run of ``steps`` steps: the same faults at the same fractions of the run."""
    if steps == STEPS:
        return FAULTS
    at = lambda step: max(1, step * steps // STEPS)  # noqa: E731
    return f"kill@step,rank=1,step={at(30)};hang@step,rank=2,step={at(110)},for=3;kill@step,rank=3,step={at(190)}"

_RUNNER = 'import runpy\nrunpy.run_module("unbroken.launch.demo_train", run_name="__main__", alter_sys=True)\n'


def example_script(run_dir: str) -> str:
    """``examples/train_digits.py`` beside the package, or a one-line runner of
    :mod:`unbroken.launch.demo_train` written into ``run_dir`` (an installed package has no examples)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # unbroken/launch/demo.py
    example = os.path.join(os.path.dirname(package), "examples", "train_digits.py")
    if os.path.isfile(example):
        return example
    os.makedirs(run_dir, exist_ok=True)
    runner = os.path.join(run_dir, "train_digits.py")
    with open(runner, "w") as f:
        f.write(_RUNNER)
    return runner


def run(run_dir: str | None = None, steps: int = STEPS) -> int:
    """Run the demo for ``steps`` steps (at least :data:`MIN_STEPS`) into ``run_dir``; the
    launcher's exit code."""
    if steps < MIN_STEPS:
        raise ConfigError(f"unbroken demo needs at least {MIN_STEPS} steps to place its faults, got {steps}")
    try:
        import sklearn  # noqa: F401 - the example's data set
    except ImportError:
        raise ConfigError("unbroken demo trains on scikit-learn's digits; install it: pip install 'unbroken[examples]'") from None
    from unbroken.observe import report
    from unbroken.launch.launcher import Launcher, LaunchSettings

    if run_dir is None:
        run_dir = os.path.join("unbroken-runs", f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    run_dir = os.path.abspath(run_dir)
    settings = LaunchSettings(
        script=example_script(run_dir),
        script_args=("--steps", str(steps)),
        nproc_per_node=WORKERS,
        run_dir=run_dir,
        chaos=faults(steps) + ";" + SLOW,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
    )
    print(f"[unbroken] demo: {WORKERS} workers, {steps} steps, faults {faults(steps)!r}; worker 0 sleeps 50 ms a micro-batch (a straggler)", flush=True)
    code = Launcher(settings).run()
    print(flush=True)
    try:
        report.main([run_dir])
    except ConfigError as exc:
        print(f"unbroken: no report: {exc}", file=sys.stderr)
        return code or 1
    print(f"timeline picture: {os.path.join(run_dir, report.TIMELINE_FILE)}", flush=True)
    return code
