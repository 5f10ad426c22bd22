"""Healing a replica group shard by shard (issue 18).

A replica group is K processes sharding one replica with FSDP2 (:mod:`unbroken.replica_groups`).
Process ``j`` of every group holds the same shard, so a restarted group is healed by K independent
transfers: process ``j`` of a live group sends its :func:`~unbroken.replica_groups.local_state_shards`
to process ``j`` of the restarted group, over a channel of their own (one per shard index), all K
at once. Nothing is gathered and no process holds more than its own shard.

One transfer (:func:`send_shard` / :func:`recv_shard`), from the sender to the receiver unless said:

1. **Manifest.** The sender sends its :class:`ShardManifest` (shard index, group size, sharding
   fingerprint of shard ``j``, the optimizer's parameter groups, and the name, shape and dtype of
   every local tensor). The receiver compares it with its own (:func:`differences`, pure) and
   replies with its manifest and the list of problems. The model part is compared before the
   receiver creates its fresh optimizer's lazy state, so a refused receiver is left exactly as it
   was; on any problem both sides raise :class:`~unbroken.replica_groups.GroupMismatch` naming
   what differs (e.g. the sizes). No tensor has moved at that point.
2. **Shards**, in the order of :func:`~unbroken.replica_groups.local_state_shards`, framed as
   :mod:`unbroken.healing` frames a state (:func:`unbroken.healing.messages`: slices of at most
   ``MESSAGE_BYTES`` of a large tensor, packs of small ones). Both sides derive the message list
   from the (equal) layouts, so it does not travel. Large tensors are sent from, and received
   into, the processes' own tensors: the receiver writes its model and optimizer in place, with no
   second copy of the state (a heal cut halfway leaves the receiver half written: it stays a
   receiver that must be healed again, which it was anyway).
3. **Small replicated state**: the optimizer's hyperparameters (``param_groups`` without their
   parameters; a scheduler changes ``lr`` there) and the caller's ``extra`` (step, RNG,
   scheduler, ...), with :func:`unbroken.healing.send_state` (its header, safe manifest and
   tensor framing).
4. **Verification**: the sender's CRC-32 of every tensor and :func:`unbroken.healing.state_digest`
   of the hyperparameters, compared by the receiver with those of what it now holds; the
   receiver acknowledges, so both sides return only when the shard is in place and verified
   (:class:`ShardCorrupt`, naming the tensors that differ, otherwise). Both sides compute the
   CRCs on a helper thread while the tensors move (``zlib.crc32`` releases the GIL; the receiver
   hashes each slice as it lands), so verification costs little more than the last message's
   hash. CRC-32 guards against transfer faults, not against an adversary: it runs at about 4 GB/s
   here, where the 64-bit BLAKE2b of ``state_digest`` ran at about 1 GB/s and made verification
   cost more than the transfer (benchmarks/bench_group_heal.py).

A channel is anything with :class:`~unbroken.group.GenerationGroup`'s ``send``/``recv``: the
runtime will use the ranks of its per-``j`` cross-group generation group (one rank per group), so
that :func:`unbroken.healing.rounds` drives the fan-out per shard index unchanged
(:func:`fan_out`). :func:`heal_group` is the convenience for one sender group and one receiver
group: it builds a 2-rank channel per ``j`` under the store prefix ``gen{N}/heal/shard{j}/``, runs
the transfer, and then makes the K processes of each group agree (over the group's own process
group) that every shard arrived, so that a group counts as healed only as a whole.
"""

from __future__ import annotations

import datetime
import json
import logging
import queue
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from unbroken import healing
from unbroken.errors import ConfigError, GenerationFailed, UnbrokenError
from unbroken.group import GenerationGroup
from unbroken.replica_groups import GroupMismatch, local_state_shards, sharding_fingerprint, state_layout

log = logging.getLogger(__name__)

__all__ = [
    "GroupHealed",
    "ShardCorrupt",
    "ShardManifest",
    "ShardReport",
    "check_manifests",
    "differences",
    "fan_out",
    "heal_group",
    "manifest_of",
    "recv_shard",
    "send_shard",
    "shard_channel",
]

WIRE_VERSION = 1
"""Version of the shard-healing wire format; a receiver refuses a sender of another version."""
MAGIC = 0x756E62726B736864  # "unbrkshd": the first int64 of every framed message
TAG_MANIFEST = 21
TAG_REPLY = 22
TAG_TENSOR = 23
TAG_PACK = 24
TAG_DIGEST = 25
TAG_ACK = 26
_HEADER = 3  # int64s: MAGIC, WIRE_VERSION, body bytes


