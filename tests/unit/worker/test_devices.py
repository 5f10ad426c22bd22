"""Devices and backends: the backend choice and its errors, the worker's device, an NCCL group's
abort when a wait is abandoned (with a stand-in process group), the CUDA RNG state, GPU
snapshots and GPU tensors in healing. The tests that need CUDA skip without it."""

import threading
import types

import pytest
import torch

from unbroken.storage import checkpoint

from unbroken.worker import devices

from unbroken.worker import healing
from unbroken.cli import main
from unbroken.errors import ConfigError, GenerationFailed
from unbroken.worker.graveyard import Graveyard
from unbroken.worker.group import GenerationGroup, Transport
from unbroken.worker.nccl import nccl_environment

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")


# -- backend choice ------------------------------------------------------------------------------


def test_auto_picks_gloo_for_a_cpu_model():
    assert devices.choose_backend("auto", torch.device("cpu")) == "gloo"
    assert devices.choose_backend("gloo", torch.device("cpu")) == "gloo"


def test_an_unknown_backend_is_refused():
    with pytest.raises(ConfigError, match="auto, gloo, nccl"):
        devices.choose_backend("mpi", torch.device("cpu"))


@no_gpu
def test_nccl_without_cuda_is_refused_with_what_to_do_instead():
    with pytest.raises(ConfigError, match="--backend nccl needs CUDA GPUs and NCCL.*use --backend gloo"):
        devices.choose_backend("nccl", torch.device("cpu"))


@no_gpu
def test_run_with_backend_nccl_and_no_cuda_exits_2_with_one_line_before_anything_starts(tmp_path, capsys, monkeypatch):
    def launcher_must_not_start(*args, **kwargs):
        raise AssertionError("the launcher was started")

    monkeypatch.setattr("unbroken.launch.launcher.Launcher", launcher_must_not_start)
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    assert main(["run", "--backend", "nccl", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("unbroken: error: --backend nccl needs CUDA")


def test_the_backend_flag_reaches_the_launch_settings(tmp_path, launched):
    seen = launched
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["run", "--backend", "gloo", str(script)]) == 0
    assert seen["settings"].backend == "gloo"
    assert main(["run", str(script)]) == 0
    assert seen["settings"].backend == "auto"


def test_the_runtime_setting_comes_from_the_environment_and_is_checked(monkeypatch):
    from unbroken.worker.runtime_settings import RuntimeSettings

    monkeypatch.setenv("UNBROKEN_BACKEND", "gloo")
    assert RuntimeSettings.from_env().backend == "gloo"
    assert RuntimeSettings.from_env(backend="nccl").backend == "nccl"  # explicit beats the variable
    with pytest.raises(ConfigError, match="backend must be"):
        RuntimeSettings(backend="mpi")


def test_workers_sharing_a_gpu_get_gloo_from_auto_and_an_error_from_nccl(monkeypatch):
    monkeypatch.setattr(devices, "nccl_usable", lambda: True)
    monkeypatch.setattr(devices, "cuda_usable", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert devices.choose_backend("auto", gpu) == "nccl"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert devices.choose_backend("auto", gpu) == "gloo"
    with pytest.raises(ConfigError, match="3 workers share 1 GPU.*use --backend gloo"):
        devices.choose_backend("nccl", gpu)


# -- the worker's device -------------------------------------------------------------------------


def test_a_model_spread_over_two_devices_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ConfigError, match="several devices"):
        devices.model_device(model)


def test_a_cpu_model_is_on_the_cpu_and_the_local_device_is_the_cpu_without_cuda(monkeypatch):
    assert devices.model_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert devices.model_device(torch.nn.Identity()) == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "3")
    if not torch.cuda.is_available():
        assert devices.local_device() == torch.device("cpu")
    devices.check_assigned(torch.device("cpu"))  # a CPU model is never refused


@needs_gpu
def test_a_model_on_a_gpu_this_worker_was_not_given_is_refused(monkeypatch):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError, match="was given cuda:0"):
        devices.check_assigned(torch.device("cuda", 1))


# -- an NCCL generation group's abort (stand-in process group) -----------------------------------


