"""A member's one-way reports to the coordinator (a failed generation, a stop, a failed job,
catch-ups turned off): posted on the member's line, and a failure to post is a warning, never an
error (each report has a slower path that still holds: the generation's own verdicts, the next
step's exchange).
"""

from __future__ import annotations

import logging
from typing import Any

from unbroken.errors import UnbrokenError

log = logging.getLogger("unbroken.worker.runtime")  # moved out of the runtime; its messages keep their logger


def tell(client: Any, path: str, member_id: str, what: str, **fields: Any) -> None:
    """POST ``fields`` to ``path`` as ``member_id``; ``client`` None (a process of a replica group
    other than 0, whose process 0 reports for the group) posts nothing."""
    if client is None:
        return
    try:
        client.post(path, member=member_id, **fields)
    except UnbrokenError as exc:
        log.warning("%s: could not report %s to the coordinator: %s", member_id, what, exc)