class ShardCorrupt(UnbrokenError):
    """A healed shard's digest differs from the sender's: the receiver holds no valid state."""


# -- the manifest ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardManifest:
    """What process ``shard`` of a group of ``group_size`` holds: enough to tell, before any tensor
    moves, whether a shard of another group can be loaded here."""

    shard: int
    group_size: int
    sharding: str
    """:func:`~unbroken.replica_groups.sharding_fingerprint` of this process's module."""
    param_groups: tuple[int, ...]
    """Number of parameters in each of the optimizer's parameter groups (empty without one)."""
    layout: tuple[tuple[str, tuple[int, ...], str], ...]
    """:func:`~unbroken.replica_groups.state_layout` of the local shards, in their order."""
    version: int = WIRE_VERSION

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ShardManifest:
        return cls(
            shard=int(raw["shard"]), group_size=int(raw["group_size"]), sharding=str(raw["sharding"]),
            param_groups=tuple(int(n) for n in raw["param_groups"]),
            layout=tuple((str(k), tuple(int(d) for d in shape), str(dtype)) for k, shape, dtype in raw["layout"]),
            version=int(raw["version"]),
        )

    @classmethod
    def from_bytes(cls, raw: bytes) -> ShardManifest:
        return cls.from_dict(json.loads(raw))


def manifest_of(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, shard: int, group_size: int,
    shards: dict[str, torch.Tensor] | None = None,
) -> ShardManifest:
    """The manifest of this process (``shards``: its local state shards, if already at hand)."""
    if not 0 <= shard < group_size:
        raise ValueError(f"shard index {shard} is not in 0..{group_size - 1}")
    shards = local_state_shards(module, optimizer) if shards is None else shards
    groups = tuple(len(g["params"]) for g in optimizer.param_groups) if optimizer is not None else ()
    return ShardManifest(shard, group_size, sharding_fingerprint(module), groups, tuple(state_layout(shards)))


def _model_part(layout: tuple) -> tuple:
    return tuple(entry for entry in layout if entry[0].startswith("model/"))


def differences(sender: ShardManifest, receiver: ShardManifest, model_only: bool = False) -> list[str]:
    """What keeps ``sender``'s shard from being loaded at ``receiver``, in words (empty: nothing). Pure.

    ``model_only`` compares the module's part of the layout only (what a receiver can check
    before it creates its fresh optimizer's state)."""
    if sender.version != receiver.version:
        return [f"the sender speaks shard-healing version {sender.version}, this process {receiver.version} "
                "(the groups run different versions of unbroken)"]
    problems = []
    if sender.group_size != receiver.group_size:
        problems.append(f"the sending group has {sender.group_size} processes but the receiving group has "
                        f"{receiver.group_size}")
    if sender.shard != receiver.shard:
        problems.append(f"process {sender.shard} of the sending group cannot heal process {receiver.shard} "
                        "(shard indices differ)")
    if sender.sharding != receiver.sharding:
        problems.append(f"shard {receiver.shard} is sharded differently (fingerprint {sender.sharding} sent, "
                        f"{receiver.sharding} here: the model or its fully_shard calls differ)")
    if not model_only and sender.param_groups != receiver.param_groups:
        problems.append(f"the optimizers differ (parameter groups of {list(sender.param_groups)} parameters sent, "
                        f"{list(receiver.param_groups)} here)")
    theirs, mine = sender.layout, receiver.layout
    if model_only:
        theirs, mine = _model_part(theirs), _model_part(mine)
    if theirs != mine:
        problems.append(_layout_difference(theirs, mine))
    return problems


def _layout_difference(theirs: tuple, mine: tuple) -> str:
    sent, here = {k: (s, d) for k, s, d in theirs}, {k: (s, d) for k, s, d in mine}
    missing, extra = sorted(set(here) - set(sent)), sorted(set(sent) - set(here))
    wrong = [f"{k} {list(sent[k][0])} {sent[k][1]} sent, {list(here[k][0])} {here[k][1]} here"
             for k in here if k in sent and sent[k] != here[k]]
    parts = []
    if missing:
        parts.append(f"missing {missing[:5]}")
    if extra:
        parts.append(f"unexpected {extra[:5]}")
    if wrong:
        parts.append("; ".join(wrong[:5]))
    if not parts:
        parts.append("the same tensors in another order")
    return "the local shards differ: " + "; ".join(parts)


