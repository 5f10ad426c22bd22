"""torchrun's spellings in ``unbroken run``: the ones it takes, and a hint for each it does not.

Users arrive with torchrun command lines. ``--nproc-per-node gpu|cpu|auto`` and ``-m MODULE`` mean
what they mean to torchrun; a flag of torchrun's that has no place here (its rendezvous, node
ranks) is refused with the flag that does the job in unbroken, instead of argparse's bare
"unrecognized arguments" or, worse, being read as the script's own flag.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from unbroken.errors import ConfigError

NPROC_WORDS = ("gpu", "cpu", "auto")

HINTS: dict[str, str] = {
    "--rdzv-backend": "unbroken brings its own coordinator: give every node the same --rdzv-endpoint HOST:PORT"
    " (or --etcd for a replicated one)",
    "--rdzv-id": "a single coordinator needs no job id; with --etcd it is --job-id",
    "--rdzv-conf": "the coordinator's timings are flags of their own (--heartbeat-timeout, --start-grace,"
    " --progress-timeout): see `unbroken run --help`",
    "--node-rank": "nodes need no rank: each is named by --node-name (default: its host name), and the node whose"
    " address --rdzv-endpoint names hosts the coordinator",
    "--master-addr": "use --rdzv-endpoint HOST:PORT on every node",
    "--master-port": "use --rdzv-endpoint HOST:PORT on every node",
    "--log-dir": "use --run-dir: each worker's output goes to RUN_DIR/workers/w<rank>.log",
    "--redirects": "each worker's output already goes to its own log (RUN_DIR/workers/w<rank>.log); --local-ranks-filter"
    " picks the workers the console shows, --tee their streams",
    "--no-python": "unbroken runs Python scripts (or modules with -m); wrap another program in a Python script",
    "--local-addr": "use --coordinator-advertise (with --etcd) or --node-name",
}
"""torchrun's flags that ``unbroken run`` does not take, with what to use instead."""
SHORT = {"--redirects": ["-r"]}
"""torchrun's one-letter spellings of those flags."""


def accept_torchrun_flags(parser: argparse.ArgumentParser) -> None:
    """torchrun's flags that mean nothing different here, taken so that its command lines run:
    ``--standalone`` (a single ``unbroken run`` starts its own coordinator on this node) and
    ``--run-path`` (workers run the script with ``runpy.run_path`` already)."""
    for names, what in ((["--standalone"], "torchrun's --standalone: accepted, nothing to do (this node starts its own"
                         " coordinator unless --coordinator or --rdzv-endpoint names another)"),
                        (["--run-path", "--run_path"], "torchrun's --run-path: accepted, what workers do anyway")):
        parser.add_argument(*names, action="store_true", help=what, dest=f"_torchrun_{names[0][2:].replace('-', '_')}")


class _Refuse(argparse.Action):
    """Fails the parse with the hint for a torchrun flag this command does not take."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: str | None = None) -> None:
        flag = (option_string or "").replace("_", "-")
        flag = next((long for long, short in SHORT.items() if flag in short), flag)
        parser.error(f"{option_string} is torchrun's flag, not unbroken's: {HINTS[flag]}")


def refuse_torchrun_flags(parser: argparse.ArgumentParser) -> None:
    """Add torchrun's flags that have no place in ``unbroken run``, hidden from the help, each
    failing the parse (status 2) with the hint of :data:`HINTS`; both spellings (``--a-b`` and
    ``--a_b``), a value or none."""
    for flag in HINTS:
        names = [flag] + ([flag.replace("-", "_").replace("__", "--", 1)] if "-" in flag[2:] else []) + SHORT.get(flag, [])
        parser.add_argument(*names, nargs="?", action=_Refuse, help=argparse.SUPPRESS, dest=f"_torchrun_{flag[2:]}")


def nproc_per_node(text: str) -> int:
    """``--nproc-per-node`` as torchrun reads it: a positive count, ``gpu`` (one per visible GPU),
    ``cpu`` (one per CPU this process may run on) or ``auto`` (``gpu`` where there is one, else
    ``cpu``)."""
    word = text.strip().lower()
    if word in NPROC_WORDS:
        gpus = _visible_gpus()
        if word == "gpu" and gpus == 0:
            raise ConfigError("--nproc-per-node gpu: this node has no visible GPU; give a number, or cpu")
        if word == "gpu" or (word == "auto" and gpus > 0):
            return gpus
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return positive_int("--nproc-per-node", text, ", gpu, cpu or auto")


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535; anything else is refused with
    argparse's exit status 2 and a message, before anything binds."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port must be a whole number from 0 to 65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port must be from 0 to 65535, got {value}")
    return value


def local_ranks(text: str) -> tuple[int, ...]:
    """An argparse type: torchrun's ``--local-ranks-filter``, local ranks separated by commas."""
    import argparse

    try:
        ranks = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"local ranks separated by commas (0 or 0,2), got {text!r}") from None
    if any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"local ranks are 0 or more, got {text!r}")
    return ranks


def tee_streams(text: str) -> int:
    """An argparse type: torchrun's ``--tee``, the streams shown on the console (0 to 3)."""
    import argparse

    if text not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(
            f"0 (none), 1 (stdout), 2 (stderr) or 3 (both), as torchrun's; got {text!r} (per-rank maps are not taken;"
            " --local-ranks-filter picks the workers the console shows)")
    return int(text)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """An argparse type: a logging level's name, in any case."""
    import argparse

    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"the log level must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.upper()


def positive_int(flag: str, text: str, or_else: str = "") -> int:
    """``text`` as the positive integer ``flag`` takes, or a :class:`ConfigError` naming both
    (``or_else``: the words the flag takes besides, for the message)."""
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{flag} must be a positive integer{or_else}, got {text!r}") from None
    if value < 1:
        raise ConfigError(f"{flag} must be a positive integer, got {value}")
    return value


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
