"""The simulated members of benchmarks/bench_coordinator.py: one process simulates a slice of them.

    python benchmarks/coordinator_sim.py    (started by bench_coordinator.py, never by hand)

Reads one JSON object a line on stdin (the first one its configuration: ``port``, ``first`` and
``count`` (its slice of member indices), ``interval``, ``survivors``, ``news_hold``), then commands
(``{"do": ...}``: ``start``, ``await``, ``measure``, ``stop``, ``mark``, ``kill``, ``quit``), and
answers those that ask with one JSON object a line on stdout. Times are ``time.monotonic()``
(CLOCK_MONOTONIC, the same in every process of the machine). It ends at ``quit`` or when stdin
closes (its parent ended or died), closing its members' connections.

Each member speaks the coordinator's real HTTP API over ONE keep-alive connection, as a worker
does: its heartbeat poll and its joins take turns on it. No torch, no aiohttp, nothing of
``unbroken``: the parent passes what it needs (the news hold) in the configuration. Its event loop
is uvloop's where installed (the test extra installs it): at 16,384 members the simulators need
as much CPU as the coordinator, on the same two cores, and asyncio's own loop costs them half as
much again (re-formation of 16,384: 0.98-1.04 s with it, 0.72-0.82 s with uvloop, two runs each in
the same hour).
"""

from __future__ import annotations

import asyncio
import json
import gc
import random
import signal
import sys
import time

import orjson

try:  # the simulator's event loop in C: the load generator shares two cores with the coordinator
    import uvloop
except ImportError:  # a slower simulator: it still measures, with less room for the coordinator
    uvloop = None

LOOP = "uvloop" if uvloop is not None else "asyncio"


