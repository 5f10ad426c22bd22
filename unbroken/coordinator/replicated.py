"""Replicated coordinator state in etcd: one leader among coordinator candidates, and decisions
that only the leader can write.

Consensus is etcd's (v3 API, through its JSON gateway and the aiohttp the coordinator already
uses), never home-made. What lives in etcd, under ``/unbroken/<job>/``:

``leader``       the leading candidate's address, attached to its etcd lease (gone when the
                 lease expires);
``generation``   the newest generation formed: ``{number, members, incarnation}``;
``outcome``      once the job ended: ``{"finished": true}`` or ``{"failed": reason}``, kept until
                 the job id is deliberately reused (its keys deleted), so that a leader taking
                 over never starts an ended job again and launchers do not restart its workers;
``candidates/<address>``  every live candidate, attached to a lease of its own, so that members
                 that know one candidate learn all of them.

Every decision is one transaction guarded by the leader key: it succeeds only while this
candidate's lease still holds that key. A deposed leader's write is refused by etcd itself, so
two leaders can never both form a generation. A leader also stops answering by its own clock one
margin before its lease can have expired on etcd's side (it renews every third of the lease), so
that it never serves while another candidate may already lead.

Heartbeats are not written to etcd: a new leader rebuilds liveness from them, and the members,
who see its new incarnation, rejoin it (numbers continue from ``generation``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from unbroken.errors import UnbrokenError

log = logging.getLogger(__name__)


class EtcdUnavailable(UnbrokenError):
    """No etcd endpoint answered (or the cluster has no quorum)."""


class NotLeader(UnbrokenError):
    """A guarded write was refused: this candidate does not hold the leader key (any more)."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


class EtcdGateway:
    """The few calls of etcd's v3 JSON gateway that leadership needs, over aiohttp. Tries every
    endpoint in turn; raises :class:`EtcdUnavailable` when none answers."""

    def __init__(self, endpoints: list[str], timeout: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("need at least one etcd endpoint (HOST:PORT)")
        self.endpoints = [e if e.startswith("http") else f"http://{e}" for e in endpoints]
        self.timeout = timeout
        self._session: Any = None
        self._preferred = 0

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        last: Exception | None = None
        for i in range(len(self.endpoints)):
            endpoint = self.endpoints[(self._preferred + i) % len(self.endpoints)]
            try:
                async with self._session.post(f"{endpoint}/v3/{path}", json=body) as response:
                    data = await response.json(content_type=None)
                    if response.status != 200:
                        raise EtcdUnavailable(f"etcd at {endpoint} answered {response.status} to {path}: {data}")
                    self._preferred = (self._preferred + i) % len(self.endpoints)
                    return data
            except (aiohttp.ClientError, asyncio.TimeoutError, EtcdUnavailable, ValueError) as exc:
                last = exc
        raise EtcdUnavailable(f"no etcd endpoint of {', '.join(self.endpoints)} answered {path}: {last}")

    async def grant(self, ttl: float) -> int:
        return (await self.grant_ttl(ttl))[0]

    async def grant_ttl(self, ttl: float) -> tuple[int, float]:
        """A lease of about ``ttl`` seconds: its id and the TTL etcd granted (whole seconds: it
        rounds 1.45 down to 1, and a leader's validity must count from what was granted)."""
        asked = max(1, round(ttl))
        reply = await self.call("lease/grant", {"TTL": asked})
        return int(reply["ID"]), float(reply.get("TTL", asked))

    async def keepalive(self, lease: int) -> float:
        """Renew ``lease`` once; returns its remaining TTL (0 or less: it has expired)."""
        reply = await self.call("lease/keepalive", {"ID": lease})
        result = reply.get("result", reply)
        return float(result.get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self.call("lease/revoke", {"ID": lease})

    async def prefix(self, prefix: str) -> list[tuple[str, str]]:
        """Every key under ``prefix`` with its value."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        reply = await self.call("kv/range", {"key": _b64(prefix), "range_end": _b64(end)})
        return [(_unb64(kv["key"]), _unb64(kv.get("value", ""))) for kv in reply.get("kvs") or []]

    async def put(self, key: str, value: str, lease: int | None = None) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = lease
        await self.call("kv/put", body)

    async def get(self, key: str) -> tuple[str | None, int]:
        """The value of ``key`` (None if absent) and the store's revision."""
        reply = await self.call("kv/range", {"key": _b64(key)})
        revision = int(reply.get("header", {}).get("revision", 0))
        kvs = reply.get("kvs") or []
        return (_unb64(kvs[0]["value"]) if kvs and "value" in kvs[0] else ("" if kvs else None)), revision

    async def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]] | None = None) -> tuple[bool, dict[str, Any]]:
        reply = await self.call("kv/txn", {"compare": compare, "success": success, "failure": failure or []})
        return bool(reply.get("succeeded")), reply


