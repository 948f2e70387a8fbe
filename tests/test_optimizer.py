"""The sharded optimizer (``zeroshard/model_states/optimizer.py``) used as torch's are: clipping
its own parameters, gradients set through ``.grad``, param-group keys of the user's own.

Each multi-rank test trains a sharded copy on two gloo ranks (each its half of the batch) and an
unsharded reference on the whole batch in the same process, and compares them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard

PER_RANK_BATCH = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _pair(stage: int, **shard_kw) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = Net()
    model = zeroshard.shard(
        copy.deepcopy(ref), stage=stage, wrap=zeroshard.wrap.by_class(nn.Sequential), **shard_kw
    )
    return model, ref


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, slice]:
    g = torch.Generator().manual_seed(100 + step)
    world = dist.get_world_size()
    x, y = (
        torch.randn(PER_RANK_BATCH * world, 4, generator=g),
        torch.randn(PER_RANK_BATCH * world, 1, generator=g),
    )
    rank = dist.get_rank()
    return x, y, slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)


def _diff(model: nn.Module, ref: nn.Module) -> float:
    full = zeroshard.full_state_dict(model, rank0_only=False)
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


def _losses(model, ref, x, y, mine) -> None:
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    nn.functional.mse_loss(ref(x), y).backward()


def _two_optimizers_clip_their_own(stage: int) -> dict:
    """Two optimizers over disjoint parts of one model (an encoder's and a decoder's), each
    clipping its own gradients, and one over the head alone (fine-tuning): the norms and the
    updates are torch's clip over each optimizer's parameters (each took the whole model's
    norm and scaled every gradient before)."""
    model, ref = _pair(stage)

    def part_a(m):
        return [*m.blocks[0].parameters(), *m.blocks[1].parameters()]

    def part_b(m):
        return [*m.inp.parameters(), *m.blocks[2].parameters(), *m.head.parameters()]

    opts = [
        zeroshard.optimizer(model, torch.optim.SGD, part(model), lr=0.5)
        for part in (part_a, part_b)
    ]
    refs = [torch.optim.SGD(part(ref), lr=0.5) for part in (part_a, part_b)]
    norms = []
    for step in range(3):
        _losses(model, ref, *_batch(step))
        ours = [o.clip_grad_norm(0.05).item() for o in opts]
        theirs = [
            torch.nn.utils.clip_grad_norm_(part(ref), 0.05).item() for part in (part_a, part_b)
        ]
        norms.append(max(abs(a - b) / b for a, b in zip(ours, theirs)))
        for o in (*opts, *refs):
            o.step()
            o.zero_grad()
    out = {"two": (max(norms), _diff(model, ref))}
    model, ref = _pair(stage)
    opt = zeroshard.optimizer(model, torch.optim.SGD, model.head.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.head.parameters(), lr=0.5)
    _losses(model, ref, *_batch(0))
    ours = opt.clip_grad_norm(0.01).item()
    theirs = torch.nn.utils.clip_grad_norm_(ref.head.parameters(), 0.01).item()
    opt.step()
    ref_opt.step()
    out["subset"] = (abs(ours - theirs) / theirs, _diff(model, ref))
    opt.zero_grad()
    out["no gradient"] = opt.clip_grad_norm(1.0).item()  # torch's clip returns 0 there too
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_optimizer_clips_its_own_parameters(workers2, stage):
    for r in workers2.run(_two_optimizers_clip_their_own, stage):
        assert r["two"][0] < 1e-5 and r["two"][1] < 1e-6, r
        assert r["subset"][0] < 1e-5 and r["subset"][1] < 1e-6, r
        assert r["no gradient"] == 0.0, r


def _grads_set_by_hand(stage: int, mode: str, precision: str) -> object:
    """``.grad`` reassigned after backward, as torch users do. At stage 0 (``.grad`` shows the
    averaged gradient, as under DDP) the new tensor is what the step takes and None leaves the
    parameter out of the step (both were ignored); at stages 1-3 the step cannot read it: an
    error naming the parameter, where it was ignored."""
    model, ref = _pair(stage, mixed_precision=None if precision == "fp32" else precision)
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=0.1, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    _losses(model, ref, *_batch(0))
    tripled = ref.head.weight.grad * 3  # (stages 1-3 show no .grad to start from)
    for m in (model, ref):
        if mode == "none":
            m.head.bias.grad = None
        elif mode == "replaced":
            m.head.weight.grad = tripled.to(m.head.weight.dtype)
            m.blocks[1][0].bias.grad = torch.zeros_like(m.blocks[1][0].bias)
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    ref_opt.step()
    return _diff(model, ref)


@pytest.mark.parametrize("mode", ["none", "replaced"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage_0_takes_grads_set_by_hand(workers2, mode, precision):
    tol = 1e-6 if precision == "fp32" else 2e-2
    for r in workers2.run(_grads_set_by_hand, 0, mode, precision):
        assert isinstance(r, float) and r < tol, r


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_grads_set_by_hand_at_stages_1_to_3_are_an_error(workers2, stage):
    for r in workers2.run(_grads_set_by_hand, stage, "replaced", "fp32"):
        assert isinstance(r, str) and r.startswith("head.weight.grad was set by hand"), r


def _autograd_grad_then_step(stage: int) -> str | float:
    """Gradients from ``torch.autograd.grad`` put into ``.grad``: no backward reduced them over
    the ranks, so the step would not see them (it applied nothing and returned True): an error
    at every stage."""
    model, _ = _pair(stage)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    x, y, mine = _batch(0)
    loss = nn.functional.mse_loss(model(x[mine]), y[mine])
    params = list(model.parameters())
    if stage < 3:
        grads = torch.autograd.grad(loss, params)
    else:  # its units' parameters are freed after the forward: any tensor of the right shape
        grads = [torch.ones(p.shape) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return "stepped"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradients_from_autograd_grad_are_an_error(workers2, stage):
    for r in workers2.run(_autograd_grad_then_step, stage):
        assert "inp.weight.grad was set by hand" in r, r


def _grad_scaler(stage: int) -> str | float:
    """torch's AMP loop (``torch.amp.GradScaler``): at stage 0, where ``.grad`` holds the
    averaged gradient, it trains as torch; at stages 1-3 the step names zeroshard's loss scaler
    (torch's "No inf checks were recorded for this optimizer" before)."""
    model, ref = _pair(stage)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    for step in range(2):
        x, y, mine = _batch(step)
        for m, o, s, xs, ys in (
            (model, opt, scalers[0], x[mine], y[mine]),
            (ref, ref_opt, scalers[1], x, y),
        ):
            s.scale(nn.functional.mse_loss(m(xs), ys)).backward()
            s.unscale_(o)
            try:
                s.step(o)
            except ValueError as e:
                return str(e)
            s.update()
            o.zero_grad()
    return _diff(model, ref)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_torch_s_grad_scaler(workers2, stage):
    for r in workers2.run(_grad_scaler, stage):
        if stage == 0:
            assert isinstance(r, float) and r < 1e-6, r
        else:
            want = "torch.amp.GradScaler cannot unscale a sharded optimizer's gradients at stage "
            want += str(stage)
            assert r.startswith(want), r
            assert "mixed_precision='fp16'" in r, r


def _clip_by_value(stage: int) -> float:
    """``opt.clip_grad_value`` against torch's ``clip_grad_value_`` (which sees no ``.grad`` at
    stages 1-3 and raises inside torch there)."""
    model, ref = _pair(stage)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        _losses(model, ref, *_batch(step))
        opt.clip_grad_value(0.01)
        torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return _diff(model, ref)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clipping_by_value(workers2, stage):
    assert max(workers2.run(_clip_by_value, stage)) < 1e-6
