"""A refusal, told to the worker's launcher by a file: the coordinator would not take this member.

A replica group's K processes end as one, and the launcher takes the group's status from the
first of them to exit. When process 0 is refused (another group size, a wrong token), the others
may exit first for a reason of their own (a peer gone silent, a collective broken by process 0
leaving) and the slot was restarted, only to be refused again (seen in CI on a loaded machine).
So a refused process writes ``<run dir>/workers/<member id>.refused`` (the exit status) before it
exits, and the launcher reads it for any failed exit of that member: the refusal is the group's
verdict, whichever process exited first.
"""

from __future__ import annotations

from unbroken.observe import member_files

KIND = "refused"


def write(run_dir: str | None, member_id: str, code: int) -> None:
    """Record that ``member_id`` was refused and exits with ``code``."""
    member_files.write(run_dir, member_id, KIND, str(code))


def read(run_dir: str, member_id: str) -> int | None:
    """The exit status ``member_id`` was refused with, or None if it was not refused."""
    try:
        return int((member_files.read(run_dir, member_id, KIND) or "").strip())
    except ValueError:
        return None


def clear(run_dir: str, member_id: str) -> None:
    """Forget a refusal recorded for ``member_id`` (the launcher, before it starts the member)."""
    member_files.remove(run_dir, member_id, KIND)
