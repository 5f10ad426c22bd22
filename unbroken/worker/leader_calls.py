"""Work one member does for all: :meth:`unbroken.Job.on_leader` at a step boundary.

Every member calls ``job.on_leader(fn, ...)`` at the same point of its loop (after a commit,
say every 100 steps). The leader runs ``fn``, marked busy so that the coordinator's watchdog never
takes the long call for a stuck process, and posts the result in the generation's store; the
others wait for it without a collective (so no collective timeout) and are never fenced for
waiting, however long ``fn`` takes, up to the busy cap (``--busy-timeout``). Every member returns
the same result, so state derived from it (a best loss, a stop decision) is the same everywhere.

If the leader dies inside ``fn``, the members that waited leave the broken generation, re-form
without it and the new generation runs the call again. A member that reaches the boundary
without being in the call (a newcomer, or one that redid the last step) waits at the start of its
first step until every member is there (:func:`first_step_barrier`), and the call runs on the
lowest-ranked member that is in it.
"""

from __future__ import annotations

import io
import time
from typing import TYPE_CHECKING, Any, Callable, ContextManager

import torch

from unbroken.errors import GenerationFailed, LeaderCallFailed, LoopMisuse
from unbroken.storage.safe_unpickle import plain_data_globals

if TYPE_CHECKING:
    from unbroken.worker.group import GenerationGroup

CENSUS_TIMEOUT_FLOOR = 10.0
"""Seconds (at least; or the collective timeout, if longer) that a call waits for every member to
reach it before calling the script wrong: a member that never calls ``on_leader`` at this
boundary is in the next step's allreduce, where no answer will ever come from."""


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def encode(ok: bool, value: Any) -> bytes:
    """The result (or the leader's error text) as bytes for the store; plain data and tensors
    only, read back with ``weights_only=True`` (a peer's bytes never name code to run)."""
    buffer = io.BytesIO()
    try:
        torch.save({"ok": ok, "value": value}, buffer)
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises, say what to return instead
        raise LeaderCallFailed(
            f"the leader's result cannot be sent to the other members ({type(exc).__name__}: {exc}); return plain data:"
            " numbers, strings, lists, dicts or tensors") from None
    return buffer.getvalue()


def decode(payload: bytes, device: torch.device) -> tuple[bool, Any]:
    try:
        with plain_data_globals():  # what heals and what checkpoints hold, a leader may return
            record = torch.load(io.BytesIO(payload), weights_only=True, map_location=device if device.type == "cuda" else "cpu")
    except Exception as exc:  # noqa: BLE001 - the unpickler refuses anything but plain data
        raise LeaderCallFailed(
            f"the leader's result cannot be read on this member ({type(exc).__name__}: {exc}); return plain data:"
            " numbers, strings, lists, dicts, tensors or numpy arrays") from None
    return bool(record["ok"]), record["value"]


def wait_for(group: "GenerationGroup", done: Callable[[], bool], what: str) -> None:
    """Wait, without a timeout and marked as waiting for a peer, until ``done()``; raises
    :class:`GenerationFailed` if the generation is abandoned meanwhile. Polls fast at first (the
    common case is a few milliseconds), then every 50 ms."""
    quick = time.monotonic() + 0.05
    while time.monotonic() < quick:
        if _checked(group, done, what):
            return
        time.sleep(0.001)
    group.watch_unbounded(lambda: _checked(group, done, what), what, poll=0.05)


def _checked(group: "GenerationGroup", done: Callable[[], bool], what: str) -> bool:
    try:
        return done()
    except (GenerationFailed, LoopMisuse):
        raise
    except Exception as exc:  # noqa: BLE001 - the store's errors are bare RuntimeErrors
        raise GenerationFailed(f"generation {group.number}: {what}: store unreachable: {exc}") from None


def first_step_barrier(group: "GenerationGroup", step: int) -> None:
    """Before the first step of a generation: count this member in at ``step``'s start and wait
    until every member is there. A member that re-formed the generation inside an
    :meth:`~unbroken.Job.on_leader` call finishes the call first; without this wait a member
    already in the step's allreduce would time out on it."""
    key = f"start/{step}"
    try:
        group.store.add(key, 1)
        group.store.set(f"{key}/{group.rank}", b"1")
    except Exception as exc:  # noqa: BLE001 - the store's errors are bare RuntimeErrors
        raise GenerationFailed(f"generation {group.number}: store unreachable at step {step}'s start: {exc}") from None
    wait_for(group, lambda: group.store.add(key, 0) >= group.size, f"waiting for every member at step {step}'s start")


