"""The coordinator under thousands of simulated members (issue 14).

    python benchmarks/bench_coordinator.py [--members 250 1000 4000] [--interval 2.0] [--steady 6]
                                           [--before REV] [--json]

A real coordinator runs in a subprocess (its CPU time read from /proc, its event loop's lateness
recorded from inside by a 10 ms ticker). This process simulates ``N`` members with asyncio, no
torch, each speaking the coordinator's real HTTP API over a connection of its own, as a worker's
heartbeat thread and main thread do: a heartbeat long poll held ``--interval`` seconds and
answered at once when the member's view changes, and a join whenever its generation is broken or
someone waits. Per size:

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
generation announced to every survivor). Writes benchmarks/results/coordinator.json.
tests/unit/test_bench_coordinator.py runs it at 20 members in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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


# -- the simulated members -----------------------------------------------------------------------


class Connection:
    """A minimal HTTP/1.1 keep-alive client over asyncio streams: aiohttp's client costs the
    simulator several times the coordinator's CPU per request, and would measure itself."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict) -> tuple[dict, int]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        payload = json.dumps(body).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            data = await self.reader.readexactly(length)
        except BaseException:
            self.close()
            raise
        if not head.startswith(b"HTTP/1.1 200"):
            raise ConnectionError(head.split(b"\r\n", 1)[0].decode())
        return json.loads(data), len(data)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def news_hold() -> tuple[float, float]:
    """The hold of a worker's poll after a changed view (this tree's, whatever ``--before`` runs)."""
    if ROOT not in sys.path:
        sys.path.append(ROOT)
    from unbroken.coordinator.client import NEWS_HOLD

    return NEWS_HOLD


