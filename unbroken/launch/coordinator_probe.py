"""Before any worker starts: does the coordinator the launcher was pointed at answer, and is it one?

A launcher given ``--coordinator HOST:PORT`` (or the ``--rdzv-endpoint`` of another node) used to
start its workers and let their joins retry: a wrong address printed nothing for minutes, and a
port held by another program was joined and hung. :func:`probe` asks ``GET /v1/status`` first:

- an unbroken coordinator answers it (200, or 503 from a candidate that does not lead): go on;
- one that refuses the token (401) is a :class:`~unbroken.errors.ConfigError` saying so;
- something that answers but not the protocol (another HTTP server, a database, a closed reply) is
  a ``ConfigError`` naming the address, at once;
- nothing (connection refused, no reply) is retried while the coordinator may still be starting
  (another node's launcher, an ``unbroken coordinator`` started beside this one), with a console
  line every few seconds, and is a ``ConfigError`` after ``patience`` seconds.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Callable

from unbroken.errors import ConfigError

PATIENCE = 15.0
"""Seconds a coordinator that does not answer at all may take to start."""
SAY_EVERY = 5.0


class _NotOurs(Exception):
    """The address answered, but not as an unbroken coordinator."""


def probe(address: str, token: str | None, say: Callable[[str], None], patience: float = PATIENCE,
          attempt_timeout: float = 2.0, stopped: Callable[[], bool] = lambda: False) -> bool:
    """Wait until a coordinator at one of ``address``'s candidates answers (see the module): True;
    False as soon as ``stopped()`` (a Ctrl-C while it waits).

    Raises:
        ConfigError: the address is not a coordinator, refuses the token, or never answered.
    """
    from unbroken.coordinator.client import parse_address

    candidates = [parse_address(a.strip()) for a in address.split(",") if a.strip()]
    started = time.monotonic()
    said = started
    while True:
        reasons = []
        for host, port in candidates:
            try:
                _ask(host, port, token, attempt_timeout)
                return True
            except _NotOurs as exc:
                raise ConfigError(f"{host}:{port} answered, but not as an unbroken coordinator ({exc}): check --coordinator"
                                  " or --rdzv-endpoint (another program may hold that port)") from None
            except (OSError, http.client.HTTPException) as exc:
                reasons.append(f"{host}:{port}: {_describe(exc)}")
        now = time.monotonic()
        if stopped():
            return False
        if now - started >= patience:
            raise ConfigError(f"no coordinator answered at {address} within {patience:.0f} s ({'; '.join(reasons)}): check"
                              " --coordinator or --rdzv-endpoint, and that the node hosting it is up")
        if now - said >= SAY_EVERY:
            said = now
            say(f"waiting for the coordinator at {address} ({'; '.join(reasons)}); giving up after {patience:.0f} s")
        time.sleep(min(0.25, max(0.0, patience - (now - started))))


def _ask(host: str, port: int, token: str | None, timeout: float) -> None:
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/v1/status", headers={"Authorization": f"Bearer {token}"} if token else {})
        response = connection.getresponse()
        body = response.read(65536)
    except http.client.BadStatusLine as exc:  # a reply that is not HTTP: another protocol on the port
        raise _NotOurs(f"not an HTTP reply: {str(exc)[:60]!r}") from None
    finally:
        connection.close()
    if response.status == 401:
        raise ConfigError(f"the coordinator at {host}:{port} refused this node's token: give every node the job's token"
                          " (--token or UNBROKEN_TOKEN)")
    try:
        reply = json.loads(body)
    except ValueError:
        raise _NotOurs(f"HTTP {response.status} with a body that is not JSON") from None
    if response.status == 200 and isinstance(reply, dict) and "generation" in reply and "members" in reply:
        return
    if response.status == 503 and isinstance(reply, dict):  # a candidate that does not lead: it is one of ours
        return
    raise _NotOurs(f"HTTP {response.status}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "no reply"
    return str(exc) or type(exc).__name__