@dataclass(frozen=True)
class LeadershipSettings:
    """How candidates elect a leader."""

    job: str
    """Names the job's keys (``/unbroken/<job>/...``): every candidate and node of a job uses the same."""
    lease: float = 2.0
    """TTL of the leader's etcd lease, in seconds: a dead leader is replaced after about this long."""
    margin: float = 0.5
    """The leader stops answering this long before its lease can have expired on etcd's side."""
    poll: float = 0.1
    """How often a candidate that does not lead looks whether the leader key is free: the
    failover's latency beyond the lease (reads of one key, cheap for etcd)."""
    registration: float = 10.0
    """TTL of a candidate's entry under ``candidates/``; renewed every third of it."""

    def __post_init__(self) -> None:
        if not self.job or "/" in self.job:
            raise ValueError(f"job id must be a non-empty name without '/', got {self.job!r}")
        if not 0 < self.margin < self.lease / 2:
            raise ValueError(f"need 0 < margin ({self.margin}) < lease / 2 ({self.lease / 2})")
        if not 0 < self.poll <= self.lease / 3:
            raise ValueError(f"need 0 < poll ({self.poll}) <= lease / 3 ({self.lease / 3:.2f})")


class Leadership:
    """One candidate's view of the election, and the leader's guarded writes."""

    def __init__(self, gateway: EtcdGateway, settings: LeadershipSettings, me: str) -> None:
        self.gateway = gateway
        self.settings = settings
        self.me = me
        self.lease: int | None = None
        self.valid_until = 0.0
        """By this candidate's own monotonic clock: it may serve as leader until then."""
        self.prefix = f"/unbroken/{settings.job}/"
        self.granted = settings.lease
        """The TTL etcd granted the leader's lease (it may round the one asked for down)."""
        self.known_leader: str | None = None
        """The leader's address as last read from etcd (a hint for members that ask a candidate)."""
        self._registration: int | None = None

    @property
    def leader_key(self) -> str:
        return self.prefix + "leader"

    def is_leader(self, now: float | None = None) -> bool:
        return self.lease is not None and (time.monotonic() if now is None else now) < self.valid_until

    async def campaign(self) -> bool:
        """Try once to become the leader; True if this candidate now leads."""
        sent = time.monotonic()
        lease, granted = await self.gateway.grant_ttl(self.settings.lease)
        won, _ = await self.gateway.txn(
            [{"key": _b64(self.leader_key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
            [{"request_put": {"key": _b64(self.leader_key), "value": _b64(self.me), "lease": lease}}],
        )
        if not won:
            await self.gateway.revoke(lease)
            return False
        self.lease = lease
        self.granted = granted
        # etcd's clock started the TTL it granted (not the one asked for) no earlier than our
        # request was sent
        self.valid_until = sent + min(granted, self.settings.lease) - self.settings.margin
        log.info("%s leads job %s (etcd lease %x)", self.me, self.settings.job, lease)
        return True

    async def campaign_if_free(self) -> bool:
        """Read the leader key; campaign only when nobody holds it. True if this candidate now
        leads. Cheap enough to run every ``poll`` seconds."""
        self.known_leader = await self.leader()
        if self.known_leader is not None:
            return False
        won = await self.campaign()
        self.known_leader = self.me if won else await self.leader()
        return won

    async def register(self) -> None:
        """Keep this candidate's entry under ``candidates/`` alive (made anew if it lapsed)."""
        if self._registration is not None and await self.gateway.keepalive(self._registration) > 0:
            return
        self._registration = await self.gateway.grant(self.settings.registration)
        await self.gateway.put(self.prefix + "candidates/" + self.me, self.me, lease=self._registration)

    async def candidates(self) -> list[str]:
        """Every registered candidate's address, the leader's first."""
        found = sorted(value for _, value in await self.gateway.prefix(self.prefix + "candidates/"))
        leader = self.me if self.is_leader() else self.known_leader
        return ([leader] if leader in found else []) + [a for a in found if a != leader]

    async def renew(self) -> bool:
        """Renew the leader's lease; False (and no longer leader) if it was lost."""
        if self.lease is None:
            return False
        sent = time.monotonic()
        try:
            ttl = await self.gateway.keepalive(self.lease)
        except EtcdUnavailable:
            return self.is_leader()  # may still lead until valid_until, by our own clock
        if ttl <= 0:
            self.step_down()
            return False
        self.valid_until = sent + min(ttl, self.settings.lease) - self.settings.margin
        return True

    def step_down(self) -> None:
        self.lease = None
        self.valid_until = 0.0

    async def resign(self) -> None:
        """Give up the lead (and the registration) at once, so that another candidate need not
        wait for the lease to run out."""
        leases = [self.lease, self._registration]
        self.lease = self._registration = None
        self.valid_until = 0.0
        for lease in leases:
            if lease is not None:
                try:
                    await self.gateway.revoke(lease)
                except EtcdUnavailable:
                    pass

    async def leader(self) -> str | None:
        value, _ = await self.gateway.get(self.leader_key)
        return value

    async def guarded_put(self, key: str, value: Any, ttl: float | None = None) -> None:
        """Write ``value`` (JSON) under ``key`` only while this candidate holds the leader key;
        with ``ttl``, the key goes away after that many seconds.

        Raises :class:`NotLeader` when etcd refuses (a deposed leader), and steps down."""
        if not self.is_leader():
            raise NotLeader(f"{self.me} is not the leader of job {self.settings.job}")
        ok, _ = await self.gateway.txn(
            [
                {"key": _b64(self.leader_key), "result": "EQUAL", "target": "VALUE", "value": _b64(self.me)},
                {"key": _b64(self.leader_key), "result": "EQUAL", "target": "LEASE", "lease": str(self.lease)},
            ],
            [{"request_put": {"key": _b64(self.prefix + key), "value": _b64(json.dumps(value)),
                              **({"lease": await self.gateway.grant(ttl)} if ttl else {})}}],
        )
        if not ok:
            self.step_down()
            raise NotLeader(f"etcd refused a write of {self.me}: it no longer holds the leader key of job {self.settings.job}")

    async def read(self, key: str) -> Any:
        value, _ = await self.gateway.get(self.prefix + key)
        return None if value is None else json.loads(value)


def leadership_from_flags(etcd: str, job_id: str | None, lease: float, me: str = "") -> Leadership:
    """A candidate's leadership from ``--etcd``, ``--job-id`` and ``--leader-lease``, with clear
    errors for each."""
    from unbroken.errors import ConfigError

    if not job_id:
        raise ConfigError("--etcd needs --job-id: the name every candidate and node of this job shares")
    endpoints = [e.strip() for e in etcd.split(",") if e.strip()]
    if not endpoints:
        raise ConfigError(f"--etcd must list HOST:PORT endpoints, got {etcd!r}")
    try:
        settings = LeadershipSettings(job_id, lease=lease, margin=lease / 4, poll=min(0.1, lease / 3))
    except ValueError as exc:
        raise ConfigError(f"--job-id/--leader-lease: {exc}") from None
    return Leadership(EtcdGateway(endpoints, timeout=lease / 2), settings, me=me)