class _HungWork:
    """A collective whose peer never comes: its future never completes."""

    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future

    def is_completed(self):
        return self.future.done()

    def wait(self):
        raise RuntimeError("aborted")


class _StandInNccl:
    def __init__(self):
        self.aborted = 0
        self.sent = []

    def allreduce(self, tensors):
        return _HungWork()

    def abort(self):
        self.aborted += 1


def _group(backend, verdict, timeout=5.0):
    group = GenerationGroup(3, 0, 2, ["a", "b"], abandoned=verdict, wake=threading.Event(), timeout=timeout,
                            transport=Transport(backend, "cuda:0"))
    group.pg = _StandInNccl()
    return group


def test_an_abandoned_wait_aborts_an_nccl_groups_communicator_once():
    group = _group("nccl", lambda: "member b was declared dead")
    with pytest.raises(GenerationFailed, match="declared dead"):
        group.allreduce(torch.zeros(2), "gradient allreduce")
    assert group.pg.aborted == 1 and group.aborted
    Graveyard().park(group)  # parking an aborted group does not abort again
    assert group.pg.aborted == 1


def test_a_wait_that_times_out_aborts_the_communicator_within_the_collective_timeout():
    import time

    group = _group("nccl", lambda: None, timeout=0.3)
    started = time.monotonic()
    with pytest.raises(GenerationFailed, match="timed out after 0.3 s"):
        group.allreduce(torch.zeros(2), "gradient allreduce")
    assert time.monotonic() - started < 2.0
    assert group.pg.aborted == 1


def test_a_gloo_group_is_never_aborted_its_pending_work_is_left_to_the_graveyard():
    group = _group("gloo", lambda: "member b was declared dead")
    with pytest.raises(GenerationFailed):
        group.allreduce(torch.zeros(2), "gradient allreduce")
    assert group.pg.aborted == 0 and group.device == torch.device("cpu")