def _refusal(problems: list[str]) -> str:
    return ("refused to heal a replica group from another: " + "; ".join(problems)
            + " (every group must have the same size, --group-size, and the same sharding; "
            "process j of every group must hold the same shard)")


def check_manifests(sender: ShardManifest, receiver: ShardManifest) -> None:
    """Raise :class:`GroupMismatch` naming what differs, unless ``sender``'s shard fits ``receiver``."""
    problems = differences(sender, receiver)
    if problems:
        raise GroupMismatch(_refusal(problems))


# -- framing -----------------------------------------------------------------------------------------


def _send_bytes(channel: Any, peer: int, data: bytes, tag: int, what: str) -> None:
    channel.send(torch.tensor([MAGIC, WIRE_VERSION, len(data)], dtype=torch.int64), peer, tag, f"{what} (header)")
    if data:
        channel.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), peer, tag, what)


def _recv_bytes(channel: Any, peer: int, tag: int, what: str) -> bytes:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    channel.recv(header, peer, tag, f"{what} (header)")
    magic, version, size = header.tolist()
    if magic != MAGIC:
        raise ConfigError(f"{what} from rank {peer} does not start with a shard-healing header")
    if version != WIRE_VERSION:
        raise ConfigError(f"shard-healing version {version} from rank {peer} is not {WIRE_VERSION}: "
                          "the groups run different versions of unbroken")
    body = torch.empty(size, dtype=torch.uint8)
    if size:
        channel.recv(body, peer, tag, what)
    return body.numpy().tobytes()


def _send_int(channel: Any, peer: int, value: int, tag: int, what: str) -> None:
    channel.send(torch.tensor([value], dtype=torch.int64), peer, tag, what)


def _recv_int(channel: Any, peer: int, tag: int, what: str) -> int:
    box = torch.zeros(1, dtype=torch.int64)
    channel.recv(box, peer, tag, what)
    return int(box.item())


class _Checksums:
    """CRC-32 of each tensor of a shard, computed on a helper thread from flat pieces fed in order
    (pieces of one tensor in order: the running CRC then equals the whole tensor's)."""

    def __init__(self, count: int) -> None:
        self.values = [0] * count
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="unbroken-shard-crc", daemon=True)
        self._thread.start()

    def feed(self, index: int, piece: torch.Tensor) -> None:
        """Add ``piece`` (flat, contiguous, not written again until :meth:`result`) to tensor ``index``."""
        self._queue.put((index, piece))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            index, piece = item
            try:
                if piece.numel():
                    data = piece.detach().cpu().view(torch.uint8).numpy().data
                    self.values[index] = zlib.crc32(data, self.values[index])
            except BaseException as exc:  # noqa: BLE001  (reported by result())
                self._error.append(exc)

    def result(self) -> list[int]:
        self._queue.put(None)
        self._thread.join()
        if self._error:
            raise self._error[0]
        return self.values


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1)


def _specs(shards: dict[str, torch.Tensor]) -> tuple[healing.TensorSpec, ...]:
    return tuple(healing.TensorSpec(t.dtype, tuple(t.shape), t.device.type == "cuda") for t in shards.values())


def _send_tensors(channel: Any, peer: int, shards: dict[str, torch.Tensor], progress: Callable[[], None]) -> int:
    """Send the shards as :func:`unbroken.healing.messages` frames them; returns the bytes sent."""
    tensors = list(shards.values())
    sent = 0
    current: tuple[int, torch.Tensor] | None = None
    for message in healing.messages(_specs(shards)):
        if message[0] == "slice":
            _, index, start, count = message
            if current is None or current[0] != index:
                current = None  # free a copy of the previous tensor before making the next
                current = (index, _flat(tensors[index]))
            buffer = current[1][start : start + count]
            channel.send(buffer, peer, TAG_TENSOR, "shard healing (tensor)")
        else:
            _, _, indices = message
            buffer = torch.cat([tensors[i].detach().reshape(-1).to(getattr(channel, "device", "cpu")) for i in indices])
            channel.send(buffer, peer, TAG_PACK, "shard healing (small tensors)")
        sent += buffer.numel() * buffer.element_size()
        progress()
    return sent


