"""The sharded optimizer's state on one process: flat spans step as the whole optimizer does, the
checkpoint's whole state goes in and out, the copies' check, and what is refused."""

import copy

import pytest
import torch

from unbroken.errors import ConfigError, ReplicaDivergence
from unbroken.worker import sharded_saving
from unbroken.worker.replica_check import verify_shards
from unbroken.worker.shard_plan import partition_spans
from unbroken.worker.sharded_optimizer import Holding, ShardedOptimizer, refuse_unshardable


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def _groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    plain = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]


def _grads(model, step):
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def _sharded(model, kind=torch.optim.AdamW, n=3, **options):
    face = kind(_groups(model), lr=0.01, **options)
    sharded = ShardedOptimizer(face, lambda: None)
    # this process holds every member's own partition: the whole state, as n spans per group
    sharded.hold([Holding(span, torch.empty(0)) for k in range(n) for span in partition_spans(sharded.sizes, n, k)])
    return face, sharded


@pytest.mark.parametrize("kind, options", [(torch.optim.AdamW, {}), (torch.optim.SGD, {"momentum": 0.9}),
                                           (torch.optim.Adam, {"amsgrad": True}), (torch.optim.NAdam, {})])
def test_spans_step_as_the_whole_optimizer_with_a_schedule_and_the_scripts_own_lr(kind, options):
    plain_model, sharded_model = _model(), _model()
    plain = kind(_groups(plain_model), lr=0.01, **options)
    face, sharded = _sharded(sharded_model, kind, **options)
    schedules = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (plain, face)]
    for step in range(6):
        for model in (plain_model, sharded_model):
            _grads(model, step)
        if step == 4:  # nanoGPT sets its lr by hand
            for o in (plain, face):
                o.param_groups[1]["lr"] = 0.003
        plain.step()
        face.step()
        for s in schedules:
            s.step()
    for a, b in zip(plain_model.parameters(), sharded_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=0)
    assert sharded.shard_step == 6 and not face.state  # the script's optimizer holds nothing itself


def test_a_checkpoints_whole_state_goes_in_as_torchs_own_format_and_comes_back_as_spans():
    plain_model, sharded_model = _model(), _model()
    plain = torch.optim.AdamW(_groups(plain_model), lr=0.01)
    face, sharded = _sharded(sharded_model)
    for step in range(3):
        for model in (plain_model, sharded_model):
            _grads(model, step)
        plain.step()
        face.step()
    whole = [Holding(span, torch.empty(0), {}) for span in sharded_saving.whole(sharded)]
    for h in whole:  # what collect() gives rank 0: the spans joined
        parts = [x for x in sharded.holdings if x.span.group == h.span.group]
        h.state = {k: torch.cat([x.state[k] for x in parts]) if v.dim() else v for k, v in parts[0].state.items()}
    sharded_saving.install(sharded, whole)
    mine, theirs = face.state_dict(), plain.state_dict()
    sharded_saving.release(sharded)
    assert not face.state
    assert mine["state"].keys() == theirs["state"].keys()
    for i in theirs["state"]:
        for key, value in theirs["state"][i].items():
            torch.testing.assert_close(mine["state"][i][key], value, rtol=0, atol=0)
    # a plain optimizer's checkpoint, loaded into a sharded job: held as whole groups
    fresh_face, fresh = _sharded(_model())
    fresh_face.load_state_dict(copy.deepcopy(theirs))
    assert sharded_saving.adopt_loaded(fresh, 3)
    assert fresh.shard_step == 3 and not fresh_face.state
    assert [h.span.size for h in fresh.holdings] == fresh.sizes
    torch.testing.assert_close(fresh.holdings[0].state["exp_avg"][:35], theirs["state"][0]["exp_avg"].reshape(-1))


class _TwoMembers:
    """A group of two members where the other holds ``other``'s row (verify_shards' exchange)."""

    size, members = 2, ["a.w0.r0", "a.w1.r0"]

    def __init__(self, other):
        self.other = other

    def allgather_rows(self, row, what):
        return torch.stack([row, self.other])


def _row_of(sharded):
    rows = []
    group = _TwoMembers(None)
    group.allgather_rows = lambda row, what: rows.append(row) or torch.stack([row, row])
    verify_shards(sharded, group, lambda reason: None, 0, 1, lambda reason: None)
    return rows[0]


def test_the_two_copies_of_a_partition_must_hold_the_same_state():
    _, sharded = _sharded(_model(), n=1)
    _, other = _sharded(_model(), n=1)
    for s in (sharded, other):
        for p in s.face.param_groups[0]["params"] + s.face.param_groups[1]["params"]:
            p.grad = torch.ones_like(p)
        s.face.step()
    assert verify_shards(sharded, _TwoMembers(_row_of(other)), lambda r: None, 1, 1, lambda r: None)
    other.holdings[0].state["exp_avg"][3] += 1e-12  # one element of one copy
    failed = []
    with pytest.raises(ReplicaDivergence, match="elements 0..56 of parameter group 0 differ"):
        verify_shards(sharded, _TwoMembers(_row_of(other)), lambda r: None, 1, 1, failed.append)
    assert failed and "replicas diverged" in failed[0]


