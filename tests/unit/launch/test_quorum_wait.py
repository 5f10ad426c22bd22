"""What the launcher says while the job is short of members (unbroken/launch/quorum_wait.py)."""

from types import SimpleNamespace

from unbroken.launch.quorum_wait import EVERY, QuorumWait

SETTINGS = SimpleNamespace(min_members=4, quorum_timeout=60.0, start_grace=30.0)


def _status(*states: str, generation: int = 0, **more) -> dict:
    return {"generation": generation, "members": [{"member": f"n{i % 2}.w{i}.r0", "node": f"n{i % 2}", "state": s}
                                                  for i, s in enumerate(states)], **more}


def test_a_short_job_is_said_every_few_seconds_with_who_joined_and_the_time_left():
    wait = QuorumWait(SETTINGS, "10.0.0.1:29400", started=0.0)
    status = _status("waiting", "waiting", "dead")
    assert wait.note(status, 1.0) is None  # not before EVERY seconds
    first = wait.note(status, EVERY)
    assert first is not None and "needs 4, 2 joined (node n0, n1)" in first and "--rdzv-endpoint 10.0.0.1:29400" in first
    assert "in 86 s" in first  # before the first generation: start grace, then quorum timeout, from the first sight (1 s)
    assert wait.note(status, EVERY + 1) is None
    assert "in 81 s" in wait.note(status, 2 * EVERY)


def test_nothing_is_said_once_the_job_has_its_members_finished_or_failed_or_past_the_timeout():
    wait = QuorumWait(SETTINGS, "h:1", started=0.0)
    assert wait.note(_status(*["active"] * 4, generation=3), 100.0) is None
    assert wait.note(_status("active", finished=True), 100.0) is None
    assert wait.note(_status("active", failed="too few"), 100.0) is None
    later = QuorumWait(SETTINGS, "h:1", started=0.0)
    assert "in 60 s" in later.note(_status("active", generation=3), 10.0)  # after a generation: no start grace
    assert later.note(_status("active", generation=3), 71.0) is None  # past the timeout: the verdict comes next
