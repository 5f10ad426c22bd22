"""The ``unbroken`` command: ``run`` (launch a node), ``coordinator`` (run one alone), ``status``,
``report`` (what happened in a run) and ``demo`` (the example with a few failures, then its report)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from unbroken.launch_settings import LaunchSettings

from unbroken.errors import ConfigError, UnbrokenError


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """Add ``--a-b`` with torchrun's ``--a_b`` spelling as an alias."""
    names = [name]
    if "-" in name[2:]:
        names.append("--" + name[2:].replace("-", "_"))
    parser.add_argument(*names, **kwargs)


def _add_run(sub: argparse._SubParsersAction) -> None:
    from unbroken.launch_settings import LaunchSettings

    d = LaunchSettings.__dataclass_fields__
    # allow_abbrev=False: the script's own flags (--warmup) must never be read as abbreviations of ours
    p = sub.add_parser("run", help="run a training script on this node, surviving worker failures", allow_abbrev=False)
    # in this order in the help and the CLI reference
    _add_run_workers(p, d)
    _add_run_coordinator(p, d)
    _add_run_checkpoints(p, d)
    _add_run_membership(p, d)
    _add_run_supervision(p, d)
    _add_run_replication(p, d)
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _add_run_workers(p: argparse.ArgumentParser, d: Mapping[str, Any]) -> None:
    """The worker slots of this node and their restart budget; where the run goes."""
    _flag(p, "--nproc-per-node", type=str, default="1", help="worker processes on this node (default 1)")
    _flag(p, "--group-size", type=str, default="1",
          help="processes per replica group (FSDP shards of one replica; one member of the job); --nproc-per-node must"
          " be a multiple of it (default 1)")
    _flag(p, "--max-restarts", type=int, default=d["max_restarts"].default,
          help="restarts per worker slot within --restart-window; one failure more quarantines the slot (default %(default)s)")
    _flag(p, "--restart-window", type=float, default=d["restart_window"].default,
          help="seconds over which a slot's failures are counted (default %(default)s)")
    _flag(p, "--quarantine-cooloff", type=float, default=d["quarantine_cooloff"].default,
          help="seconds a quarantined slot is not started; then it starts again with a fresh budget (default %(default)s)")
    _flag(p, "--run-dir", default=None, help="logs and events go here (default unbroken-runs/<time>-<pid>)")
    _flag(p, "--backend", choices=["auto", "gloo", "nccl"], default=d["backend"].default,
          help="collective backend of the workers: gloo (CPU or CUDA tensors), nccl (CUDA), or auto: NCCL when the model is on a GPU (default %(default)s)")


def _add_run_coordinator(p: argparse.ArgumentParser, d: Mapping[str, Any]) -> None:
    """Which coordinator, this node's name in it, and the timings of liveness."""
    _flag(p, "--coordinator", default=None, help="HOST:PORT of an external coordinator (default: start one here)")
    _flag(p, "--rdzv-endpoint", default=None, metavar="HOST:PORT",
          help="the same on every node (torchrun's spelling): the node whose address HOST is hosts the coordinator on"
          " PORT, the others join it (default: none)")
    _flag(p, "--coordinator-host", default=None,
          help="address the embedded coordinator binds (default 127.0.0.1; with --etcd or --ha: 0.0.0.0, advertised as --node-name)")
    _flag(p, "--coordinator-advertise", default=None,
          help="with --etcd: the address other nodes reach this node's coordinator candidate and store at (default: --node-name)")
    _flag(p, "--coordinator-port", type=int, default=d["coordinator_port"].default, help="port of the embedded coordinator (default 0: any free)")
    _flag(p, "--node-name", default=None, help="name of this node (default: host name)")
    _flag(p, "--heartbeat-interval", type=float, default=d["heartbeat_interval"].default, help="seconds between heartbeats (default %(default)s)")
    _flag(p, "--heartbeat-timeout", type=float, default=d["heartbeat_timeout"].default, help="silence that declares a worker dead (default %(default)s)")
    _flag(p, "--collective-timeout", type=float, default=d["collective_timeout"].default, help="longest wait of one collective (default %(default)s)")


def _add_run_checkpoints(p: argparse.ArgumentParser, d: Mapping[str, Any]) -> None:
    """Durable checkpoints."""
    _flag(p, "--checkpoint-dir", default=None, help="durable checkpoints: a directory or fsspec URL such as s3://bucket/run (default: none)")
    _flag(p, "--checkpoint-every", default=None, help="save every N steps, or 'auto' (Young/Daly interval) (default: never)")
    _flag(p, "--checkpoint-keep", type=int, default=d["checkpoint_keep"].default, help="complete checkpoints to keep (default %(default)s)")


