"""The worker runtime as a plain single process (no coordinator in the environment)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from unbroken.data.data_plan import DataPlan
from unbroken.errors import ConfigError
from unbroken.worker.runtime import Job, RuntimeSettings

torch.set_num_threads(1)

N, G = 20, 8


@pytest.fixture(autouse=True)
def _no_unbroken_environment(monkeypatch):
    monkeypatch.delenv("UNBROKEN_COORDINATOR", raising=False)
    for name in list(os.environ):
        if name.startswith("UNBROKEN_"):
            monkeypatch.delenv(name)


def _data(n: int = N) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64) + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, y)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1).double()


def _job(model=None, dataset=None, **kwargs) -> Job:
    model = model if model is not None else _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs.setdefault("global_batch_size", G)
    return Job(model, optimizer, dataset if dataset is not None else _data(), **kwargs)


def _train(job: Job, total: int) -> list:
    steps = []
    for step in job.steps(total=total):
        for x, y in step.micro_batches():
            step.backward(torch.nn.functional.mse_loss(job.model(x), y))
        step.commit()
        steps.append(step)
    return steps


def test_without_a_coordinator_the_job_is_a_single_process_that_trains():
    job = _job(micro_batch_size=3)
    before = [p.detach().clone() for p in job.model.parameters()]
    steps = _train(job, total=6)
    assert not job.distributed and job.is_leader
    assert (job.member_index, job.member_count, job.generation) == (0, 1, 0)
    assert [s.index for s in steps] == list(range(6))
    assert all(s.committed and not s.failed for s in steps)
    assert job.next_step == 6
    assert any(not torch.equal(a, b) for a, b in zip(before, job.model.parameters()))


def test_each_single_process_step_processes_the_whole_global_batch_in_micro_batches():
    job = _job(micro_batch_size=3)
    seen = []
    for step in job.steps(total=3):
        assert step.positions == range(step.index * G, (step.index + 1) * G)
        assert (step.rank, step.members, step.samples) == (0, 1, G)
        sizes = []
        for x, y in step.micro_batches():
            sizes.append(len(x))
            seen.append(x)
            step.backward(torch.nn.functional.mse_loss(job.model(x), y))
        assert sizes == [3, 3, 2]
    x_all = job.dataset.tensors[0]
    expected = x_all[job.plan.indices(range(0, 3 * G))]
    assert torch.equal(torch.cat(seen), expected)


def test_single_process_training_equals_plain_sgd_on_the_global_batch():
    job = _job(micro_batch_size=3)
    _train(job, total=7)
    reference = _model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x_all, y_all = _data().tensors
    plan = DataPlan(N, G, G)
    for s in range(7):
        idx = plan.indices(range(s * G, (s + 1) * G))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x_all[idx]), y_all[idx]).backward()
        optimizer.step()
    for mine, theirs in zip(job.model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_step_loss_is_the_mean_loss_over_the_global_batch_before_the_update():
    job = _job(micro_batch_size=5)
    x_all, y_all = job.dataset.tensors
    for step in job.steps(total=3):
        assert step.loss is None
        idx = job.plan.indices(step.positions)
        with torch.no_grad():
            expected = torch.nn.functional.mse_loss(job.model(x_all[idx]), y_all[idx]).item()
        for x, y in step.micro_batches():
            step.backward(torch.nn.functional.mse_loss(job.model(x), y))
        assert step.commit() is True
        assert step.loss == pytest.approx(expected, rel=1e-12)


def test_a_step_the_loop_does_not_commit_is_committed_for_it():
    job = _job()
    before = job.model.weight.detach().clone()
    steps = []
    for step in job.steps(total=2):
        for x, y in step.micro_batches():
            step.backward(torch.nn.functional.mse_loss(job.model(x), y))
        steps.append(step)
    assert all(s.committed for s in steps)
    assert isinstance(steps[0].loss, float) and steps[0].loss > 0
    assert job.next_step == 2
    assert not torch.equal(before, job.model.weight)


def test_steps_resume_from_the_next_step_and_the_scheduler_steps_per_commit():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    job = Job(model, optimizer, _data(), global_batch_size=G, scheduler=scheduler)
    assert [s.index for s in _train(job, total=3)] == [0, 1, 2]
    assert [s.index for s in _train(job, total=5)] == [3, 4]
    assert [s.index for s in _train(job, total=5)] == []
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5**5)


def test_zero_steps_yields_nothing_and_changes_nothing():
    job = _job()
    before = copy.deepcopy(job.model.state_dict())
    assert _train(job, total=0) == []
    assert all(torch.equal(before[k], v) for k, v in job.model.state_dict().items())


def test_more_backward_calls_than_micro_batches_is_an_error():
    job = _job(micro_batch_size=4)
    step = next(iter(job.steps(total=1)))
    for x, y in step.micro_batches():
        step.backward(torch.nn.functional.mse_loss(job.model(x), y))
    with pytest.raises(RuntimeError, match="more times than there are micro-batches"):
        step.backward(job.model(x).sum())


def test_a_micro_batch_skipped_by_the_loop_is_refused_at_commit_on_the_first_step():
    from unbroken.errors import LoopMisuse

    job = _job(micro_batch_size=4)
    before = job.model.weight.detach().clone()
    step = next(iter(job.steps(total=3)))
    for i, (x, y) in enumerate(step.micro_batches()):
        if i == 0:
            continue  # "skip a batch after a caught error"
        step.backward(torch.nn.functional.mse_loss(job.model(x), y))
    with pytest.raises(LoopMisuse, match="called 1 time.*for 2 micro-batch"):
        step.commit()
    assert torch.equal(before, job.model.weight) and job.next_step == 0


def test_gradients_from_a_plain_loss_backward_are_refused_at_commit_on_the_first_step():
    from unbroken.errors import LoopMisuse

    job = _job(micro_batch_size=4)
    before = job.model.weight.detach().clone()
    step = next(iter(job.steps(total=3)))
    for x, y in step.micro_batches():
        torch.nn.functional.mse_loss(job.model(x), y).backward()
    with pytest.raises(LoopMisuse, match="outside step.backward"):
        step.commit()
    assert torch.equal(before, job.model.weight) and job.next_step == 0


def test_a_loss_normalised_by_a_count_is_the_sum_over_the_global_batch_divided_by_its_total_count():
    job = _job(micro_batch_size=3)
    reference = copy.deepcopy(job.model)
    x, y = job.dataset.tensors
    step = next(iter(job.steps(total=1)))
    counted = 0.0
    for xb, yb in step.micro_batches():
        mask = (xb[:, :1] > 0).double()
        counted += float(mask.sum())
        step.backward(((job.model(xb) - yb) ** 2 * mask).sum(), count=mask.sum())
    assert step.reduce()
    positions = job.plan.indices(step.positions)
    xs, ys = x[positions], y[positions]
    mask = (xs[:, :1] > 0).double()
    expected = ((reference(xs) - ys) ** 2 * mask).sum() / mask.sum()
    expected.backward()
    assert counted == float(mask.sum())
    assert step.loss == pytest.approx(expected.item(), rel=1e-12)
    assert torch.allclose(job.model.weight.grad, reference.weight.grad, rtol=1e-12, atol=0)


def test_mixing_the_two_forms_of_backward_in_one_step_is_refused():
    from unbroken.errors import LoopMisuse

    job = _job(micro_batch_size=4)
    step = next(iter(job.steps(total=1)))
    batches = iter(step.micro_batches())
    x, y = next(batches)
    step.backward(torch.nn.functional.mse_loss(job.model(x), y))
    x, y = next(batches)
    with pytest.raises(LoopMisuse, match="with and without count="):
        step.backward(((job.model(x) - y) ** 2).sum(), count=len(x))


def test_a_collate_function_and_a_plain_dataset_are_supported():
    samples = [(torch.full((3,), float(i), dtype=torch.float64), torch.tensor([float(i)], dtype=torch.float64)) for i in range(N)]
    calls = []

    def collate(items):
        calls.append(len(items))
        return torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])

    job = _job(dataset=samples, micro_batch_size=4, collate_fn=collate)
    step = next(iter(job.steps(total=1)))
    xs = [x for x, _ in step.micro_batches()]
    assert calls == [4, 4]
    assert torch.cat(xs)[:, 0].long().tolist() == job.plan.indices(range(0, G)).tolist()


# -- configuration errors --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8", True])
def test_a_bad_global_batch_size_is_a_config_error_naming_it(bad):
    with pytest.raises(ConfigError, match="global_batch_size"):
        _job(global_batch_size=bad)


@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_a_bad_micro_batch_size_is_a_config_error_naming_it(bad):
    with pytest.raises(ConfigError, match="micro_batch_size"):
        _job(micro_batch_size=bad)


class _NoLen:
    def __getitem__(self, i):
        return torch.zeros(3)


class _BrokenLen:
    def __getitem__(self, i):
        return torch.zeros(3)

    def __len__(self):
        raise TypeError("length unknown")


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([torch.zeros(3)])


@pytest.mark.parametrize("dataset", [_NoLen(), _BrokenLen(), _Stream(), iter([1, 2])], ids=["no-len", "len-raises", "iterable", "iterator"])
def test_a_dataset_without_len_is_a_config_error_mentioning_len(dataset):
    with pytest.raises(ConfigError, match=r"len\(\)"):
        _job(dataset=dataset)


def test_an_empty_dataset_is_a_config_error():
    with pytest.raises(ConfigError, match="empty"):
        _job(dataset=[])


@pytest.mark.parametrize("total", [-1, 2.5, "3", True, None])
def test_an_invalid_total_is_a_config_error(total):
    job = _job()
    with pytest.raises(ConfigError, match="total must be a non-negative integer"):
        next(iter(job.steps(total=total)))
    assert job.next_step == 0


# -- settings --------------------------------------------------------------------------------------


def test_runtime_settings_without_environment_are_the_defaults():
    s = RuntimeSettings.from_env()
    assert s == RuntimeSettings()
    assert s.coordinator is None and s.record_samples is False


def test_runtime_settings_read_typed_values_from_unbroken_variables(monkeypatch):
    monkeypatch.setenv("UNBROKEN_COORDINATOR", "10.0.0.1:29400")
    monkeypatch.setenv("UNBROKEN_MEMBER_ID", "node1.w0.r2")
    monkeypatch.setenv("UNBROKEN_HEARTBEAT_INTERVAL", "0.25")
    monkeypatch.setenv("UNBROKEN_JOIN_TIMEOUT", "12")
    monkeypatch.setenv("UNBROKEN_RECORD_SAMPLES", "yes")
    monkeypatch.setenv("UNBROKEN_NODE", "")  # empty means unset
    s = RuntimeSettings.from_env()
    assert (s.coordinator, s.member_id, s.heartbeat_interval, s.join_timeout, s.record_samples, s.node) == (
        "10.0.0.1:29400", "node1.w0.r2", 0.25, 12.0, True, ""
    )
    assert isinstance(s.join_timeout, float)


@pytest.mark.parametrize("raw, expected", [("1", True), ("TRUE", True), ("0", False), ("no", False), ("false", False)])
def test_boolean_variables_accept_the_usual_spellings(monkeypatch, raw, expected):
    monkeypatch.setenv("UNBROKEN_RECORD_SAMPLES", raw)
    assert RuntimeSettings.from_env().record_samples is expected


def test_explicit_arguments_beat_the_environment_and_none_means_not_given(monkeypatch):
    monkeypatch.setenv("UNBROKEN_COLLECTIVE_TIMEOUT", "45")
    monkeypatch.setenv("UNBROKEN_MEMBER_ID", "from-env")
    s = RuntimeSettings.from_env(collective_timeout=20.0, member_id=None)
    assert (s.collective_timeout, s.member_id) == (20.0, "from-env")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"heartbeat_interval": 0.0}, "heartbeat_interval < collective_timeout"),
        ({"heartbeat_interval": 30.0}, "heartbeat_interval < collective_timeout"),
        ({"coordinator_timeout": 0.0}, "coordinator_timeout must be positive"),
        ({"join_timeout": -1.0}, "join_timeout must be positive"),
        ({"bucket_cap_mb": 0.0}, "bucket_cap_mb must be positive"),
        ({"heal_lanes": 0}, "heal_lanes must be positive"),
        ({"heal_lanes": 2.5}, "heal_lanes must be a whole number"),
    ],
)
def test_runtime_settings_refuse_bad_timeouts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        RuntimeSettings(**overrides)


def test_an_invalid_environment_value_is_refused_through_the_settings_checks(monkeypatch):
    monkeypatch.setenv("UNBROKEN_JOIN_TIMEOUT", "0")
    with pytest.raises(ConfigError, match="join_timeout must be positive"):
        RuntimeSettings.from_env()


def test_a_malformed_numeric_variable_is_a_config_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("UNBROKEN_HEARTBEAT_INTERVAL", "half a second")
    with pytest.raises(ConfigError, match="UNBROKEN_HEARTBEAT_INTERVAL"):
        RuntimeSettings.from_env()


def _job_with_a_fake_heartbeat(**settings):
    """A job whose coordinator is a heartbeat the test drives: ``answered`` (when the request
    whose reply is ``view`` was sent) and ``view``; and a client whose other requests answer."""
    import time as _time

    from unbroken.worker.runtime import Job, RuntimeSettings

    torch.set_num_threads(1)
    model = torch.nn.Linear(2, 1)
    data = torch.utils.data.TensorDataset(torch.zeros(8, 2), torch.zeros(8, 1))
    job = Job(model, torch.optim.SGD(model.parameters(), lr=0.1), data, global_batch_size=4,
              settings=RuntimeSettings(coordinator="127.0.0.1:1", **settings))

    class Heartbeat:
        answered = _time.monotonic()
        view: dict = {"generation": 1, "state": "active"}

    class Client:
        last_ok = _time.monotonic()

    job._joiner.heartbeat = Heartbeat()
    job._client = Client()
    return job, job._joiner.heartbeat


def test_a_member_past_its_lease_may_not_commit_and_past_its_grace_abandons_its_generation():
    import time as _time

    job, heartbeat = _job_with_a_fake_heartbeat(lease=2.0, coordinator_grace=3.0)
    assert job._abandon_reason(1) is None
    heartbeat.answered = _time.monotonic() - 2.5
    assert job._abandon_reason(1) is None  # within the grace: waits go on
    reason = job._abandon_reason(1, for_commit=True)
    assert reason and "lease 2.0 s" in reason  # but no commit
    heartbeat.answered = _time.monotonic() - 5.5
    reason = job._abandon_reason(1)
    assert reason and "lease 2.0 s" in reason


def test_a_commit_past_the_lease_waits_for_the_coordinator_to_answer_again():
    import threading
    import time as _time

    job, heartbeat = _job_with_a_fake_heartbeat(lease=2.0, coordinator_grace=3.0)
    heartbeat.answered = _time.monotonic() - 2.5
    answered = threading.Timer(0.3, lambda: setattr(heartbeat, "answered", _time.monotonic()))
    answered.start()
    started = _time.monotonic()
    assert job._joiner.commit_reason(1) is None
    assert _time.monotonic() - started >= 0.25
    heartbeat.answered = _time.monotonic() - 4.8  # never answers: gives up at the end of the grace
    started = _time.monotonic()
    reason = job._joiner.commit_reason(1)
    assert reason and "no reply from the coordinator" in reason
    assert 0.1 < _time.monotonic() - started < 2.0


def test_a_member_holding_its_commit_through_a_cut_takes_the_news_that_renews_its_lease():
    """A member cut off mid-step holds its commit past its lease; when the network returns, an
    answered request that carries no news (a roster's) must not renew the lease, and the heartbeat
    that does renew it brings the newer generation with it: the step is not committed (seen in CI:
    a cut-off leader committed step 4 of generation 2 after the others had redone it in 3)."""
    import threading
    import time as _time

    job, heartbeat = _job_with_a_fake_heartbeat(lease=2.0, coordinator_grace=3.0)
    heartbeat.answered = _time.monotonic() - 2.5
    client = job._client

    def network_back():
        client.last_ok = _time.monotonic()  # some other request answered first
        _time.sleep(0.3)
        heartbeat.view = {"generation": 2, "state": "dead"}
        heartbeat.answered = _time.monotonic()

    threading.Timer(0.2, network_back).start()
    reason = job._joiner.commit_reason(1)
    assert reason is not None and ("dead" in reason or "generation 2" in reason), reason


def test_an_optimizer_stepped_by_the_script_is_refused_on_the_first_step():
    from unbroken.errors import LoopMisuse

    job = _job(micro_batch_size=4)
    before = copy.deepcopy(job.model.state_dict())
    steps = job.steps(total=2)  # held: the loop body runs while the generator is alive
    step = next(steps)
    for xb, yb in step.micro_batches():
        step.backward(torch.nn.functional.mse_loss(job.model(xb), yb))
    with pytest.raises(LoopMisuse, match=r"step 0: optimizer.step\(\) was called by the script.*call step.commit\(\) instead"):
        job.optimizer.step()
    assert all(torch.equal(before[k], v) for k, v in job.model.state_dict().items())  # refused before it changed anything
    assert step.commit() and job.next_step == 1  # the rightful caller still may


def _tracking() -> bool:
    from torch.overrides import _get_current_function_mode_stack

    from unbroken.worker.input_check import _Marking

    return any(isinstance(mode, _Marking) for mode in _get_current_function_mode_stack())


def test_a_model_fed_batches_of_the_scripts_own_is_refused_on_the_first_step():
    from unbroken.errors import LoopMisuse

    job = _job(micro_batch_size=4)
    before = copy.deepcopy(job.model.state_dict())
    own = _data(4)  # nanoGPT's get_batch: samples the data plan never chose
    step = next(job.steps(total=2))
    for _ in step.micro_batches():
        x, y = own.tensors
        with pytest.raises(LoopMisuse, match=r"step 0: the model was called on tensors that did not come from step.micro_batches\(\)"):
            step.backward(torch.nn.functional.mse_loss(job.model(x), y))
        break
    assert all(torch.equal(before[k], v) for k, v in job.model.state_dict().items())
    assert not _tracking(), "the tracking mode was left on"


def test_a_batch_transformed_before_the_model_is_accepted_and_followed_only_once():
    job = _job(micro_batch_size=4)
    steps = 0
    for step in job.steps(total=3):
        for x, y in step.micro_batches():
            x = (x.to("cpu").float().double() - 0.5) * 2.0  # moved, cast, normalised
            x = torch.cat([x[:2], x[2:]])[:, :3]
            step.backward(torch.nn.functional.mse_loss(job.model(x), y))
            assert not _tracking()
        step.commit()
        steps += 1
    assert steps == 3 and job._inputs_checked and job.next_step == 3


def test_a_batch_without_tensors_is_not_followed():
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    model = _model()
    job = Job(model, torch.optim.SGD(model.parameters(), lr=0.1), words, global_batch_size=4, collate_fn=list)
    for step in job.steps(total=2):
        for batch in step.micro_batches():  # the script tokenises: new tensors, nothing to follow
            x = torch.tensor([[float(len(w)), 1.0, 0.0] for w in batch], dtype=torch.float64)
            step.backward(model(x).pow(2).mean())
        step.commit()
    assert job.next_step == 2


def test_zero_grad_between_backward_and_commit_is_refused_and_before_backward_is_allowed():
    from unbroken.errors import LoopMisuse

    job = _job(micro_batch_size=4)
    steps = job.steps(total=2)
    step = next(steps)
    job.optimizer.zero_grad()  # at the top of the loop body, as DDP scripts do: harmless
    for xb, yb in step.micro_batches():
        step.backward(torch.nn.functional.mse_loss(job.model(xb), yb))
    with pytest.raises(LoopMisuse, match=r"step 0: optimizer.zero_grad\(\) was called by the script after step.backward"):
        job.optimizer.zero_grad()
    assert job.model.weight.grad is not None  # refused before it dropped anything
    assert step.commit() and job.model.weight.grad is None  # commit zeroes them itself


def test_a_break_at_the_top_of_a_step_ends_the_loop_at_the_boundary_before_it():
    job = _job(micro_batch_size=4)
    for step in job.steps(total=5):
        if step.index == 2:
            assert step.untouched
            break
        for x, y in step.micro_batches():
            assert not step.untouched
            step.backward(torch.nn.functional.mse_loss(job.model(x), y))
        step.commit()
    assert job.next_step == 2
