"""The coordinator a launcher runs itself, unless ``--coordinator`` names one elsewhere.

Alone, it serves this node's workers (and those of other nodes that reach it, under SLURM). With
``--etcd`` it is this node's candidate among several, one per launcher, of which the leading one
serves; under ``--ha`` this node may also run one of the job's etcd members, started first. Its
address and token go to ``<run dir>/coordinator.json`` for ``unbroken status`` and metrics
scrapers.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from typing import TYPE_CHECKING, Any, Callable

from unbroken.observe.events import EventLog


def _said_by_the_launcher(record: logging.LogRecord) -> bool:
    """The embedded coordinator's verdict that the job failed is the launcher's last line: not
    said twice on one console."""
    return not str(record.msg).startswith("job failed:")

if TYPE_CHECKING:
    from unbroken.launch.launch_settings import LaunchSettings
    from unbroken.launch.workers import Worker


class EmbeddedCoordinator:
    """The coordinator side of :class:`~unbroken.launch.launcher.Launcher`, which it is a base of:
    starting and stopping this node's coordinator (or candidate) and etcd member."""

    settings: LaunchSettings
    run_dir: str
    token: str | None
    address: str | None
    coordinator: Any
    workers: list[Worker]
    _say: Callable[[str], None]  # the launcher's console

    def _start_coordinator(self) -> None:
        """Start the embedded coordinator: alone, or with ``--etcd`` as this node's candidate
        (after this node's etcd member under ``--ha``)."""
        if self.address is not None and not self.settings.etcd:
            return
        from unbroken.coordinator.server import Coordinator, CoordinatorSettings
        from unbroken.coordinator.membership import MembershipSettings

        logging.getLogger("unbroken.coordinator.server").addFilter(_said_by_the_launcher)

        leadership = None
        if self.settings.etcd:
            from unbroken.coordinator.replicated import leadership_from_flags

            self._start_etcd_member()
            leadership = leadership_from_flags(self.settings.etcd, self.settings.job_id, self.settings.leader_lease)
        self.coordinator = Coordinator(
            CoordinatorSettings(
                host=self.settings.coordinator_host,
                port=self.settings.coordinator_port,
                advertise_host=self.settings.coordinator_advertise,
                token=self.token,
            ),
            MembershipSettings(
                heartbeat_timeout=self.settings.heartbeat_timeout,
                expected_members=self.settings.expected_members or max(len(self.workers), self.settings.min_members),
                min_members=self.settings.min_members,
                max_members=self.settings.max_members,
                progress_timeout=self.settings.progress_timeout,
                warmup_timeout=self.settings.warmup_timeout,
                busy_timeout=self.settings.busy_timeout,
                quorum_timeout=self.settings.quorum_timeout,
                start_grace=self.settings.start_grace,
            ),
            EventLog.for_run_dir(self.run_dir, "coordinator"),
            leadership=leadership,
        ).start_in_thread()
        host = "127.0.0.1" if self.settings.coordinator_host == "0.0.0.0" else self.settings.coordinator_host
        # this node's candidate first, then the others known up front (workers learn the rest)
        self.address = ",".join([f"{host}:{self.coordinator.port}"] + ([self.address] if self.address else []))
        # for `unbroken status` and metrics scrapers: readable by this user only
        # (written whole, then renamed into place: a reader never sees half of it)
        path = os.path.join(self.run_dir, "coordinator.json")
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"address": self.address, "token": self.token}, f)
        os.rename(path + ".tmp", path)

    def _start_etcd_member(self) -> None:
        """Under ``--ha``: this node's etcd member, in a fresh local data directory, until the
        launcher ends. The cluster is healthy once a majority of the first three nodes runs."""
        spec = self.settings.etcd_member
        if spec is None:
            return
        import tempfile

        from unbroken.launch.etcd_member import EtcdMember

        self._etcd_dir = tempfile.mkdtemp(prefix="unbroken-etcd-")
        self.etcd_member = EtcdMember(spec, self._etcd_dir, os.path.join(self.run_dir, "etcd.log")).start()
        self._say(f"etcd member {spec.name} at {spec.client_url} (log {self.run_dir}/etcd.log)")

    def _stop_etcd_member(self) -> None:
        member = getattr(self, "etcd_member", None)
        if member is not None:
            member.stop(signal.SIGTERM)
            import shutil

            shutil.rmtree(self._etcd_dir, ignore_errors=True)
