"""The sharded optimizer's state on one process: flat spans step as the whole optimizer does, the
checkpoint's whole state goes in and out, the copies' check, and what is refused."""

import pytest
import torch

from unbroken.errors import ConfigError, ReplicaDivergence
from unbroken.worker import sharded_saving
from unbroken.worker.replica_check import verify_shards
from unbroken.worker.shard_plan import Span, partition_spans
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


@pytest.mark.parametrize("written_by, frozen", [(3, False), (2, True)], ids=["three-owners", "two-owners-a-frozen-parameter"])
def test_the_owners_parts_of_a_checkpoint_come_back_as_torchs_own_format_and_as_spans_of_another_plan(tmp_path, written_by, frozen):
    from unbroken.storage.checkpoint import CheckpointStore
    from unbroken.storage.optimizer_parts import merge, per_parameter_state, read_spans, write_part

    plain_model, sharded_model = _model(), _model()
    if frozen:  # in the optimizer, but never stepped: no state, left out of the flat vectors
        for model in (plain_model, sharded_model):
            model[0].bias.requires_grad_(False)
    plain = torch.optim.AdamW(_groups(plain_model), lr=0.01)
    face, sharded = _sharded(sharded_model, n=written_by)
    for step in range(3):
        for model in (plain_model, sharded_model):
            _grads(model, step)
            if frozen:
                model[0].bias.grad = None
        plain.step()
        face.step()
    store = CheckpointStore(str(tmp_path))
    root = store._path("step-00000003")
    # every owner writes its own partition, and only it (what sharded_saving.owned hands each member)
    markers = [write_part(store.fs, root, k, sharded_saving.owned(sharded, k, written_by)) for k in range(written_by)]
    for k, marker in enumerate(markers):
        assert marker["spans"] == [[s.group, s.start, s.end] for s in partition_spans(sharded.sizes, written_by, k)]
    merge(store.fs, root, markers, sharded.sizes)
    # a job that does not shard (or a single process): the state torch.optim itself would hold
    layout = sharded_saving.layout_record(sharded)
    mine, theirs = per_parameter_state(store.fs, root, layout, sharded_saving.parameter_shapes(plain)), plain.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for i in theirs:
        assert mine[i].keys() == theirs[i].keys()
        for key, value in theirs[i].items():
            torch.testing.assert_close(mine[i][key], value, rtol=0, atol=0)
    # a member of a job of another size reads just the spans it holds there
    for n in (1, 2, 4):
        for k in range(n):
            wanted = [(s.group, s.start, s.end) for s in partition_spans(sharded.sizes, n, k)]
            for span, state in read_spans(store.fs, root, wanted).items():
                whole = torch.cat([h.state["exp_avg_sq"] for h in sharded.holdings if h.span.group == span[0]])
                torch.testing.assert_close(state["exp_avg_sq"], whole[span[1]:span[2]], rtol=0, atol=0)
                assert float(state["step"]) == 3


def test_a_checkpoints_parts_read_as_one_dcp_checkpoint_by_users_tools(tmp_path):
    import torch.distributed.checkpoint as dcp

    from unbroken.storage.checkpoint import CheckpointStore
    from unbroken.storage.optimizer_parts import PARTS_DIR, entry_name, merge, write_part

    face, sharded = _sharded(_model(), n=2)
    for p in (p for g in face.param_groups for p in g["params"]):
        p.grad = torch.ones_like(p)
    face.step()
    store = CheckpointStore(str(tmp_path))
    root = store._path("step-00000001")
    merge(store.fs, root, [write_part(store.fs, root, k, sharded_saving.owned(sharded, k, 2)) for k in range(2)], sharded.sizes)
    span = partition_spans(sharded.sizes, 2, 1)[0]
    key = entry_name((span.group, span.start, span.end), "exp_avg")
    state = {key: torch.empty(span.size, dtype=torch.float64)}
    dcp.load(state, checkpoint_id=f"{root}/{PARTS_DIR}", no_dist=True)
    holding = next(h for h in sharded.holdings if h.span == span)
    torch.testing.assert_close(state[key], holding.state["exp_avg"], rtol=0, atol=0)


def test_a_resume_from_parts_written_for_other_parameters_is_refused_before_reading():
    face, sharded = _sharded(_model(), n=2)
    record = {"layout": sharded_saving.layout_record(sharded), "sizes": list(sharded.sizes)}
    sharded_saving.adopt_parts(sharded, 5, record)
    assert sharded.in_checkpoint and sharded.shard_step == 5 and not sharded.holdings
    other_face, other = _sharded(_model(), n=2)
    other_face.param_groups.reverse()  # the same parameters, grouped in another order
    other.layout.reverse()
    other.sizes.reverse()
    with pytest.raises(ConfigError, match="written for other parameters"):
        sharded_saving.adopt_parts(other, 5, record)
    assert not other.in_checkpoint


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
    whole = [Span(g, 0, size) for g, size in enumerate(sharded.sizes) if size]
    new, moved = move(sharded, _Alone(), {0: whole}, 1, "test")
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
