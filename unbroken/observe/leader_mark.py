"""Each worker's place in the newest generation it formed, told to its node's launcher by a file.

The launcher's console shows the output of the job's leader (member 0 of the running generation)
when it is one of the node's workers. Polling the coordinator learns the leader half a second
late at best, and a short job's generation can pass whole in that time: its lines were shown
under another worker's name, or not at all. So a worker writes its generation and index to
``<run dir>/workers/<member id>.rank`` when it forms a generation, before it trains in it, and
the launcher reads the marks before it shows a line: a line written after the mark is never
judged by an older one. The coordinator's answer still counts where it is newer (the leader may
be on another node, whose run directory this one does not see).
"""

from __future__ import annotations

from unbroken.observe import member_files

KIND = "rank"


def write(run_dir: str | None, member_id: str, generation: int, index: int) -> None:
    """Record that ``member_id`` is member ``index`` of ``generation`` (a run without a run
    directory records nothing: the console then relies on the coordinator's answer alone)."""
    member_files.write(run_dir, member_id, KIND, f"{generation} {index}")


def newest_leader(run_dir: str, member_ids: list[str]) -> tuple[int, str] | None:
    """(generation, member) of the newest generation that one of ``member_ids`` says it leads,
    or None when none of them leads the generation it last formed."""
    best: tuple[int, str] | None = None
    for member in member_ids:
        try:
            generation, index = (int(x) for x in (member_files.read(run_dir, member, KIND) or "").split())
        except ValueError:
            continue
        if index == 0 and (best is None or generation > best[0]):
            best = (generation, member)
    return best
