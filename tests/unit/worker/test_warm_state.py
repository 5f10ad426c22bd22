"""A newcomer's optimizer state warmed before its heal (unbroken.worker.warm_state), and the heal
landing in it (healing.recv_state's ``into``)."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.unit.worker.test_healing import _Link, _assert_same, _sizes
from unbroken.worker import healing, warm_state
from unbroken.worker.warm_state import adopt_parameters, warm_model, warm_optimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 600), torch.nn.ReLU(), torch.nn.Linear(600, 512), torch.nn.BatchNorm1d(512))


def _sender_and_newcomer():
    """A member after one AdamW step, its state, and a newcomer that has just built the same model."""
    sender_model, newcomer_model = _model(), _model()
    sender = torch.optim.AdamW(sender_model.parameters(), lr=0.1)
    sender_model(torch.randn(4, 16)).square().mean().backward()
    sender.step()
    state = {"model": sender_model.state_dict(), "optimizer": sender.state_dict()}
    return sender_model, sender, state, newcomer_model, torch.optim.AdamW(newcomer_model.parameters(), lr=0.1)


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.5),
    "adam": lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1, amsgrad=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.1),
    "adam tensor lr": lambda p: torch.optim.Adam(p, lr=torch.tensor(0.01)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_warming_leaves_the_parameters_and_an_empty_optimizer_and_finds_every_state_tensor(name):
    model = _model()
    optimizer = OPTIMIZERS[name](model.parameters())
    before = model.state_dict()
    before = type(before)((k, v.clone()) for k, v in before.items())
    before._metadata = model.state_dict()._metadata
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    places = warm_optimizer(optimizer)
    assert places and all(t.abs().sum() == 0 for t in places.values() if t.is_floating_point() and t.dim() > 0)
    _assert_same(model.state_dict(), before)  # not one bit changed
    assert not optimizer.state and all(p.grad is None for p in model.parameters())
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == settings
    # the places are where a real step's state sits in the state_dict a peer would send
    model(torch.randn(4, 16)).square().mean().backward()
    optimizer.step()
    real = {("optimizer", "state", i, k): v for i, s in optimizer.state_dict()["state"].items() for k, v in s.items()
            if isinstance(v, torch.Tensor)}
    assert places.keys() == real.keys()
    assert all((places[k].dtype, places[k].shape) == (v.dtype, v.shape) for k, v in real.items())


def test_optimizers_it_cannot_warm_safely_are_left_alone():
    model = _model()
    for optimizer in (torch.optim.Adagrad(model.parameters()), torch.optim.RMSprop(model.parameters())):
        before = {k: dict(v) for k, v in optimizer.state.items()}  # Adagrad builds its state at once
        assert warm_optimizer(optimizer) == {}
        assert {k: dict(v) for k, v in optimizer.state.items()}.keys() == before.keys()
    used = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 16)).square().mean().backward()
    used.step()
    assert warm_optimizer(used) == {}  # it holds state already


def test_the_places_of_a_states_tensors_are_its_keys_from_the_root():
    state = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}}, "list": [1, (torch.ones(1),)]}
    skeleton, tensors = healing.split(state)
    places = healing.tensor_places(skeleton)
    assert dict(zip(places, (t.shape for t in tensors))) == {
        ("model", "w"): (2,), ("optimizer", "state", 0, "exp_avg"): (3,), ("list", 1, 0): (1,)}


def test_a_heal_into_warm_memory_lands_in_it_and_arrives_exactly():
    sender_model, sender, state, newcomer_model, newcomer = _sender_and_newcomer()
    warm = warm_optimizer(newcomer)
    link = _Link()
    with _sizes(large=1 << 10, pack=16 << 20, message=16 << 20):
        healing.send_state(link, state, 1)
        back, _ = healing.recv_state(link, 0, into=warm)
    _assert_same(back, state)
    landed = [k for k, t in warm.items() if any(t is v for s in back["optimizer"]["state"].values() for v in s.values())]
    assert landed and all(warm[k].numel() * 4 >= 1 << 10 for k in landed)  # every large one landed in place
    newcomer_model.load_state_dict(back["model"])
    newcomer.load_state_dict(back["optimizer"])
    assert any(v is warm[("optimizer", "state", 0, "exp_avg")] for v in newcomer.state[next(iter(newcomer_model.parameters()))].values())


def test_tensors_that_do_not_fit_the_warm_memory_arrive_in_new_memory():
    state = {"optimizer": {"state": {0: {"exp_avg": torch.randn(2048)}}}}
    warm = {("optimizer", "state", 0, "exp_avg"): torch.zeros(1024)}  # another shape
    link = _Link()
    with _sizes(large=1 << 10, pack=16 << 20, message=16 << 20):
        healing.send_state(link, state, 1)
        back, _ = healing.recv_state(link, 0, into=warm)
    _assert_same(back, state)
    assert back["optimizer"]["state"][0]["exp_avg"] is not warm[("optimizer", "state", 0, "exp_avg")]


def test_the_parameters_arrive_in_warm_memory_which_becomes_theirs_without_a_copy_and_training_goes_on_alike():
    sender_model, sender, state, newcomer_model, newcomer = _sender_and_newcomer()
    params = list(newcomer_model.parameters())
    warm = {**warm_optimizer(newcomer), **warm_model(newcomer_model)}
    assert {("model", n) for n, _ in newcomer_model.named_parameters()} <= warm.keys()
    before = {n: p.detach().clone() for n, p in newcomer_model.named_parameters()}
    link = _Link()
    with _sizes(large=1 << 10, pack=16 << 20, message=16 << 20):
        healing.send_state(link, state, 1)
        back, _ = healing.recv_state(link, 0, into=warm)
    for n, p in newcomer_model.named_parameters():  # received, not yet adopted: the model is as it was
        assert torch.equal(p, before[n])
    large = [n for n, p in newcomer_model.named_parameters() if p.numel() * p.element_size() >= 1 << 10]
    assert large and all(back["model"][n] is warm[("model", n)] for n in large)
    adopted = adopt_parameters(newcomer_model, back["model"])
    assert adopted >= sum(p.numel() * p.element_size() for n, p in newcomer_model.named_parameters() if n in large)
    assert list(newcomer_model.parameters()) == params  # the same Parameter objects: the optimizer keeps them
    assert all(p.data_ptr() == warm[("model", n)].data_ptr() for n, p in newcomer_model.named_parameters() if n in large)
    newcomer_model.load_state_dict(back["model"])
    newcomer.load_state_dict(back["optimizer"])
    _assert_same(newcomer_model.state_dict(), sender_model.state_dict())
    x = torch.randn(8, 16)
    for model, optimizer in ((sender_model, sender), (newcomer_model, newcomer)):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    _assert_same(newcomer_model.state_dict(), sender_model.state_dict())


def test_only_received_tensors_that_fit_exactly_are_adopted_and_tied_parameters_stay_tied():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as a language model's input and output embeddings
    weight = model[0].weight
    received = {"0.weight": torch.ones(10, 4), "1.weight": torch.ones(10, 4)}
    assert adopt_parameters(model, received) > 0
    assert model[0].weight is weight and model[1].weight is weight and torch.equal(weight, torch.ones(10, 4))
    other = {"0.weight": torch.ones(10, 4, dtype=torch.float64), "1.weight": torch.ones(80)[:10 * 4].view(10, 4)}
    pointer = weight.data_ptr()
    assert adopt_parameters(model, other) == 0  # another dtype; a view of a larger storage
    assert weight.data_ptr() == pointer


def test_adopting_parameters_frees_their_old_memory_on_a_thread_of_its_own(monkeypatch):
    model = torch.nn.Linear(256, 256)
    old = [p.detach() for p in model.parameters()]  # views of the memory the adoption replaces
    threads = []
    real = warm_state.release_in_background

    def spy(tensors):
        threads.append(real(list(tensors)))  # a copy: the real one clears its list
        return threads[-1]

    received = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    monkeypatch.setattr(warm_state, "release_in_background", spy)
    assert adopt_parameters(model, received) > 0
    assert len(threads) == 1 and threads[0].name == warm_state.RELEASE_THREAD
    threads[0].join(10)
    assert not threads[0].is_alive()
    for n, p in model.named_parameters():
        assert p.data_ptr() == received[n].data_ptr()
    # the model's old memory is still held by the test's views, and only by them: untouched
    assert all(t.untyped_storage().nbytes() > 0 for t in old)


def test_release_in_background_empties_the_tensors_it_is_given_off_the_calling_thread():
    tensors = [torch.ones(1000), torch.ones(10)]
    seen = list(tensors)
    thread = warm_state.release_in_background(tensors)
    assert thread is not None and thread is not threading.current_thread()
    thread.join(10)
    assert all(t.untyped_storage().nbytes() == 0 for t in seen)
    assert warm_state.release_in_background([]) is None