def _add_run_membership(p: argparse.ArgumentParser, d: Mapping[str, Any]) -> None:
    """How many workers a generation takes, and how long the coordinator waits for them."""
    _flag(p, "--nnodes", default=None, help="MIN:MAX nodes (torchrun spelling); sets --min-members/--max-members to MIN*N/MAX*N")
    _flag(p, "--min-members", type=int, default=d["min_members"].default, help="no generation below this many workers (default %(default)s)")
    _flag(p, "--max-members", type=int, default=None, help="at most this many workers in a generation (default: no limit)")
    _flag(p, "--progress-timeout", type=float, default=d["progress_timeout"].default,
          help="evict a worker whose progress stops this long while peers wait for it (default %(default)s)")
    _flag(p, "--warmup-timeout", type=float, default=d["warmup_timeout"].default,
          help="the same for a worker's first step (compilation, loading) (default %(default)s)")
    _flag(p, "--busy-timeout", type=float, default=d["busy_timeout"].default,
          help="end a worker whose checkpoint write or read has lasted this long (default %(default)s)")
    _flag(p, "--quorum-timeout", type=float, default=d["quorum_timeout"].default, help="fail if below --min-members this long (default %(default)s)")
    _flag(p, "--start-grace", type=float, default=d["start_grace"].default, help="first generation waits this long for all workers (default %(default)s)")


def _add_run_supervision(p: argparse.ArgumentParser, d: Mapping[str, Any]) -> None:
    """Restart delays, shutdown, the console, fault injection and the sample record."""
    _flag(p, "--restart-backoff", type=float, default=d["restart_backoff"].default,
          help="restart delay after a slot's first failure within the window; doubles with each further one (default %(default)s)")
    _flag(p, "--max-restart-backoff", type=float, default=d["max_restart_backoff"].default, help="upper bound of the restart delay (default %(default)s)")
    _flag(p, "--shutdown-grace", type=float, default=d["shutdown_grace"].default,
          help="seconds between SIGTERM and SIGKILL at shutdown; once the job finished, how long a worker that has not"
          " left the training loop gets before SIGKILL (default %(default)s)")
    _flag(p, "--tee", type=int, default=None, help="show this slot's output on the console: a local rank, or with --group-size a replica group's process 0 (default: lowest alive)")
    _flag(p, "--progress-interval", type=float, default=d["progress_interval"].default,
          help="seconds between progress lines when the output is not a terminal; 0: no progress display (default %(default)s)")
    _flag(p, "--chaos", default=None, help="fault schedule, e.g. 'kill@step,rank=1,step=20' (see docs)")
    _flag(p, "--record-samples", action="store_true", help="log every step's sample positions under the run directory")


def _add_run_replication(p: argparse.ArgumentParser, d: Mapping[str, Any]) -> None:
    """The token, and the replicated coordinator over etcd."""
    _flag(p, "--token", default=None,
          help="shared secret for the coordinator (default: $UNBROKEN_TOKEN; the embedded coordinator makes one up"
          " and writes it to RUN_DIR/coordinator.json)")
    _flag(p, "--etcd", default=None, metavar="HOST:PORT,...",
          help="etcd cluster of the replicated coordinator: this launcher runs a coordinator candidate, the leading one"
          " serves, and the job survives the loss of any host (needs --job-id; default: no etcd)")
    _flag(p, "--job-id", default=None, help="with --etcd: the job's name, the same on every node (under SLURM: the SLURM job id)")
    _flag(p, "--leader-lease", type=float, default=d["leader_lease"].default,
          help="with --etcd: seconds after which a lost leading coordinator is replaced (default %(default)s)")
    _flag(p, "--ha", action="store_true",
          help="under SLURM: the first three nodes each run an etcd member, every node a coordinator candidate;"
          " needs 3 or more nodes and the etcd binary on PATH")
    _flag(p, "--etcd-port", type=int, default=2379, help="with --ha: etcd's client port; the peer port is the next (default %(default)s)")


