"""A worker for launcher tests of ``--group-size`` that does not use the unbroken runtime (no Job).

``group_probe.py OUT_DIR``: writes what the launcher gave it to ``OUT_DIR/<member>.p<j>.json``;
with a group store, meets its group's other processes there under the group's prefix (proof that
the store is reachable and shared); then

- in slot 0's first incarnation, process 1 exits with 75 (as the group watchdog would);
- in slot 1, process 1 exits 0 at once (the slot must wait for process 0);
- every other process waits for ``OUT_DIR/done``, writes ``<member>.p<j>.exit`` and exits 0.

Every wait is bounded: a probe never outlives 60 s.
"""

import json
import os
import sys
import time

out = sys.argv[1]
env = os.environ
member, j = env["UNBROKEN_MEMBER_ID"], int(env["UNBROKEN_RANK_IN_GROUP"])
slot = member.split(".")[-2]  # <node>.w<slot>.r<restart>
restart = int(env["UNBROKEN_RESTART_COUNT"])
record = {k: env.get(k) for k in (
    "UNBROKEN_MEMBER_ID", "UNBROKEN_GROUP_SIZE", "UNBROKEN_RANK_IN_GROUP", "UNBROKEN_GROUP_STORE", "UNBROKEN_GROUP_PREFIX",
    "UNBROKEN_GROUP_TIMEOUT", "UNBROKEN_RESTART_COUNT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "UNBROKEN_TOKEN",
)}
record["pid"] = os.getpid()
record["pgid"] = os.getpgid(0)
record["sid"] = os.getsid(0)
if env.get("UNBROKEN_GROUP_STORE"):
    from datetime import timedelta

    import torch.distributed as dist

    host, port = env["UNBROKEN_GROUP_STORE"].rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    prefix, k = env["UNBROKEN_GROUP_PREFIX"], int(env["UNBROKEN_GROUP_SIZE"])
    store.set(f"{prefix}pid/{j}", str(os.getpid()))
    store.wait([f"{prefix}pid/{i}" for i in range(k)], timedelta(seconds=30))  # every process of this incarnation
    record["peer_pids"] = [int(store.get(f"{prefix}pid/{i}")) for i in range(k)]
path = os.path.join(out, f"{member}.p{j}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.rename(path + ".tmp", path)
print(f"probe {member} j={j} local_rank={env['LOCAL_RANK']} pid={os.getpid()}", flush=True)
if slot == "w0" and restart == 0 and j == 1:
    # let process 0 write its record first, so that the test sees it was started and then killed
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(out, f"{member}.p0.json")) and time.monotonic() < deadline:
        time.sleep(0.02)
    print("probe: a peer went silent; ending the group", flush=True)
    sys.exit(75)
if slot == "w1" and j == 1:
    sys.exit(0)
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(out, "done")):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.05)
open(os.path.join(out, f"{member}.p{j}.exit"), "w").close()
