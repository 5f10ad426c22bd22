"""Foundation benchmark: stall after a SIGKILL, rejoin time, healthy step time against plain DDP.

    python benchmarks/bench_foundation.py [--workers 3] [--kills 5] [--trials 3]

Prints a markdown table and writes benchmarks/results/foundation.json. Every job is started in
its own session and killed by process group if anything goes wrong; nothing is left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "train_bench.py")
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.common import save_results  # noqa: E402

from testbed.harness import wait_for  # noqa: E402
from unbroken.observe.events import read_events  # noqa: E402


def _run(cmd: list[str], timeout: float, cwd: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=cwd,
                            env={**os.environ, **env} if env else None)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise RuntimeError(f"{cmd[:4]} did not finish in {timeout} s:\n{out[-2000:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}):\n{out[-2000:]}")
    return out


def _step_seconds(output: str) -> float:
    values = [float(v) for v in re.findall(r"STEP_SECONDS ([0-9.]+)", output)]
    if not values:
        raise RuntimeError("no STEP_SECONDS in the output:\n" + output[-2000:])
    return statistics.median(values)


def healthy(workers: int, trials: int, steps: int) -> dict:
    """Alternate plain DDP (torchrun) and unbroken runs; compare median step times."""
    ddp, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(trials):
            ddp.append(_step_seconds(_run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers), SCRIPT, "--mode", "ddp", "--steps", str(steps)], 600, tmp)))
            ours.append(_step_seconds(_run([sys.executable, "-m", "unbroken", "run", "--nproc-per-node", str(workers), "--run-dir", os.path.join(tmp, f"h{len(ours)}"), SCRIPT, "--mode", "unbroken", "--steps", str(steps)], 600, tmp)))
    ratios = [o / d for o, d in zip(ours, ddp)]
    return {"ddp_step_s": ddp, "unbroken_step_s": ours, "ratio": ratios}


def kills(workers: int, count: int) -> dict:
    """One long run; SIGKILL a non-leader worker ``count`` times, each after the previous rejoin."""
    with tempfile.TemporaryDirectory() as run_dir:
        events_path = os.path.join(run_dir, "events.jsonl")
        proc = subprocess.Popen(
            [sys.executable, "-m", "unbroken", "run", "--nproc-per-node", str(workers), "--max-restarts", str(count + 1), "--run-dir", run_dir, SCRIPT, "--mode", "unbroken", "--steps", "1000000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )

        def events():
            return read_events(events_path)[0] if os.path.exists(events_path) else []

        kills_at, victims = [], []
        try:
          try:
            for _ in range(count):
                # Wait until every worker is in a generation and some steps were committed in it.
                def ready():
                    ev = events()
                    since = kills_at[-1] if kills_at else 0.0
                    gens = [e for e in ev if e["kind"] == "generation" and e["t"] > since]
                    if not gens or len(gens[-1]["members"]) != workers:
                        return None
                    steps = [e for e in ev if e["kind"] == "step" and e["t"] > gens[-1]["t"]]
                    return gens[-1] if len(steps) >= 50 else None

                generation = wait_for(ready, 120, "a full generation")
                victim = generation["members"][-1]  # not the leader, whose step events we time
                starts = [e for e in events() if e["kind"] == "worker_start" and e["member"] == victim]
                pid = starts[-1]["pid"]
                kills_at.append(time.time())
                os.kill(pid, signal.SIGKILL)
                victims.append(victim)
                wait_for(lambda: any(e["kind"] == "worker_exit" and e["member"] == victim for e in events()), 30, "the kill to be seen")
            wait_for(lambda: len([e for e in events() if e["kind"] == "heal"]) >= count + 1, 120, "the last rejoin")
            time.sleep(1.0)
          except (RuntimeError, AssertionError):
            for e in events():
                if e["kind"] != "step":
                    print(round(e["t"] - kills_at[0], 3) if kills_at else e["t"], e["kind"], e.get("member"), e.get("members"), e.get("receivers"), file=sys.stderr)
            raise
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        ev = events()
        imports = {}
        with open(os.path.join(run_dir, "imports.jsonl")) as f:
            for line in f:
                record = json.loads(line)
                imports[record["member"]] = record
    steps = [e for e in ev if e["kind"] == "step"]
    healthy_step = statistics.median(e["seconds"] for e in steps)
    stalls, rejoins, import_s, joining, optim_s = [], [], [], [], []
    for t_kill, victim in zip(kills_at, victims):
        after = [e for e in steps if e["t"] > t_kill]
        stalls.append(after[0]["t"] - t_kill - healthy_step)
        rank = victim.split(".w")[1].split(".r")[0]
        restart = [e for e in ev if e["kind"] == "worker_start" and e["t"] > t_kill and e["local_rank"] == int(rank)][0]
        healed = [e for e in ev if e["kind"] == "heal" and restart["member"] in e["receivers"]][0]
        first_commit = [e for e in steps if e["t"] > healed["t"]][0]
        rejoins.append(first_commit["t"] - restart["t"])
        record = imports[restart["member"]]
        import_s.append(record["import_torch"])
        joining.append(first_commit["t"] - record["t"])
        optim_s.append(record["first_optimizer"])
    return {
        "healthy_step_s": healthy_step,
        "stall_s": stalls,
        "rejoin_s": rejoins,
        "rejoin_import_torch_s": import_s,
        "rejoin_join_heal_first_step_s": joining,
        "rejoin_first_optimizer_s": optim_s,
    }


def _fmt(values: list[float], unit: str = "s") -> str:
    return f"{statistics.median(values):.3f} {unit} ({min(values):.3f} – {max(values):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="steps per healthy run")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "foundation.json"))
    args = parser.parse_args()
    result = {"date": time.strftime("%Y-%m-%d"), "workers": args.workers}
    result["kills"] = kills(args.workers, args.kills)
    result["healthy"] = healthy(args.workers, args.trials, args.steps)
    k, h = result["kills"], result["healthy"]
    beyond = [r - i for r, i in zip(k["rejoin_s"], k["rejoin_import_torch_s"])]
    print(f"\n{args.workers} CPU workers, Gloo, {time.strftime('%Y-%m-%d')}; median (min – max)\n")
    print("| measure | result | target |")
    print("| --- | --- | --- |")
    print(f"| stall after SIGKILL (kill → survivors' next commit − one healthy step), {args.kills} kills | {_fmt(k['stall_s'])} | < 0.5 s |")
    print(f"| rejoin (restarted process start → its first commit) | {_fmt(k['rejoin_s'])} | |")
    print(f"| … of which `import torch` | {_fmt(k['rejoin_import_torch_s'])} | |")
    print(f"| … beyond the import | {_fmt(beyond)} | < 1 s |")
    print(f"| … of which torch's lazy imports when the script builds its first optimizer | {_fmt(k['rejoin_first_optimizer_s'])} | |")
    print(f"| … of which unbroken: join, heal from a peer, first step | {_fmt(k['rejoin_join_heal_first_step_s'])} | |")
    print(f"| healthy step, plain DDP (torchrun, Gloo) | {_fmt(h['ddp_step_s'])} | |")
    print(f"| healthy step, unbroken | {_fmt(h['unbroken_step_s'])} | |")
    print(f"| ratio unbroken / DDP, {args.trials} side-by-side pairs | {_fmt(h['ratio'], 'x')} | ≤ 1.03 x |")
    save_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
