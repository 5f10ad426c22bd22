"""A worker's large temporaries reuse memory instead of faulting in fresh pages every step
(:mod:`unbroken.worker.allocator`)."""

import subprocess
import sys
import textwrap

import pytest

from unbroken.worker.runtime_settings import RuntimeSettings

# In a fresh interpreter whose heap layout made glibc map and unmap every large temporary
# (``import typing`` before torch did, on this project's machines: 4,064 faults a step): the
# faults of AdamW-like steps over two 4 MiB tensors, each step making four 4 MiB temporaries.
PROBE = textwrap.dedent("""
    import resource, sys, typing
    import torch
    if sys.argv[1] == "job":
        import unbroken
        unbroken.Job(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                     torch.utils.data.TensorDataset(torch.randn(8, 2)), global_batch_size=4)
    weights = [torch.rand(1024, 1024) + 1 for _ in range(2)]
    def step():
        for w in weights:
            denom = w.sqrt()
            update = w / denom
            w.add_(update, alpha=-1e-6)
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
""")


def _faults_per_step(mode: str, tune: str) -> float:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                          env={"UNBROKEN_TUNE_MALLOC": tune, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_jobs_step_temporaries_come_from_reused_memory_not_fresh_pages():
    # 4 temporaries of 4 MiB a step are 4,096 pages: a step that faults them all in again is
    # the untuned process's; a reused heap faults a small fraction of one.
    assert _faults_per_step("job", "1") < 500


def test_tune_malloc_is_on_by_default_and_off_by_its_variable(monkeypatch):
    assert RuntimeSettings().tune_malloc is True
    monkeypatch.setenv("UNBROKEN_TUNE_MALLOC", "0")
    assert RuntimeSettings.from_env().tune_malloc is False
