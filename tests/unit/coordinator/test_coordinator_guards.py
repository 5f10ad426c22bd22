"""Who may speak to the coordinator, and who may join (issue 11: a shared token; a preflight
that refuses a member whose script, settings or versions differ)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from unbroken.coordinator.client import CoordinatorClient
from unbroken.coordinator.server import Coordinator, CoordinatorSettings
from unbroken.errors import Unauthorized
from unbroken.coordinator.membership import MembershipSettings

PREFLIGHT = {"bucket_cap_mb": "25.0", "script": "train.py sha256 abc", "torch": "2.13.0"}


@pytest.fixture
def coordinator():
    c = Coordinator(CoordinatorSettings(hold=0.05, token="s3cret"), MembershipSettings(expected_members=2)).start_in_thread()
    try:
        yield c
    finally:
        c.stop()


def test_a_request_without_the_token_gets_401_and_a_clear_error(coordinator):
    stranger = CoordinatorClient(f"127.0.0.1:{coordinator.port}", timeout=2.0)
    with pytest.raises(Unauthorized, match="missing or wrong token"):
        stranger.status()
    wrong = CoordinatorClient(f"127.0.0.1:{coordinator.port}", timeout=2.0, token="guess")
    with pytest.raises(Unauthorized):
        wrong.status()
    for path in ("/metrics", "/v1/status"):
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(f"http://127.0.0.1:{coordinator.port}{path}", timeout=5)
        assert raised.value.code == 401


def test_leave_from_a_stranger_cannot_end_the_job_but_the_token_holder_can_talk(coordinator):
    member = CoordinatorClient(f"127.0.0.1:{coordinator.port}", timeout=2.0, token="s3cret")
    member.post("/v1/join", member="a", node="n", pid=1, step=0, after=0)
    stranger = CoordinatorClient(f"127.0.0.1:{coordinator.port}", timeout=2.0)
    with pytest.raises(Unauthorized):
        stranger.post("/v1/leave", member="a", finished=True, step=0)
    with pytest.raises(Unauthorized):
        stranger.post("/v1/exit", member="a", exitcode=-9, reason="forged")
    status = member.status()
    assert status["finished"] is False and status["members"][0]["state"] == "waiting"
    request = urllib.request.Request(f"http://127.0.0.1:{coordinator.port}/metrics", headers={"Authorization": "Bearer s3cret"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200


def test_a_member_that_differs_from_the_job_is_refused_naming_each_difference(coordinator):
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", timeout=2.0, token="s3cret")
    assert client.post("/v1/join", member="a", node="n", pid=1, step=0, after=0, preflight=PREFLIGHT)["status"] == "wait"
    other = {**PREFLIGHT, "bucket_cap_mb": "10.0", "script": "train.py sha256 def"}
    reply = client.post("/v1/join", member="b", node="m", pid=2, step=0, after=0, preflight=other)
    assert reply["status"] == "mismatch"
    assert "bucket_cap_mb: 10.0 here, 25.0 in the job" in reply["reason"]
    assert "script: train.py sha256 def here, train.py sha256 abc in the job" in reply["reason"]
    assert "torch" not in reply["reason"]
    assert "b" not in {m["member"] for m in client.status()["members"]}  # never became a member
    same = client.post("/v1/join", member="c", node="m", pid=3, step=0, after=0, preflight=dict(PREFLIGHT))
    assert same["status"] == "formed" and same["members"] == ["a", "c"]


def test_status_of_a_run_directory_reads_the_address_and_token_there(coordinator, tmp_path, capsys):
    """What `unbroken run` writes for its embedded coordinator is enough: no --token, no address.
    Without it the 401 says where the token is."""
    import json

    from unbroken.cli import main

    (tmp_path / "coordinator.json").write_text(json.dumps({"address": f"127.0.0.1:{coordinator.port}", "token": "s3cret"}))
    assert main(["status", str(tmp_path)]) == 0
    assert "generation 0" in capsys.readouterr().out
    assert main(["status", f"127.0.0.1:{coordinator.port}"]) == 2
    assert "RUN_DIR/coordinator.json" in capsys.readouterr().err
    assert main(["status", str(tmp_path / "nowhere")]) == 2  # neither a run directory nor HOST:PORT
    (tmp_path / "empty").mkdir()
    assert main(["status", str(tmp_path / "empty")]) == 2
    assert "coordinator.json cannot be read" in capsys.readouterr().err