def _positive_int(flag: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{flag} must be a positive integer, got {text!r}") from None
    if value < 1:
        raise ConfigError(f"{flag} must be a positive integer, got {value}")
    return value


def _every(text: str | None) -> int | str | None:
    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--checkpoint-every must be a number of steps or 'auto', got {text!r}") from None


def _nnodes(text: str, nproc: int) -> tuple[int, int | None]:
    """torchrun's ``--nnodes N`` or ``MIN:MAX`` as member counts; ``nproc`` is the members of one
    node (its slots: processes per node over ``--group-size``)."""
    low, sep, high = text.partition(":")
    try:
        lo = int(low)
        hi = int(high) if sep else lo
    except ValueError:
        raise ConfigError(f"--nnodes must be N or MIN:MAX, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise ConfigError(f"--nnodes needs 1 <= MIN <= MAX, got {text!r}")
    return lo * nproc, hi * nproc


def launch_settings(args: argparse.Namespace, env: Mapping[str, str]) -> "LaunchSettings":
    """The launcher's settings from the flags, completed from SLURM's environment under srun."""
    from unbroken.launch_settings import LaunchSettings, check_group_size
    from unbroken.placement import placement

    nproc = _positive_int("--nproc-per-node", args.nproc_per_node)
    group_size = _positive_int("--group-size", args.group_size)
    check_group_size(nproc, group_size)
    members = nproc // group_size  # the coordinator counts replica groups, not processes
    min_members, max_members = args.min_members, args.max_members
    if args.nnodes:
        min_members, max_members = _nnodes(args.nnodes, members)
    place = placement(args, env, members)
    return LaunchSettings(
        script=args.script,
        script_args=tuple(args.script_args),
        nproc_per_node=nproc,
        group_size=group_size,
        max_restarts=args.max_restarts,
        restart_window=args.restart_window,
        quarantine_cooloff=args.quarantine_cooloff,
        restart_backoff=args.restart_backoff,
        max_restart_backoff=args.max_restart_backoff,
        shutdown_grace=args.shutdown_grace,
        run_dir=args.run_dir,
        coordinator=place.coordinator,
        coordinator_host=place.host,
        coordinator_port=place.port,
        coordinator_advertise=place.advertise,
        expected_members=place.expected,
        node=place.node,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
        collective_timeout=args.collective_timeout,
        tee=args.tee,
        progress_interval=args.progress_interval,
        chaos=args.chaos,
        record_samples=args.record_samples,
        backend=args.backend,
        token=args.token or env.get("UNBROKEN_TOKEN") or None,
        etcd=place.etcd,
        job_id=place.job_id,
        leader_lease=args.leader_lease,
        etcd_member=place.etcd_member,
        min_members=min_members,
        max_members=max_members,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=_every(args.checkpoint_every),
        checkpoint_keep=args.checkpoint_keep,
        progress_timeout=args.progress_timeout,
        warmup_timeout=args.warmup_timeout,
        busy_timeout=args.busy_timeout,
        quorum_timeout=args.quorum_timeout,
        start_grace=args.start_grace,
    )


def _run(args: argparse.Namespace) -> int:
    import os

    from unbroken.launcher import Launcher

    return Launcher(launch_settings(args, os.environ)).run()


def _coordinator(args: argparse.Namespace) -> int:
    from unbroken.coordinator import Coordinator, CoordinatorSettings
    from unbroken.membership import MembershipSettings
    from unbroken.telemetry import EventLog

    import os

    token = args.token or os.environ.get("UNBROKEN_TOKEN") or None
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"unbroken: warning: the coordinator listens on {args.host} without a token: anyone who reaches it can end"
            " the job; pass --token (or set UNBROKEN_TOKEN) here and on every node",
            file=sys.stderr,
        )
    coordinator = Coordinator(
        CoordinatorSettings(
            host=args.host, port=args.port, store_port=args.store_port, advertise_host=args.advertise_host, token=token
        ),
        MembershipSettings(
            heartbeat_timeout=args.heartbeat_timeout,
            expected_members=args.expected_members or args.min_members,
            min_members=args.min_members,
            max_members=args.max_members,
            progress_timeout=args.progress_timeout,
            warmup_timeout=args.warmup_timeout,
            busy_timeout=args.busy_timeout,
            quorum_timeout=args.quorum_timeout,
            start_grace=args.start_grace,
        ),
        EventLog.for_run_dir(args.run_dir, "coordinator"),
        leadership=_leadership(args),
    )
    try:
        coordinator.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def _leadership(args: argparse.Namespace):
    """A candidate's leadership when ``--etcd`` is given, else None (a coordinator on its own)."""
    if not args.etcd:
        return None
    from unbroken.replicated import leadership_from_flags

    return leadership_from_flags(args.etcd, args.job_id, args.leader_lease)


def _status(args: argparse.Namespace) -> int:
    from unbroken.client import CoordinatorClient

    import os

    token = args.token or os.environ.get("UNBROKEN_TOKEN") or None
    status = CoordinatorClient(args.address, timeout=args.timeout, token=token).status()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"generation {status['generation']}  committed step {status['committed_step']}  live {status['live']}  finished {status['finished']}")
    if status.get("failed"):
        print(f"failed: {status['failed']}")
    for prefix, left in (status.get("quarantined") or {}).items():
        print(f"quarantined: {prefix}* for {left:.0f} s more")
    for m in status["members"]:
        print(f"  {m['member']:<28} {m['state']:<8} step {m['step']:<7} heartbeat {m['heartbeat_age']:.1f} s ago" + (f"  ({m['reason']})" if m["reason"] else ""))
    return 0


