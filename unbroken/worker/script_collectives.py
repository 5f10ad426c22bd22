"""The script's own collectives inside a step: the same ones on every member, or a clean error.

A DDP script makes collectives of its own inside a step (``dist.all_reduce(loss)`` after each
backward, Accelerate's ``gather`` per batch). Under DDP every rank holds the same number of
micro-batches; under unbroken the members' shares differ (by one sample, or by the straggler
balancer's split), so a collective per micro-batch is made a different number of times on
different members. On the generation's own group that pairs one member's collective with
another's gradient bucket, and Gloo aborts the process ("Received data size doesn't match
expected size"), in every generation, until the slot is quarantined.

So inside a step's body the script's collectives go over a group of their own (built at the
first one of each generation, :attr:`ScriptCollectives.pg`), never mixed with the gradients, and
each one first meets every member in the generation's store (:meth:`ScriptCollectives.begin`):
the k-th collective of step s is made only once every member has announced its k-th, with the
same operation, shapes and dtypes (two counters in the store; a few hundred microseconds per
collective, and nothing for a step that makes none). Each member also keeps where it stands in
the store (step, collectives made, whether in the gradient exchange; the exchange says it from its
idle wait slices, :meth:`ScriptCollectives.in_exchange`: nothing in a healthy step), so that a
member waiting for a collective that a peer will never make (the peer reached the exchange with
fewer, or committed and went on) learns it within about a second. Either way every member
learns that the rule was broken before any byte of the mismatched collective is sent; the job
fails with :class:`~unbroken.errors.LoopMisuse` naming the rule, recorded by the coordinator, so
that no restart repeats it.
"""

from __future__ import annotations

import threading
import time
import zlib
from typing import TYPE_CHECKING, Any, Callable

import torch

from unbroken.errors import GenerationFailed, LoopMisuse

if TYPE_CHECKING:
    from unbroken.worker.group import GenerationGroup

SLOW_CHECK = 1.0
"""Seconds a collective waits for the others before it also looks for a member that already
reached the gradient exchange with fewer collectives (a store read per member each poll)."""

RULE = ("every member must make the same collectives of its own in every step, and members hold different"
        " numbers of micro-batches (the shares of the global batch differ with the member count and the straggler"
        " balancer): make a collective once per step, after the micro-batch loop (sum the losses locally, then one"
        " dist.all_reduce before step.commit())")


def signature(op: str, args: tuple[Any, ...]) -> str:
    """What must be the same on every member for a collective to pair: the operation and its
    tensors' shapes and dtypes."""
    tensors: list[torch.Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)

    collect(args[:2])
    return op + ";" + ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors)


