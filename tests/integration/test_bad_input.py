"""Bad input ends with a clear message and a non-zero exit, never a hang or endless retries."""

import socket

import pytest

from testbed import harness

pytestmark = pytest.mark.slow


def starts(run):
    return len(run.events("worker_start"))


def test_a_missing_script_is_named(tmp_path):
    run = harness.unbroken(str(tmp_path), "--nproc-per-node", "2", str(tmp_path / "nope.py"), timeout=60)
    assert run.code == 2
    assert "training script not found" in run.stderr and "nope.py" in run.stderr


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_nproc_per_node_must_be_a_positive_integer(tmp_path, value):
    run = harness.unbroken(str(tmp_path), "--nproc-per-node", value, harness.EXACT, timeout=60)
    assert run.code == 2
    assert "--nproc-per-node must be a positive integer" in run.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--global-batch-size", "0"], "global_batch_size must be a positive integer"),
        (["--micro-batch-size", "-2"], "micro_batch_size must be a positive integer"),
        (["--bad-dataset"], "dataset must support len() and indexing"),
    ],
    ids=["global-batch-zero", "micro-batch-negative", "dataset-without-len"],
)
def test_invalid_job_settings_stop_the_run_with_the_reason(tmp_path, args, message):
    run = harness.unbroken(str(tmp_path), "--nproc-per-node", "2", harness.EXACT, *args, timeout=120)
    assert run.code == 1
    assert message in run.stderr
    assert "not retrying a bug in the script" in run.stderr
    assert starts(run) < 2 * 2  # at most one early restart before every worker has failed


def test_a_taken_coordinator_port_is_reported(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = harness.unbroken(str(tmp_path), "--nproc-per-node", "2", "--coordinator-port", str(port), harness.EXACT, timeout=60)
    assert run.code == 2
    assert f"coordinator port {port}" in run.stderr and "already in use" in run.stderr
    assert starts(run) == 0


def test_a_script_that_raises_on_every_member_is_not_retried_forever(tmp_path):
    run = harness.unbroken(str(tmp_path), "--nproc-per-node", "3", "--max-restarts", "5", harness.EXACT, "--raise-at-step", "3", timeout=120)
    assert run.code == 1
    assert "deliberate failure at step 3" in run.stderr
    # each worker may be restarted once before the last one fails too; never more
    assert starts(run) < 2 * 3
