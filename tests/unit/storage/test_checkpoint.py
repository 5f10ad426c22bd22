"""Durable checkpoints: atomic publish, verification, retention, resume, and s3:// (moto)."""

import dataclasses
import io
import json
import os
import time

import pytest
import torch

from unbroken.storage.checkpoint import (
    CheckpointCorrupt,
    CheckpointSettings,
    CheckpointStore,
    Saver,
    Schedule,
    snapshot,
    young_daly_interval,
)
from tests import needs
from unbroken.errors import ConfigError


def state(step):
    return {"model": {"w": torch.full((4,), float(step))}, "runtime": {"next_step": step}}


def save(store, step):
    import io

    buffer = io.BytesIO()
    torch.save(state(step), buffer)
    return store.write(step, buffer.getvalue(), {"generation": 1, "members": ["a"]})


def test_a_checkpoint_is_published_with_a_manifest_that_verifies(tmp_path):
    store = CheckpointStore(str(tmp_path))
    location = save(store, 7)
    assert location.endswith("step-00000007")
    manifest = json.loads((tmp_path / "step-00000007" / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["files"]["state.pt"]["bytes"] > 0
    assert set(manifest["versions"]) == {"unbroken", "torch", "python"}
    loaded, found_manifest, where = store.load_latest()
    assert torch.equal(loaded["model"]["w"], torch.full((4,), 7.0)) and where == location


@pytest.mark.parametrize("url", ["dir", "memory://unbroken-generation-note"])
def test_a_noted_generation_newer_than_the_checkpoints_is_the_floor_and_is_not_a_checkpoint(tmp_path, url):
    from unbroken.worker.checkpointing import _has_entries

    store = CheckpointStore(str(tmp_path / url) if url == "dir" else url)
    assert store.newest_generation() == 0
    store.note_generation(4)  # before any checkpoint: an empty directory but for the note
    assert store.newest_generation() == 4 and store.steps() == [] and not _has_entries(store)
    save(store, 7)  # written by generation 1 (the checkpoint's manifest)
    assert store.newest_generation() == 4
    store.note_generation(9)
    assert store.newest_generation() == 9 and store.steps() == [7]


def test_a_directory_without_its_manifest_is_invisible(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save(store, 5)
    os.makedirs(tmp_path / "step-00000010")
    (tmp_path / "step-00000010" / "state.pt").write_bytes(b"half written")
    assert store.steps() == [5]
    assert store.load_latest()[0]["runtime"]["next_step"] == 5


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path, capsys, damage):
    store = CheckpointStore(str(tmp_path))
    save(store, 5)
    save(store, 10)
    path = tmp_path / "step-00000010" / "state.pt"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="step-00000010"):
        store.read(10)
    loaded, manifest, where = store.load_latest()
    assert manifest["step"] == 5 and where.endswith("step-00000005")
    out = capsys.readouterr().out
    assert "skipping checkpoint" in out and "step-00000010" in out


def test_with_no_valid_checkpoint_load_latest_returns_none(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save(store, 3)
    (tmp_path / "step-00000003" / "manifest.json").write_text("{not json")
    assert store.load_latest() is None


def test_retention_keeps_the_newest_and_removes_older_leftovers(tmp_path):
    store = CheckpointStore(str(tmp_path))
    for step in (5, 10, 15, 20):
        save(store, step)
    os.makedirs(tmp_path / "step-00000012")  # an unpublished leftover, older than the newest
    deleted = store.retain(2)
    assert sorted(deleted) == ["step-00000005", "step-00000010", "step-00000012"]
    assert store.steps() == [20, 15]


def test_the_saver_stalls_only_for_the_memory_copy_and_writes_in_the_background(tmp_path):
    import threading

    done, held, release = [], threading.Event(), threading.Event()

    def hold(step):  # the write blocks before publishing until the test lets it go
        held.set()
        assert release.wait(30), "the test never released the write"

    store = CheckpointStore(str(tmp_path))
    saver = Saver(store, keep=2, on_done=done.append, fault=hold)
    live = {"model": {"w": torch.zeros(1000)}}
    try:
        stall = saver.save(4, live, {"generation": 1, "members": ["a"]})
        assert stall is not None and held.wait(30), "the write never started"
        # save() returned while the write is held: training goes on, and the snapshot must not see it
        live["model"]["w"].add_(1.0)
        assert saver.busy() and saver.writing == 4 and store.steps() == [] and not done
        assert saver.save(5, live, {"generation": 1, "members": ["a"]}) is None  # one write in flight
    finally:
        release.set()
    saver.wait(30)
    assert not saver.busy() and saver.error is None
    assert [d["step"] for d in done] == [4] and done[0]["stall"] == stall
    loaded = CheckpointStore(str(tmp_path)).load_latest()[0]
    assert torch.equal(loaded["model"]["w"], torch.zeros(1000))


def test_snapshot_copies_tensors_and_keeps_structure():
    original = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": "x"}
    copy = snapshot(original)
    original["a"][0].add_(1)
    assert torch.equal(copy["a"][0], torch.ones(2)) and copy["a"][1][1] == 3 and copy["b"] == "x"


def test_young_daly_grows_with_the_save_cost_and_the_time_between_failures():
    assert young_daly_interval(0.5, 3600) == pytest.approx(60.0)
    assert young_daly_interval(2.0, 3600) > young_daly_interval(0.5, 3600)
    schedule = Schedule("auto", mtbf=3600.0, now=0.0)
    assert schedule.due(1, 0.0)  # the first save measures the cost
    message = schedule.saved(0.5, 0.0)
    assert "60.0 s" in message
    assert not schedule.due(2, 30.0) and schedule.due(3, 60.5)


def test_auto_counts_only_losses_of_every_live_copy_and_its_estimate_grows_while_none_happens():
    schedule = Schedule("auto", mtbf=3600.0, now=0.0)
    assert schedule.mtbf(0.0) == 3600.0
    assert schedule.mtbf(3600.0) == 7200.0  # an hour without a loss: the prior counts as one observation
    schedule.saved(0.5, 3600.0)
    assert schedule.interval == pytest.approx(young_daly_interval(0.5, 7200.0))
    # a job resumed from a checkpoint that was not its final one: every live copy had been lost
    resumed = Schedule("auto", mtbf=3600.0, now=100.0)
    resumed.adopt({"losses": 2, "seconds": 8000.0}, now=100.0, lost=True)
    assert resumed.losses == 3 and resumed.mtbf(100.0) == pytest.approx((3600.0 + 8000.0) / 4)
    assert "3 in 8000 s of training" in resumed.saved(0.5, 100.0)
    # a member healed from a peer takes its history, never lowering its own; junk is ignored
    healed = Schedule("auto", mtbf=3600.0, now=0.0)
    healed.adopt(resumed.record(100.0), now=0.0)
    assert (healed.losses, healed.seconds(0.0)) == (3, 8000.0)
    healed.adopt({"losses": 1, "seconds": 10.0}, now=0.0)
    healed.adopt({"losses": True, "seconds": "x"}, now=0.0)
    healed.adopt(None, now=0.0)
    assert (healed.losses, healed.seconds(0.0)) == (3, 8000.0)


def test_the_auto_interval_is_capped_and_says_so():
    schedule = Schedule("auto", mtbf=1e9, now=0.0, max_interval=600.0)
    message = schedule.saved(2.0, 0.0)
    assert schedule.interval == 600.0 and "capped at 600 s" in message
    assert CheckpointSettings.from_env({"UNBROKEN_CHECKPOINT_MAX_INTERVAL": "90"}).max_interval == 90.0
    with pytest.raises(ConfigError, match="max interval must be a positive"):
        CheckpointSettings(max_interval=0)
    with pytest.raises(ConfigError, match="UNBROKEN_CHECKPOINT_MAX_INTERVAL"):
        CheckpointSettings.from_env({"UNBROKEN_CHECKPOINT_MAX_INTERVAL": "soon"})


def test_a_fixed_interval_saves_every_n_steps():
    schedule = Schedule(5, mtbf=3600.0, now=0.0)
    assert [s for s in range(1, 16) if schedule.due(s, 0.0)] == [5, 10, 15]


@pytest.mark.parametrize(
    "kwargs, message",
    [({"directory": "d", "every": 0}, "positive number of steps"), ({"every": 5}, "needs a checkpoint directory"),
     ({"directory": "d", "keep": 0}, "keep must be at least 1"), ({"directory": "d", "every": "sometimes"}, "'auto'")],
)
def test_bad_checkpoint_settings_are_clear_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CheckpointSettings(**kwargs)


def test_a_single_process_job_resumes_from_its_newest_valid_checkpoint(tmp_path, monkeypatch, capsys):
    import unbroken

    monkeypatch.delenv("UNBROKEN_COORDINATOR", raising=False)
    torch.set_num_threads(1)

    def run(total):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        data = torch.utils.data.TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
        job = unbroken.Job(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=8,
                           checkpoint=CheckpointSettings(str(tmp_path), every=3))
        seen = []
        for step in job.steps(total):
            seen.append(step.index)
            for xb, yb in step.micro_batches():
                step.backward(torch.nn.functional.mse_loss(model(xb), yb))
            job._saver.wait()  # a save due while the previous one is written would be skipped
        return seen, model

    assert run(7)[0] == list(range(7))  # saves at 3, 6 and the final 7
    assert CheckpointStore(str(tmp_path)).steps() == [7, 6, 3]
    (tmp_path / "step-00000007" / "state.pt").write_bytes(b"garbage")
    seen, _ = run(9)
    out = capsys.readouterr().out
    assert seen == [6, 7, 8]
    assert "skipping checkpoint" in out and "step-00000007" in out
    assert "resumed from step 6 of" in out


def test_checkpoints_on_s3_save_list_resume_and_retain(tmp_path, monkeypatch):
    moto_server = needs.module("moto.server")
    needs.module("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        port = server._server.server_port
        for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
            monkeypatch.setenv(key, value)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("ckpt")
        store = CheckpointStore("s3://ckpt/run1")
        for step in (2, 4, 6):
            assert save(store, step) == f"s3://ckpt/run1/step-{step:08d}"
        assert store.steps() == [6, 4, 2]
        assert store.load_latest()[1]["step"] == 6
        store.retain(2)
        assert store.steps() == [6, 4]
        # a flipped byte on the object store is caught too
        with store.fs.open("ckpt/run1/step-00000006/state.pt", "rb") as f:
            data = bytearray(f.read())
        data[10] ^= 0xFF
        with store.fs.open("ckpt/run1/step-00000006/state.pt", "wb") as f:
            f.write(bytes(data))
        assert store.load_latest()[1]["step"] == 4
    finally:
        server.stop()


def test_a_save_due_while_the_previous_write_runs_is_refused_at_once_not_waited_for(tmp_path):
    import threading

    release = threading.Event()
    store = CheckpointStore(str(tmp_path))
    done = []
    saver = Saver(store, keep=3, on_done=done.append, fault=lambda step: release.wait(30))
    assert saver.save(1, {"w": torch.ones(3)}, {}) is not None
    started = time.monotonic()
    assert saver.save(2, {"w": torch.ones(3)}, {}) is None  # the write of step 1 hangs in the store
    assert time.monotonic() - started < 1.0
    assert saver.writing == 1 and saver.busy()
    release.set()
    saver.wait()
    assert [d["step"] for d in done] == [1] and store.steps() == [1]
    assert saver.save(3, {"w": torch.ones(3)}, {}) is not None
    saver.wait()
    assert store.steps() == [3, 1]


def test_retention_keeps_the_newest_by_write_time_and_never_the_one_just_written(tmp_path):
    store = CheckpointStore(str(tmp_path))
    payload = b"x"
    # an earlier run left checkpoints of higher steps; this run's are newer but lower
    for step in (500, 600, 700, 10, 20):
        store.write(step, payload, {})
        time.sleep(0.01)
    deleted = store.retain(2, just_written=20)
    assert store.steps() == [20, 10]
    assert sorted(deleted) == ["step-00000500", "step-00000600", "step-00000700"]


class _Code:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_a_checkpoint_that_names_code_to_run_is_not_executed_on_load(tmp_path, capsys):
    import io as _io

    store = CheckpointStore(str(tmp_path))
    buffer = _io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}, "extra": _Code()}, buffer)
    store.write(5, buffer.getvalue(), {})
    assert store.load_latest() is None  # skipped, with a warning, never run
    out = capsys.readouterr().out
    assert "this must never run" not in out and "cannot load" in out


