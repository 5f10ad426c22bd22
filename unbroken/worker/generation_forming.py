"""Forming a generation's group from the coordinator's reply: who its members are, the connection to
the process-group store it rendezvouses over (:class:`StoreConnection`), and a replica group's
agreement before its processes heal and after.

Pieces of :meth:`Joiner._form <unbroken.worker.joining.Joiner._form>`, which builds the group,
has it healed and keeps it; each takes the few things it uses as arguments.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from unbroken.errors import GenerationFailed
from unbroken.open_files import raise_limit

log = logging.getLogger("unbroken.worker.runtime")  # moved out of the runtime; its messages keep their logger


def generation_group(
    reply: dict[str, Any],
    client: Any,
    member_id: str,
    abandoned: Callable[[], str | None],
    wake: Any,
    timeout: float,
    blocked: Callable[[str | None], None],
) -> Any:
    """The (not yet connected) :class:`~unbroken.worker.group.GenerationGroup` of the generation
    ``reply`` announces. Its members: the list the coordinator sent, else names only (processes
    1..K-1 of a replica group, which hold no ``client``), else a
    :class:`~unbroken.coordinator.roster.Roster` that fetches their ids when they are needed."""
    from unbroken.worker.group import LAZY_CONNECT, GenerationGroup

    number = reply["generation"]
    if "members" in reply:  # a coordinator that sends the whole list
        members: Any = reply["members"]
    elif client is None:  # processes 1..K-1 of a replica group: names only for messages
        members = [f"rank{i}" for i in range(int(reply["size"]))]
    else:
        from unbroken.coordinator.roster import Roster

        members = Roster(client, number, int(reply["size"]), member_id, reply["rank"])
    # A lazily connected Gloo group holds connections to its two ring neighbours and to the
    # peers it heals or is healed by; the full mesh one to every peer.
    raise_limit(8 if LAZY_CONNECT else len(members), f"a member of a generation of {len(members)}")
    return GenerationGroup(
        number,
        reply["rank"],
        len(members),
        members,
        abandoned=abandoned,
        wake=wake,
        timeout=timeout,
        blocked=blocked,
    )


def store_prefix(reply: dict[str, Any], replica: Any) -> str:
    """The generation's prefix in the store; in a replica group, its shard's (process j reduces and heals shard j)."""
    prefix = reply["prefix"]
    if replica is not None:
        prefix = f"{prefix}/shard{replica.rank}"  # process j reduces and heals shard j
    return prefix


def connect_store(host: str, port: int, timeout: float) -> Any:
    """A client of the process-group store at ``host:port``; :class:`GenerationFailed` if it cannot be reached."""
    import datetime

    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:  # DistNetworkError / RuntimeError from torch
        raise GenerationFailed(f"cannot reach the process-group store at {host}:{port}: {exc}") from None


class StoreConnection:
    """The connection to the process-group store, kept from one generation to the next while the
    store stays where it is (a restarted coordinator moves it)."""

    def __init__(self) -> None:
        self.store: Any = None
        self.address: tuple[str, int] | None = None
        """Where the store was last reached (or tried)."""

    def connect(self, host: str, port: int, timeout: float) -> Any:
        """The store at ``host:port``, connected now unless it is the one already held."""
        if self.store is not None and self.address != (host, port):
            self.store = None  # the store moved (a restarted coordinator)
        if self.store is None:
            self.address = (host, port)
            self.store = connect_store(host, port, timeout)
        return self.store


def agree_before_healing(
    replica: Any, number: int, error: GenerationFailed | None, state: tuple[int, int, bool], member_id: str, next_step: int,
) -> tuple[GenerationFailed | None, bool]:
    """A replica group's processes, before they heal: did every one connect its shard's group,
    and do they hold the same next step, lineage and freshness (``state``)? If they do not (a heal
    that failed part-way left some shards loaded and others not), the whole group counts as
    fresh, so that every shard is healed again from one source. Returns the error to fail with,
    and whether this process is to heal as fresh."""
    ballot = replica.ballot(error is None, number, state=state)
    if error is None and not ballot.ok:
        return GenerationFailed(f"generation {number}: another process of this replica group could not connect"), False
    if ballot.ok and not ballot.same_state:
        log.warning("%s: the processes of this replica group hold different steps or lineages (this one: step %d);"
                    " the group is healed as fresh", member_id, next_step)
        return error, True
    return error, False


def agree_after_healing(
    replica: Any, number: int, error: GenerationFailed | None, state: tuple[int, int, bool],
) -> tuple[GenerationFailed | None, bool]:
    """A replica group uses a generation only if every one of its processes built and healed its
    shard's group, and they all hold the same step and lineage (``state``) after it. Returns the
    error to fail with, and whether the group's states are still a mix no heal could mend (see
    :func:`unmendable_message`)."""
    ballot = replica.ballot(error is None, number, state=state)
    unmendable = ballot.ok and not ballot.same_state
    if error is None and not ballot.ok:
        error = GenerationFailed(f"generation {number}: another process of this replica group could not join it")
    return error, unmendable


def unmendable_message(member_id: str, number: int, next_step: int) -> str:
    """What a replica group's process says as it ends the group: its processes still hold
    different states after healing as fresh, because nobody in generation ``number`` held the
    job's state to heal every shard from (each shard went to whichever process held the most of
    it). Its state is a mix no step can be trusted from, so the group ends itself; its launcher
    restarts it with a truly fresh state, which is healed from a member that holds the job's, or
    from the newest checkpoint, or starts over."""
    return (f"unbroken: {member_id}: the processes of this replica group hold different steps or lineages"
            f" after healing in generation {number} (this one: step {next_step}), and no member holds the"
            " job's state to heal them from; ending the group so that it restarts fresh")