def test_an_nccl_group_moves_small_messages_through_its_gpu_and_gloo_through_the_host():
    assert Transport("nccl", "cuda:1").device == torch.device("cuda", 1)
    assert Transport("gloo", "cuda:1").device == torch.device("cpu")
    env = nccl_environment(30.0)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # abort the communicator, keep the process
    assert env["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "30"
    assert env["TORCH_NCCL_USE_COMM_NONBLOCKING"] == "1"  # a communicator whose peer never comes can be aborted


# -- NCCL's semantics: a future done at enqueue, completion when the GPU has run it -------------


class _EnqueuedWork:
    """What an NCCL collective's work does: its future is done as soon as the collective is
    enqueued; ``is_completed()`` turns true when the GPU ran it (or it failed); ``wait()`` never
    blocks the host and raises if the work failed."""

    def __init__(self, finish_after: float | None = None, error: str | None = None):
        self.future = torch.futures.Future()
        self.future.set_result(None)  # enqueued
        self.error = error
        self.completed = threading.Event()
        if finish_after is not None:
            threading.Timer(finish_after, self.completed.set).start()

    def get_future(self):
        return self.future

    def is_completed(self):
        return self.completed.is_set()

    def wait(self):
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


class _EnqueuingNccl(_StandInNccl):
    def __init__(self, **work):
        super().__init__()
        self.work = work

    def allreduce(self, tensors):
        return _EnqueuedWork(**self.work)


def _enqueuing_group(verdict, timeout=5.0, **work):
    group = _group("nccl", verdict, timeout)
    group.pg = _EnqueuingNccl(**work)
    return group


def test_a_verdict_ends_the_wait_on_an_nccl_collective_that_was_enqueued_but_never_ran():
    group = _enqueuing_group(lambda: "member b was declared dead")
    with pytest.raises(GenerationFailed, match="declared dead"):
        group.allreduce(torch.zeros(2), "gradient allreduce")
    assert group.pg.aborted == 1


def test_an_nccl_wait_returns_when_the_gpu_finished_not_when_the_work_was_enqueued():
    import time

    group = _enqueuing_group(lambda: None, finish_after=0.3)
    started = time.monotonic()
    group.allreduce(torch.zeros(2), "gradient allreduce")
    assert time.monotonic() - started >= 0.3
    assert group.pg.aborted == 0


def test_an_nccl_work_that_completed_with_an_error_fails_the_generation():
    group = _enqueuing_group(lambda: None, finish_after=0.0, error="NCCL communicator was aborted")
    with pytest.raises(GenerationFailed, match="communicator was aborted"):
        group.allreduce(torch.zeros(2), "gradient allreduce")
    assert group.pg.aborted == 1


def test_an_abort_that_hangs_costs_its_bound_and_a_broken_communicator_is_never_shut_down(monkeypatch):
    import time

    from unbroken.worker import nccl

    class Hanging(_StandInNccl):
        def abort(self):
            time.sleep(3600)

    class ShutdownOnly:
        def __init__(self):
            self.shut = 0

        def shutdown(self):
            self.shut += 1

    monkeypatch.setattr(nccl, "ABORT_BOUND", 0.2)
    group = _group("nccl", lambda: "member b was declared dead")
    group.pg = Hanging()
    started = time.monotonic()
    with pytest.raises(GenerationFailed, match="declared dead"):
        group.allreduce(torch.zeros(2), "gradient allreduce")
    assert time.monotonic() - started < 2.0
    only = ShutdownOnly()
    assert nccl.abort(only, torch.device("cuda", 0), bound=5.0) and only.shut == 0


def test_an_abort_held_behind_a_long_kernel_finishes_in_the_background_and_is_in_flight_meanwhile():
    """On an H200, ncclCommAbort returned only when the kernel queued before the aborted
    collective had run (3 s): a verdict must end the wait at once, not when the GPU is free."""
    import time

    from unbroken.worker import blocking_waits

    class HeldBehindAKernel(_StandInNccl):
        def __init__(self):
            super().__init__()
            self.returned = threading.Event()

        def abort(self):
            time.sleep(1.5)
            super().abort()
            self.returned.set()

    before = blocking_waits.in_flight()
    group = _group("nccl", lambda: "member b was declared dead")
    group.pg = held = HeldBehindAKernel()
    started = time.monotonic()
    with pytest.raises(GenerationFailed, match="declared dead"):
        group.allreduce(torch.zeros(2), "gradient allreduce")
    assert time.monotonic() - started < 1.2  # the abort's default bound (0.5 s), not the kernel's 1.5 s
    assert not held.returned.is_set() and blocking_waits.in_flight() == before + 1  # the exit guard sees it
    assert held.returned.wait(5.0) and held.aborted == 1
    deadline = time.monotonic() + 5.0
    while blocking_waits.in_flight() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert blocking_waits.in_flight() == before


def test_torchs_own_nccl_timeout_comes_after_unbrokens_so_its_watchdog_never_races_the_abort(monkeypatch):
    import datetime

    from unbroken.worker import torch_groups

    made = {}

    class FakeNccl:
        class Options:
            pass

        def __init__(self, store, rank, size, options):
            made["timeout"] = options._timeout

    monkeypatch.setattr(torch_groups.dist, "ProcessGroupNCCL", FakeNccl, raising=False)
    monkeypatch.setattr(torch_groups.torch.cuda, "set_device", lambda device: None)
    torch_groups._nccl_group(None, 0, 2, 5.0, torch.device("cuda", 0))
    assert made["timeout"] == datetime.timedelta(seconds=5.0 + torch_groups.TORCH_TIMEOUT_MARGIN)
    assert torch_groups.TORCH_TIMEOUT_MARGIN >= 30.0


def test_the_nccl_environment_is_set_and_a_setting_that_ends_workers_is_refused(capsys):
    from unbroken.worker import nccl

    environ: dict[str, str] = {}
    assert nccl.prepare_environment(30.0, environ) == []
    assert environ == nccl.nccl_environment(30.0)
    assert environ["TORCH_NCCL_ENABLE_MONITORING"] == "0" and environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    for value in ("1", "3"):  # TearDown, and torch's default SkipCleanUp: both end the process
        with pytest.raises(ConfigError, match=f"TORCH_NCCL_ASYNC_ERROR_HANDLING={value} makes torch end a worker"):
            nccl.prepare_environment(30.0, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": value})
    mine = {"TORCH_NCCL_ENABLE_MONITORING": "1"}
    warnings = nccl.prepare_environment(30.0, mine)
    assert mine["TORCH_NCCL_ENABLE_MONITORING"] == "1" and len(warnings) == 1  # kept, with what it costs
    assert "heartbeat monitor may end a healthy worker" in capsys.readouterr().out


def test_a_cuda_model_sets_its_device_on_the_main_thread_and_nccl_settings_before_any_group(monkeypatch):
    from unbroken.worker import runtime

    calls = []
    monkeypatch.setattr(devices, "model_device", lambda model: torch.device("cuda", 1))
    monkeypatch.setattr(devices, "choose_backend", lambda name, device: "nccl")
    monkeypatch.setattr(devices, "check_assigned", lambda device: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device, threading.current_thread())))
    monkeypatch.setattr("unbroken.worker.nccl.prepare_environment", lambda timeout: calls.append(("environment", timeout)))
    monkeypatch.setattr("unbroken.worker.group.set_transport", lambda backend, device: calls.append(("transport", backend)))
    job = runtime.Job.__new__(runtime.Job)
    job.distributed = True
    job.settings = types.SimpleNamespace(backend="auto", collective_timeout=12.0)
    job._choose_backend(torch.nn.Linear(1, 1))
    assert calls == [("set_device", torch.device("cuda", 1), threading.main_thread()), ("environment", 12.0), ("transport", "nccl")]


