"""``unbroken run``'s flags and the launcher's settings made from them (and from SLURM's
environment under srun). The flags' defaults are :class:`LaunchSettings`' own."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Mapping

from unbroken.errors import ConfigError
from unbroken.launch.torchrun_habits import (
    accept_torchrun_flags,
    local_ranks,
    log_level,
    nproc_per_node,
    port_number,
    positive_int,
    refuse_torchrun_flags,
    tee_streams,
)

if TYPE_CHECKING:
    from unbroken.launch.launch_settings import LaunchSettings


def log_level_flag(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` after the command too (``unbroken run --log-level INFO``), as torchrun users
    write it; given before the command it works as well."""
    parser.add_argument("--log-level", type=log_level, default=argparse.SUPPRESS,
                        help="logging level of unbroken itself: DEBUG, INFO, WARNING, ERROR or CRITICAL (default WARNING)")


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """Add ``--a-b`` with torchrun's ``--a_b`` spelling as an alias."""
    names = [name]
    if "-" in name[2:]:
        names.append("--" + name[2:].replace("-", "_"))
    parser.add_argument(*names, **kwargs)


class _OneSpellingHelp(argparse.HelpFormatter):
    """``--help`` shows each flag once: torchrun's underscore spellings (``--nproc_per_node``) and
    torchrun's other names for a flag are accepted but not listed (docs/guide/settings.md names them)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = [o for o in action.option_strings if "_" not in o]
        if action.option_strings and len(shown) > 1 and shown[0].startswith("--"):
            shown = shown[:1]  # the first long name; its aliases (--shutdown-timeout) in the guide
        if not action.option_strings or not shown:
            return super()._format_action_invocation(action)
        original, action.option_strings = action.option_strings, shown
        try:
            return super()._format_action_invocation(action)
        finally:
            action.option_strings = original


def add_run(sub: argparse._SubParsersAction) -> None:
    from unbroken.launch.launch_settings import LaunchSettings

    d = LaunchSettings.__dataclass_fields__
    # allow_abbrev=False: the script's own flags (--warmup) must never be read as abbreviations of ours
    p = sub.add_parser("run", help="run a training script on this node, surviving worker failures", allow_abbrev=False,
                       formatter_class=_OneSpellingHelp, usage="unbroken run [flags] SCRIPT [script args]")
    # in this order in the help and the CLI reference, one section each (torchrun's flags first)
    _add_run_workers(p.add_argument_group("workers (torchrun's --nproc-per-node, --max-restarts)"), d)
    _add_run_coordinator(p.add_argument_group("coordinator and liveness (torchrun's --rdzv-endpoint)"), d)
    _add_run_checkpoints(p.add_argument_group("durable checkpoints"), d)
    _add_run_membership(p.add_argument_group("membership and timeouts"), d)
    _add_run_supervision(p.add_argument_group("restarts, shutdown, console and fault injection"), d)
    _add_run_replication(p.add_argument_group("replicated coordinator (etcd)"), d)
    p.add_argument("-m", "--module", action="store_true",
                   help="SCRIPT is a module, run as `python -m SCRIPT` (torchrun's -m; default: a file)")
    log_level_flag(p)
    refuse_torchrun_flags(p)
    accept_torchrun_flags(p)
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _add_run_workers(p: argparse.ArgumentParser, d: Mapping[str, Any]) -> None:
    """The worker slots of this node and their restart budget; where the run goes."""
    _flag(p, "--nproc-per-node", type=str, default="1",
          help="worker processes on this node: a number, gpu (one per visible GPU), cpu (one per CPU) or auto (gpu if"
          " there is one, else cpu) (default 1)")
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
    _flag(p, "--stragglers", choices=["balance", "report", "evict", "off"], default=d["stragglers"].default,
          help="a member slower than the others: balance gives it fewer micro-batches (the same model) and flags it,"
               " report only flags it, evict also ends one that stays below half the median pace, off measures nothing"
               " (default %(default)s)")
    _flag(p, "--shard-optimizer", action="store_true",
          help="shard the optimizer's state across the members, each part held by two (about 2/N of it per member),"
               " re-partitioned among the survivors when a member is lost; element-wise torch.optim optimizers")
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
    _flag(p, "--coordinator-port", type=port_number, default=d["coordinator_port"].default, help="port of the embedded coordinator (default 0: any free)")
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
    _flag(p, "--nnodes", default=None, help="MIN:MAX nodes (torchrun spelling); sets --min-members/--max-members to MIN*P/MAX*P, P being the members of one node (--nproc-per-node / --group-size) (default: none)")
    _flag(p, "--min-members", type=int, default=d["min_members"].default, help="no generation below this many workers (default %(default)s)")
    _flag(p, "--max-members", type=int, default=None, help="at most this many workers in a generation (default: no limit)")
    _flag(p, "--progress-timeout", type=float, default=d["progress_timeout"].default,
          help="evict a worker whose progress stops this long while peers wait for it (default %(default)s)")
    _flag(p, "--warmup-timeout", type=float, default=d["warmup_timeout"].default,
          help="the same for a worker's first step (compilation, loading) (default %(default)s)")
    _flag(p, "--busy-timeout", type=float, default=d["busy_timeout"].default,
          help="end a worker whose work marked busy (a checkpoint snapshot, write or read; job.on_leader's fn on the"
          " leader; warming memory for a heal; leaving the loop) has lasted this long (default %(default)s)")
    _flag(p, "--quorum-timeout", type=float, default=d["quorum_timeout"].default, help="fail if below --min-members this long (default %(default)s)")
    _flag(p, "--start-grace", type=float, default=d["start_grace"].default, help="first generation waits this long for all workers (default %(default)s)")


def _add_run_supervision(p: argparse.ArgumentParser, d: Mapping[str, Any]) -> None:
    """Restart delays, shutdown, the console, fault injection and the sample record."""
    _flag(p, "--restart-backoff", type=float, default=d["restart_backoff"].default,
          help="restart delay after a slot's first failure within the window; doubles with each further one (default %(default)s)")
    _flag(p, "--max-restart-backoff", type=float, default=d["max_restart_backoff"].default, help="upper bound of the restart delay (default %(default)s)")
    p.add_argument("--shutdown-grace", "--shutdown_grace", "--shutdown-timeout", "--shutdown_timeout", type=float,
                   default=d["shutdown_grace"].default, dest="shutdown_grace",
                   help="seconds between SIGTERM and SIGKILL at shutdown (torchrun's --shutdown-timeout); once the job"
                   " finished, how long a worker that has not left the training loop gets before SIGKILL (default %(default)s)")
    p.add_argument("--local-ranks-filter", "--local_ranks_filter", type=local_ranks, default=None, dest="console_ranks",
                   metavar="R[,R...]",
                   help="show these slots' output on the console: local ranks, or with --group-size replica groups'"
                   " process 0 (default: the job's leader when it runs on this node, else the lowest local rank alive)."
                   " Any worker's tracebacks and errors are shown too; every worker's whole output is in"
                   " RUN_DIR/workers/w<slot>.log")
    p.add_argument("--tee", "-t", type=tee_streams, default=3, metavar="{0,1,2,3}",
                   help="which streams of the shown workers reach the console, as torchrun's: 1 stdout, 2 stderr,"
                   " 3 both, 0 none (both always go to the log) (default %(default)s)")
    _flag(p, "--progress-interval", type=float, default=d["progress_interval"].default,
          help="seconds between progress lines when the output is not a terminal; 0: no progress display (default %(default)s)")
    _flag(p, "--chaos", default=None, help="fault schedule, e.g. 'kill@step,rank=1,step=20' (see docs)")
    _flag(p, "--record-samples", action="store_true", help="log every step's sample positions under the run directory")
    _flag(p, "--no-zygote", action="store_true",
          help="start every worker as a fresh interpreter, not by fork from a process that imported torch already"
          " (default: forked; also UNBROKEN_ZYGOTE=0)")


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
    _flag(p, "--etcd-port", type=port_number, default=2379, help="with --ha: etcd's client port; the peer port is the next (default %(default)s)")


_positive_int = positive_int


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
    from unbroken.launch.launch_settings import LaunchSettings, check_group_size
    from unbroken.launch.placement import placement

    nproc = nproc_per_node(args.nproc_per_node)
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
        module=args.module,
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
        console_ranks=args.console_ranks,
        tee=args.tee,
        progress_interval=args.progress_interval,
        chaos=args.chaos,
        record_samples=args.record_samples,
        zygote=not args.no_zygote and env.get("UNBROKEN_ZYGOTE", "1") not in ("0", "false", "no"),
        backend=args.backend,
        stragglers=args.stragglers,
        shard_optimizer=args.shard_optimizer,
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
