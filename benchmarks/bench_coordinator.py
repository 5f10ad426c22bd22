"""The coordinator under thousands of simulated members (issue 14).

    python benchmarks/bench_coordinator.py [--members 250 1000 4000] [--interval 2.0] [--steady 6]
                                           [--processes P] [--before REV] [--json]

A real coordinator runs in a subprocess (its CPU time read from /proc, its event loop's lateness
recorded from inside by a 10 ms ticker). ``P`` simulator processes (benchmarks/coordinator_sim.py;
by default enough that none simulates more than 4,096 members) simulate ``N`` members with asyncio,
each a contiguous slice of them, no torch. Each member speaks the coordinator's real HTTP API over
ONE keep-alive connection, as a worker does: a heartbeat long poll held ``--interval`` seconds and
answered at once when the member's view changes, and a join whenever its generation is broken or
someone waits. They take turns on that connection: from the member's decision to join until a
join reply says it formed, its joins go back to back (after a poll in flight came back) and it
sends no heartbeat. So the coordinator holds one connection per member, and no process holds more
than its slice's (the open-file limit, often 20,000 a process, allowed no 16,000 members at two
connections each in one process). This process orchestrates the phases over the simulators'
stdin and stdout (one JSON object a line); ``time.monotonic()`` is the same clock in all of them.
Per size:

1. formation: all ``N`` join at once; seconds until every member holds the first generation;
2. steady state for ``--steady`` seconds: coordinator CPU per heartbeat and per second, how late
   held heartbeats came back (beyond their hold), the event loop's worst lateness;
3. one member killed (its connection closed, as the kernel does for a dead process): seconds from
   the kill until every survivor holds the next generation, bytes of the join replies of that
   formation, and the event loop's worst lateness meanwhile.

``--before REV`` runs the same load against the coordinator of git revision ``REV`` too (its
``unbroken`` package extracted to a temporary folder with ``git archive``). Prints a markdown table;
``--json`` prints one JSON object per run instead, with (among others) ``heartbeat_p99_ms`` (how
late the slowest 1% of held heartbeats came back beyond their hold, steady state),
``coordinator_cpu_s_per_s``, ``cpu_us_per_member_s`` and ``reform_s`` (the kill to the next
generation announced to every survivor, from the kill in the simulator that held the victim to the
last survivor's formation in any of them) and ``processes``. Writes benchmarks/results/coordinator.json.
tests/unit/test_bench_coordinator.py runs it at 20 members, in one and in two processes, in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import select
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the coordinator's side (a subprocess) -----------------------------------------------------


def serve(members: int, interval: float, timeout: float, lag_file: str) -> None:
    """Run a coordinator for ``members`` and record its event loop's lateness in ``lag_file``."""
    import logging

    from unbroken.coordinator.server import Coordinator, CoordinatorSettings
    from unbroken.coordinator.membership import MembershipSettings

    logging.getLogger("unbroken").setLevel(logging.ERROR)  # the verdicts of the final teardown
    coordinator = Coordinator(
        CoordinatorSettings(hold=interval),
        MembershipSettings(heartbeat_timeout=timeout, expected_members=members, start_grace=600.0),
    ).start_in_thread()

    async def ticker() -> None:
        # one line per 10 ms tick that came back more than 5 ms late: (when, how late)
        with open(lag_file, "a", buffering=1) as out:
            while True:
                before = time.monotonic()
                await asyncio.sleep(0.01)
                late = time.monotonic() - before - 0.01
                if late > 0.005:
                    out.write(f"{time.monotonic():.4f} {late:.4f}\n")

    asyncio.run_coroutine_threadsafe(ticker(), coordinator._loop)
    print(coordinator.port, flush=True)
    sys.stdin.read()  # until the benchmark closes our stdin


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worst_lag(lag_file: str, start: float, end: float) -> float:
    worst = 0.0
    with open(lag_file) as f:
        for line in f:
            at, late = map(float, line.split())
            if start <= at <= end:
                worst = max(worst, late)
    return worst


# -- the simulated members (child processes running coordinator_sim.py) -------------------------


SIMULATOR = os.path.join(ROOT, "benchmarks", "coordinator_sim.py")
SLICE = 4096
"""Members one simulator process holds at most by default (one connection each, well below the
open-file limits, and a share of the CPU an asyncio loop keeps up with)."""


def news_hold() -> tuple[float, float]:
    """The hold of a worker's poll after a changed view (this tree's, whatever ``--before`` runs)."""
    if ROOT not in sys.path:
        sys.path.append(ROOT)
    from unbroken.coordinator.client import NEWS_HOLD

    return NEWS_HOLD


