"""What a worker forked by the zygote does to become its script: show the script's command
line, take its interpreter's name, and run the script as ``python script.py`` would, outside the
zygote's own frames (no exception in flight; a traceback that starts at the script).
"""

from __future__ import annotations

import os
import sys
from typing import Any


def set_command_line(request: dict[str, Any]) -> None:
    """Show the worker as ``python train.py ARGS`` (``/proc/PID/cmdline``), the command it runs,
    not the zygote's: ``ps``, ``pgrep -f train.py``, ``top`` and ``py-spy`` find it by name."""
    try:
        from setproctitle import setproctitle
    except ImportError:  # an install without it: the zygote's command line stays
        return
    argv = [sys.executable, *(["-m"] if request["module"] else []), *request["argv"]]
    setproctitle(" ".join(argv))


def set_name(name: str) -> None:
    """Set this process's name (``/proc/PID/comm``, at most 15 bytes; Linux only)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def run_worker(request: dict[str, Any]) -> None:
    import runpy

    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # as a fresh interpreter's: from the OS, not the zygote's
    target, *args = request["argv"]
    explain_init_process_group()
    refuse_zero_redundancy_optimizer()
    try:
        if request["module"]:
            sys.argv = [target, *args]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - the script's error, printed as `python script.py` would
        trimmed = _from_the_script(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(trimmed), trimmed)
        sys.exit(1)


def _from_the_script(tb: Any) -> Any:
    """``tb`` without its first frames, the zygote's and runpy's: a traceback that starts where the
    script does, as Python prints it for ``python script.py`` (an error in compiling the script
    itself keeps them: they are all there is)."""
    import runpy

    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    start = tb
    while start is not None and (os.path.abspath(start.tb_frame.f_code.co_filename) in ours
                                 or start.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        start = start.tb_next
    return start if start is not None else tb


INIT_HINT = ("dist.init_process_group(...) under `unbroken run`: unbroken makes the process groups itself, one per"
             " generation, and does not start workers the way torchrun does (no RANK or WORLD_SIZE). Remove"
             " dist.init_process_group(...), DDP(model) and dist.destroy_process_group() from the script; inside the"
             " loop torch.distributed answers with the current generation (docs/guide/porting.md)")


def explain_init_process_group() -> None:
    """Every DDP script calls ``dist.init_process_group()``; under ``unbroken run`` torch then fails
    with "environment variable RANK expected". Keep torch's function, but turn that one error into
    what to do instead (:data:`INIT_HINT`). Any other call and error is torch's own."""
    import functools

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from unbroken.errors import ConfigError

    original = distributed_c10d.init_process_group
    if getattr(original, "_unbroken_explains", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except ValueError as exc:
            if "RANK expected" not in str(exc) and "WORLD_SIZE expected" not in str(exc):
                raise
            raise ConfigError(INIT_HINT) from None

    init_process_group._unbroken_explains = True  # type: ignore[attr-defined]
    dist.init_process_group = distributed_c10d.init_process_group = init_process_group


ZERO_HINT = ("ZeroRedundancyOptimizer under `unbroken run`: it keeps each part of the optimizer state on one rank"
             " only, and that part dies with its rank, where unbroken could not heal it; every member keeps the whole"
             " optimizer state instead. Pass the optimizer it wraps (for example torch.optim.AdamW(model.parameters(),"
             " lr=...) and run with --shard-optimizer: unbroken then shards its state with every part held by two"
             " members (docs/guide/sharded-optimizer.md)")
ZERO_MODULE = "torch.distributed.optim.zero_redundancy_optimizer"


class _RefuseZero:
    """An import hook for :data:`ZERO_MODULE` (importing it eagerly would cost every worker 0.24 s):
    once the module is loaded, building its ``ZeroRedundancyOptimizer`` raises a ConfigError that
    says what to do (:data:`ZERO_HINT`), where torch would say "Default process group has not been
    initialized" and the user's fix, ``init_process_group``, meets :data:`INIT_HINT`."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != ZERO_MODULE:
            return None
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if finder is not self and hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        loaded = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            loaded(module)
            from unbroken.errors import ConfigError

            def refused(*args: Any, **kwargs: Any) -> None:
                raise ConfigError(ZERO_HINT)

            module.ZeroRedundancyOptimizer.__init__ = refused

        spec.loader.exec_module = exec_module  # this spec's own loader: nothing else loads through it
        return spec


def refuse_zero_redundancy_optimizer() -> None:
    """Install :class:`_RefuseZero` first on ``sys.meta_path`` (once)."""
    if ZERO_MODULE not in sys.modules and not any(isinstance(f, _RefuseZero) for f in sys.meta_path):
        sys.meta_path.insert(0, _RefuseZero())