@dataclasses.dataclass
class UserRecord:
    best: float


def test_what_heals_also_loads_from_a_checkpoint_numpy_and_the_users_safe_globals(tmp_path):
    """One allow-list: a numpy array in extra_state healed, but made every checkpoint holding it
    unreadable (skipped: the job resumed from step 0); a type the user allows for torch's loads is
    accepted by both readers."""
    import io as _io
    import pickle

    import numpy as np

    from unbroken.storage.safe_unpickle import safe_loads

    extra = {"history": np.arange(4.0), "best": np.float32(0.25), "rng": np.random.get_state()}
    store = CheckpointStore(str(tmp_path))
    buffer = _io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}, "extra_state": extra}, buffer)
    store.write(5, buffer.getvalue(), {})
    loaded = store.load_latest()
    assert loaded is not None, "a checkpoint holding numpy arrays must load"
    assert np.array_equal(loaded[0]["extra_state"]["history"], extra["history"])
    assert np.array_equal(safe_loads(pickle.dumps(extra))["history"], extra["history"])

    record = {"extra_state": UserRecord(0.5)}
    with pytest.raises(pickle.UnpicklingError, match="add_safe_globals"):
        safe_loads(pickle.dumps(record))
    with torch.serialization.safe_globals([UserRecord]):
        assert safe_loads(pickle.dumps(record)) == record
        buffer = _io.BytesIO()
        torch.save(record, buffer)
        store.write(6, buffer.getvalue(), {})
        assert store.load_latest()[0] == record


