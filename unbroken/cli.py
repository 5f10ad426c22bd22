"""The ``unbroken`` command: ``run`` (launch a node), ``coordinator`` (run one alone), ``status``,
``report`` (what happened in a run) and ``demo`` (the example with a few failures, then its report)."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from typing import Sequence

from unbroken.errors import ConfigError, UnbrokenError
from unbroken.launch.run_flags import add_run, launch_settings, log_level_flag
from unbroken.launch.torchrun_habits import log_level, port_number
from unbroken.launch.slurm import DEFAULT_PORT


def _run(args: argparse.Namespace) -> int:
    import os

    from unbroken.launch.launcher import Launcher

    return Launcher(launch_settings(args, os.environ)).run()


def _coordinator(args: argparse.Namespace) -> int:
    from unbroken.coordinator.server import Coordinator, CoordinatorSettings
    from unbroken.coordinator.membership import MembershipSettings
    from unbroken.observe.events import EventLog

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
    from unbroken.coordinator.replicated import leadership_from_flags

    return leadership_from_flags(args.etcd, args.job_id, args.leader_lease)


def _status(args: argparse.Namespace) -> int:
    from unbroken.coordinator.client import CoordinatorClient

    import os

    address, token = args.address, args.token or os.environ.get("UNBROKEN_TOKEN") or None
    if os.path.isdir(address):  # a run directory: its embedded coordinator's address and token
        address, token = _run_dir_coordinator(address, token)
    status = CoordinatorClient(address, timeout=args.timeout, token=token).status()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"generation {status['generation']}  committed step {status['committed_step']}  live {status['live']}  finished {status['finished']}")
    if status.get("failed"):
        print(f"failed: {status['failed']}")
    for prefix, left in (status.get("quarantined") or {}).items():
        print(f"quarantined: {prefix}* for {left:.0f} s more")
    for m in status["members"]:
        pace = m.get("pace")
        pace_text = "" if pace is None else f"  pace {pace:.0%}" + (" straggler" if m.get("straggler") else "")
        print(f"  {m['member']:<28} {m['state']:<8} step {m['step']:<7} heartbeat {m['heartbeat_age']:.1f} s ago"
              + pace_text + (f"  ({m['reason']})" if m["reason"] else ""))
    return 0


def _run_dir_coordinator(run_dir: str, token: str | None) -> tuple[str, str | None]:
    """The address and token that ``unbroken run`` wrote to ``RUN_DIR/coordinator.json``."""
    import os

    path = os.path.join(run_dir, "coordinator.json")
    try:
        with open(path) as f:
            recorded = json.load(f)
        return str(recorded["address"]), token or recorded.get("token")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{run_dir} is a directory but {path} cannot be read ({exc}): give the run directory of an"
                          " `unbroken run` whose coordinator is embedded, or the coordinator's HOST:PORT") from None


def _report(args: argparse.Namespace) -> int:
    from unbroken.observe import report

    return report.main(args.run_dirs, as_json=args.json, png=args.png, no_png=args.no_png)


def _demo(args: argparse.Namespace) -> int:
    from unbroken.launch import demo

    if args.log_level.upper() == "WARNING":  # the default: the console's own lines say what happens
        logging.getLogger("unbroken.coordinator.server").setLevel(logging.ERROR)
    return demo.run(args.run_dir, demo.STEPS if args.steps is None else args.steps)


def _add_coordinator(sub: argparse._SubParsersAction) -> None:
    """``unbroken coordinator``: its defaults are the settings' own (membership, leadership), never
    copied here, so that the CLI and a coordinator made from Python cannot drift apart."""
    from unbroken.coordinator.membership import MembershipSettings
    from unbroken.coordinator.replicated import LeadershipSettings

    m, lead = MembershipSettings.__dataclass_fields__, LeadershipSettings.__dataclass_fields__
    c = sub.add_parser("coordinator", help="run a coordinator alone, for jobs that span several nodes")
    c.add_argument("--host", default="0.0.0.0", help="address to bind (default %(default)s)")
    c.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="HTTP port (default %(default)s)")
    c.add_argument("--store-port", type=port_number, default=0, help="TCPStore port (default 0: any free)")
    c.add_argument("--advertise-host", default=None, help="host name members use for the store (default: this host's name)")
    c.add_argument("--min-members", type=int, default=m["min_members"].default,
                   help="no generation below this many members (default %(default)s)")
    c.add_argument("--max-members", type=int, default=m["max_members"].default,
                   help="at most this many members in a generation (default: no limit)")
    c.add_argument("--expected-members", type=int, default=None, help="members the first generation waits for (default: --min-members)")
    c.add_argument("--start-grace", type=float, default=m["start_grace"].default,
                   help="first generation waits this long for the expected members (default %(default)s)")
    c.add_argument("--progress-timeout", type=float, default=m["progress_timeout"].default,
                   help="evict a member whose progress stops this long while peers wait (default %(default)s)")
    c.add_argument("--warmup-timeout", type=float, default=m["warmup_timeout"].default,
                   help="the same for a member's first step (default %(default)s)")
    c.add_argument("--busy-timeout", type=float, default=m["busy_timeout"].default,
                   help="end a member whose work marked busy (a checkpoint snapshot, write or read; job.on_leader's fn"
                        " on the leader; warming memory for a heal; leaving the loop) has lasted this long"
                        " (default %(default)s)")
    c.add_argument("--quorum-timeout", type=float, default=m["quorum_timeout"].default,
                   help="fail the job if below --min-members this long (default %(default)s)")
    c.add_argument("--heartbeat-timeout", type=float, default=m["heartbeat_timeout"].default,
                   help="silence that declares a member dead (default %(default)s)")
    c.add_argument("--run-dir", default=None, help="write the event log here")
    c.add_argument("--etcd", default=None, metavar="HOST:PORT,...",
                   help="run as one of several coordinator candidates, electing a leader in this etcd cluster (default: alone)")
    c.add_argument("--job-id", default=None, help="with --etcd: the job's name, the same for every candidate")
    c.add_argument("--leader-lease", type=float, default=lead["lease"].default,
                   help="with --etcd: seconds after which a dead leader is replaced (default %(default)s)")
    c.add_argument("--token", default=None, help="every request must carry this secret (default: $UNBROKEN_TOKEN; none if unset)")
    log_level_flag(c)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unbroken", description="PyTorch data-parallel training that survives failed nodes.")
    parser.add_argument("--log-level", type=log_level, default="WARNING",
                        help="logging level of unbroken itself: DEBUG, INFO, WARNING, ERROR or CRITICAL (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run(sub)
    _add_coordinator(sub)
    s = sub.add_parser("status", help="show a coordinator's generation and members")
    s.add_argument("address", metavar="RUN_DIR|HOST:PORT",
                   help="the run directory of an `unbroken run` (its coordinator.json gives the address and token),"
                        " or the coordinator's HOST:PORT")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--timeout", type=float, default=5.0, help="give up after this many seconds (default 5)")
    s.add_argument("--token", default=None,
                   help="the coordinator's token (default: $UNBROKEN_TOKEN, or RUN_DIR/coordinator.json's)")
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
    level = args.log_level.upper()
    if args.command in ("run", "demo") and level == "WARNING":  # the launcher's console: one voice
        logging.basicConfig(level=level, format="[unbroken] %(message)s")
    else:  # a service's log, or a user who asked for detail: when and where from
        logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "coordinator" and args.advertise_host is None and args.host == "0.0.0.0":
        import socket

        args.advertise_host = socket.gethostname()
    handlers = {"run": _run, "coordinator": _coordinator, "status": _status, "report": _report, "demo": _demo}
    try:
        return handlers[args.command](args)
    except (UnbrokenError, ValueError) as exc:
        print(f"unbroken: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.command == "run":
            # The interpreter's last collection at exit walks every object left, torch's modules
            # included (a launcher imports torch to host the store): 0.2-0.4 s of every `unbroken
            # run`'s end on 2 cores. Frozen objects are skipped. The launcher has closed what it
            # wrote (run summary, event log, workers' logs) and stopped its threads by now.
            gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