class LeaderCalls:
    """The :meth:`~unbroken.Job.on_leader` calls of one member: which boundary and call it is at,
    and how a call runs in a generation.

    Args:
        group: the member's current generation group (None between generations).
        rejoin: leave the broken generation (with the reason, if any) and join the next; False
            if the job finished meanwhile.
        busy: a context manager marking deliberate work (the coordinator never fences it).
        boundary: the member's next step: calls are numbered within one boundary.
        device: where tensors in a result go on the members that receive it.
        collective_timeout: bounds the wait for every member to reach the call.
    """

    def __init__(
        self,
        group: Callable[[], "GenerationGroup | None"],
        rejoin: Callable[[str | None], bool],
        busy: Callable[[str], ContextManager[None]],
        boundary: Callable[[], int],
        device: torch.device,
        collective_timeout: float,
    ) -> None:
        self._group = group
        self._rejoin = rejoin
        self._busy = busy
        self._boundary = boundary
        self._device = device
        self._census_timeout = max(CENSUS_TIMEOUT_FLOOR, collective_timeout)
        self._step = -1
        self._calls = 0

    def run_for_script(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], loop_guard: Any,
                       started: bool) -> Any:
        """:meth:`run` for the script's ``job.on_leader``: refused before the job's steps began
        (no generation, no leader yet); while ``fn`` runs, its collectives are refused
        (``loop_guard.leader_call``: only the leader runs it); its time inside a step's body is
        not counted in this member's pace (the straggler balancer)."""
        if not started:
            raise LoopMisuse(
                f"job.on_leader({_name(fn)!r}) was called before job.steps(): the members have not formed a generation"
                " yet, so there is no leader. Call it inside the loop, e.g. at the top of the body:"
                " `if step.index == 0: job.on_leader(evaluate)` (nanoGPT's evaluation at iteration 0)")
        loop_guard.leader_call = _name(fn)
        entered = time.monotonic()
        try:
            return self.run(fn, args, kwargs)
        finally:
            loop_guard.leader_call = None
            step = loop_guard.step
            if step is not None and loop_guard.in_body:  # the leader's work is not its pace
                step.paused += time.monotonic() - entered

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``fn`` on the lowest-ranked member in the call and return its result everywhere."""
        step = self._boundary()
        if step != self._step:
            self._step, self._calls = step, 0
        number = self._calls
        self._calls += 1
        while True:
            group = self._group()
            if group is None:
                if not self._rejoin(None):
                    raise LeaderCallFailed(f"the job finished while this member waited to call {_name(fn)} on the leader")
                continue
            if self._boundary() != step:
                raise LeaderCallFailed(
                    f"this member was healed from step {step} to step {self._boundary()} while it called {_name(fn)} on the"
                    " leader: the other members trained on without it, so this boundary has passed")
            try:
                return self._run_in(group, step, number, fn, args, kwargs)
            except GenerationFailed as exc:
                if getattr(exc, "_raised_by_fn", False):
                    raise  # fn's own error: every member has it, and it is never run again
                self._rejoin(str(exc))  # the leader (or another member) died: the next generation runs it again

    def _run_in(self, group: "GenerationGroup", step: int, number: int, fn: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        key = f"leader/{step}/{number}"
        runner = self._census(group, step, key, _name(fn))
        if group.rank == runner:
            with self._busy(f"running {_name(fn)} for every member"):
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    exc._raised_by_fn = True  # type: ignore[attr-defined]
                    self._post(group, key, encode(False, f"{type(exc).__name__}: {exc}"))
                    raise
            self._post(group, key, encode(True, result))
            return result
        wait_for(group, lambda: bool(group.store.check([f"{key}/result"])), f"waiting for the leader's {_name(fn)}")
        try:
            payload = group.store.get(f"{key}/result")
        except Exception as exc:  # noqa: BLE001 - the store's errors are bare RuntimeErrors
            raise GenerationFailed(f"generation {group.number}: cannot read the leader's result: {exc}") from None
        ok, value = decode(payload, self._device)
        if not ok:
            raise LeaderCallFailed(f"job.on_leader({_name(fn)}) raised on the leader (member 0 of generation {group.number}): {value}")
        return value

    def _post(self, group: "GenerationGroup", key: str, payload: bytes) -> None:
        try:
            group.store.set(f"{key}/result", payload)
        except Exception as exc:  # noqa: BLE001 - the store's errors are bare RuntimeErrors
            raise GenerationFailed(f"generation {group.number}: cannot post the leader's result: {exc}") from None

    def _census(self, group: "GenerationGroup", step: int, key: str, name: str) -> int:
        """Count this member in at the call and wait until every member of the generation is in
        it or waits at the next step's start; the rank that runs the call: the lowest in it."""
        try:
            group.store.set(f"{key}/in/{group.rank}", b"1")
            group.store.add(f"{key}/in", 1)
        except Exception as exc:  # noqa: BLE001 - the store's errors are bare RuntimeErrors
            raise GenerationFailed(f"generation {group.number}: store unreachable at {name}: {exc}") from None
        deadline = time.monotonic() + self._census_timeout

        def everyone() -> bool:
            if group.store.add(f"{key}/in", 0) + group.store.add(f"start/{step}", 0) >= group.size:
                return True
            if time.monotonic() > deadline:
                raise LoopMisuse(
                    f"job.on_leader({name}) at step {step}: not every member called it within {self._census_timeout:.0f} s;"
                    " call on_leader at the same point of the loop on every member (the same condition on"
                    " step.index), not only on the leader")
            return False

        wait_for(group, everyone, f"waiting for every member at {name}")
        for rank in range(group.size):
            try:
                if group.store.check([f"{key}/in/{rank}"]):
                    return rank
            except Exception as exc:  # noqa: BLE001 - the store's errors are bare RuntimeErrors
                raise GenerationFailed(f"generation {group.number}: store unreachable at {name}: {exc}") from None
        return group.rank  # unreachable: this member is in
