"""Small files a worker leaves for its node's launcher: ``<run dir>/workers/<member id>.<kind>``.

Written atomically (a reader sees the old text or the new, never half), read back as text; a
run without a run directory, or one that cannot be written, leaves nothing, and a missing file
reads as None. :mod:`~unbroken.observe.leader_mark` and :mod:`~unbroken.observe.refusal_mark`
are the two kinds.
"""

from __future__ import annotations

import os


def _path(run_dir: str, member_id: str, kind: str) -> str:
    return os.path.join(run_dir, "workers", f"{member_id}.{kind}")


def write(run_dir: str | None, member_id: str, kind: str, text: str) -> None:
    if not run_dir:
        return
    path = _path(run_dir, member_id, kind)
    try:
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def read(run_dir: str, member_id: str, kind: str) -> str | None:
    try:
        with open(_path(run_dir, member_id, kind)) as f:
            return f.read()
    except OSError:
        return None


def remove(run_dir: str, member_id: str, kind: str) -> None:
    try:
        os.remove(_path(run_dir, member_id, kind))
    except OSError:
        pass
