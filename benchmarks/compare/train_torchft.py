"""The workload as one torchft 0.2.0 replica group of one process.

``--wrapper manual`` (default): ``torchft.Optimizer`` plus one ``manager.allreduce`` of the flat
gradient after backward, as torchft's own integration tests do. ``--wrapper ddp``: the documented
``torchft.DistributedDataParallel``. The data is indexed by ``manager.current_step()``, the most
favourable choice for torchft: a replica that heals reads from the right place at once (its
example's per-replica sampler is not restored and would repeat data). The lighthouse is started
by the benchmark; its address comes in ``--lighthouse``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import StepLog, arguments, batch, setup, share  # noqa: E402

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo  # noqa: E402


def extra(parser):
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--wrapper", choices=["manual", "ddp"], default="manual")
    parser.add_argument("--pg-timeout", type=float, default=5.0, help="Gloo timeout (torchft's example uses 5 s)")


args = arguments(extra)
log = StepLog(args.step_log)
x, y, model, inner = setup(args.width)
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the replica group's own store
manager = Manager(
    pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout)),
    min_replica_size=1,
    load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
    state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
    replica_id=f"bench_{args.replica}",
    store_addr="127.0.0.1",
    store_port=store.port,
    rank=0,
    world_size=1,
    lighthouse_addr=args.lighthouse,
    hostname="127.0.0.1",
    timeout=timedelta(seconds=30),
    quorum_timeout=timedelta(seconds=60),
    connect_timeout=timedelta(seconds=10),
)
net = DistributedDataParallel(manager, model) if args.wrapper == "ddp" else model
optimizer = Optimizer(manager, inner)
params = list(model.parameters())
loss_fn = torch.nn.CrossEntropyLoss()


def allreduce_gradients() -> None:
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    manager.allreduce(flat).wait()  # the average over the participating replicas
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()


while True:
    before = manager.current_step()
    if args.steps and before >= args.steps:
        break
    optimizer.zero_grad()  # starts the quorum
    a, b = share(before, args.replica, args.replicas, args.global_batch)
    xb, yb = batch(x, y, a, b)
    loss_fn(net(xb), yb).backward()
    if args.wrapper == "manual":
        allreduce_gradients()
    optimizer.step()  # commits only if every participant agrees
    if manager.current_step() > before:
        if manager.is_participating():
            log.step(before, args.replica, manager.num_participants(), [(a, b)], slots=args.replicas)
        else:  # a healing step: the state came from a peer, this replica's gradient was zeroed
            log.step(manager.current_step() - 1, args.replica, manager.num_participants(), [], slots=args.replicas)
log.write("done")
sys.stdout.flush()
manager.shutdown(wait=False)
os._exit(0)
