"""Isolated virtual environments, one per compared system, made by the benchmark itself.

Each system runs from its released package with torch pinned to the same version, so that only
the fault-tolerance machinery differs. An environment is made once and reused while its
recorded requirements stay the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TORCH = "torch==2.13.0"


@dataclass(frozen=True)
class EnvSpec:
    """A virtual environment: its name and what goes into it, in install order."""

    name: str
    packages: tuple[tuple[str, ...], ...]
    check: str  # Python that prints the versions the table reports

    def stamp(self) -> str:
        return repr(self.packages)


ENVS: dict[str, EnvSpec] = {
    # unbroken from this checkout (not editable: the installed package, as a user would have it).
    "unbroken": EnvSpec(
        "unbroken",
        ((TORCH, "numpy"), (REPO,)),
        "import torch, importlib.metadata as m; print('torch', torch.__version__, 'unbroken', m.version('unbroken'))",
    ),
    # Plain DDP and torchrun elastic: torch alone.
    "torch": EnvSpec("torch", ((TORCH, "numpy"),), "import torch; print('torch', torch.__version__)"),
    # torchft 0.2.0 from PyPI; its wheel carries the Rust lighthouse binary.
    "torchft": EnvSpec(
        "torchft",
        ((TORCH, "numpy"), ("torchft==0.2.0",)),
        "import torch, torchft, importlib.metadata as m; print('torch', torch.__version__, 'torchft', m.version('torchft'))",
    ),
    # Ray Train 2.60 (heavy: about 2.4 GB running; only with --with-ray).
    "ray": EnvSpec(
        "ray",
        ((TORCH, "numpy"), ("ray[train]==2.60.0",)),
        "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)",
    ),
}


class EnvError(RuntimeError):
    """A benchmark environment could not be made; the message says which command failed."""


def root() -> str:
    return os.environ.get("UNBROKEN_BENCH_VENVS", os.path.join(REPO, "benchmarks", ".venvs"))


def python(name: str) -> str:
    return os.path.join(root(), name, "bin", "python")


def ensure(name: str, log=print) -> str:
    """Make (or reuse) the environment ``name``; return its version line."""
    spec = ENVS[name]
    path = os.path.join(root(), name)
    stamp_file = os.path.join(path, ".unbroken-bench-stamp")
    fresh = True
    if os.path.exists(stamp_file):
        with open(stamp_file) as f:
            fresh = f.read() != spec.stamp()
    if name == "unbroken":
        fresh = True  # the checkout may have changed: reinstall our package (torch stays)
    if fresh:
        if not os.path.exists(os.path.join(path, "bin", "python")):
            log(f"setup: creating {path}")
            _run([sys.executable, "-m", "venv", path])
            _run([python(name), "-m", "pip", "install", "-q", "--upgrade", "pip"])
        for group in spec.packages:
            args = ["--force-reinstall", "--no-deps"] if group == (REPO,) else []
            log(f"setup: {name}: pip install {' '.join(group)}")
            _run([python(name), "-m", "pip", "install", "-q", *args, *group])
            if args:  # our dependencies, once, without touching torch
                _run([python(name), "-m", "pip", "install", "-q", REPO])
        with open(stamp_file, "w") as f:
            f.write(spec.stamp())
    return _run([python(name), "-c", spec.check]).strip()


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise EnvError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


if __name__ == "__main__":
    for env in sys.argv[1:] or ["unbroken", "torch", "torchft"]:
        print(env, ensure(env))