def _recv_tensors(channel: Any, peer: int, shards: dict[str, torch.Tensor], progress: Callable[[], None],
                  checksums: _Checksums) -> int:
    """Receive the shards into ``shards``' own tensors, in place, feeding what lands to
    ``checksums``; returns the bytes received."""
    tensors = list(shards.values())
    specs = _specs(shards)
    staging: dict[int, torch.Tensor] = {}  # flat copies of targets that are not contiguous
    received = 0
    with torch.no_grad():
        for message in healing.messages(specs):
            if message[0] == "slice":
                _, index, start, count = message
                target = tensors[index]
                flat = target.view(-1) if target.is_contiguous() else staging.setdefault(index, torch.empty(target.numel(), dtype=target.dtype, device=target.device))
                buffer = flat[start : start + count]
                channel.recv(buffer, peer, TAG_TENSOR, "shard healing (tensor)")
                checksums.feed(index, buffer)
            else:
                _, dtype, indices = message
                buffer = torch.empty(sum(specs[i].numel for i in indices), dtype=dtype, device=getattr(channel, "device", "cpu"))
                channel.recv(buffer, peer, TAG_PACK, "shard healing (small tensors)")
                offset = 0
                for i in indices:
                    tensors[i].copy_(buffer[offset : offset + specs[i].numel].view(specs[i].shape))
                    checksums.feed(i, _flat(tensors[i]))
                    offset += specs[i].numel
            received += buffer.numel() * buffer.element_size()
            progress()
        for index, flat in staging.items():
            tensors[index].copy_(flat.view(tensors[index].shape))
    return received


# -- one transfer ------------------------------------------------------------------------------------


@dataclass
class ShardReport:
    """What one transfer did, for the log and the heal event; seconds are this side's."""

    shard: int
    role: str
    bytes: int = 0
    """Tensor bytes of the shards (the small state and the manifests not counted)."""
    manifest_s: float = 0.0
    transfer_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0


