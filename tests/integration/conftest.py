import pytest

from testbed import harness

STEPS = 40
GLOBAL = harness.GLOBAL


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Final parameters of a single process and of a failure-free 4-worker run."""
    single = harness.single_process(str(tmp_path_factory.mktemp("single")), "--steps", str(STEPS))
    run_dir = str(tmp_path_factory.mktemp("healthy"))
    out = f"{run_dir}/final"
    run = harness.unbroken(run_dir, "--nproc-per-node", "4", "--record-samples", harness.EXACT, "--steps", str(STEPS), "--out", out)
    assert run.code == 0, run.stdout + run.stderr
    healthy = harness.final_params(out)
    assert len(healthy) == 4
    return {"single": single, "healthy": next(iter(healthy.values())), "healthy_run": run}
