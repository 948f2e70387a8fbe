"""Backwards that make no parameter's gradient (``torch.autograd.grad`` of inputs: adversarial
examples, saliency maps) reduce nothing, as under DDP: they ran a full reduction of zeros,
which hung or aborted when one rank took such a backward alone. A reentrant checkpoint's inner
backward, whose gradients the outer graph cannot show, still reduces. 2 gloo ranks against
single-process torch on the concatenated batch (SGD with momentum, FP32)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import zeroshard

LINEARS = zeroshard.wrap.by_class(nn.Linear)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _perturbed(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """FGSM: ``x`` moved along the sign of the loss's gradient with respect to it."""
    x = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(nn.functional.mse_loss(model(x), y), x)
    return (x + 0.1 * gx.sign()).detach()


def _train(model, opt, rank: int | None, steps: int = 3) -> None:
    """``steps`` steps; rank 0's batch made adversarial (``rank`` None: both ranks' batches
    concatenated, the reference)."""
    for step in range(steps):
        ranks = [0, 1] if rank is None else [rank]
        xs, ys = zip(*(_batch(step, r) for r in ranks))
        xs = [_perturbed(model, x, y) if r == 0 else x for r, x, y in zip(ranks, xs, ys)]
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()


def _diff(model, ref) -> float:
    full = zeroshard.full_state_dict(model, rank0_only=False)
    return max(
        ((full[k] - v).abs().max() / v.abs().max()).item() for k, v in ref.state_dict().items()
    )


def _example_on_one_rank(stage: int) -> dict:
    ref = _net()
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage, wrap=LINEARS)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), None)
    _train(model, opt, dist.get_rank())
    steps = zeroshard.ledger(model).steps
    return {"diff": _diff(model, ref), "grads": [s.get(("all_reduce", "grads")) for s in steps]}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_an_example_made_on_one_rank_only_trains_as_torch(workers2, stage):
    """Rank 0 makes its batch adversarial, rank 1 does not (stage 0 aborted on a collective
    mismatch, stages 1-2 hung: DDP trains it). Stage 3 gathers in that forward: one rank alone
    cannot run it, as under FSDP2."""
    for r in workers2.run(_example_on_one_rank, stage):
        assert r["diff"] < 1e-6, r
        if stage == 0:  # one all-reduce of gradients per step, not two on rank 0
            assert [e.calls for e in r["grads"]] == [1, 1, 1], r


def _saliency_alone(stage: int) -> dict:
    torch.manual_seed(0)
    ref = _net()
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage, wrap=LINEARS)
    x = torch.randn(4, 8, requires_grad=True)
    (want,) = torch.autograd.grad(ref(x).sum(), x)
    got = None
    with zeroshard.summon_full_params(model, writeback=False):
        if dist.get_rank() == 0:  # the README: no collective of zeroshard's runs in here
            (got,) = torch.autograd.grad(model(x).sum(), x)
    dist.barrier()
    return {"equal": got is None or torch.equal(got, want), "ran": got is not None}


@pytest.mark.parametrize("stage", [0, 3])
def test_a_saliency_map_on_rank_0_alone_inside_summon(workers2, stage):
    """It hung in the reduction at the end of its backward."""
    rs = workers2.run(_saliency_alone, stage)
    assert all(r["equal"] for r in rs) and [r["ran"] for r in rs] == [True, False], rs