class Member:
    def __init__(self, sim: "Simulation", index: int) -> None:
        self.sim = sim
        self.id = f"node{index // 8}.w{index % 8}.sim"
        # two connections, as a worker's heartbeat thread and main thread each keep one
        self.beat = Connection(sim.port)
        self.main = Connection(sim.port)
        self.generation = 0
        self.view: dict = {}
        self.formed: dict[int, float] = {}
        self.rejoin = asyncio.Event()
        self.rejoin.set()
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.ensure_future(self._heartbeats()), asyncio.ensure_future(self._joins())]

    async def kill(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.beat.close()  # the kernel closes a dead process's sockets
        self.main.close()

    async def _heartbeats(self) -> None:
        sim = self.sim
        hold = sim.interval
        while True:
            sent = time.monotonic()
            try:
                view, _ = await self.beat.post(
                    "/v1/heartbeat",
                    {"member": self.id, "step": 0, "progress": 0, "warm": True, "seen": self.view, "hold": hold, "blocked_on": sim.blocked_on},
                )
            except Exception:
                sim.errors += 1
                await asyncio.sleep(sim.interval)
                continue
            now = time.monotonic()
            sim.heartbeats += 1
            if view == self.view and sim.measuring:
                sim.lateness.append(now - sent - hold)
            hold = sim.interval
            changed = view != self.view
            if changed:
                hold = sim.interval * random.uniform(*sim.news_hold)  # as the worker's heartbeat thread does
            self.view = view
            generation = view.get("generation", 0)
            if generation > self.generation and view.get("state") == "active" and view.get("rank") is not None and not view.get("broken"):
                # formed into it without joining (it waited in the broken generation's allreduce)
                self.generation = generation
                self.formed.setdefault(generation, now)
                self.rejoin.clear()
            elif generation == self.generation and (view.get("broken") or view.get("reconfigure")):
                self.rejoin.set()
            if changed and (view.get("broken") or view.get("reconfigure")):  # as the worker's heartbeat thread does
                await asyncio.sleep(hold)
                hold = sim.interval

    async def _joins(self) -> None:
        sim = self.sim
        while True:
            await self.rejoin.wait()
            while True:
                try:
                    reply, size = await self.main.post(
                        "/v1/join",
                        {"member": self.id, "node": "sim", "pid": 1, "step": 0, "after": self.generation, "warm": True, "lean": True},
                    )
                except Exception:  # a refused or reset connection: retry, as CoordinatorClient does
                    sim.errors += 1
                    await asyncio.sleep(0.1)
                    continue
                sim.joins += 1
                if reply["status"] == "formed":
                    sim.formed_bytes[reply["generation"]] = sim.formed_bytes.get(reply["generation"], 0) + size
                    self.generation = max(self.generation, reply["generation"])
                    self.formed.setdefault(reply["generation"], time.monotonic())
                    self.rejoin.clear()
                    break


class Simulation:
    def __init__(self, port: int, interval: float, survivors: str = "waiting") -> None:
        self.port = port
        self.interval = interval
        self.news_hold = news_hold()
        self.blocked_on = "allreduce" if survivors == "waiting" else None
        """What each member reports waiting in: the step's allreduce (``--survivors waiting``, where
        a data-parallel job's survivors are when a member dies), or nothing (``computing``)."""
        self.heartbeats = 0
        self.joins = 0
        self.errors = 0
        self.measuring = False
        self.lateness: list[float] = []
        self.formed_bytes: dict[int, int] = {}


async def wait_all_formed(members: list[Member], generation: int, limit: float) -> float | None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if all(generation in m.formed for m in members):
            return max(m.formed[generation] for m in members)
        await asyncio.sleep(0.02)
    return None


async def simulate(
    n: int, port: int, pid: int, lag_file: str, interval: float, steady: float, limit: float, survivors: str = "waiting"
) -> dict:
    sim = Simulation(port, interval, survivors)
    members = [Member(sim, i) for i in range(n)]
    started = time.monotonic()
    for member in members:
        member.start()
    formed_at = await wait_all_formed(members, 1, limit)
    result: dict = {"members": n, "interval_s": interval, "survivors": survivors, "form_s": round(formed_at - started, 3) if formed_at else None}
    if formed_at is None:
        held = sum(1 in m.formed for m in members)
        print(f"{n} members: {held} held the first generation after {limit:.0f} s; giving up", file=sys.stderr, flush=True)
        result["form_cpu_s"] = round(cpu_seconds(pid), 1)
        await asyncio.gather(*(m.kill() for m in members))
        return result
    # The heartbeats of a freshly formed generation come in bursts, one per interval: measure
    # whole intervals, starting between two bursts, or the counts alias.
    await asyncio.sleep(max(0.0, formed_at + 2.5 * interval - time.monotonic()))
    steady = max(1, round(steady / interval)) * interval

    cpu0, beats0, t0 = cpu_seconds(pid), sim.heartbeats, time.monotonic()
    sim.measuring = True
    await asyncio.sleep(steady)
    sim.measuring = False
    cpu1, beats1, t1 = cpu_seconds(pid), sim.heartbeats, time.monotonic()
    beats = beats1 - beats0
    lateness = sorted(sim.lateness)
    result.update(
        heartbeats_per_s=round(beats / (t1 - t0)),
        coordinator_cpu_s_per_s=round((cpu1 - cpu0) / (t1 - t0), 3),
        cpu_us_per_member_s=round(1e6 * (cpu1 - cpu0) / (t1 - t0) / n, 1),
        cpu_us_per_heartbeat=round(1e6 * (cpu1 - cpu0) / max(beats, 1), 1),
        heartbeat_p50_ms=round(1000 * lateness[len(lateness) // 2], 1) if lateness else None,
        heartbeat_p99_ms=round(1000 * lateness[int(len(lateness) * 0.99)], 1) if lateness else None,
        steady_loop_lag_max_ms=round(1000 * worst_lag(lag_file, t0, t1), 1),
    )

    victim = random.Random(n).choice(members)
    survivors = [m for m in members if m is not victim]
    cpu0, killed = cpu_seconds(pid), time.monotonic()
    requests0 = sim.heartbeats + sim.joins
    await victim.kill()
    announced = await wait_all_formed(survivors, 2, limit)
    done = time.monotonic()
    requests = sim.heartbeats + sim.joins - requests0
    result.update(
        reform_requests_per_member=round(requests / max(len(survivors), 1), 2),
        reform_s=round(announced - killed, 3) if announced else None,
        reform_cpu_s=round(cpu_seconds(pid) - cpu0, 3),
        reform_loop_lag_max_ms=round(1000 * worst_lag(lag_file, killed, done), 1),
        formed_reply_bytes=sim.formed_bytes.get(2, 0),
        request_errors=sim.errors,
    )
    await asyncio.gather(*(m.kill() for m in survivors))
    return result


def run_size(n: int, args, src: str) -> dict:
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
        try:
            port = int(server.stdout.readline())
            return asyncio.run(simulate(n, port, server.pid, lag_file, args.interval, args.steady, args.limit, args.survivors))
        finally:
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