def _report(args: argparse.Namespace) -> int:
    from unbroken import report

    return report.main(args.run_dirs, as_json=args.json, png=args.png, no_png=args.no_png)


def _demo(args: argparse.Namespace) -> int:
    from unbroken import demo

    if args.log_level.upper() == "WARNING":  # the default: the console's own lines say what happens
        logging.getLogger("unbroken.coordinator").setLevel(logging.ERROR)
    return demo.run(args.run_dir, demo.STEPS if args.steps is None else args.steps)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unbroken", description="PyTorch data-parallel training that survives failed nodes.")
    parser.add_argument("--log-level", default="WARNING", help="logging level of unbroken itself (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    c = sub.add_parser("coordinator", help="run a coordinator alone, for jobs that span several nodes")
    c.add_argument("--host", default="0.0.0.0", help="address to bind (default %(default)s)")
    c.add_argument("--port", type=int, default=29400, help="HTTP port (default %(default)s)")
    c.add_argument("--store-port", type=int, default=0, help="TCPStore port (default 0: any free)")
    c.add_argument("--advertise-host", default=None, help="host name members use for the store (default: this host's name)")
    c.add_argument("--min-members", type=int, default=1, help="no generation below this many members (default 1)")
    c.add_argument("--max-members", type=int, default=None, help="at most this many members in a generation (default: no limit)")
    c.add_argument("--expected-members", type=int, default=None, help="members the first generation waits for (default: --min-members)")
    c.add_argument("--start-grace", type=float, default=30.0, help="first generation waits this long for the expected members (default 30)")
    c.add_argument("--progress-timeout", type=float, default=20.0, help="evict a member whose progress stops this long while peers wait (default 20)")
    c.add_argument("--warmup-timeout", type=float, default=600.0, help="the same for a member's first step (default 600)")
    c.add_argument("--busy-timeout", type=float, default=3600.0,
                   help="end a member whose checkpoint write or read has lasted this long (default 3600)")
    c.add_argument("--quorum-timeout", type=float, default=300.0, help="fail the job if below --min-members this long (default 300)")
    c.add_argument("--heartbeat-timeout", type=float, default=3.0, help="silence that declares a member dead (default 3)")
    c.add_argument("--run-dir", default=None, help="write the event log here")
    c.add_argument("--etcd", default=None, metavar="HOST:PORT,...",
                   help="run as one of several coordinator candidates, electing a leader in this etcd cluster (default: alone)")
    c.add_argument("--job-id", default=None, help="with --etcd: the job's name, the same for every candidate")
    c.add_argument("--leader-lease", type=float, default=2.0,
                   help="with --etcd: seconds after which a dead leader is replaced (default %(default)s)")
    c.add_argument("--token", default=None, help="every request must carry this secret (default: $UNBROKEN_TOKEN; none if unset)")
    s = sub.add_parser("status", help="show a coordinator's generation and members")
    s.add_argument("address", help="HOST:PORT of the coordinator")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--timeout", type=float, default=5.0, help="give up after this many seconds (default 5)")
    s.add_argument("--token", default=None, help="the coordinator's token (default: $UNBROKEN_TOKEN)")
    r = sub.add_parser("report", help="summarize a finished or running job from its event log; draw its timeline")
    r.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory (several: one per node, merged)")
    r.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    r.add_argument("--png", default=None, metavar="PATH", help="where to draw the timeline (default RUN_DIR/timeline.png)")
    r.add_argument("--no-png", action="store_true", help="do not draw the timeline")
    d = sub.add_parser("demo", help="train the example with 4 workers and a few failures, then show the report")
    d.add_argument("--run-dir", default=None, help="where the run goes (default unbroken-runs/demo-<time>-<pid>)")
    d.add_argument("--steps", type=int, default=None,
                   help="train this many steps, the faults at the same fractions of the run (default 400, at least 40)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "coordinator" and args.advertise_host is None and args.host == "0.0.0.0":
        import socket

        args.advertise_host = socket.gethostname()
    handlers = {"run": _run, "coordinator": _coordinator, "status": _status, "report": _report, "demo": _demo}
    try:
        return handlers[args.command](args)
    except (UnbrokenError, ValueError) as exc:
        print(f"unbroken: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
