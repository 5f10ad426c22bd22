"""Checks shared by every test: a test that leaves torch.distributed's default process group
behind fails by name, instead of making later tests skip or misbehave; under ``UNBROKEN_CI=1`` a
test whose machine needs are missing fails (:mod:`tests.needs`); the run says in one line when
the GPU tests did not run."""

import pytest
import torch
import torch.distributed as dist


def pytest_runtest_setup(item):
    missing = item.get_closest_marker("needs_missing")
    if missing is not None:
        pytest.fail(missing.args[0], pytrace=False)


def pytest_terminal_summary(terminalreporter):
    if torch.cuda.is_available():
        return
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "GPU" in str(r.longrepr)]
    terminalreporter.write_line(
        f"unbroken: the GPU tests did not run ({len(skipped)} skipped: no CUDA device here); "
        "tests/gpu/run.sh runs the GPU checks on a machine with one", yellow=True, bold=True)


def _destroy_leaked_group() -> None:
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group is still gone from torch's registry
        pass


@pytest.fixture(autouse=True)
def _no_leaked_process_group(request):
    """Fail the test that created a default process group and did not destroy it (a group held by
    a module-scoped fixture exists before the test starts and is that fixture's to destroy)."""
    before = dist.is_initialized()
    yield
    if not before and dist.is_initialized():
        _destroy_leaked_group()
        pytest.fail(f"{request.node.nodeid} left a torch.distributed process group behind; destroy it in a finally")


@pytest.fixture(autouse=True, scope="module")
def _no_leaked_module_group(request):
    """Fail the module whose fixtures left a default process group behind."""
    yield
    if dist.is_initialized():
        _destroy_leaked_group()
        pytest.fail(f"{request.module.__name__} left a torch.distributed process group behind")
