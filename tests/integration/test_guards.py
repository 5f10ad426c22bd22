"""Members that do not belong (issue 11): a node whose script or settings differ is refused with
a message naming each difference, and stopped; the others train on."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from testbed import harness

pytestmark = pytest.mark.slow


def _start(argv, env=None):
    return subprocess.Popen(
        [sys.executable, "-m", "unbroken", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, env={**os.environ, **(env or {})},
    )


def _finish(proc, timeout=180):
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"did not end within {timeout} s\n{out[-2000:]}\n{err[-2000:]}")


@pytest.mark.parametrize("difference", ["bucket_cap_mb", "script"])
def test_a_node_that_does_not_match_the_job_is_refused_and_stopped_while_the_others_train_on(tmp_path, difference):
    run_a, run_b = str(tmp_path / "a"), str(tmp_path / "b")
    script, env_b = harness.EXACT, {}
    if difference == "script":
        other = tmp_path / "other"
        other.mkdir()
        script = str(other / os.path.basename(harness.EXACT))
        shutil.copy(harness.EXACT, script)
        with open(script, "a") as f:
            f.write("\n# a different version of the script\n")
    else:
        env_b = {"UNBROKEN_BUCKET_CAP_MB": "10"}
    # 200 steps: node a trains for 20 s or more, so node b joins while a's job runs however slowly
    # b's worker starts on a loaded machine (with 60 steps a once finished before b joined).
    a = _start(["run", "--run-dir", run_a, "--node-name", "a", "--nproc-per-node", "2",
                harness.EXACT, "--steps", "200", "--step-delay", "0.1", "--out", f"{run_a}/final"])
    b = None
    try:
        started = harness.wait_for(lambda: harness.Run(0, "", "", run_a).events("coordinator_start"), 60, "node a's coordinator")
        address = f"127.0.0.1:{started[0]['port']}"
        token_file = os.path.join(run_a, "coordinator.json")
        harness.wait_for(lambda: os.path.exists(token_file), 30, "node a's token file")
        with open(token_file) as f:
            token = json.load(f)["token"]
        harness.wait_for(lambda: harness.Run(0, "", "", run_a).events("step"), 90, "node a to train")
        b = _start(["run", "--run-dir", run_b, "--node-name", "b", "--coordinator", address, "--nproc-per-node", "1",
                    "--token", token, script, "--steps", "200", "--step-delay", "0.1"], env=env_b)
        out_b, err_b = _finish(b, timeout=120)
        out_a, err_a = _finish(a)
    finally:
        harness.stop([a, b], [run_a, run_b])
    assert b.returncode == 2, out_b[-2000:] + err_b[-2000:]
    refusals = harness.Run(0, "", "", run_a).events("refused")
    assert refusals and refusals[0]["member"].startswith("b.w0"), (
        out_b[-2000:] + err_b[-2000:] + "\n" + "\n".join(json.dumps(e) for e in harness.Run(0, "", "", run_a).events() if e["kind"] != "step")[-4000:]
    )
    assert difference in refusals[0]["reason"], refusals[0]["reason"]
    assert "does not match the job" in out_b + err_b
    worker_log = open(os.path.join(run_b, "workers", "w0.log")).read()
    assert difference in worker_log
    summary_b = harness.Run(0, "", "", run_b).summary()
    assert summary_b["workers"][0]["restarts"] == 0  # stopped, not restarted
    assert a.returncode == 0, out_a[-2000:] + err_a[-2000:]
    generations = harness.Run(0, "", "", run_a).events("generation")
    assert len(generations) == 1 and all(m.startswith("a.") for m in generations[0]["members"])