def test_a_memory_file_holds_what_torch_saves_byte_for_byte_and_loads_it_back():
    import io

    from unbroken.storage.checkpoint import MemoryFile

    state = {"w": torch.randn(300, 7), "b": torch.arange(5, dtype=torch.int16), "meta": {"step": 3, "names": ["a"]}}
    reference = io.BytesIO()
    torch.save(state, reference)
    small = MemoryFile(capacity=16)  # grows as it is written
    torch.save(state, small)
    assert bytes(small.getbuffer()) == reference.getvalue()
    loaded = torch.load(MemoryFile(bytes(small.getbuffer())), weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"]) and loaded["meta"] == state["meta"]


def test_a_checkpoint_that_cannot_be_completed_is_skipped_but_one_for_another_job_is_refused(tmp_path):
    from unbroken.errors import ConfigError

    store = CheckpointStore(str(tmp_path))
    for step in (3, 6):
        buffer = io.BytesIO()
        torch.save({"step": step}, buffer)
        store.write(step, buffer.getvalue(), {})
        time.sleep(0.01)  # newest by write time

    def unreadable_parts(state, manifest):
        if manifest["step"] == 6:
            raise OSError("part gone")

    state, manifest, _ = store.load_latest(unreadable_parts)
    assert manifest["step"] == 3 and state == {"step": 3}

    def other_parameters(state, manifest):
        raise ConfigError("written for other parameters")

    with pytest.raises(ConfigError):
        store.load_latest(other_parameters)
