"""A newcomer's replay of its donor's steps (unbroken.worker.catch_up): the same bits."""

from __future__ import annotations

import copy
import types

import torch

from unbroken.worker import catch_up, healing


def _job(model, optimizer, scheduler):
    return types.SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler, _committing=False,
                                 next_step=0, lineage=[], _digest=0, fresh=True)


def _trio(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    return optimizer, scheduler


def test_replaying_a_donors_gradients_and_buffers_gives_its_parameters_bit_for_bit():
    torch.manual_seed(0)
    donor_model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    newcomer_model = copy.deepcopy(donor_model)
    donor = _job(donor_model, *_trio(donor_model))
    newcomer = _job(newcomer_model, *_trio(newcomer_model))
    for index in range(12):
        x, y = torch.randn(8, 6), torch.randn(8, 2)
        torch.nn.functional.mse_loss(donor_model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(donor_model.parameters(), 0.5)
        grads = [p.grad.clone() if index % 5 or i else None for i, p in enumerate(donor_model.parameters())]  # a missing grad too
        if grads[0] is None:
            donor_model[0].weight.grad = None
        buffers = [b.clone() for b in donor_model.buffers()]
        catch_up.replay(newcomer, index, 3, grads, buffers)  # what the donor streams, applied as its commit does
        donor.optimizer.step()
        donor.scheduler.step()
        donor.optimizer.zero_grad(set_to_none=True)
    for (name, a), b in zip(donor_model.state_dict().items(), newcomer_model.state_dict().values()):
        assert torch.equal(a, b), name
    assert newcomer.next_step == 12 and newcomer.lineage == [3] * 12 and not newcomer.fresh
    assert newcomer._digest == healing.lineage_digest([3] * 12)
    assert catch_up.params_digest(newcomer) == catch_up.params_digest(donor)


def test_the_parameter_digest_sees_one_changed_bit_and_is_the_same_in_every_process():
    torch.manual_seed(1)
    job = _job(torch.nn.Sequential(torch.nn.Linear(33, 7), torch.nn.BatchNorm1d(7)), None, None)
    before = catch_up.params_digest(job)
    with torch.no_grad():
        weight = job.model[0].weight.view(-1)
        weight[100] = torch.nextafter(weight[100], torch.tensor(2.0))
    assert catch_up.params_digest(job) != before
    import subprocess
    import sys

    code = ("import torch; from unbroken.worker import catch_up; import types; torch.manual_seed(1);"
            "m = torch.nn.Sequential(torch.nn.Linear(33, 7), torch.nn.BatchNorm1d(7));"
            "print(catch_up.params_digest(types.SimpleNamespace(model=m)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert int(out) == before
