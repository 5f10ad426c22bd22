"""Mixed precision in one process: the scaler path of Step.commit against the same scaler logic
written by hand, clipping after unscale_, bf16 autocast on the CPU, the scaler's state in the
training state and in checkpoints, and the errors of a scaler that cannot work."""

import pytest
import torch

import unbroken
from unbroken.worker import mixed_precision
from unbroken.storage.checkpoint import CheckpointSettings
from unbroken.errors import ConfigError

GLOBAL, MICRO, STEPS, INF = 12, 4, 14, 3


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 5, generator=g, dtype=torch.float64)
    y = torch.randn(48, 2, generator=g, dtype=torch.float64)
    x[INF] = float("inf")  # every step whose batch holds it overflows
    return torch.utils.data.TensorDataset(x, y)


def _model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)


def _by_hand(clip):
    """The reference: the job's data plan, the share weighting and torch's own AMP recipe."""
    dataset, model = _data(), _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scaler = _scaler()
    # a job only for its data plan, on an optimizer of its own: the job refuses a step of its optimizer by the script
    plan = unbroken.Job(model, torch.optim.AdamW(model.parameters()), dataset, global_batch_size=GLOBAL, micro_batch_size=MICRO, seed=3).plan
    skipped = []
    for s in range(STEPS):
        for micro in plan.micro_batches(s, 0, 1):
            x, y = dataset[plan.indices(micro)]
            loss = torch.nn.functional.mse_loss(model(x), y) * (len(micro) / GLOBAL)
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        found = sum(float(v) for v in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        skipped.append(bool(found))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return model, scaler, skipped


def _with_job(clip, **job_kwargs):
    dataset, model = _data(), _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    job = unbroken.Job(model, optimizer, dataset, global_batch_size=GLOBAL, micro_batch_size=MICRO, seed=3, scaler=_scaler(), **job_kwargs)
    skipped = []
    for step in job.steps(total=STEPS):
        for x, y in step.micro_batches():
            step.backward(torch.nn.functional.mse_loss(model(x), y))
        assert step.reduce()
        if clip:
            job.scaler.unscale_(job.optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        assert step.commit()
        skipped.append(step.skipped)
    return job, skipped


@pytest.mark.parametrize("clip", [False, True], ids=["unscaled-by-commit", "unscaled-by-the-loop-to-clip"])
def test_the_scaler_path_equals_torchs_amp_recipe_step_for_step(clip):
    reference, reference_scaler, expected = _by_hand(clip)
    job, skipped = _with_job(clip)
    assert skipped == expected and any(skipped) and not all(skipped)
    assert job.scaler.state_dict() == reference_scaler.state_dict()
    for (name, got), want in zip(job.model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(got, want), name


def test_bf16_autocast_on_the_cpu_needs_nothing_from_unbroken():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    dataset = torch.utils.data.TensorDataset(torch.randn(32, 5), torch.randn(32, 2))
    job = unbroken.Job(model, torch.optim.SGD(model.parameters(), lr=0.1), dataset, global_batch_size=8, micro_batch_size=4)
    before = [p.detach().clone() for p in model.parameters()]
    for step in job.steps(total=4):
        for x, y in step.micro_batches():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            assert out.dtype == torch.bfloat16
            step.backward(torch.nn.functional.mse_loss(out.float(), y))
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_member_given_a_peers_state_takes_its_scale_and_growth_tracker():
    trained, _ = _with_job(False)
    assert trained.scaler.get_scale() != 2.0**8
    model = _model()
    fresh = unbroken.Job(model, torch.optim.AdamW(model.parameters(), lr=0.01), _data(), global_batch_size=GLOBAL,
                         micro_batch_size=MICRO, seed=3, scaler=_scaler())
    fresh._load(trained._state())  # what a heal does with the state it received
    assert fresh.scaler.state_dict() == trained.scaler.state_dict()
    assert fresh.next_step == STEPS


def test_a_state_without_a_scaler_entry_leaves_the_scaler_as_it_is():
    job, _ = _with_job(False)
    state = job._state()
    del state["scaler"]  # a checkpoint written before scalers were saved
    before = job.scaler.state_dict()
    job._load(state)
    assert job.scaler.state_dict() == before


def test_a_resumed_job_restores_the_scale_from_its_checkpoint(tmp_path):
    first, _ = _with_job(False, checkpoint=CheckpointSettings(str(tmp_path), every=1))
    first._saver.wait(30)
    dataset, model = _data(), _model()
    job = unbroken.Job(model, torch.optim.AdamW(model.parameters(), lr=0.01), dataset, global_batch_size=GLOBAL,
                       micro_batch_size=MICRO, seed=3, scaler=_scaler(), checkpoint=CheckpointSettings(str(tmp_path), every=1))
    assert list(job.steps(total=STEPS)) == []  # resumed at the end: nothing left to do
    assert job.next_step == STEPS
    assert job.scaler.state_dict() == first.scaler.state_dict() != _scaler().state_dict()


def test_a_step_that_fails_after_unscale_forgets_it_so_that_the_redo_can_unscale_again():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _scaler()
    scaler.scale(model(torch.ones(1, 5, dtype=torch.float64)).sum()).backward()
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(optimizer)
    mixed_precision.forget_step(scaler)
    scaler.unscale_(optimizer)  # the redo's
    assert mixed_precision.step(scaler, optimizer, torch.device("cpu"))


def test_a_member_with_an_empty_share_still_steps_its_scaler():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _scaler()  # never asked to scale a loss: the scale is not made yet
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    assert mixed_precision.step(scaler, optimizer, torch.device("cpu"))
    assert scaler.get_scale() == 2.0**8


def test_a_scaler_with_a_model_without_floating_point_parameters_is_refused():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigError, match="no floating-point parameters"):
        unbroken.Job(torch.nn.Identity(), optimizer, _data(), global_batch_size=4, scaler=_scaler())


def test_something_that_is_not_a_grad_scaler_is_refused():
    model = _model()
    with pytest.raises(ConfigError, match="torch.amp.GradScaler"):
        unbroken.Job(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), global_batch_size=4, scaler=object())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_scaler_with_a_cpu_model_is_refused():
    model = _model()
    with pytest.raises(ConfigError, match="the scaler is for 'cuda'"):
        unbroken.Job(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), global_batch_size=4, scaler=torch.amp.GradScaler("cuda"))


def test_the_amp_example_trains_in_one_process(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    done = subprocess.run([sys.executable, os.path.join(root, "examples", "train_amp.py"), "--steps", "12"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    losses = [float(line.split()[3]) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and losses[1] < losses[0]
