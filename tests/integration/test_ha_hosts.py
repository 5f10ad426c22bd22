"""Any host may fail, the coordinator's included (issue 12): three hosts as network namespaces, each
running an etcd member, a launcher whose coordinator candidate may lead, and one worker.

- the host that runs both the leading coordinator and etcd's leader is lost whole: the others
  train on, stalled within 1 s of the heartbeat timeout;
- the leader frozen for 3x its lease, then woken: it serves nothing, writes nothing, and is a
  candidate again;
- the leader's host cut off: the majority trains, the cut-off side commits nothing;
- two of three etcd members stopped: nobody commits; restarted: training goes on.

Every case ends with the exactly-once check and the same model as a single process. Each test
removes its hosts, and with them every process it started, in every outcome.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from testbed import etcd, harness, netns
from tests.integration.conftest import GLOBAL, STEPS
from tests.needs import needs

pytestmark = [pytest.mark.slow]

REASON = netns.why_not_available() or etcd.why_not_available()
HEARTBEAT_TIMEOUT = 4.0
LEASE = 2.0
"""The leader's etcd lease."""
MEMBER_LEASE = HEARTBEAT_TIMEOUT - 0.25
"""A member stops committing this long after its newest answered heartbeat was sent."""
TOKEN = "ha-test-token"