def _input_grads_everywhere(stage: int) -> dict:
    ref = _net()
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage, wrap=LINEARS)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    ledger = zeroshard.ledger(model)
    moved = []
    for step in range(2):
        x, y = _batch(step, dist.get_rank())
        before = ledger.bytes(labels=("grads",))
        _perturbed(model, x, y)
        moved.append(ledger.bytes(labels=("grads",)) - before)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        xs, ys = zip(*(_batch(step, r) for r in range(2)))
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    return {"moved": moved, "diff": _diff(model, ref)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_input_gradients_move_no_gradient_bytes(workers2, stage):
    """Each rank's ``autograd.grad`` of its inputs before the step: no gradient traffic (a whole
    reduction of zeros each time: the step's gradient bytes doubled), the step as torch's."""
    for r in workers2.run(_input_grads_everywhere, stage):
        assert r["moved"] == [0, 0] and r["diff"] < 1e-6, r


class _Reentrant(nn.Module):
    """Every parameter inside a reentrant checkpoint: the outer backward reaches none of them,
    the checkpoint's own backward (a graph task of its own) makes all the gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x.requires_grad_(True), use_reentrant=True)


def _reentrant(stage: int, by_linear: bool) -> float:
    torch.manual_seed(0)
    ref = _Reentrant()
    wrap = LINEARS if by_linear else None
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage, wrap=wrap)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rank = dist.get_rank()
    for step in range(3):
        xs, ys = zip(*(_batch(step, r) for r in range(2)))
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(model(xs[rank].clone()), ys[rank]).backward()
        opt.step()
    return _diff(model, ref)


@pytest.mark.parametrize("by_linear", [False, True], ids=["one_unit", "units_inside"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_reentrant_checkpoint_s_gradients_are_reduced(workers2, stage, by_linear):
    for r in workers2.run(_reentrant, stage, by_linear):
        assert r < 1e-6, r


def _mid_accumulation(stage: int, precision: str | None) -> dict:
    """Input gradients between two accumulation micro-steps (stage 3's local gradients wait in
    ``.grad`` there: taken for gradients a reentrant checkpoint made, they were reduced, and in
    FP16 the loss scaler refused the backward)."""
    ref = _net()
    model = zeroshard.shard(
        copy.deepcopy(ref), stage=stage, wrap=LINEARS, mixed_precision=precision
    )
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    ledger = zeroshard.ledger(model)
    rank = dist.get_rank()
    (x0, y0), (x1, y1) = _batch(0, rank), _batch(1, rank)
    opt.backward(nn.functional.mse_loss(model(x0).float(), y0) / 2, sync=False)
    before = ledger.bytes(labels=("grads",))
    _perturbed(model, x1, y1)
    moved = ledger.bytes(labels=("grads",)) - before
    opt.backward(nn.functional.mse_loss(model(x1).float(), y1) / 2)
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        xs, ys = zip(*(_batch(step, r) for r in range(2)))
        (nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)) / 2).backward()
    ref_opt.step()
    return {"moved": moved, "diff": _diff(model, ref)}


@pytest.mark.parametrize("precision", [None, "fp16"])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_input_gradients_between_accumulation_micro_steps(workers2, stage, precision):
    for r in workers2.run(_mid_accumulation, stage, precision):
        assert r["moved"] == 0, r
        assert r["diff"] < (1e-6 if precision is None else 1e-2), r


def _own_gradients_after_zeros(kind: str) -> float:
    """Stage 0, the same batch on every rank: ``zero_grad(set_to_none=False)`` (zeros bound
    to the buffer), then ``autograd.grad``'s gradients put into ``.grad`` by hand, as a DDP
    user would; the step takes them (it refused them as "set by hand" after the zeros)."""
    ref = _net()
    model = zeroshard.shard(copy.deepcopy(ref), stage=0, wrap=LINEARS)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = _batch(0, 0)
    for _ in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            (m if kind == "model" else o).zero_grad(set_to_none=False)
            params = list(m.parameters())
            for p, g in zip(params, torch.autograd.grad(nn.functional.mse_loss(m(x), y), params)):
                p.grad = g
            o.step()
    return _diff(model, ref)


@pytest.mark.parametrize("kind", ["optimizer", "model"])
def test_own_gradients_put_over_kept_zeros_are_taken(workers2, kind):
    for r in workers2.run(_own_gradients_after_zeros, kind):
        assert r < 1e-6, r


def _penalty_alone(stage: int, after_backward: bool) -> str | float:
    """A loss of the parameters alone, backpropagated on its own: it reaches no unit, so no
    backward reduces it. At stage 0 after a reduction it adds to the averaged ``.grad`` that
    the step takes, as under DDP (the same on every rank: exact); elsewhere it was dropped
    without a word (stages 0-1: the step took zeros for it)."""
    ref = _net()
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage, wrap=LINEARS)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rank = dist.get_rank()
    for step in range(2):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            if after_backward or step == 0:
                ranks = [0, 1] if m is ref else [rank]
                xs, ys = zip(*(_batch(step, r) for r in ranks))
                nn.functional.mse_loss(m(torch.cat(xs)), torch.cat(ys)).backward()
            if step == 1:
                (0.05 * sum(p.square().sum() for p in m.parameters())).backward()
            try:
                o.step()
            except ValueError as e:
                return str(e)
    return _diff(model, ref)


@pytest.mark.parametrize("after_backward", [False, True], ids=["alone", "after_a_backward"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_penalty_backpropagated_alone(workers2, stage, after_backward):
    for r in workers2.run(_penalty_alone, stage, after_backward):
        if stage == 0 and after_backward:
            assert isinstance(r, float) and r < 1e-6, r
        else:
            assert isinstance(r, str), r
            assert "backward that ran through none of its units" in r or "set by hand" in r, r


def _zero_grad_drops_autograd_s_own(stage: int, how: str) -> dict:
    """A ``.grad`` the engine did not make (set by hand, or a penalty's backward that reached
    no unit) before ``opt.zero_grad()``: dropped like the rest (stages 0-2 kept it when no
    buffer held the gradients, and the next backward added it into the step)."""
    ref = _net()
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage, wrap=LINEARS)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    if how == "by_hand":
        for p in model.parameters():
            p.grad = torch.ones_like(p)
    else:
        (0.1 * sum(p.square().sum() for p in model.parameters())).backward()
    opt.zero_grad()
    left = [n for n, p in model.named_parameters() if p.grad is not None]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        for m, o, ranks in ((ref, ref_opt, [0, 1]), (model, opt, [dist.get_rank()])):
            xs, ys = zip(*(_batch(step, r) for r in ranks))
            o.zero_grad()
            nn.functional.mse_loss(m(torch.cat(xs)), torch.cat(ys)).backward()
            o.step()
    return {"left": left, "diff": _diff(model, ref)}


@pytest.mark.parametrize("how", ["by_hand", "penalty"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_grad_drops_gradients_the_engine_did_not_make(workers2, stage, how):
    for r in workers2.run(_zero_grad_drops_autograd_s_own, stage, how):
        assert r["left"] == [] and r["diff"] < 1e-6, r


def _refused_after_stepping_in_backward() -> dict:
    """Stage 2 with ``step_in_backward``: ``step()`` refuses a penalty backpropagated on its
    own after the units stepped in backward; every rank's replicas follow those updates (each
    rank kept only its own slice updated: 9e-3 apart)."""
    torch.manual_seed(0)
    model = zeroshard.shard(_net(), stage=2, wrap=LINEARS)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, step_in_backward=True)
    x, y = _batch(0, dist.get_rank())
    nn.functional.mse_loss(model(x), y).backward()
    (0.01 * sum(p.square().sum() for p in model.parameters())).backward()
    said = None
    try:
        opt.step()
    except ValueError as e:
        said = str(e)
    opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(every, flat)
    return {"said": said, "apart": (every[0] - every[1]).abs().max().item()}


def test_a_refused_step_keeps_the_updates_made_in_backward_on_every_rank(workers2):
    for r in workers2.run(_refused_after_stepping_in_backward):
        assert r["said"] and "ran through none of its units" in r["said"], r
        assert r["apart"] == 0.0, r


def _forward_mode(stage: int) -> dict:
    """A Jacobian-vector product by forward-mode AD (dual tensors) with grad enabled, between
    training steps: torch refused it (the engine's identity Function had no jvp)."""
    import torch.autograd.forward_ad as fwAD

    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _net()
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage, wrap=LINEARS)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def jvp(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with fwAD.dual_level():
            return fwAD.unpack_dual(m(fwAD.make_dual(x, torch.ones_like(x)))).tangent.clone()

    gap = 0.0
    for step in range(2):
        x = _batch(step, 99)[0]
        gap = max(gap, (jvp(model, x) - jvp(ref, x)).abs().max().item())
        batches = [_batch(step, r) for r in range(world)]
        x, y = batches[rank]
        opt.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        xs, ys = (torch.cat(t) for t in zip(*batches))
        nn.functional.mse_loss(ref(xs), ys).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = zeroshard.full_state_dict(model, rank0_only=False)
    params = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return {"tangents": gap, "params": params}


@pytest.mark.parametrize("stage", [0, 3])
def test_forward_mode_ad_through_a_sharded_model(workers2, stage):
    for r in workers2.run(_forward_mode, stage):
        assert r["tangents"] < 1e-6 and r["params"] < 1e-6, r