class Simulator:
    """A child process simulating the members ``first .. first + count - 1``, spoken to in JSON
    lines over its stdin and stdout; it ends when its stdin closes (when this process ends or dies)."""

    def __init__(self, config: dict) -> None:
        self.first, self.count = config["first"], config["count"]
        self.process = subprocess.Popen([sys.executable, SIMULATOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.buffer = bytearray()

    def holds(self, index: int) -> bool:
        return self.first <= index < self.first + self.count

    def send(self, message: dict) -> None:
        self.process.stdin.write((json.dumps(message) + "\n").encode())
        self.process.stdin.flush()

    def receive(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.process.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the simulator of members {self.first}.. did not answer in {timeout:.0f} s")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"the simulator of members {self.first}.. exited ({self.process.wait()})")
                self.buffer += chunk
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer = bytearray(rest)
        return json.loads(line)

    def close(self) -> None:
        try:
            self.send({"do": "quit"})
            self.process.stdin.close()
        except OSError:  # already gone
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def ask(simulators: list[Simulator], message: dict, timeout: float) -> list[dict]:
    """Send ``message`` to every simulator, then read each one's answer."""
    for simulator in simulators:
        simulator.send(message)
    return [simulator.receive(timeout) for simulator in simulators]


def simulate(simulators: list[Simulator], n: int, pid: int, lag_file: str, interval: float, steady: float, limit: float, survivors: str) -> dict:
    slack = 30.0  # beyond a simulator's own limit, before this process stops waiting for it
    started = time.monotonic()
    for simulator in simulators:
        simulator.send({"do": "start"})
    replies = ask(simulators, {"do": "await", "generation": 1, "limit": limit}, limit + slack)
    formed_at = None if any(r["at"] is None for r in replies) else max(r["at"] for r in replies)
    result: dict = {"members": n, "processes": len(simulators), "interval_s": interval, "survivors": survivors,
                    "form_s": round(formed_at - started, 3) if formed_at else None}
    if formed_at is None:
        held = sum(r["held"] for r in replies)
        print(f"{n} members: {held} held the first generation after {limit:.0f} s; giving up", file=sys.stderr, flush=True)
        result["form_cpu_s"] = round(cpu_seconds(pid), 1)
        return result
    # The heartbeats of a freshly formed generation come in bursts, one per interval: measure
    # whole intervals, starting between two bursts, or the counts alias.
    time.sleep(max(0.0, formed_at + 2.5 * interval - time.monotonic()))
    steady = max(1, round(steady / interval)) * interval

    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    for simulator in simulators:
        simulator.send({"do": "measure"})
    time.sleep(steady)
    windows = ask(simulators, {"do": "stop"}, slack)
    cpu1, t1 = cpu_seconds(pid), time.monotonic()
    beats = sum(w["heartbeats"] for w in windows)
    lateness = sorted(x for w in windows for x in w["lateness"])  # every sample: exact percentiles
    result.update(
        heartbeats_per_s=round(sum(w["heartbeats"] / w["seconds"] for w in windows)),
        coordinator_cpu_s_per_s=round((cpu1 - cpu0) / (t1 - t0), 3),
        cpu_us_per_member_s=round(1e6 * (cpu1 - cpu0) / (t1 - t0) / n, 1),
        cpu_us_per_heartbeat=round(1e6 * (cpu1 - cpu0) / max(beats, 1), 1),
        heartbeat_p50_ms=round(1000 * lateness[len(lateness) // 2], 1) if lateness else None,
        heartbeat_p99_ms=round(1000 * lateness[int(len(lateness) * 0.99)], 1) if lateness else None,
        steady_loop_lag_max_ms=round(1000 * worst_lag(lag_file, t0, t1), 1),
    )

    victim = random.Random(n).choice(range(n))  # the member random.Random(n).choice(members) picked
    holder = next(s for s in simulators if s.holds(victim))
    ask(simulators, {"do": "mark"}, slack)  # every simulator counts its requests from here
    cpu0 = cpu_seconds(pid)
    simulators_cpu0 = sum(cpu_seconds(s.process.pid) for s in simulators)
    holder.send({"do": "kill", "index": victim})
    killed = holder.receive(slack)["killed"]
    replies = ask(simulators, {"do": "await", "generation": 2, "limit": limit}, limit + slack)
    done = time.monotonic()
    announced = None if any(r["at"] is None for r in replies) else max((r["at"] for r in replies if r["live"]), default=None)
    result.update(
        reform_requests_per_member=round(sum(r["requests"] for r in replies) / max(n - 1, 1), 2),
        reform_s=round(announced - killed, 3) if announced else None,
        reform_first_s=round(min(r["first"] for r in replies if r["first"] is not None) - killed, 3) if announced else None,
        reform_cpu_s=round(cpu_seconds(pid) - cpu0, 3),
        reform_simulators_cpu_s=round(sum(cpu_seconds(s.process.pid) for s in simulators) - simulators_cpu0, 3),
        reform_loop_lag_max_ms=round(1000 * worst_lag(lag_file, killed, done), 1),
        formed_reply_bytes=sum(r["formed_bytes"] for r in replies),
        request_errors=sum(r["errors"] for r in replies),
    )
    return result


def run_size(n: int, args, src: str) -> dict:
    processes = max(1, min(n, getattr(args, "processes", None) or -(-n // SLICE)))
    with tempfile.TemporaryDirectory() as tmp:
        lag_file = os.path.join(tmp, "lag")
        env = {**os.environ, "PYTHONPATH": src}
        server = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve", str(n), str(args.interval), str(args.timeout), lag_file],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=tmp,
        )
        simulators: list[Simulator] = []
        try:
            port = int(server.stdout.readline())
            hold = news_hold()
            for k in range(processes):
                first, end = k * n // processes, (k + 1) * n // processes
                config = {"port": port, "first": first, "count": end - first, "interval": args.interval,
                          "survivors": args.survivors, "news_hold": list(hold)}
                simulators.append(Simulator(config))
                simulators[-1].send(config)
            loops = {simulator.receive(60.0)["loop"] for simulator in simulators}  # every one is up before the members start
            result = simulate(simulators, n, server.pid, lag_file, args.interval, args.steady, args.limit, args.survivors)
            return {**result, "simulator_loop": "/".join(sorted(loops))}
        finally:
            for simulator in simulators:
                simulator.close()
            server.stdin.close()
            server.terminate()
            server.wait(10)


def table(rows: list[dict]) -> str:
    head = (
        "| code | members | first generation | heartbeats/s | coordinator CPU | CPU per member per s | CPU per heartbeat | heartbeat late p50 / p99"
        " | loop stall, steady | kill to all re-formed | loop stall, re-forming | join reply bytes per formation |"
    )
    lines = [head, "|" + " --- |" * 12]
    for r in rows:
        if r.get("form_s") is None:
            lines.append(f"| {r['code']} | {r['members']} | not every member within {r['limit_s']:.0f} s |" + " - |" * 9)
            continue
        reform = f"{r['reform_s']:.2f} s" if r.get("reform_s") is not None else "never"
        lines.append(
            f"| {r['code']} | {r['members']} | {r['form_s']:.2f} s | {r['heartbeats_per_s']} | {r['coordinator_cpu_s_per_s']:.2f} core"
            f" | {r['cpu_us_per_member_s']:.0f} µs | {r['cpu_us_per_heartbeat']:.0f} µs | {r['heartbeat_p50_ms']} / {r['heartbeat_p99_ms']} ms"
            f" | {r['steady_loop_lag_max_ms']} ms | {reform} | {r['reform_loop_lag_max_ms']} ms | {r['formed_reply_bytes']:,} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, nargs="+", default=[250, 1000, 4000])
    parser.add_argument("--interval", type=float, default=2.0, help="heartbeat hold (the members' interval), seconds")
    parser.add_argument("--timeout", type=float, default=30.0, help="heartbeat timeout, seconds (generous: the simulator shares the CPU)")
    parser.add_argument("--steady", type=float, default=6.0, help="seconds of steady state measured")
    parser.add_argument("--limit", type=float, default=60.0, help="seconds a formation may take before the run gives up")
    parser.add_argument(
        "--survivors",
        choices=["waiting", "computing"],
        default="waiting",
        help="where the survivors are when a member dies: waiting in the step's allreduce (as they report in their heartbeats;"
        " formed into the next generation without joining) or computing (each comes to join)",
    )
    parser.add_argument(
        "--processes", type=int, help=f"simulator processes (default: enough that none simulates more than {SLICE} members)"
    )
    parser.add_argument("--before", help="also run against the coordinator of this git revision")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    codes = [("this tree", ROOT)]
    before_dir = None
    if args.before:
        before_dir = tempfile.mkdtemp(prefix="unbroken-before-")
        archive = subprocess.run(["git", "archive", args.before, "unbroken"], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", before_dir], input=archive, check=True)
        codes.insert(0, (args.before[:10], before_dir))
    rows = []
    for n in args.members:
        for code, src in codes:
            row = {"code": code, "limit_s": args.limit, **run_size(n, args, src)}
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"done: {code}, {n} members", file=sys.stderr, flush=True)
    if not args.json:
        print(table(rows))
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "coordinator.json"), "w") as f:
        json.dump({"interval_s": args.interval, "steady_s": args.steady, "runs": rows}, f, indent=2)


if __name__ == "__main__":
    main()