# -- RNG, snapshots and healing ------------------------------------------------------------------


def test_a_cpu_members_rng_state_has_no_cuda_entry_and_loading_one_with_a_cuda_entry_on_the_cpu_ignores_it():
    state = healing.rng_state(torch.device("cpu"))
    assert "cuda" not in state
    expected = torch.rand(3)
    healing.set_rng_state({**state, "cuda": torch.zeros(8, dtype=torch.uint8)}, torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected)


@needs_gpu
def test_the_cuda_rng_state_of_the_models_device_is_taken_and_put_back():
    device = torch.device("cuda", 0)
    state = healing.rng_state(device)
    expected = torch.rand(3, device=device)
    healing.set_rng_state(state, device)
    assert torch.equal(torch.rand(3, device=device), expected)


def test_a_cpu_snapshot_copies_and_uses_no_pinned_pool():
    state = {"w": torch.ones(3), "nested": [torch.zeros(2)], "n": 4}
    pool = checkpoint.PinnedPool()
    copy = checkpoint.snapshot(state, pool)
    state["w"].add_(1)
    assert torch.equal(copy["w"], torch.ones(3)) and copy["n"] == 4
    assert pool._lent == []
    checkpoint.copies_done(state)()  # a no-op without CUDA tensors


@needs_gpu
def test_a_gpu_snapshot_lands_in_pinned_buffers_reused_by_the_next_save():
    state = {"w": torch.randn(1000, device="cuda"), "step": torch.tensor(3)}
    pool = checkpoint.PinnedPool()
    copy = checkpoint.snapshot(state, pool)
    checkpoint.copies_done(state)()
    assert copy["w"].is_pinned() and torch.equal(copy["w"], state["w"].cpu())
    pool.give_back()
    again = checkpoint.snapshot(state, pool)
    assert again["w"].data_ptr() == copy["w"].data_ptr()


@needs_gpu
def test_gpu_tensors_of_a_healed_state_arrive_on_the_receivers_gpu_and_cpu_tensors_on_the_cpu():
    from tests.unit.worker.test_healing import _Link

    class GpuLink(_Link):
        device = torch.device("cpu")

        def send(self, tensor, dst, tag, what):
            super().send(tensor.cpu(), dst, tag, what)

    state = {"w": torch.randn(600, 1000, device="cuda"), "b": torch.randn(4, device="cuda"), "step": torch.tensor(7)}
    link = GpuLink()
    healing.send_state(link, state, 1)
    back, _ = healing.recv_state(link, 0, gpu=torch.device("cuda", 0))
    assert back["w"].device.type == "cuda" and back["b"].device.type == "cuda" and back["step"].device.type == "cpu"
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
