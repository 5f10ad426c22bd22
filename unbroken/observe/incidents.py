"""Failures counted as incidents, for ``unbroken report``.

Failure-related events (``verdict``, ``failure``, a ``worker_exit`` with a non-zero status, a
chaos ``fault``) that follow each other within :data:`INCIDENT_GAP` seconds are one incident. A
SIGKILL therefore counts once, although the launcher reports the exit, the coordinator gives its
verdict and a survivor reports the broken collective. The incident is classified by its
strongest evidence (:data:`EVIDENCE`). A worker that crashed counts even where the coordinator
never saw it (a script that fails before it joins, restarted until its slot is quarantined); one
the launcher stopped on purpose (at the end of the job) does not; nor does anything
about a node's members after its launcher's ``shutdown`` event (a Ctrl-C or SIGTERM).
Each incident that hit the running generation is measured: its stall lasts until the next commit
of a later generation, less one median step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from unbroken.observe.run_log import is_int

# Failure-related events closer than this (seconds) belong to one incident.
INCIDENT_GAP = 1.0

# Evidence that classifies an incident, strongest first.
EVIDENCE = ("launcher", "connection", "heartbeat", "progress watchdog", "collective")


@dataclass
class Incident:
    start: float  # time of its first event (a chaos fault, if one led to it)
    end: float
    kind: str  # the strongest evidence, one of EVIDENCE (or another detected_by value)
    members: list[str]  # the members that died (verdicts, non-zero exits, faults)
    generation: int | None  # the generation that was running
    affected: bool  # whether a member of that generation was lost or it reported a failure
    events: list[dict[str, Any]]
    stall: float | None = None  # to the next commit in a later generation, less one median step
    resumed_at: float | None = None


def rank(kind: str) -> int:
    """Where ``kind`` stands in :data:`EVIDENCE` (strongest first; others after)."""
    return EVIDENCE.index(kind) if kind in EVIDENCE else len(EVIDENCE)


def evidence(event: dict[str, Any]) -> str | None:
    """What detected the failure that ``event`` reports, or None if it reports none."""
    kind = event["kind"]
    if kind == "worker_exit":
        return "launcher"
    if kind in ("verdict", "failure"):
        return str(event.get("detected_by") or ("collective" if kind == "failure" else "unknown"))
    return None


def _is_failure_event(event: dict[str, Any]) -> bool:
    kind = event["kind"]
    if kind == "worker_exit":
        code = event.get("code")
        return is_int(code) and code != 0
    return kind in ("verdict", "failure", "fault")


def _stopped(event: dict[str, Any], stops: dict[Any, float]) -> bool:
    """Whether ``event`` concerns a member of a node whose launcher was stopping it (a Ctrl-C)."""
    member = event.get("member")
    node = member.rsplit(".", 2)[0] if isinstance(member, str) and member.count(".") >= 2 else None
    return node in stops and event["t"] >= stops[node]


def _generation_at(generations: list[dict[str, Any]], t: float) -> dict[str, Any] | None:
    current = None
    for g in generations:
        if g["t"] > t:
            break
        current = g
    return current


def incidents(events: list[dict[str, Any]], steps: list[dict[str, Any]], median_step: float) -> list[Incident]:
    """Group failure-related events into incidents and measure the stall each one caused."""
    stops = {e.get("node"): e["t"] for e in events if e["kind"] == "shutdown"}
    related = [e for e in events if _is_failure_event(e) and not _stopped(e, stops)]
    chains: list[list[dict[str, Any]]] = []
    for event in related:
        if chains and event["t"] - chains[-1][-1]["t"] <= INCIDENT_GAP:
            chains[-1].append(event)
        else:
            chains.append([event])
    generations = [e for e in events if e["kind"] == "generation"]
    found: list[Incident] = []
    previous_end = -math.inf
    for chain in chains:
        coordinator = [e for e in chain if e["kind"] in ("verdict", "failure")]
        crashed = [e for e in chain if e["kind"] == "worker_exit" and not str(e.get("how", "")).endswith("(stopped by the launcher)")]
        if not coordinator and not crashed:
            continue  # a fault the coordinator never called a failure
        kinds = [k for k in (evidence(e) for e in chain) if k is not None]
        kind = min(kinds, key=rank)
        members = []
        for e in chain:
            if e["kind"] in ("verdict", "worker_exit", "fault") and isinstance(e.get("member"), str) and e["member"] not in members:
                members.append(e["member"])
        start, end = chain[0]["t"], chain[-1]["t"]
        # A fault that hung a worker (stop, spin) comes long before the verdict: it is the onset.
        for e in related:
            if e["kind"] == "fault" and previous_end < e["t"] < start and e.get("member") in members:
                start = e["t"]
                break
        failures = [e for e in chain if e["kind"] == "failure"]
        running = _generation_at(generations, start)
        if failures:
            generation = max(e["generation"] for e in failures)
        else:
            generation = running["generation"] if running is not None else None
        if failures or running is None or not isinstance(running.get("members"), list):
            affected = True
        else:
            affected = any(m in running["members"] for m in members)
        incident = Incident(start, end, kind, members, generation, affected, chain)
        if affected:
            later = (s for s in steps if s["t"] >= start and (generation is None or s["generation"] > generation))
            resumed = next(later, None)
            if resumed is not None:
                incident.resumed_at = resumed["t"]
                incident.stall = max(0.0, resumed["t"] - start - median_step)
        found.append(incident)
        previous_end = end
    return found


def state_loss_text(event: dict[str, Any], checkpointing: bool | None = None, resumed_at: int | None = None) -> str:
    """What a ``state_lost`` event means for the user, in one sentence: which steps are trained
    again and why; with ``checkpointing`` False, what to do about it next time; None: said as it
    happens, before it is known whether a checkpoint is read. ``resumed_at``: the
    step of the checkpoint the generation then read (its members held nothing: the event says step
    0), where it really went on from."""
    start, lost = event.get("step"), event.get("lost")
    if isinstance(resumed_at, int) and (not isinstance(start, int) or resumed_at > start):
        start = resumed_at
    again = f"steps {start}-{lost - 1}" if isinstance(start, int) and isinstance(lost, int) and lost - 1 > start else f"from step {start}"
    if checkpointing is None:  # said as it happens: whether a checkpoint is read next is not known yet
        return (f"progress lost: generation {event.get('generation')} formed at step {start} though the job had reached step"
                f" {lost} ({event.get('reason')}); it goes on from its newest checkpoint if there is one, else {again}"
                " are trained again")
    text = (f"progress lost: generation {event.get('generation')} went on from step {start} though the job had reached step"
            f" {lost} ({event.get('reason')}); {again} are trained again")
    if checkpointing is False:
        text += ": no checkpoint was configured; use --checkpoint-dir"
    return text


def progress_lost(events: list[dict[str, Any]]) -> list[str]:
    """What the run's ``state_lost`` events say (:func:`state_loss_text`), each from the step the
    job went on from: a checkpoint's when one took the job back (the first ``resume`` event after it,
    before the next loss)."""
    lines = []
    checkpointing = any(e.get("kind") == "resume" for e in events)
    for i, event in enumerate(events):
        if event.get("kind") == "state_lost":
            later = events[i + 1:]
            until = next((j for j, e in enumerate(later) if e.get("kind") == "state_lost"), len(later))
            resume = next((e for e in later[:until] if e.get("kind") == "resume"), None)  # this loss's, not a later one's
            step = resume.get("step") if resume is not None else None
            lines.append(state_loss_text(event, checkpointing=checkpointing, resumed_at=step if isinstance(step, int) else None))
    return lines


def stragglers_text(events: list[dict[str, Any]]) -> str | None:
    """One line on the run's stragglers: the members whose slowdown was sustained (announced on the
    console), and how many flags members got in all. None when no slowdown was sustained: brief
    flags (members slow in turn on a busy host) stay in the events and ``unbroken report``."""
    sustained = sorted({str(e.get("member")) for e in events if e.get("kind") == "straggler_sustained"})
    if not sustained:
        return None
    flags = [e for e in events if e.get("kind") == "straggler"]
    members = len({e.get("member") for e in flags})
    return f"straggler(s) {', '.join(sustained)} ({len(flags)} flag(s) of {members} member(s) in all: `unbroken report` lists them)"


def finish_notes(run_dir: str) -> list[str]:
    """What the launcher's last line adds to "training finished": progress lost, stragglers."""
    from unbroken.observe.run_log import load

    try:
        events = load([run_dir]).events
    except (OSError, ValueError):
        return []
    stragglers = stragglers_text(events)
    return progress_lost(events) + ([stragglers] if stragglers else [])