class ScriptCollectives:
    """One member's collectives of its own in one generation (see the module's docstring).

    Args:
        group: the generation's group.
        fail_job: records the job as failed with a reason (the coordinator), before raising.
        build: makes the group the collectives go over (called once, by every member at once).
    """

    def __init__(self, group: "GenerationGroup", fail_job: Callable[[str], None], build: Callable[[], Any]) -> None:
        self.group = group
        self._fail_job = fail_job
        self._build = build
        self.pg: Any = None
        self.step: int | None = None
        self.count = 0
        """Collectives made in :attr:`step` so far."""
        self._announced_exchange: int | None = None
        self._keys: list[tuple[int, str, str]] = []
        self._probe: threading.Thread | None = None
        self._probe_store: Any = None
        self._made: dict[int, int] = {}
        """Collectives made in each of the last steps (a member that moved on compares its count)."""
        self._found: str | None = None
        """What the exchange's probe found wrong (raised by the next idle slice)."""
        """(step, counters) of the collectives made, for rank 0 to delete once they are done."""

    def begin(self, step: int, op: str, args: tuple[Any, ...]) -> Any:
        """Meet every member at this member's next collective of ``step``; returns the group to
        make it on. Raises :class:`LoopMisuse` if members differ, :class:`GenerationFailed` if
        the generation broke meanwhile.

        Two counters in the store per collective: every member adds to ``script/s/k`` (who has
        arrived) and to ``script/s/k/<signature>`` (who has arrived with this signature); the
        collective is made when the second reaches the generation's size, and the members differ
        when the first does and the second does not."""
        from unbroken.worker.leader_calls import wait_for

        if step != self.step:
            if self.step is not None and self.group.rank == 0:
                self._forget(self.step)
            self.step, self.count = step, 0
        self.count += 1
        k, group, mine = self.count, self.group, signature(op, args)
        self._made[step] = k
        for done in [made for made in self._made if made < step - 3]:
            del self._made[done]
        _store(group, lambda: group.store.set(f"script/at/{group.rank}", f"{step}:{k}:0".encode()))
        arrived, alike = f"script/{step}/{k}", f"script/{step}/{k}/{zlib.crc32(mine.encode()):08x}"
        self._keys.append((step, arrived, alike))
        # alike before arrived, by every member: once ``arrived`` is full, every ``alike`` is in
        alike_now = _store(group, lambda: group.store.add(alike, 1))
        _store(group, lambda: group.store.add(arrived, 1))
        if alike_now < group.size:
            began = time.monotonic()

            def everyone() -> bool:
                if _store(group, lambda: group.store.add(alike, 0)) >= group.size:
                    return True
                if (_store(group, lambda: group.store.add(arrived, 0)) >= group.size
                        and _store(group, lambda: group.store.add(alike, 0)) < group.size):
                    self._misuse(f"step {step}: the script's collective number {k} differs between members (this member's:"
                                 f" {mine})")
                if time.monotonic() - began > SLOW_CHECK:
                    self._peers_elsewhere(group.store, step, k, waiting=True)
                return False

            wait_for(group, everyone, f"waiting for every member at the script's {op}")
        if self.pg is None:
            self.pg = self._build()  # every member is here: they make it together
        return self.pg

    def _forget(self, step: int) -> None:
        """Rank 0, at a new step: drop the counters of the steps before the last (the others
        may still be reading the last step's). Keeps the store from growing with the job."""
        keep = [entry for entry in self._keys if entry[0] >= step]
        for _, arrived, alike in (entry for entry in self._keys if entry[0] < step):
            for key in (arrived, alike):
                try:
                    self.group.store.delete_key(key)
                except Exception:  # noqa: BLE001 - a counter left behind costs a few bytes, nothing else
                    pass
        self._keys = keep

    def in_exchange(self, step: int) -> None:
        """This member waits in ``step``'s gradient exchange (called from its idle wait slices):
        say in the store how many collectives it made, and fail if a member waits for one more.
        The store is read on a helper thread with a client of its own, never in the wait itself:
        a coordinator cut off by a partition must not hold the wait past the verdict that ends it."""
        if self._found is not None:
            raise LoopMisuse(self._found)
        if self._probe is None or not self._probe.is_alive():
            self._probe = threading.Thread(target=self._probe_exchange, args=(step,), name="unbroken-script-probe",
                                           daemon=True)
            self._probe.start()

    def _probe_exchange(self, step: int) -> None:
        made = self._made.get(step, 0)
        group = self.group
        try:
            store = self._probe_store = self._probe_store or _own_client(group)
            if self._announced_exchange != step:
                store.set(f"script/at/{group.rank}", f"{step}:{made}:1".encode())
                self._announced_exchange = step
            self._peers_elsewhere(store, step, made, waiting=False)
        except LoopMisuse as exc:
            self._found = str(exc)
        except Exception:  # noqa: BLE001 - an unreachable store: the generation's own verdicts end the wait
            pass

    def _peers_elsewhere(self, store: Any, step: int, k: int, waiting: bool) -> None:
        """Where the others stand (``script/at/<rank>``: step, collectives made, whether in the
        exchange), against this member at collective ``k`` of ``step`` (``waiting``: in its
        barrier), or in ``step``'s exchange after ``k``. Raises :class:`LoopMisuse` when a member
        can never meet this one: it went on past this step, reached the exchange with fewer, or
        waits for a collective this member did not make."""
        group = self.group
        for r in range(group.size):
            if r == group.rank or not store.check([f"script/at/{r}"]):
                continue
            at_step, at_k, in_exchange = (int(v) for v in store.get(f"script/at/{r}").decode().split(":"))
            where = f"member {r} of generation {group.number}"
            if waiting and at_step > step:
                self._misuse(f"step {step}: {where} went on to step {at_step} without the script's collective number {k}"
                             f" that this member makes")
            if waiting and at_step == step and in_exchange and at_k < k:
                self._misuse(f"step {step}: {where} reached the gradient exchange after {at_k} collective(s) of the"
                             f" script's own, and this member makes number {k}")
            behind = at_step < step or (at_step == step and not waiting)
            if not in_exchange and behind and at_k > self._made.get(at_step, 0):
                self._misuse(f"step {at_step}: {where} waits in the script's collective number {at_k}, and this member"
                             f" made {self._made.get(at_step, 0)} in that step")

    def _misuse(self, what: str) -> None:
        message = f"{what}: {RULE}"
        self._fail_job(message)
        raise LoopMisuse(message)


def _store(group: "GenerationGroup", call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the store's errors are bare RuntimeErrors
        raise GenerationFailed(f"generation {group.number}: store unreachable at the script's collective: {exc}") from None


def _own_client(group: "GenerationGroup") -> Any:
    """The generation's store through a client of this probe's own (a TCPStore's), or the
    group's store itself where there is no TCPStore under it."""
    import datetime

    import torch.distributed as dist

    base = getattr(group, "base_store", None)
    if isinstance(base, dist.TCPStore):
        client = dist.TCPStore(base.host, base.port, is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=group.timeout))
        return dist.PrefixStore(group.store_prefix, client)
    return group.store


def for_group(group: "GenerationGroup", fail_job: Callable[[str], None]) -> ScriptCollectives:
    """``group``'s :class:`ScriptCollectives`, made at first use. Over Gloo the collectives get a
    Gloo group of their own; over NCCL they stay on the generation's communicator (a second one
    per generation costs more than it saves), still met in the store first."""
    if group.script is None:
        group.script = ScriptCollectives(group, fail_job, lambda: _side_group(group))
    return group.script


def _side_group(group: "GenerationGroup") -> Any:
    if group.backend != "gloo":
        return group.pg
    import datetime

    import torch.distributed as dist

    from unbroken.worker.heal_lanes import _own_store
    from unbroken.worker.torch_groups import _device

    def build() -> Any:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=group.timeout)
        options._devices = [_device(group.store_host)]
        return dist.ProcessGroupGloo(_own_store(group, "script-group/"), group.rank, group.size, options)

    pg = group.run_watched(build, "connecting the script's collectives' group")
    group.side_groups.append(("script", pg))
    return pg


def script_route(loop_guard: Any, group: Callable[[], Any], fail_job: Callable[[str], None]) -> Callable[[str, tuple], Any]:
    """The default group's ``route``: the group a collective of the script's own goes over. Inside
    a step's body, before its commit, the one the script's collectives have to themselves, met in
    the store first (:meth:`ScriptCollectives.begin`); elsewhere None (the generation's own)."""

    def route(op: str, args: tuple) -> Any:
        step, current = loop_guard.step, group()
        if (not loop_guard.in_body or step is None or step.committed or step.failed or current is None
                or current.number != step.generation):
            return None
        return for_group(current, fail_job).begin(step.index, op, args)

    return route