class Connection(asyncio.Protocol):
    """A minimal HTTP/1.1 keep-alive client, one request at a time, as an asyncio protocol: one
    future per request and no stream machinery. aiohttp's client costs the simulator several times
    the coordinator's CPU per request, and asyncio's streams twice this; on two cores shared with
    the coordinator, the simulator's own cost would be part of what it measures."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiting: asyncio.Future | None = None

    async def post(self, path: str, body: dict) -> tuple[dict, int]:
        loop = asyncio.get_running_loop()
        if self.transport is None:
            await loop.create_connection(lambda: self, "127.0.0.1", self.port)
        payload = orjson.dumps(body)
        self.waiting = loop.create_future()
        self.transport.write(
            b"POST %s HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), len(payload), payload)
        )
        try:
            head, data = await self.waiting
        except BaseException:
            self.close()
            raise
        if not head.startswith(b"HTTP/1.1 200"):
            raise ConnectionError(head.split(b"\r\n", 1)[0].decode())
        return orjson.loads(data), len(data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.waiting is None:
            return
        head = bytes(self.buffer[:end])
        length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        if len(self.buffer) < end + 4 + length:
            return
        data = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        waiting, self.waiting = self.waiting, None
        if not waiting.done():
            waiting.set_result((head, data))

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        self.buffer.clear()
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_exception(ConnectionError("the coordinator closed the connection"))
        self.waiting = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class Member:
    """A member: a heartbeat coroutine and a join coroutine that take turns on one connection.

    From the moment the member decides to join (at the start; after a heartbeat view says its
    generation broke or must be reconfigured) until a join reply says ``formed`` (or
    ``finished``), the join loop has the connection: it waits for a heartbeat poll in flight to
    come back, then sends its joins back to back, and the heartbeat coroutine sends nothing until
    it is over (then polls again with the normal hold)."""

    def __init__(self, sim: "Simulation", index: int) -> None:
        self.sim = sim
        self.id = f"node{index // 8}.w{index % 8}.sim"
        self.connection = Connection(sim.port)  # the member's only one, as a worker's
        self.turn = asyncio.Lock()  # held by a heartbeat poll in flight, or by the whole join loop
        self.joining = asyncio.Event()  # from the decision to join until the join loop is over
        self.idle = asyncio.Event()  # the opposite of `joining`: the heartbeats wait on it
        self.generation = 0
        self.view: dict = {}
        self.formed: dict[int, float] = {}
        self.tasks: list[asyncio.Task] = []
        self.want_join()

    def want_join(self) -> None:
        self.joining.set()
        self.idle.clear()

    def joined(self) -> None:
        self.joining.clear()
        self.idle.set()

    def start(self) -> None:
        self.tasks = [asyncio.ensure_future(self._heartbeats()), asyncio.ensure_future(self._joins())]

    async def kill(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.connection.close()  # the kernel closes a dead process's sockets

    async def _heartbeats(self) -> None:
        sim = self.sim
        hold = sim.interval
        while True:
            if self.joining.is_set():
                await self.idle.wait()  # the join loop has the connection
                hold = sim.interval
            async with self.turn:
                sent = time.monotonic()
                try:
                    view, _ = await self.connection.post(
                        "/v1/heartbeat",
                        {"member": self.id, "step": 0, "progress": 0, "warm": True, "seen": self.view, "hold": hold, "blocked_on": sim.blocked_on},
                    )
                except Exception:
                    view = None
            if view is None:
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
                # formed into it without joining (it waited in the broken generation's allreduce);
                # a join loop waiting for this poll to come back then has nothing to do
                self.generation = generation
                self.formed.setdefault(generation, now)
                self.joined()
            elif generation == self.generation and (view.get("broken") or view.get("reconfigure")):
                self.want_join()
            if changed and (view.get("broken") or view.get("reconfigure")):  # as the worker's heartbeat thread does
                await asyncio.sleep(hold)
                hold = sim.interval

    async def _joins(self) -> None:
        sim = self.sim
        while True:
            await self.joining.wait()
            async with self.turn:  # after a heartbeat poll in flight came back
                while self.joining.is_set():  # that poll's view may have formed it meanwhile
                    try:
                        reply, size = await self.connection.post(
                            "/v1/join",
                            {"member": self.id, "node": "sim", "pid": 1, "step": 0, "after": self.generation, "warm": True, "lean": True},
                        )
                    except Exception:  # a refused or reset connection: retry, as CoordinatorClient does
                        sim.errors += 1
                        await asyncio.sleep(0.1)
                        continue
                    sim.joins += 1
                    status = reply.get("status")
                    if status == "formed":
                        sim.formed_bytes[reply["generation"]] = sim.formed_bytes.get(reply["generation"], 0) + size
                        self.generation = max(self.generation, reply["generation"])
                        self.formed.setdefault(reply["generation"], time.monotonic())
                        self.joined()
                    elif status == "finished":
                        self.joined()
                    elif status != "wait":  # refused, mismatch, failed: not expected here
                        sim.errors += 1
                        await asyncio.sleep(0.1)


class Simulation:
    def __init__(self, port: int, interval: float, survivors: str, news_hold: tuple[float, float]) -> None:
        self.port = port
        self.interval = interval
        self.news_hold = news_hold
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
            return max((m.formed[generation] for m in members), default=0.0)  # 0.0: no live member
        await asyncio.sleep(0.02)
    return None


def reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def serve_slice() -> None:
    loop = asyncio.get_running_loop()
    commands = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(commands), sys.stdin)
    line = await commands.readline()
    if not line:
        return
    config = json.loads(line)
    sim = Simulation(config["port"], config["interval"], config["survivors"], tuple(config["news_hold"]))
    members = {i: Member(sim, i) for i in range(config["first"], config["first"] + config["count"])}
    # the simulator's own collections (Python's default thresholds, 4,096 members' coroutines and
    # futures) stalled a whole slice for tens of ms and showed as the coordinator's lateness
    # (heartbeat p99 80-157 ms with them, 28-111 ms without, in one hour): collected as the
    # coordinator's process is (unbroken.coordinator.garbage.collect_less_often)
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    reply({"ready": True, "loop": LOOP})
    mark = 0
    measured = (0, 0.0)
    try:
        while True:
            line = await commands.readline()
            if not line:  # the parent ended or died
                break
            command = json.loads(line)
            do = command["do"]
            if do == "start":
                for member in members.values():
                    member.start()
            elif do == "await":  # until every live member of this slice holds the generation
                generation = command["generation"]
                at = await wait_all_formed(list(members.values()), generation, command["limit"])
                reply(
                    {
                        "at": at,
                        "first": min((m.formed[generation] for m in members.values() if generation in m.formed), default=None),
                        "held": sum(generation in m.formed for m in members.values()),
                        "live": len(members),
                        "requests": sim.heartbeats + sim.joins - mark,
                        "errors": sim.errors,
                        "formed_bytes": sim.formed_bytes.get(generation, 0),
                    }
                )
            elif do == "measure":
                sim.lateness = []
                sim.measuring = True
                measured = (sim.heartbeats, time.monotonic())
            elif do == "stop":
                sim.measuring = False
                reply(
                    {
                        "heartbeats": sim.heartbeats - measured[0],
                        "seconds": time.monotonic() - measured[1],
                        "lateness": [round(x, 6) for x in sim.lateness],
                    }
                )
            elif do == "mark":  # requests are counted from here
                mark = sim.heartbeats + sim.joins
                reply({"marked": True})
            elif do == "kill":
                victim = members.pop(command["index"])
                killed = time.monotonic()
                await victim.kill()
                reply({"killed": killed})
            elif do == "quit":
                break
    finally:
        for member in members.values():
            await member.kill()


def raise_open_files() -> None:
    """Up to the hard limit: a slice of 4,096 members holds 4,096 connections."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # the slice's connections fail, and are counted as request errors


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's: it ends us by closing our stdin
    raise_open_files()
    try:
        if uvloop is not None:
            uvloop.run(serve_slice())
        else:
            asyncio.run(serve_slice())
    except BrokenPipeError:  # the parent is gone
        pass


if __name__ == "__main__":
    main()
