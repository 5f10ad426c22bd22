"""The open-file limit: a coordinator's process holds two connections per member, its line
(:mod:`unbroken.coordinator.member_line`) and its connection to the process-group store that the
coordinator hosts (and a member's Gloo group,
with ``UNBROKEN_GLOO_FULL_MESH=1``, one to every peer), so the default soft limit of 1,024 descriptors ends a job
of a few hundred members with ``Too many open files``.

:func:`raise_limit` lifts this process's soft limit to its hard limit (which needs no privilege)
and warns, naming the fix, when even the hard limit is below what the job needs.
"""

from __future__ import annotations

import logging

log = logging.getLogger("unbroken")

HEADROOM = 256
"""Descriptors kept for everything else: files, logs, pipes, the store, the event loop."""


def raise_limit(needed: int, who: str) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; returns the soft limit now in force.

    ``needed``: descriptors the job's size calls for (``who`` names what needs them, for the
    warning). Warns when the limit stays below ``needed + HEADROOM``."""
    try:
        import resource
    except ImportError:  # not on Linux or macOS: nothing to raise
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.debug("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft != resource.RLIM_INFINITY and soft < needed + HEADROOM:
        log.warning(
            "%s needs about %d open files but this process may open %d (hard limit %s): raise it"
            " (ulimit -n in the job script, LimitNOFILE= for systemd, or the container's nofile ulimit)",
            who, needed + HEADROOM, soft, "unlimited" if hard == resource.RLIM_INFINITY else hard,
        )
    return soft