def _hyperparameters(optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
    if optimizer is None:
        return []
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _with_hyper(crcs: list[int], optimizer: torch.optim.Optimizer | None) -> torch.Tensor:
    """The verification message: each tensor's CRC-32, then the hyperparameters' digest."""
    return torch.tensor(crcs + [healing.state_digest(_hyperparameters(optimizer))], dtype=torch.int64)


def send_shard(
    channel: Any, receiver: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
    shard: int, group_size: int, extra: Any = None, progress: Callable[[], None] = lambda: None,
) -> ShardReport:
    """Send this process's shard ``shard`` (of a group of ``group_size``) to rank ``receiver`` of
    ``channel``, with the optimizer's hyperparameters and ``extra`` (any state
    :func:`unbroken.healing.send_state` takes: step, RNG, scheduler).

    Returns once the receiver has loaded and verified it. Raises :class:`GroupMismatch` if the
    receiver refused the manifest (nothing was sent then), :class:`ShardCorrupt` if its digest
    differed, :class:`GenerationFailed` if the channel failed or was abandoned.
    """
    started = time.perf_counter()
    report = ShardReport(shard, "send")
    shards = local_state_shards(module, optimizer)
    _send_bytes(channel, receiver, manifest_of(module, optimizer, shard, group_size, shards).to_bytes(), TAG_MANIFEST,
                "shard healing (manifest)")
    reply = json.loads(_recv_bytes(channel, receiver, TAG_REPLY, "shard healing (manifest reply)"))
    if reply["problems"]:
        raise GroupMismatch(_refusal(reply["problems"]))
    report.manifest_s = time.perf_counter() - started
    checksums = _Checksums(len(shards))
    for index, tensor in enumerate(shards.values()):
        checksums.feed(index, _flat(tensor))  # hashed while the tensors go
    mark = time.perf_counter()
    report.bytes = _send_tensors(channel, receiver, shards, progress)
    healing.send_state(channel, {"param_groups": _hyperparameters(optimizer), "extra": extra}, receiver, progress=progress)
    report.transfer_s = time.perf_counter() - mark
    mark = time.perf_counter()
    channel.send(_with_hyper(checksums.result(), optimizer), receiver, TAG_DIGEST, "shard healing (checksums)")
    if _recv_int(channel, receiver, TAG_ACK, "shard healing (acknowledgement)") != 1:
        raise ShardCorrupt(f"shard {shard}: the receiver's checksums of the healed shard differ from this sender's")
    report.verify_s = time.perf_counter() - mark
    report.total_s = time.perf_counter() - started
    return report


def recv_shard(
    channel: Any, sender: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
    shard: int, group_size: int, progress: Callable[[], None] = lambda: None,
) -> tuple[Any, ShardReport]:
    """Receive shard ``shard`` from rank ``sender`` of ``channel`` into ``module`` and ``optimizer``,
    in place; returns (the sender's ``extra``, report). The optimizer's hyperparameters are set to
    the sender's; loading ``extra`` (step, RNG, scheduler) is the caller's.

    Raises :class:`GroupMismatch` before writing anything if the sender's manifest differs (size,
    shard index, sharding, optimizer, tensors), :class:`ShardCorrupt` if the loaded shard's digest
    differs from the sender's, :class:`GenerationFailed` if the channel fails (the receiver may be
    half written then and must be healed again).
    """
    from unbroken.replica_groups import _init_optimizer_state  # a fresh optimizer has no state to receive into

    started = time.perf_counter()
    report = ShardReport(shard, "receive")
    theirs = ShardManifest.from_bytes(_recv_bytes(channel, sender, TAG_MANIFEST, "shard healing (manifest)"))
    problems = differences(theirs, manifest_of(module, optimizer, shard, group_size), model_only=True)
    if not problems and optimizer is not None:
        _init_optimizer_state(module, optimizer)  # only once the model is known to match: a refusal writes nothing
    mine = manifest_of(module, optimizer, shard, group_size)
    if not problems:
        problems = differences(theirs, mine)
    _send_bytes(channel, sender, json.dumps({"manifest": asdict(mine), "problems": problems}).encode(), TAG_REPLY,
                "shard healing (manifest reply)")
    if problems:
        raise GroupMismatch(_refusal(problems))
    report.manifest_s = time.perf_counter() - started
    mark = time.perf_counter()
    shards = local_state_shards(module, optimizer)
    checksums = _Checksums(len(shards))
    report.bytes = _recv_tensors(channel, sender, shards, progress, checksums)
    small, _ = healing.recv_state(channel, sender, progress)
    if optimizer is not None:
        for group, sent in zip(optimizer.param_groups, small["param_groups"]):
            group.update(sent)
    report.transfer_s = time.perf_counter() - mark
    mark = time.perf_counter()
    held = _with_hyper(checksums.result(), optimizer)
    sent = torch.zeros_like(held)
    channel.recv(sent, sender, TAG_DIGEST, "shard healing (checksums)")
    _send_int(channel, sender, int(torch.equal(held, sent)), TAG_ACK, "shard healing (acknowledgement)")
    if not torch.equal(held, sent):
        names = [k for k, a, b in zip([*shards, "optimizer hyperparameters"], held.tolist(), sent.tolist()) if a != b]
        raise ShardCorrupt(f"shard {shard}: {names[:5]} differ from the sender's after the transfer; it must be healed again")
    report.verify_s = time.perf_counter() - mark
    report.total_s = time.perf_counter() - started
    return small["extra"], report


def fan_out(
    channel: Any, plan: healing.HealPlan, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
    shard: int, group_size: int, extra: Any = None, progress: Callable[[], None] = lambda: None,
) -> tuple[Any, list[ShardReport]]:
    """Run this process's part of :func:`unbroken.healing.rounds` for shard ``shard`` over
    ``channel``, whose ranks are the groups (process ``shard`` of each): receive once if this group
    is a receiver, then send on in every later round that names it. A holder sends ``extra``; a
    healed receiver sends on the extra it received (its shard now equals the source's bit for bit).
    Returns (the received extra, or None if this group held the state, and the reports)."""
    received, reports, healed = None, [], False
    for pairs in healing.rounds(plan, channel.size):
        for sender, receiver in pairs:
            if receiver == channel.rank:
                received, report = recv_shard(channel, sender, module, optimizer, shard=shard, group_size=group_size,
                                              progress=progress)
                healed = True
                reports.append(report)
            elif sender == channel.rank:
                reports.append(send_shard(channel, receiver, module, optimizer, shard=shard, group_size=group_size,
                                          extra=received if healed else extra, progress=progress))
    return received, reports


# -- one group heals another ---------------------------------------------------------------------


def shard_channel(
    store: dist.Store, generation: int, shard: int, role: str, *, timeout: float = 60.0,
    store_host: str = "127.0.0.1", abandoned: Callable[[], str | None] = lambda: None, prefix: str = "",
) -> GenerationGroup:
    """The 2-rank channel between process ``shard`` of the sending group (rank 0) and of the
    receiving group (rank 1), built under ``{prefix}gen{generation}/heal/shard{shard}/``."""
    if role not in ("send", "receive"):
        raise ValueError(f"role must be 'send' or 'receive', got {role!r}")
    channel = GenerationGroup(generation, 0 if role == "send" else 1, 2, ["sender", "receiver"], abandoned,
                              threading.Event(), timeout)
    channel.connect(store, f"{prefix}gen{generation}/heal/shard{shard}/", store_host)
    return channel


@dataclass
class GroupHealed:
    """The outcome of :func:`heal_group` in one process: its own report and what it received."""

    report: ShardReport
    extra: Any = None
    seconds: float = 0.0
    """From the start to the whole group's agreement that every shard arrived."""
    reports: list[ShardReport] = field(default_factory=list)


_OK, _MISMATCH, _FAILED = 0, 1, 2


def heal_group(
    role: str, store: dist.Store, generation: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
    group_pg: dist.ProcessGroup, extra: Any = None, timeout: float = 60.0, store_host: str = "127.0.0.1",
    prefix: str = "", abandoned: Callable[[], str | None] = lambda: None,
) -> GroupHealed:
    """Heal one group from another: called by every process of the sending group (``role="send"``)
    and of the receiving group (``"receive"``). Process ``j`` (its rank in ``group_pg``, the group's
    own process group, whose size is the group's) transfers shard ``j`` over its own channel, all
    K at once; then the K processes of each group agree, over ``group_pg``, that every shard arrived.

    Raises, in every process of a group, :class:`GroupMismatch` if any shard was refused (the
    process whose shard differs names what), else :class:`ShardCorrupt` or :class:`GenerationFailed`
    if any transfer failed: a group is healed only as a whole.
    """
    started = time.perf_counter()
    shard, size = dist.get_rank(group_pg), dist.get_world_size(group_pg)
    failure: BaseException | None = None
    report, received = ShardReport(shard, role), None
    channel = None
    try:
        channel = shard_channel(store, generation, shard, role, timeout=timeout, store_host=store_host,
                                abandoned=abandoned, prefix=prefix)
        if role == "send":
            report = send_shard(channel, 1, module, optimizer, shard=shard, group_size=size, extra=extra)
        else:
            received, report = recv_shard(channel, 0, module, optimizer, shard=shard, group_size=size)
    except UnbrokenError as exc:
        failure = exc
    finally:
        if channel is not None and channel.idle():
            channel.pg = channel.store = None  # nothing pending: the channel's sockets go now
    code = _MISMATCH if isinstance(failure, GroupMismatch) else _FAILED if failure is not None else _OK
    codes = _agree(group_pg, shard, size, code, timeout)
    bad = [j for j, c in enumerate(codes) if c != _OK]
    if _MISMATCH in codes and not isinstance(failure, GroupMismatch):
        refused = [j for j, c in enumerate(codes) if c == _MISMATCH]
        raise GroupMismatch(f"generation {generation}: shard(s) {refused} of this group were refused (the groups "
                            "differ; those processes' errors say how); the group is not healed") from failure
    if failure is not None:
        raise failure
    if bad:
        raise GenerationFailed(f"generation {generation}: the transfer of shard(s) {bad} of this group failed; "
                               "the group is not healed")
    log.info("shard %d of %d %s in %.3f s (%d bytes)", shard, size, "sent" if role == "send" else "healed",
             report.total_s, report.bytes)
    return GroupHealed(report, received, time.perf_counter() - started)


def _agree(group_pg: dist.ProcessGroup, shard: int, size: int, code: int, timeout: float) -> list[int]:
    """Every process's outcome code, by shard index (an allreduce over the group)."""
    table = torch.zeros(size, dtype=torch.int64)
    table[shard] = code
    try:
        dist.all_reduce(table, group=group_pg, async_op=True).wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:  # Gloo reports a timeout or a lost peer as a bare RuntimeError
        raise GenerationFailed(f"the group's agreement on its heal failed: {exc}") from None
    return [int(c) for c in table.tolist()]
