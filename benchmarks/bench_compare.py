"""unbroken side by side with plain DDP, torchrun elastic, torchft and (optionally) Ray Train.

    python benchmarks/bench_compare.py [--repeats 3] [--systems unbroken,ddp,torchrun,torchft,torchft-ddp]
        [--scenarios healthy,kill,stop,chaos] [--chaos-seconds 180] [--chaos-every 20]
        [--stop-cap 30] [--with-ray] [--out benchmarks/results/compare]

Each system is installed by this script into its own virtual environment under
benchmarks/.venvs (torch 2.13.0 everywhere; torchft 0.2.0, ray[train] 2.60.0 from PyPI) and
trains the same model on the same data with 3 CPU workers. Every scenario runs ``--repeats``
times, the systems interleaved within each repeat. Prints a markdown table (median and range)
and writes compare.json, compare.md and compare.png to ``--out``. About 20 minutes per repeat
without Ray. Every process started is ended, whatever happens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.compare import envs, report, scenarios, systems  # noqa: E402

DEFAULT_SYSTEMS = "unbroken,ddp,torchrun,torchft,torchft-ddp"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma-separated, from {', '.join(systems.SYSTEMS)}")
    p.add_argument("--scenarios", default="healthy,kill,stop,chaos")
    p.add_argument("--chaos-seconds", type=float, default=180.0)
    p.add_argument("--chaos-every", type=float, default=20.0)
    p.add_argument("--stop-cap", type=float, default=30.0, help="SIGCONT the stopped member after this long")
    p.add_argument("--with-ray", action="store_true", help="also Ray Train 2.60 (about 2.4 GB and 15 s to start)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "compare"))
    args = p.parse_args()
    args.systems = [s for s in args.systems.split(",") if s]
    if args.with_ray and "ray" not in args.systems:
        args.systems.append("ray")
    unknown = [s for s in args.systems if s not in systems.SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(systems.SYSTEMS)}")
    args.out = os.path.abspath(args.out)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    bad = [s for s in args.scenarios if s not in ("healthy", "kill", "stop", "chaos")]
    if bad:
        p.error(f"unknown scenario(s) {', '.join(bad)}; choose from healthy, kill, stop, chaos")
    if args.repeats < 1:
        p.error("--repeats must be 1 or more")
    return args


def main() -> int:
    args = parse()
    systems.become_subreaper()

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")  # unwinds through every run's stop()

    # SIGINT too: a job started in the background of a shell inherits it ignored
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupted)
    versions = {}
    for env in sorted({systems.SYSTEMS[s].env for s in args.systems}):
        versions[env] = envs.ensure(env, log=lambda m: print(m, flush=True))
        print(f"{env}: {versions[env]}", flush=True)
    runs_dir = os.path.join(args.out, "runs")
    runs: list[dict] = []
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "versions": versions,
        "systems": args.systems,
        "labels": {s: systems.SYSTEMS[s].label for s in args.systems},
        "governs": {s: systems.SYSTEMS[s].governs_hang for s in args.systems},
        "settings": {"workers": systems.WORKERS, "repeats": args.repeats, "global_batch": scenarios.GLOBAL_BATCH, "healthy_steps": scenarios.HEALTHY_STEPS, "fault_steps": scenarios.FAULT_STEPS, "fault_at": scenarios.FAULT_AT, "stop_cap": args.stop_cap, "chaos_seconds": args.chaos_seconds, "chaos_every": args.chaos_every},
        "runs": runs,
    }
    healthy_step: dict[tuple[str, int], float] = {}
    for repeat in range(args.repeats):
        for scenario in args.scenarios:
            order = sorted(args.systems, key=lambda s: s != "ddp")  # the reference first
            for name in order:
                system = systems.SYSTEMS[name]
                directory = os.path.join(runs_dir, f"{scenario}-{name}-r{repeat}")
                started = time.time()
                step = healthy_step.get((name, repeat)) or healthy_step.get((name, 0)) or 0.0
                try:
                    if scenario == "healthy":
                        got = scenarios.healthy(system, directory)
                        if got["step_seconds"]:
                            healthy_step[(name, repeat)] = got["step_seconds"]
                    elif scenario == "kill":
                        got = scenarios.kill(system, directory, step)
                    elif scenario == "stop":
                        got = scenarios.stop(system, directory, step, args.stop_cap)
                    else:
                        got = scenarios.chaos(system, directory, args.chaos_seconds, args.chaos_every, seed=repeat)
                except Exception as exc:  # one broken run must not lose the others
                    got = {"error": f"{type(exc).__name__}: {exc}"}
                    traceback.print_exc()
                got.update(system=name, scenario=scenario, repeat=repeat, wall=time.time() - started)
                _derive(got, healthy_step, repeat)
                runs.append(got)
                print(json.dumps(got, default=str), flush=True)
                _save(result, args)
    table = _save(result, args)
    print()
    print(table)
    print(f"written: {os.path.join(args.out, 'compare.json')}, compare.md, compare.png")
    return 0


def _derive(got: dict, healthy_step: dict, repeat: int) -> None:
    ddp = healthy_step.get(("ddp", repeat)) or healthy_step.get(("ddp", 0))
    if got["scenario"] == "healthy" and got.get("step_seconds") and ddp:
        got["ratio"] = got["step_seconds"] / ddp
    if got["scenario"] == "chaos" and "goodput" in got and ddp:
        got["goodput_ratio"] = got["goodput"] / (scenarios.GLOBAL_BATCH / ddp)


def _save(result: dict, args: argparse.Namespace) -> str:
    result["summary"] = report.summary(result["runs"], args.systems)
    return report.write(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
