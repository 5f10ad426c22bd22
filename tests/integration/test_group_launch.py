"""``unbroken run --group-size K``: a slot is a replica group of K processes that share one fate.

The workers are ``scripts/group_probe.py``, which does not use the runtime (no Job): nobody joins
the coordinator, so the job never finishes and the launcher ends with status 1 ("workers exited
before the job finished") once every slot exited 0.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from testbed import harness
from unbroken.store_keys import key_tag

pytestmark = pytest.mark.slow

PROBE = os.path.join(harness.SCRIPTS, "group_probe.py")


def _records(out: str) -> dict[str, dict]:
    """``<member>.p<j>`` -> what that process wrote."""
    found = {}
    for name in os.listdir(out):
        if name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                found[name[: -len(".json")]] = json.load(f)
    return found


def _launch(run_dir: str, out: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "unbroken", "run", "--run-dir", run_dir, "--node-name", "n1", "--progress-interval", "0",
         *flags, PROBE, out],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
    )


def test_a_failing_process_ends_and_restarts_its_whole_group_and_no_other(tmp_path):
    run_dir, out = str(tmp_path / "run"), str(tmp_path / "probe")
    os.makedirs(out)
    proc = _launch(run_dir, out, "--nproc-per-node", "4", "--group-size", "2", "--restart-backoff", "0.1")
    try:
        wanted = ["n1.w0.r0.p0", "n1.w0.r0.p1", "n1.w0.r1.p0", "n1.w0.r1.p1", "n1.w1.r0.p0", "n1.w1.r0.p1"]
        harness.wait_for(lambda: set(wanted) <= set(_records(out)), 40, "both incarnations of slot 0 and slot 1 to start")
        first_p0 = _records(out)["n1.w0.r0.p0"]["pid"]
        # the first incarnation's process 0 was killed with its group: gone before the test lets anyone end
        harness.wait_for(lambda: not harness._running(first_p0), 10, "the failed group's process 0 to be gone")
        open(os.path.join(out, "done"), "w").close()
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        leftovers = harness.stop([proc], [run_dir])
    assert leftovers == []
    assert proc.returncode == 1 and "workers exited before the job finished" in stderr, stdout + stderr
    records = _records(out)
    assert sorted(records) == sorted(wanted)  # slot 0 started twice, slot 1 once

    # the environment of each process
    store = records["n1.w0.r0.p0"]["UNBROKEN_GROUP_STORE"]
    assert store.startswith("127.0.0.1:")
    for name, r in records.items():
        slot, restart, j = int(name.split(".")[1][1:]), int(name.split(".")[2][1:]), int(name[-1])
        assert r["UNBROKEN_MEMBER_ID"] == f"n1.w{slot}.r{restart}"  # the group is the member
        assert (r["UNBROKEN_GROUP_SIZE"], r["UNBROKEN_RANK_IN_GROUP"], r["UNBROKEN_RESTART_COUNT"]) == ("2", str(j), str(restart))
        assert (r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) == (str(slot * 2 + j), "4")
        assert r["UNBROKEN_GROUP_STORE"] == store  # one store per launcher, reachable: the probes met there
        # named from the job's token: nobody without it can name the group's keys in the store
        assert r["UNBROKEN_TOKEN"] and r["UNBROKEN_GROUP_PREFIX"] == (
            f"unbroken/group/{key_tag(r['UNBROKEN_TOKEN'], f'group/n1.w{slot}/{restart}')}n1.w{slot}/{restart}/")
        assert r["UNBROKEN_GROUP_TIMEOUT"] == "3.0"  # --heartbeat-timeout
        group = [records[f"n1.w{slot}.r{restart}.p{i}"]["pid"] for i in range(2)]
        assert r["peer_pids"] == group  # met its own incarnation's processes under its prefix
        assert r["pgid"] == group[0]  # one process group per replica group, led by process 0
    assert {records[f"n1.w0.r1.p{j}"]["pid"] for j in (0, 1)}.isdisjoint({records[f"n1.w0.r0.p{j}"]["pid"] for j in (0, 1)})

    # fate: process 1's exit 75 ended process 0 (no normal exit), and the group came back as one
    exits = set(n for n in os.listdir(out) if n.endswith(".exit"))
    assert exits == {"n1.w0.r1.p0.exit", "n1.w0.r1.p1.exit", "n1.w1.r0.p0.exit"}, exits
    # slot 1's process 1 exited 0 at once; its slot waited for process 0, which ended normally
    assert "[unbroken] worker 0 (n1.w0.r0) process 1 of 2: exit code 75" in stdout
    summary = harness.Run(0, "", "", run_dir).summary()
    w0, w1 = summary["workers"]
    assert (w0["restarts"], w0["state"], w1["restarts"], w1["state"]) == (1, "succeeded", 0, "succeeded")
    assert [(e["member"], e["code"], e["process"], e["how"]) for e in w0["exits"]] == [
        ("n1.w0.r0", 75, 1, "process 1 of 2: exit code 75"), ("n1.w0.r1", 0, 0, "exit code 0")
    ]
    assert [(e["member"], e["code"]) for e in w1["exits"]] == [("n1.w1.r0", 0)]
    run = harness.Run(0, "", "", run_dir)
    starts = [(e["member"], e["pids"]) for e in run.events("worker_start")]
    assert sorted(m for m, _ in starts) == ["n1.w0.r0", "n1.w0.r1", "n1.w1.r0"]
    assert all(len(pids) == 2 for _, pids in starts)

    # one log per slot with every process's lines; the console shows process 0's only
    with open(os.path.join(run_dir, "workers", "w0.log")) as f:
        log = f.read()
    assert "[p1] probe n1.w0.r0 j=1" in log and "[p1] probe: a peer went silent" in log
    assert "\nprobe n1.w0.r1 j=0" in log and "[p1] probe n1.w0.r1 j=1" in log
    assert not os.path.exists(os.path.join(run_dir, "workers", "w2.log"))
    shown = [line for line in stdout.splitlines() if line.startswith("[w") and "probe" in line]
    assert shown and all(" j=0 " in line for line in shown), shown


def test_without_group_size_every_process_is_a_group_of_one(tmp_path):
    run_dir, out = str(tmp_path / "run"), str(tmp_path / "probe")
    os.makedirs(out)
    open(os.path.join(out, "done"), "w").close()
    run = harness.unbroken(run_dir, "--node-name", "n1", "--progress-interval", "0", "--nproc-per-node", "2", PROBE, out, timeout=60)
    assert run.code == 1 and "workers exited before the job finished" in run.stderr, run.stdout + run.stderr
    records = _records(out)
    assert sorted(records) == ["n1.w0.r0.p0", "n1.w1.r0.p0"]
    for slot in (0, 1):
        r = records[f"n1.w{slot}.r0.p0"]
        assert (r["UNBROKEN_GROUP_SIZE"], r["UNBROKEN_RANK_IN_GROUP"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) == ("1", "0", str(slot), "2")
        assert (r["UNBROKEN_GROUP_STORE"], r["UNBROKEN_GROUP_PREFIX"], r["UNBROKEN_GROUP_TIMEOUT"]) == (None, None, None)
        assert r["pgid"] == r["sid"] == r["pid"]  # a session of its own, as before groups
    assert "process" not in json.dumps(run.summary()["workers"])
    assert all("pids" not in e for e in run.events("worker_start"))


def test_a_process_count_that_is_not_a_multiple_of_the_group_size_exits_2(tmp_path):
    run = harness.unbroken(str(tmp_path / "run"), "--nproc-per-node", "3", "--group-size", "2", PROBE, str(tmp_path), timeout=30)
    assert run.code == 2
    assert "--nproc-per-node 3 is not a multiple of --group-size 2" in run.stderr


def test_sigterm_to_the_launcher_stops_every_process_of_every_group(tmp_path):
    run_dir, out = str(tmp_path / "run"), str(tmp_path / "probe")
    os.makedirs(out)
    proc = _launch(run_dir, out, "--nproc-per-node", "4", "--group-size", "2", "--shutdown-grace", "2")
    try:
        # slot 0's first incarnation fails on purpose; wait for its second and for slot 1's process 0
        wanted = ["n1.w0.r1.p0", "n1.w0.r1.p1", "n1.w1.r0.p0"]
        harness.wait_for(lambda: set(wanted) <= set(_records(out)), 40, "the groups to start")
        pids = [_records(out)[name]["pid"] for name in wanted]
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        leftovers = harness.stop([proc], [run_dir])
    assert proc.returncode == 143 and "stopped by SIGTERM" in stderr, stdout + stderr
    assert leftovers == [] and not any(harness._running(pid) for pid in pids)
    assert not [n for n in os.listdir(out) if n.endswith(".exit")]  # none ended normally
    assert all(w["state"] == "stopped" for w in harness.Run(0, "", "", run_dir).summary()["workers"])