class Job:
    """Three hosts, each an etcd member (unless ``ha``: then the launchers start them), a launcher
    with a coordinator candidate, and one worker."""

    def __init__(self, hosts: netns.Hosts, base: str, ha: bool = False) -> None:
        self.hosts, self.base, self.ha = hosts, base, ha
        self.dirs = [os.path.join(base, f"h{i}") for i in range(3)]
        self.final = os.path.join(base, "final")
        self.procs: list[subprocess.Popen] = []
        self.etcd_endpoints = [f"{a}:2379" for a in hosts.addresses]

    def start(self, index: int) -> subprocess.Popen:
        address = self.hosts.addresses[index]
        env = dict(os.environ, UNBROKEN_TOKEN=TOKEN)
        if self.ha:  # what srun gives each node's launcher
            env.update(SLURM_JOB_ID="77", SLURM_JOB_NODELIST=",".join(self.hosts.addresses), SLURM_NODEID=str(index),
                       SLURMD_NODENAME=f"h{index}")
            where = ["--ha", "--node-name", f"h{index}"]
        else:
            where = ["--etcd", ",".join(self.etcd_endpoints), "--job-id", "ha", "--coordinator-host", address,
                     "--coordinator-port", "29400", "--node-name", f"h{index}"]
        proc = self.hosts.popen(
            index,
            [sys.executable, "-m", "unbroken", "run", *where, "--leader-lease", str(LEASE), "--nproc-per-node", "1",
             "--heartbeat-interval", "0.25", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--min-members", "1",
             "--record-samples", "--run-dir", self.dirs[index],
             harness.EXACT, "--steps", str(STEPS), "--step-delay", "0.5", "--out", self.final],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.procs.append(proc)
        return proc

    def events(self, kind: str, hosts=(0, 1, 2)) -> list[dict]:
        found = [e for i in hosts for e in harness.Run(0, "", "", self.dirs[i]).events(kind)]
        return sorted(found, key=lambda e: e["t"])

    def leader(self) -> int:
        """The host whose candidate took the lead last."""
        return max((e["t"], i) for i in range(3) for e in self.events("leader", (i,)))[1]

    def commits(self, index: int) -> list[dict]:
        try:
            return harness.commits(self.dirs[index], f"h{index}.w0.r0")
        except FileNotFoundError:
            return []

    def wait_training(self) -> None:
        harness.wait_for(lambda: [g for g in self.events("generation") if len(g["members"]) == 3], 120, "three hosts in a generation")
        harness.wait_for(lambda: len(self.commits(0)) >= 4, 60, "training to start")

    def first_commit_after(self, t: float, hosts) -> float:
        """When the members of ``hosts`` first committed a step in a generation formed after ``t``."""

        def found():
            new = {g["generation"] for g in self.events("generation") if g["t"] > t}
            return [c["t"] for i in hosts for c in self.commits(i) if c["g"] in new]

        return min(harness.wait_for(found, 60, "a commit in a new generation"))

    def finish(self, hosts) -> None:
        for i in hosts:
            out, err = self.procs[i].communicate(timeout=240)
            assert self.procs[i].returncode == 0, f"h{i}: " + out[-2000:] + err[-3000:]

    def check(self, reference, finished_hosts) -> None:
        harness.check_exactly_once(self.dirs, STEPS, GLOBAL)
        finals = harness.final_params(self.final)
        for i in finished_hosts:
            member = f"h{i}.w0.r0"
            assert member in finals, sorted(finals)
            assert harness.max_relative_difference(finals[member], reference["single"]) < 1e-8, member

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        for d in self.dirs:
            harness.kill_leftovers(d)


def _etcd_inside(hosts):
    return lambda index: lambda argv, **kwargs: hosts.popen(index, argv, **kwargs)


@contextlib.contextmanager
def _training(tmp_path):
    """Three hosts, each an etcd member (the test's) and a training launcher, once they train;
    everything ends with the hosts."""
    with netns.hosts(3) as hosts, etcd.cluster(str(tmp_path / "etcd"), hosts=hosts.addresses, popen_for=_etcd_inside(hosts)) as cluster:
        job = Job(hosts, str(tmp_path))
        try:
            for i in range(3):
                job.start(i)
            job.wait_training()
            yield hosts, cluster, job
        finally:
            job.stop_all()


def _status(address: str) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{address}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@needs(REASON)
def test_the_host_of_both_leaders_lost_whole_the_others_train_on_under_ha(tmp_path, reference):
    """Under --ha (SLURM's environment, the launchers start etcd): the host that runs the leading
    coordinator and etcd's leader loses power; the stall stays within 1 s of the heartbeat timeout."""
    with netns.hosts(3) as hosts:
        job = Job(hosts, str(tmp_path), ha=True)
        try:
            for i in range(3):
                job.start(i)
            job.wait_training()
            victim = job.leader()
            etcd.move_leader(job.etcd_endpoints, victim)
            time.sleep(1.0)  # a few steps with both leaders on the victim
            hosts.signal_all(victim, signal.SIGKILL)
            lost = time.time()
            survivors = [i for i in range(3) if i != victim]
            resumed = job.first_commit_after(lost, survivors)
            new_leader = harness.wait_for(lambda: [e for e in job.events("leader", survivors) if e["t"] > lost], 30, "a new leader")[0]
            job.finish(survivors)
        finally:
            job.stop_all()
    print(f"both leaders' host lost: new leader after {new_leader['t'] - lost:.2f} s, training again after {resumed - lost:.2f} s")
    assert resumed - lost <= HEARTBEAT_TIMEOUT + 1.0
    job.check(reference, survivors)


@needs(REASON)
def test_a_frozen_leader_serves_nothing_when_woken_and_is_a_candidate_again(tmp_path, reference):
    with _training(tmp_path) as (hosts, cluster, job):
        victim = job.leader()
        launcher = job.procs[victim].pid  # `ip netns exec` execs the launcher: the same pid
        os.kill(launcher, signal.SIGSTOP)
        frozen = time.time()
        harness.wait_for(lambda: [e for e in job.events("leader") if e["t"] > frozen], 30, "a new leader")
        time.sleep(max(0.0, frozen + 3 * LEASE - time.time()))
        os.kill(launcher, signal.SIGCONT)
        woken = time.time()
        new_leader = job.leader()
        # at once it answers nothing but 503; within a poll or two, it names the new leader
        assert _status(f"{hosts.addresses[victim]}:29400")[0] == 503
        expected = f"{hosts.addresses[new_leader]}:29400"
        harness.wait_for(lambda: [r for r in [_status(f"{hosts.addresses[victim]}:29400")] if r[0] == 503 and r[1]["leader"] == expected], 10,
                         "the woken leader to name the new one")
        job.finish(range(3))
    # it formed nothing after it froze; its members committed only in generations of the new leader
    # once their lease (counted from a heartbeat sent before the freeze) had run out
    mine = job.events("generation", (victim,))
    assert not [g for g in mine if g["t"] > frozen], mine
    old = max(g["generation"] for g in mine)
    late = [c for i in range(3) for c in job.commits(i) if c["t"] > frozen + MEMBER_LEASE + 0.5 and c["g"] <= old]
    assert not late, late
    assert new_leader != victim and woken - frozen >= 3 * LEASE
    job.check(reference, range(3))


@needs(REASON)
def test_the_leaders_host_cut_off_the_majority_trains_and_the_cut_side_commits_nothing(tmp_path, reference):
    with _training(tmp_path) as (hosts, cluster, job):
        victim = job.leader()
        majority = [i for i in range(3) if i != victim]
        hosts.cut(victim)
        cut = time.time()
        resumed = job.first_commit_after(cut, majority)
        harness.wait_for(lambda: len([c for i in majority for c in job.commits(i) if c["t"] > resumed]) >= 6, 60, "steps without the cut host")
        restored_at = time.time()
        hosts.restore(victim)
        job.finish(range(3))
    stale = [c for c in job.commits(victim) if cut + MEMBER_LEASE + 0.5 < c["t"] < restored_at]
    assert not stale, stale
    print(f"leader's host cut off: the majority trains again after {resumed - cut:.2f} s")
    job.check(reference, range(3))


@needs(REASON)
def test_without_an_etcd_majority_nobody_commits_and_training_resumes_when_it_returns(tmp_path, reference):
    with _training(tmp_path) as (hosts, cluster, job):
        cluster.stop(1)
        cluster.stop(2)
        stopped = time.time()
        time.sleep(LEASE + MEMBER_LEASE + 3.0)
        restarted = time.time()
        cluster.start(1, popen=_etcd_inside(hosts)(1))
        cluster.start(2, popen=_etcd_inside(hosts)(2))
        resumed = job.first_commit_after(restarted, range(3))
        job.finish(range(3))
    # the leader stops serving by its own clock within LEASE; members within their lease after that
    quiet = [c for i in range(3) for c in job.commits(i) if stopped + LEASE + MEMBER_LEASE + 0.5 < c["t"] < restarted]
    assert not quiet, quiet
    print(f"etcd majority back: training again after {resumed - restarted:.2f} s")
    job.check(reference, range(3))
