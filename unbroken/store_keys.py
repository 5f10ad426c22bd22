"""Key names in the job's stores that a stranger cannot guess.

The coordinator's TCPStore (generations' rendezvous, their flags) and a launcher's group store
(replica groups' rendezvous and relay) take connections from anyone who reaches their port, and
TCPStore has no authentication. It has no way to list keys either: a client reads or writes a
key only by its name. So with a token, every key the job uses lives under a tag derived from the
token and from what the keys are for (a generation, a group's incarnation): without the token a
stranger can neither read nor write them. What this does not protect (the store's availability,
the collectives' own connections) is in docs/protocol.md.
"""

from __future__ import annotations

import hashlib
import hmac


def key_tag(token: str | None, name: str) -> str:
    """``""`` without a token; else 32 hex digits of HMAC-SHA256(token, ``name``) and a ``/``."""
    if not token:
        return ""
    return hmac.new(token.encode(), f"unbroken-store:{name}".encode(), hashlib.sha256).hexdigest()[:32] + "/"
