"""The modules' former paths (``unbroken.checkpoint``, ``unbroken.devices``, ...), before the
package was cut by role: they keep working for one release, with a ``DeprecationWarning``
naming the new path. ``unbroken.coordinator`` and ``unbroken.replica_groups`` are packages now
and still offer the former modules' names themselves.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

MOVED = {
    "telemetry": "observe.events",
    "console": "observe.console",
    "console_lines": "observe.console_lines",
    "report": "observe.report",
    "report_table": "observe.report_table",
    "run_log": "observe.run_log",
    "timeline": "observe.timeline",
    "incidents": "observe.incidents",
    "leader_mark": "observe.leader_mark",
    "data_plan": "data.data_plan",
    "loader": "data.loader",
    "shards": "data.shards",
    "windows": "data.windows",
    "group_member": "worker.group_member",
    "group_relay": "replica_groups.group_relay",
    "checkpoint": "storage.checkpoint",
    "sharded_checkpoint": "storage.sharded_checkpoint",
    "state_copy": "storage.state_copy",
    "safe_unpickle": "storage.safe_unpickle",
    "coordinator_api": "coordinator.api",
    "leading": "coordinator.leading",
    "membership": "coordinator.membership",
    "liveness": "coordinator.liveness",
    "member_records": "coordinator.member_records",
    "roster": "coordinator.roster",
    "replicated": "coordinator.replicated",
    "metrics": "coordinator.metrics",
    "client": "coordinator.client",
    "runtime": "worker.runtime",
    "step": "worker.step",
    "joining": "worker.joining",
    "healer": "worker.healer",
    "healing": "worker.healing",
    "gradients": "worker.gradients",
    "group": "worker.group",
    "default_group": "worker.default_group",
    "leader_calls": "worker.leader_calls",
    "lifetime": "worker.lifetime",
    "replica_check": "worker.replica_check",
    "sample_record": "worker.sample_record",
    "script_state": "worker.script_state",
    "runtime_settings": "worker.runtime_settings",
    "randomness": "worker.randomness",
    "prefault": "worker.prefault",
    "input_check": "worker.input_check",
    "mixed_precision": "worker.mixed_precision",
    "devices": "worker.devices",
    "nccl": "worker.nccl",
    "chaos": "worker.chaos",
    "checkpointing": "worker.checkpointing",
    "launcher": "launch.launcher",
    "workers": "launch.workers",
    "launch_settings": "launch.launch_settings",
    "run_flags": "launch.run_flags",
    "torchrun_habits": "launch.torchrun_habits",
    "placement": "launch.placement",
    "slurm": "launch.slurm",
    "etcd_member": "launch.etcd_member",
    "embedded_coordinator": "launch.embedded_coordinator",
    "restarts": "launch.restarts",
    "demo": "launch.demo",
    "demo_train": "launch.demo_train",
}
"""Former module name (under ``unbroken.``) -> its module now (under ``unbroken.``)."""


_KEPT: dict[str, tuple[Any, Any]] = {}


class _FormerPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``unbroken.<former>`` as the module it became: the same module object, so that
    classes and functions are the same under both names."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.startswith("unbroken.") and fullname[len("unbroken."):] in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> Any:
        new = "unbroken." + MOVED[spec.name[len("unbroken."):]]
        warnings.warn(f"{spec.name} is now {new}; the old path works until unbroken 0.3", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        _KEPT[spec.name] = (module.__spec__, module.__loader__)  # the import system overwrites them after this
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__, module.__loader__ = _KEPT.pop(module.__spec__.name)


def install() -> None:
    """Make the former paths importable (once)."""
    if not any(isinstance(f, _FormerPaths) for f in sys.meta_path):
        sys.meta_path.append(_FormerPaths())