def test_what_cannot_be_sharded_is_refused_by_name_with_what_to_do():
    params = list(_model().parameters())
    with pytest.raises(ConfigError, match="LBFGS is not one of them"):
        refuse_unshardable(torch.optim.LBFGS(params))
    mixed = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    with pytest.raises(ConfigError, match="mixes dtypes"):
        refuse_unshardable(torch.optim.AdamW(mixed))
    stepped = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    stepped.step()
    with pytest.raises(ConfigError, match="already holds state"):
        refuse_unshardable(stepped)
    refuse_unshardable(torch.optim.Adagrad(params))  # Adagrad makes its state when built: allowed


def test_a_single_process_is_the_unsharded_reference_and_replica_groups_are_refused():
    from unbroken.worker import job_setup
    from unbroken.worker.runtime_settings import RuntimeSettings

    settings = RuntimeSettings(shard_optimizer=True)
    optimizer = torch.optim.AdamW(_model().parameters())
    assert job_setup.sharded_optimizer(settings, False, None, optimizer, None) is None  # alone: the whole state
    with pytest.raises(ConfigError, match="cannot be combined with replica groups"):
        job_setup.sharded_optimizer(settings, True, object(), optimizer, None)
    assert job_setup.sharded_optimizer(RuntimeSettings(), True, None, optimizer, None) is None  # off by default
    assert isinstance(job_setup.sharded_optimizer(settings, True, None, optimizer, None), ShardedOptimizer)


class _Alone:
    """A generation of one member, for moving state without a peer (shard_moves.move)."""

    size, rank, number, members, device = 1, 0, 1, ["a.w0.r0"], torch.device("cpu")

    def allgather_rows(self, row, what):
        return row.unsqueeze(0)

    def staged(self, tensor, sending):
        return tensor


@pytest.mark.parametrize("kind, options", [(torch.optim.SGD, {}), (torch.optim.AdamW, {})])
def test_a_move_assembles_spans_from_held_pieces_for_stateless_optimizers_and_empty_groups(kind, options):
    from unbroken.worker.shard_moves import move

    model = _model()
    groups = _groups(model) + [{"params": [], "weight_decay": 0.0}]  # torch accepts an empty group
    face = kind(groups, lr=0.01, **options)
    sharded = ShardedOptimizer(face, lambda: None)
    assert sharded.sizes[-1] == 0
    sharded.hold([Holding(span, torch.empty(0)) for k in range(3) for span in partition_spans(sharded.sizes, 3, k)])
    _grads(model, 0)
    face.step()  # SGD without momentum keeps no state at all
    new, moved = move(sharded, _Alone(), {0: sharded_saving.whole(sharded)}, 1, "test")
    assert moved == 0 and [h.span.size for h in new] == [s for s in sharded.sizes if s]
    if kind is torch.optim.SGD:  # a piece received from a peer holds no tensors at all
        from unbroken.worker.shard_moves import _assemble

        piece = sharded.holdings[-1].span
        assert _assemble(sharded, [(piece, 1)], {piece: []}, []) == {}
    for h in new:
        parts = [x for x in sharded.holdings if x.span.group == h.span.group]
        assert h.state.keys() == parts[0].state.keys()
        for key, value in h.state.items():
            expected = torch.cat([x.state[key] for x in parts]) if value.dim() else parts[0].state[key]
            torch.testing.assert_close(value, expected, rtol=0, atol=0)


def test_frozen_parameters_are_left_out_and_a_parameter_without_a_gradient_is_refused_by_every_member():
    plain_model, sharded_model = _model(), _model()
    for model in (plain_model, sharded_model):
        model[0].bias.requires_grad_(False)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.01)
    face = torch.optim.AdamW(sharded_model.parameters(), lr=0.01)
    sharded = ShardedOptimizer(face, lambda: None)
    assert sum(sharded.sizes) == sum(p.numel() for p in sharded_model.parameters() if p.requires_grad)
    sharded.hold([Holding(span, torch.empty(0)) for span in partition_spans(sharded.sizes, 1, 0)])
    for step in range(3):
        for model in (plain_model, sharded_model):
            _grads(model, step)
            model[0].bias.grad = None
        plain.step()
        face.step()
    for a, b in zip(plain_model.parameters(), sharded_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=0)
    sharded_model[2].bias.grad = None  # unused in the forward pass this step: torch would skip it
    with pytest.raises(ConfigError, match="1 parameter\\(s\\) of the optimizer got no gradient"):
        face.step()
