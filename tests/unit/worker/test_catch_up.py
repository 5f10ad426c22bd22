"""A newcomer's replay of its donor's steps (unbroken.worker.catch_up): the same bits."""

from __future__ import annotations

import copy
import types

import torch

from unbroken.worker import catch_up, healing


def _job(model, optimizer, scheduler):
    job = types.SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler, _committing=False,
                                next_step=0, lineage=[], _digest=0, fresh=True)
    job._state = lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict() if optimizer else None,
                          "scheduler": scheduler.state_dict() if scheduler else None,
                          "runtime": {"next_step": job.next_step, "lineage": list(job.lineage)}, "rng": torch.rand(1)}
    return job


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
    donor.next_step, donor.lineage = 12, [3] * 12
    assert catch_up.state_digest(newcomer).value() == catch_up.state_digest(donor).value()


def test_the_whole_state_digest_sees_one_changed_bit_and_is_the_same_in_every_process():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(33, 7), torch.nn.BatchNorm1d(7))
    job = _job(model, *_trio(model))
    before = catch_up.state_digest(job).value()
    with torch.no_grad():
        weight = job.model[0].weight.view(-1)
        weight[100] = torch.nextafter(weight[100], torch.tensor(2.0))
    assert catch_up.state_digest(job).value() != before
    with torch.no_grad():
        weight[100] = torch.nextafter(weight[100], torch.tensor(-2.0))
    assert catch_up.state_digest(job).value() == before
    job.optimizer.param_groups[0]["lr"] = 0.0501  # a hyper-parameter the optimizer's state_dict carries
    assert catch_up.state_digest(job).value() != before
    import subprocess
    import sys

    code = ("import torch, types; from unbroken.worker import catch_up; from tests.unit.worker.test_catch_up import _job, _trio;"
            "torch.manual_seed(1); m = torch.nn.Sequential(torch.nn.Linear(33, 7), torch.nn.BatchNorm1d(7));"
            "print(catch_up.state_digest(_job(m, *_trio(m))).value())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert int(out) == before


def test_a_replay_with_the_records_hyper_parameters_matches_a_loop_that_sets_its_learning_rate_by_hand():
    # nanoGPT sets every param_group's lr at the top of each iteration, no scheduler
    torch.manual_seed(2)
    donor_model = torch.nn.Linear(5, 3)
    newcomer_model = copy.deepcopy(donor_model)
    donor = _job(donor_model, torch.optim.AdamW(donor_model.parameters(), lr=0.1), None)
    newcomer = _job(newcomer_model, torch.optim.AdamW(newcomer_model.parameters(), lr=0.1), None)
    blind = _job(copy.deepcopy(donor_model), None, None)
    blind.optimizer = torch.optim.AdamW(blind.model.parameters(), lr=0.1)
    for index in range(6):
        for group in donor.optimizer.param_groups:
            group["lr"] = 0.1 / (1 + index)
        torch.nn.functional.mse_loss(donor_model(torch.randn(4, 5)), torch.randn(4, 3)).backward()
        grads = [p.grad.clone() for p in donor_model.parameters()]
        hypers = catch_up.hyper_parameters(donor.optimizer)  # what the record carries
        catch_up.replay(newcomer, index, 1, grads, [], hypers)
        catch_up.replay(blind, index, 1, grads, [])  # the replay before records carried them
        donor.optimizer.step()
        donor.optimizer.zero_grad(set_to_none=True)
        donor.next_step, donor.lineage = index + 1, donor.lineage + [1]
    assert catch_up.state_digest(newcomer).value() == catch_up.state_digest(donor).value()
    assert catch_up.state_digest(blind).value() != catch_up.state_digest(donor).value()


def test_a_clamp_after_the_commit_makes_the_replay_differ_from_its_donor():
    torch.manual_seed(3)
    donor_model = torch.nn.Linear(5, 3)
    newcomer_model = copy.deepcopy(donor_model)
    donor, newcomer = _job(donor_model, *_trio(donor_model)), _job(newcomer_model, *_trio(newcomer_model))
    for index in range(3):
        torch.nn.functional.mse_loss(donor_model(torch.randn(4, 5)), torch.randn(4, 3)).backward()
        catch_up.replay(newcomer, index, 1, [p.grad.clone() for p in donor_model.parameters()], [],
                        catch_up.hyper_parameters(donor.optimizer))
        donor.optimizer.step()
        donor.scheduler.step()
        donor.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p in donor_model.parameters():
                p.clamp_(-0.2, 0.2)  # outside the optimizer: a replay cannot see it
        donor.next_step, donor.lineage = index + 1, donor.lineage + [1]
    assert catch_up.state_digest(newcomer).value() != catch_up.state_digest(donor).value()


def test_tensor_words_reads_views_at_any_offset_and_length():
    from unbroken.worker.state_digests import tensor_words

    storage = torch.arange(64, dtype=torch.uint8)
    odd = storage[3:20]  # a view at a storage offset not divisible by 8, 17 bytes long
    assert tensor_words(odd) == tensor_words(odd.clone())
    assert tensor_words(odd) != tensor_words(storage[4:21])
    assert tensor_words(torch.ones(3, dtype=torch.bool)) == tensor_words(torch.ones(3, dtype=torch.bool)[0:3])
    halves = torch.arange(9, dtype=torch.float16)[1:]
    assert tensor_words(halves) == tensor_words(halves.clone())
