"""Asking to join: what a member's join carries and what the coordinator's answer means.

A join carries the member's *preflight* (:func:`preflight`): what every member must agree on, or
the collectives mismatch, compared by the coordinator. The answer is a formed generation, the
job's end, or a refusal (:func:`refusal` says what a refusal means for the worker). A member whose
heartbeat already told it that the coordinator formed it into a newer generation needs no join
at all (:func:`formed_from_view`). The joiner (:mod:`unbroken.worker.joining`) holds the client and
the view these take, and acts on the answers.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any

import torch

from unbroken.errors import EXIT_MISMATCH, JobCannotGoOn


def preflight(settings: Any, reducer: Any, total: int | None, plan: Any, replica: Any, model: Any) -> dict[str, Any]:
    """What every member must agree on, or the collectives mismatch (a livelock, or the wrong
    parameters summed together): sent with every join, compared by the coordinator.

    ``settings`` are the worker's :class:`~unbroken.worker.runtime_settings.RuntimeSettings`,
    ``reducer`` its :class:`~unbroken.worker.gradients.GradientReducer` (None alone), ``plan`` its
    :class:`~unbroken.data.data_plan.DataPlan`, ``replica`` its replica group (or None) and
    ``model`` the model that group shards."""
    from unbroken.version import __version__

    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    try:
        with open(script, "rb") as f:
            script_hash = hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        script_hash = "-"
    layout = [] if reducer is None else [
        f"{b.flat.dtype}x{b.numel}/{len(b.params)}" for b in reducer.buckets
    ]
    return {
        "gradient buckets": hashlib.sha256(";".join(layout).encode()).hexdigest()[:16] + f" ({len(layout)} buckets)",
        "bucket_cap_mb": str(settings.bucket_cap_mb),
        "verify_every": str(settings.verify_every),
        "stragglers": settings.stragglers,
        "total steps": str(total),
        "data plan": (
            f"dataset {plan.dataset_len}, global batch {plan.global_batch_size},"
            f" micro-batch {plan.micro_batch_size}, seed {plan.seed}"
        ),
        **group_preflight(replica, model),
        "torch": torch.__version__,
        "unbroken": __version__,
        "script": f"{os.path.basename(script)} sha256 {script_hash}",
    }


def group_preflight(replica: Any, model: Any) -> dict[str, str]:
    """A replica group's size and sharding: every group must match (same shard at index j)."""
    if replica is None:
        return {}
    from unbroken.replica_groups.sharding import sharding_fingerprint

    return {"group size": str(replica.size), "sharding": sharding_fingerprint(model)}


CATCH_UP_HOLD = 0.1
"""Seconds the coordinator may hold the join of a member that catches up (its own hold is the
heartbeat interval): the others re-form for it once its next join says it has caught up, so a
longer hold would be time it trains no step (measured: 2.1 s per catch-up with the full hold)."""


def ask_to_join(
    client: Any,
    member_id: str,
    node: str | None,
    step: int,
    after: int,
    warm: bool,
    preflight: dict[str, Any],
    catch_up: str | None = None,
) -> dict[str, Any]:
    """Post this member's join (at ``step``, for a generation after ``after``) and return the
    coordinator's answer; ``catch_up``: the address a donor streams the state to, if any."""
    return client.post(
        "/v1/join",
        read_timeout=30.0,
        member=member_id,
        node=node,
        pid=os.getpid(),
        step=step,
        after=after,
        warm=warm,
        preflight=preflight,
        # catching up, it asks again soon: it must say it has caught up as soon as it has
        **({"catch_up": catch_up, "hold": CATCH_UP_HOLD} if catch_up else {}),
        lean=True,  # no member list in the reply: a Roster fetches ids if they are needed
    )


def formed_from_view(
    view: dict[str, Any], store_address: tuple[str, int] | None, incarnation: str | None, after: int,
) -> dict[str, Any] | None:
    """The join reply this member would get, when its heartbeat's ``view`` already told it that
    the coordinator formed it into a generation newer than ``after`` (it was waiting in a
    collective of the one a verdict broke: ``Membership.take_survivors``); None when it must ask.
    Only from the coordinator ``incarnation`` that formed its last generation, whose store is at
    ``store_address``."""
    number = view.get("generation", 0)
    if (
        store_address is None
        or incarnation is None
        or view.get("incarnation") != incarnation
        or view.get("state") != "active"
        or view.get("broken")
        or view.get("rank") is None
        or number <= after
    ):
        return None
    host, port = store_address
    return {
        "status": "formed",
        "incarnation": incarnation,
        "generation": number,
        "size": view["size"],
        "rank": view["rank"],
        "prefix": view["prefix"],
        **({"stop": view["stop"]} if view.get("stop") else {}),
        "store_host": host,
        "store_port": port,
    }


def refusal(reply: dict[str, Any], member_id: str) -> tuple[str, int] | None:
    """What to say and the exit status to end with, if the coordinator's ``reply`` will not take
    this member; None if it may go on. A job that cannot go on at all raises :class:`JobCannotGoOn`."""
    if reply["status"] == "failed":
        raise JobCannotGoOn(f"the job cannot go on: {reply.get('reason')}")
    if reply["status"] == "mismatch":
        return (
            f"unbroken: error: {member_id} does not match the job, so the coordinator refused it:"
            f" {reply.get('reason')}. Run every node with the same script, settings and versions.",
            EXIT_MISMATCH,
        )
    if reply["status"] == "refused":
        return f"unbroken: {member_id}: the coordinator refuses this member: {reply.get('reason')}", 1
    return None
