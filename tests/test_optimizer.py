"""The sharded optimizer (``zeroshard/model_states/optimizer.py``) used as torch's are: clipping
its own parameters, gradients set through ``.grad``, param-group keys of the user's own.

Each multi-rank test trains a sharded copy on two gloo ranks (each its half of the batch) and an
unsharded reference on the whole batch in the same process, and compares them."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard.offload import Offload

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


class Skipping(Net):
    """Net whose block 1 no rank runs and whose block 2 only rank 0 runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.inp(x))
        if not dist.is_initialized() or dist.get_rank() == 0:
            h = self.blocks[2](h)
        return self.head(h)


def _unused_at_stage_0() -> dict:
    """A parameter no rank's backward reached shows ``.grad`` None, as under torch and DDP (it
    showed zeros, and in-place writes to them were dropped by the step); one set by hand is
    taken, once also through a second backward; one only another rank reached shows the
    averaged gradient."""
    torch.manual_seed(0)
    ref = Skipping()
    by_class = zeroshard.wrap.by_class(nn.Sequential)
    model = zeroshard.shard(copy.deepcopy(ref), stage=0, wrap=by_class)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y, mine = _batch(0)
    for m in (model, ref):  # (only block 1 is compared: the reference runs rank 0's path)
        nn.functional.mse_loss(m(x[mine]), y[mine]).backward()
    unused = [p.grad for p in model.blocks[1].parameters()]
    other_ranks = [p.grad is not None for p in model.blocks[2].parameters()]
    for m in (model, ref):
        m.blocks[1][0].weight.grad = torch.ones_like(m.blocks[1][0].weight)
        nn.functional.mse_loss(m(x[mine]), y[mine]).backward()  # accumulates: taken once
    opt.step()
    ref_opt.step()
    full = zeroshard.full_state_dict(model, rank0_only=False)
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()
               if k.startswith("blocks.1"))  # fmt: skip
    return {"unused": unused, "other_ranks": other_ranks, "diff": diff}


def test_stage_0_shows_no_grad_where_no_rank_reached(workers2):
    for r in workers2.run(_unused_at_stage_0):
        assert r["unused"] == [None, None] and r["other_ranks"] == [True, True], r
        assert r["diff"] < 1e-6, r


class ReadEarly(nn.Module):
    """Block 1's only parameter is read before block 1 runs: its gradient comes after its
    bucket's reduction, which is then reduced again at the end of the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Tanh(), nn.Tanh()])
        self.blocks[1].w = nn.Parameter(torch.randn(8, 8) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) @ self.blocks[1].w.t()
        return self.blocks[1](self.blocks[0](h))


def test_stage_0_a_gradient_after_its_reduction(lone_process):
    torch.manual_seed(0)
    ref = ReadEarly()
    wrap, config = zeroshard.wrap.by_class(nn.Tanh), zeroshard.ShardConfig(bucket_bytes=0)
    model = zeroshard.shard(copy.deepcopy(ref), stage=0, wrap=wrap, config=config)
    x = torch.randn(2, 4)
    for m in (model, ref):
        m(x).square().mean().backward()  # (it failed at the end of this backward)
    assert torch.equal(model.blocks[1].w.grad, ref.blocks[1].w.grad)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_grads_set_by_hand_at_stages_1_to_3_are_an_error(workers2, stage):
    for r in workers2.run(_grads_set_by_hand, stage, "replaced", "fp32"):
        assert isinstance(r, str) and r.startswith("head.weight.grad was set by hand"), r


def _autograd_grad_then_step(stage: int) -> str | float:
    """Gradients from ``torch.autograd.grad`` put into ``.grad`` (the step applied nothing and
    returned True): at stage 0 the step takes them, as DDP does (this rank's own values: no
    backward averaged them); at stages 1-3, where the step cannot read ``.grad``, an error."""
    model, _ = _pair(stage)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    x, y, mine = _batch(0)
    loss = nn.functional.mse_loss(model(x[mine]), y[mine])
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, params)  # (at stage 3 too: the graph holds them)
    for p, g in zip(params, grads):
        p.grad = g
    before = [p.detach().clone() for p in params]
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    moved = [b - p.detach() for b, p in zip(before, params)]
    return max((m - 0.5 * g).abs().max().item() for m, g in zip(moved, grads))  # SGD, lr 0.5


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradients_from_autograd_grad(workers2, stage):
    for r in workers2.run(_autograd_grad_then_step, stage):
        if stage == 0:
            assert isinstance(r, float) and r < 1e-6, r
        else:
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


def _grad_scaler_in_bf16() -> float:
    """Stage 0 with ``mixed_precision="bf16"``, where ``.grad`` shows a BF16 copy of the FP32
    average that the step takes: GradScaler's unscale kernel writes it in place without a version
    bump, and the step took the FP32 values still scaled (an update 1024 times too large). The
    difference from the same model trained without a scaler (a power-of-two scale is exact)."""
    models = [_pair(0, mixed_precision="bf16")[0] for _ in range(2)]
    opts = [zeroshard.optimizer(m, torch.optim.SGD, lr=0.5) for m in models]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(2):
        x, y, mine = _batch(step)
        for m, o in zip(models, opts):
            loss = nn.functional.mse_loss(m(x[mine]).float(), y[mine])
            if o is opts[0]:
                scaler.scale(loss).backward()
                scaler.step(o)
                scaler.update()
            else:
                loss.backward()
                o.step()
            o.zero_grad()
    a, b = (zeroshard.full_state_dict(m, rank0_only=False) for m in models)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _grad_scaler_on_a_zero_sum_gradient() -> float:
    """The same, where the gradient's elements sum to exactly 0 (inputs ``[a, -a]`` into one
    weight row): the unscaled gradient sums to 0 too, and the unscale went unseen."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(zeroshard.shard(nn.Linear(2, 1, bias=False), stage=0, mixed_precision="bf16"))
    opts = [zeroshard.optimizer(m, torch.optim.SGD, lr=0.5) for m in models]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(2):
        a = torch.randn(4, 1, generator=torch.Generator().manual_seed(step * 2 + dist.get_rank()))
        for m, o in zip(models, opts):
            loss = m(torch.cat([a, -a], 1)).float().square().mean()
            (scaler.scale(loss) if o is opts[0] else loss).backward()
            scaler.step(o) if o is opts[0] else o.step()
            o.zero_grad()
        scaler.update()
    a, b = (zeroshard.full_state_dict(m, rank0_only=False) for m in models)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("case", [_grad_scaler_in_bf16, _grad_scaler_on_a_zero_sum_gradient])
def test_torch_s_grad_scaler_with_bf16_gradients_shown(workers2, case):
    for worst in workers2.run(case):
        assert worst < 1e-6, worst


def _submodule_zero_grad(stage: int) -> float:
    """Gradients dropped by each submodule's own ``zero_grad`` (a GAN's ``netD.zero_grad()``)
    against torch's: they came back at the next step, added to the new ones."""
    model, ref = _pair(stage)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        for m in (model, ref):
            for child in (m.inp, m.blocks, m.head):
                child.zero_grad()
        _losses(model, ref, *_batch(step))
        opt.step()
        ref_opt.step()
    return _diff(model, ref)


def _some_submodules_zero_grad(stage: int, where: str, tmp: str) -> float:
    """Only some submodules drop their gradients between steps (``inp`` a part of the root's
    bucket, ``head`` the rest of it; ``blocks`` keep accumulating), gradients in memory or on
    NVMe: with NVMe the stored shard was not dropped, and the next backward added onto it."""
    offload = None if where == "memory" else Offload(optimizer="nvme", gradients="nvme", folder=tmp)
    model, ref = _pair(stage, offload=offload)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        _losses(model, ref, *_batch(step))
        opt.step()
        ref_opt.step()
        for m in (model, ref):
            m.inp.zero_grad()
            if step % 2:
                m.head.zero_grad()
    return _diff(model, ref)


@pytest.mark.parametrize("stage, where", [(2, "nvme"), (3, "nvme"), (3, "memory")])
def test_some_submodules_zero_grad_with_gradients_on_nvme(workers2, tmp_path, stage, where):
    assert max(workers2.run(_some_submodules_zero_grad, stage, where, str(tmp_path))) < 1e-6


def _grads_dropped_by_hand(how: str) -> float:
    """Stage 0, gradients dropped before each backward the ways DDP's users do (``.grad`` set to
    None by hand, or a torch optimizer over the parameters, stepping ``.grad``): the reduced
    gradients of the step before came back, added to the new ones."""
    model, ref = _pair(0)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.5)
        if how == "torch optimizer"
        else zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        if how == "torch optimizer":
            opt.zero_grad()
        else:
            for p in model.parameters():
                p.grad = None
        ref_opt.zero_grad()
        _losses(model, ref, *_batch(step))
        opt.step()
        ref_opt.step()
    return _diff(model, ref)


@pytest.mark.parametrize("how", ["by hand", "torch optimizer"])
def test_stage_0_gradients_dropped_as_under_ddp(workers2, how):
    assert max(workers2.run(_grads_dropped_by_hand, how)) < 1e-6


def _overflow_then_submodule_zero_grads(stage: int, parts: int) -> list[bool]:
    """FP16, the first loss overflows; gradients dropped only by submodules' ``zero_grad`` (all
    of the model in one, or in two parts): the later steps are taken, as in torch (the inf/NaN
    flag stayed set, and every step was skipped)."""
    model, _ = _pair(stage, mixed_precision="fp16")
    scaler = zeroshard.DynamicLossScaler(init_scale=2.0**8)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, loss_scaler=scaler)
    children = [model.inp, model.blocks, model.head]
    taken = []
    for step in range(3):
        if parts == 1:
            for child in children:
                child.zero_grad()
        else:  # the model's root, whose bucket holds inp's and head's parameters, in two calls
            model.inp.zero_grad()
            model.head.zero_grad()
            model.blocks.zero_grad()
        x, y, mine = _batch(step)
        loss = nn.functional.mse_loss(model(x[mine]).float(), y[mine])
        opt.backward(loss * (1e30 if step == 0 else 1.0))
        taken.append(opt.step())
    return taken


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("parts", [1, 2])
def test_an_overflow_dropped_by_submodules_zero_grad_is_forgotten(workers2, stage, parts):
    for taken in workers2.run(_overflow_then_submodule_zero_grads, stage, parts):
        assert taken == [False, True, True], taken


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_submodule_s_zero_grad_drops_its_gradients(workers2, stage):
    assert max(workers2.run(_submodule_zero_grad, stage)) < 1e-6


def _backward_twice_through_one_graph(stage: int) -> float:
    """``opt.backward(loss, retain_graph=True)`` then again: gradients summed, as torch's (the
    keyword was a TypeError)."""
    model, ref = _pair(stage)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x, y, mine = _batch(0)
    loss = nn.functional.mse_loss(model(x[mine]), y[mine])
    opt.backward(loss, retain_graph=True)
    opt.backward(loss)
    ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    opt.step()
    ref_opt.step()
    return _diff(model, ref)


@pytest.mark.parametrize("stage", [0, 3])
def test_backward_takes_torch_s_keywords(workers2, stage):
    assert max(workers2.run(_backward_twice_through_one_graph, stage)) < 1e-6


class _LARS(torch.optim.SGD):
    """A per-tensor trust ratio, as LARS scales each gradient: not element-wise."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(p.norm() / (p.grad.norm() + 1e-12))
        return super().step(closure)


class _MySGD(torch.optim.SGD):
    def __init__(self, params, lr=0.1):
        super().__init__(params, lr=lr, momentum=0.9)


def _optimizer_subclasses() -> str:
    model, _ = _pair(3)
    zeroshard.optimizer(model, _MySGD)  # settings of its own, torch's step: element-wise
    try:
        zeroshard.optimizer(model, _LARS, lr=0.1)
    except ValueError as e:
        zeroshard.optimizer(model, _LARS, lr=0.1, elementwise=True)  # the caller's word
        return str(e)
    return "accepted"


def test_a_subclass_that_steps_its_own_way_is_not_taken_as_element_wise(workers1):
    said = workers1.run(_optimizer_subclasses)[0]
    assert said.startswith("_LARS overrides step() of SGD: a sharded optimizer steps each"), said
    assert "elementwise=True" in said, said


def _shared_scaler() -> str:
    model, _ = _pair(3, mixed_precision="fp16")
    scaler = zeroshard.DynamicLossScaler()
    with pytest.raises(ValueError):  # a parameter of another model: the scaler stays free
        zeroshard.optimizer(
            model, torch.optim.SGD, [nn.Parameter(torch.ones(1))], loss_scaler=scaler
        )
    first = zeroshard.optimizer(model, torch.optim.SGD, [model.inp.weight], loss_scaler=scaler)
    try:
        zeroshard.optimizer(model, torch.optim.SGD, [model.head.weight], loss_scaler=scaler)
    except ValueError as e:
        said = str(e)
    else:
        return "a second optimizer took the first one's loss scaler"
    # A rebuild over the same parameters replaces the first (kept alive, say by a scheduler)
    # in every bucket: it hands its scaler on.
    rebuilt = zeroshard.optimizer(model, torch.optim.SGD, [model.inp.weight], loss_scaler=scaler)
    assert first is not None and rebuilt.loss_scaler is scaler
    del first, rebuilt  # freed: its scaler may serve another optimizer
    zeroshard.optimizer(model, torch.optim.SGD, [model.head.weight], loss_scaler=scaler)
    return said


def test_a_loss_scaler_serves_one_optimizer(workers1):
    """Each optimizer's step updates its scaler: shared, one overflow halved the scale twice."""
    said = workers1.run(_shared_scaler)[0]
    assert said.startswith("this DynamicLossScaler already belongs to another zeroshard"), said
    assert "loss_scaler=zeroshard.DynamicLossScaler()" in said, said


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


def _out_of_place_edit_where_a_rank_s_backward_did_not_reach(stage: int) -> float:
    """Stage 0: ``p.grad = p.grad * 0.5`` over every parameter with a ``.grad``, when a branch
    ran on rank 1 only (a router, layer drop): the averaged gradient rank 0 shows for it is
    edited too, on every rank alike (rank 0 alone raised, and rank 1 waited in the step)."""
    torch.manual_seed(0)
    ref = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x, _, mine = _batch(0)
    out = model["a"](x[mine])
    if dist.get_rank() == 1:
        out = out + model["b"](x[mine])
    opt.backward(out.square().sum() / PER_RANK_BATCH)  # averaged over the ranks: the batch's
    full = ref["a"](x)
    full = torch.cat([full[:PER_RANK_BATCH], full[PER_RANK_BATCH:] + ref["b"](x[PER_RANK_BATCH:])])
    (full.square().sum() / x.shape[0]).backward()
    for m in (model, ref):
        for p in m.parameters():
            if p.grad is not None:
                p.grad = p.grad * 0.5
    opt.step()
    ref_opt.step()
    return _diff(model, ref)


def test_an_out_of_place_edit_of_a_gradient_another_rank_made(workers2):
    assert max(workers2.run(_out_of_place_edit_where_a_rank_s_backward_did_not_reach, 0)) < 1e-6


def _clip_a_subset_with_gradients_on_nvme(folder: str) -> str:
    """Gradients on NVMe keep one norm per bucket, of every trainable parameter: an optimizer
    over the head alone got the whole model's norm there (torch's clip takes the head's)."""
    model, _ = _pair(
        3, offload=zeroshard.Offload(optimizer="nvme", gradients="nvme", folder=folder)
    )
    opt = zeroshard.optimizer(model, torch.optim.SGD, model.head.parameters(), lr=0.5)
    _losses(model, copy.deepcopy(Net()), *_batch(0))
    try:
        opt.clip_grad_norm(1.0)
    except ValueError as e:
        return str(e)
    finally:
        opt.close()
    return "clipped"


def test_a_subset_optimizer_with_gradients_on_nvme_does_not_clip_by_the_whole_model(
    workers2, tmp_path
):
    for said in workers2.run(_clip_a_subset_with_gradients_on_nvme, str(tmp_path)):
        assert "takes the norm of every trainable parameter's gradient" in said, said


def _backward_after_step(stage: int) -> dict:
    """``backward(retain_graph=True)``, ``step()``, then a backward through the same graph:
    torch raises (the weights it saved were changed in place); so must a sharded model, whose
    backward would otherwise mix the old activations with the new weights. A forward after
    the step trains as usual."""
    model, ref = _pair(stage)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x, y, mine = _batch(0)
    out = {}
    for name, net, o, rows in (("ours", model, opt, mine), ("torch", ref, ref_opt, slice(None))):
        loss = nn.functional.mse_loss(net(x[rows]), y[rows])
        (o.backward(loss, retain_graph=True) if o is opt else loss.backward(retain_graph=True))
        o.step()
        o.zero_grad()
        try:
            o.backward(loss) if o is opt else loss.backward()
            out[name] = "accepted"
        except RuntimeError as exc:
            out[name] = str(exc)
    opt.zero_grad()
    for step in range(1, 3):  # fresh forwards: trained as torch trains
        x, y, mine = _batch(step)
        _losses(model, ref, x, y, mine)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    out["diff"] = _diff(model, ref)
    # A load_state_dict between a forward and its backward: the same (torch copies in place).
    for name, net in (("ours loaded", model), ("torch loaded", ref)):
        loss = nn.functional.mse_loss(net(x[mine]), y[mine])
        net.load_state_dict(net.state_dict())
        try:
            opt.backward(loss) if net is model else loss.backward()
            out[name] = "accepted"
        except RuntimeError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_backward_through_a_graph_from_before_the_step_raises(workers2, stage):
    for r in workers2.run(_backward_after_step, stage):
        assert "modified by an inplace operation" in r["torch"], r
        assert "made before an optimizer step or a load changed its" in r["ours"], r
        assert r["diff"] < 1e-6, r
        assert "modified by an inplace operation" in r["torch loaded"], r
        assert "made before an optimizer step or a load changed" in r["ours loaded"], r


class _GAN(nn.Module):
    """A generator and a discriminator in one sharded model, each with its own optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.D = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, z: torch.Tensor, which: str) -> torch.Tensor:
        return self.G(z) if which == "G" else self.D(z)


class _Queries(nn.Module):
    """A unit that returns its own parameter (a leaf: its backward hook outlives the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.randn(3, 4))

    def forward(self) -> torch.Tensor:
        return self.q


def _graphs_still_valid(stage: int, wrap: bool) -> list[str]:
    """Patterns whose graphs a step does not make stale: the GAN loop (the generator's forward
    made before the discriminator's step, backward through it after; G and D in units of their
    own, or both in the root), and a unit returning its own parameter; the steps each takes."""
    torch.manual_seed(0)
    policy = zeroshard.wrap.by_class(nn.Sequential) if wrap else None
    gan = zeroshard.shard(_GAN(), stage=stage, wrap=policy)
    opt_g = zeroshard.optimizer(gan, torch.optim.Adam, list(gan.G.parameters()), lr=1e-3)
    opt_d = zeroshard.optimizer(gan, torch.optim.Adam, list(gan.D.parameters()), lr=1e-3)
    taken = []
    for _ in range(2):
        fake = gan(torch.randn(2, 4), "G")
        opt_d.backward(gan(fake.detach(), "D").mean())
        taken.append(f"D {opt_d.step()}")
        opt_d.zero_grad()
        opt_g.backward(-gan(fake, "D").mean())
        taken.append(f"G {opt_g.step()}")
        opt_g.zero_grad()
        opt_d.zero_grad()
    net = nn.ModuleDict({"queries": _Queries(), "lin": nn.Linear(4, 4)})
    net = zeroshard.shard(net, stage=stage, wrap=zeroshard.wrap.by_class(_Queries))
    opt = zeroshard.optimizer(net, torch.optim.SGD, lr=0.1)
    for _ in range(3):
        opt.backward((net["lin"](torch.randn(2, 4)) @ net["queries"]().t()).sum())
        taken.append(f"Q {opt.step()}")
        opt.zero_grad()
    return [*taken, f"hooks {len(net['queries'].q._backward_hooks or {})}"]  # once each


class _Temperature(nn.Module):
    """CLIP's pattern: the root returns its own parameter (a learned temperature) beside the
    features its unit computes."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.enc(x), self.logit_scale


def _temperature_beside_features(stage: int) -> tuple[float, int]:
    """Trained against torch; and the hooks left on the parameter after the steps."""
    torch.manual_seed(0)
    ref = _Temperature()
    model = zeroshard.shard(
        copy.deepcopy(ref), stage=stage, wrap=zeroshard.wrap.by_class(nn.Linear)
    )
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4 * world, 8, generator=g)
        features, scale = model(x[rank * 4 : (rank + 1) * 4])
        opt.backward(features.square().mean() * scale)  # the ranks' mean: the whole's
        opt.step()
        opt.zero_grad()
        features, scale = ref(x)
        (features.square().mean() * scale).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with zeroshard.summon_full_params(model, writeback=False):
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    diff = max((got[n] - p).abs().max().item() for n, p in ref.named_parameters())
    return diff, len(model.logit_scale._backward_hooks or {})


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_parameter_returned_beside_features_trains(workers2, stage):
    # the hook on the returned parameter (a leaf) outlived the graph: the next step's backward
    # fired it as a backward through the old graph, a false "stale graph" error, and each
    # forward added one for good
    for diff, hooks in workers2.run(_temperature_beside_features, stage):
        assert diff < 1e-6 and hooks == 0, (diff, hooks)


@pytest.mark.parametrize("wrap", [True, False])
@pytest.mark.parametrize("stage", [0, 3])
def test_graphs_a_step_leaves_valid_still_train(workers2, stage, wrap):
    for r in workers2.run(_graphs_still_valid, stage, wrap):
        assert r == ["D True", "G True"] * 2 + ["Q True"] * 3 + ["hooks 0"], r


def _replaced_then_used(stage: int, order: str) -> float:
    """An optimizer over the head, then one over every parameter (which replaces it in the
    head's bucket), used as in a probe-then-finetune: the head's first, for 3 steps (the body's
    gradients accumulate meanwhile, as torch's do), then the whole model's. ``"same"``: two
    optimizers over the same parameters, the first one used while the second lives."""
    model, ref = _pair(stage)

    def both(params, cls, **kw):
        mine = zeroshard.optimizer(model, cls, list(params(model)), **kw)
        return mine, cls(list(params(ref)), **kw)

    if order == "subset":
        first = both(lambda m: m.head.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        second = both(lambda m: m.parameters(), torch.optim.AdamW, lr=0.01)
    else:
        first = both(lambda m: m.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        second = both(lambda m: m.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    for step in range(5):
        used = first if step < 3 or order == "same" else second
        x, y, mine = _batch(step)
        _losses(model, ref, x, y, mine)
        for opt in used:
            opt.step()
            opt.zero_grad()
    del second
    return _diff(model, ref)


@pytest.mark.parametrize("order", ["subset", "same"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_replaced_optimizer_used_again_acts_on_its_own_gradients(workers2, stage, order):
    # Before: the replaced optimizer still stepped, but its zero_grad() cleared nothing, so
    # gradients piled up (0.08-0.18 off torch, with no error).
    for diff in workers2.run(_replaced_then_used, stage, order):
        assert diff < 1e-5, diff


def _warm(step: int) -> float:
    return min(1.0, (step + 1) / 10)


def _group_keys_with_addresses() -> str:
    """A group key holding a function or an object of the user's: ranks agree on settings by
    their text, which held each rank's own memory address ("another param groups on ranks
    [1]")."""
    model, _ = _pair(1)
    groups = [{"params": model.parameters(), "lr_rule": _warm, "tag": object()}]
    opt = zeroshard.optimizer(model, torch.optim.SGD, groups, lr=0.1)
    return f"{len(opt.param_groups)} group, rule {opt.param_groups[0]['lr_rule'] is _warm}"


def test_group_keys_are_compared_without_memory_addresses(workers2):
    assert workers2.run(_group_keys_with_addresses) == ["1 group, rule True"] * 2


def _reclaim_from_step_in_backward() -> str:
    """A head's optimizer used again after one over the whole model that steps in backward
    replaced it: taking the head's bucket back silently stopped the other from updating the
    head; it is an error."""
    torch.manual_seed(0)
    model = zeroshard.shard(Net(), stage=3, wrap=zeroshard.wrap.by_class(nn.Linear))
    head = zeroshard.optimizer(model, torch.optim.SGD, model.head.parameters(), lr=0.1)
    whole = zeroshard.optimizer(model, torch.optim.AdamW, lr=0.1, step_in_backward=True)
    try:
        head.zero_grad()
    except ValueError as exc:
        return str(exc)
    return f"no error ({whole} lives)"


def test_taking_buckets_back_from_a_step_in_backward_optimizer_is_an_error(workers2):
    for said in workers2.run(_reclaim_from_step_in_backward):
        assert said.startswith("this optimizer was replaced by a newer one"), said


def _states_reset(stage: int, how: str, folder: str | None) -> tuple[float, str]:
    """Adam's moments reset before step 3 (``opt.state = defaultdict(dict)``, ``clear()``, or
    every key deleted) against torch's optimizer reset the same way."""
    from collections import defaultdict

    offload = None if folder is None else Offload(optimizer="nvme", folder=folder)
    model, ref = _pair(stage, offload=offload)
    opt = zeroshard.optimizer(model, torch.optim.Adam, lr=0.05)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    for step in range(4):
        if step == 2:
            ref_opt.state = defaultdict(dict)
            if how == "assign":
                opt.state = defaultdict(dict)
            elif how == "clear":
                opt.state.clear()
            else:
                for key in list(opt.state):
                    del opt.state[key]
        x, y, mine = _batch(step)
        _losses(model, ref, x, y, mine)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    refused = []
    for value in ({"not": "a reset"}, None):
        try:
            opt.state = value
            refused.append("taken")
        except ValueError as exc:
            refused.append(str(exc))
    return _diff(model, ref), refused


@pytest.mark.parametrize(
    "stage, how, nvme", [(0, "assign", False), (3, "assign", False), (3, "clear", False),
                         (2, "delete", False), (1, "assign", True), (3, "delete", True)],
)  # fmt: skip
def test_optimizer_states_reset_as_torch_s(workers2, tmp_path, stage, how, nvme):
    # opt.state = defaultdict(dict) replaced the view only: the step kept the moments (1e-1
    # off torch); clear() and del raised AttributeError / TypeError.
    for diff, refused in workers2.run(_states_reset, stage, how, str(tmp_path) if nvme else None):
        assert diff < 1e-6, diff
        assert all("opt.state can only be reset" in r for r in refused), refused


def _listed_twice() -> str:
    model, _ = _pair(1)
    params = [model.head.weight, *model.parameters()]
    try:
        zeroshard.optimizer(model, torch.optim.SGD, params, lr=0.1, momentum=0.9)
    except ValueError as exc:
        return str(exc)
    return "built"


def test_a_parameter_listed_twice_in_a_group_is_refused(workers2):
    # Each listing stepped its own piece of one master: the update applied twice (torch warns).
    for said in workers2.run(_listed_twice):
        assert "'head.weight' is listed twice in one param group" in said, said


def _two_models_one_loss(stage: int, how: str) -> dict:
    """An encoder and a decoder sharded apart, each with its own optimizer, one loss through
    both (``opt_enc.backward(loss)``). ``how``: "fp16" (the loss scaled by the encoder's
    scaler: the decoder's reductions must remove that scale too; they kept it, gradients
    32768x), "gan" (``step_in_backward`` on both: the encoder's backward must not step the
    decoder, whose gradients wait for its own step; it stepped it), "accumulate"
    (``step_in_backward``, two micro-steps with ``sync=False`` then synced: the decoder
    accumulates too; it stepped in the first and raised in the second). Against plain torch
    in FP32 on every rank's rows."""
    torch.manual_seed(0)
    ref_enc, ref_dec = nn.Linear(4, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 1))
    sib = how != "fp16"
    mp = "fp16" if how == "fp16" else None
    enc = zeroshard.shard(copy.deepcopy(ref_enc), stage=stage, mixed_precision=mp)
    dec = zeroshard.shard(copy.deepcopy(ref_dec), stage=stage, mixed_precision=mp)
    opt_enc = zeroshard.optimizer(enc, torch.optim.SGD, lr=0.1, step_in_backward=sib)
    opt_dec = zeroshard.optimizer(dec, torch.optim.SGD, lr=0.1, step_in_backward=sib)
    x, y, mine = _batch(0)
    micro = 2 if how == "accumulate" else 1
    for i in range(micro):
        loss = nn.functional.mse_loss(dec(enc(x[mine])).float(), y[mine]) / micro
        opt_enc.backward(loss, sync=i == micro - 1)
    with zeroshard.summon_full_params(dec):
        dec_moved = max((a - b).abs().max().item() for a, b in
                        zip(dec.parameters(), ref_dec.parameters()))  # fmt: skip
    taken = [opt_enc.step(), opt_dec.step()]
    nn.functional.mse_loss(ref_dec(ref_enc(x)), y).backward()
    torch.optim.SGD([*ref_enc.parameters(), *ref_dec.parameters()], lr=0.1).step()
    return {"dec moved before its step": dec_moved if sib else 0.0, "taken": taken,
            "diff": max(_diff(enc, ref_enc), _diff(dec, ref_dec))}  # fmt: skip


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("how", ["fp16", "gan", "accumulate"])
def test_one_loss_through_two_models_sharded_apart(workers2, stage, how):
    for r in workers2.run(_two_models_one_loss, stage, how):
        assert r["dec moved before its step"] == 0.0 and r["taken"] == [True, True], r
        assert r["diff"] < (1e-3 if how == "fp16" else 1e-6), r


def _overflow_in_the_other_model(stage: int, order: str, both: bool, settings: dict) -> dict:
    """FP16, an encoder and a decoder sharded apart, one loss scaled by the encoder's scaler
    (``opt_enc.backward``), three steps; the decoder's gradients overflow (its input is large),
    with ``both`` the encoder's too (the loss is inf). Each optimizer skips on its own
    gradients, as ``torch.amp.GradScaler.step`` does per optimizer, and the scale that
    overflowed is lowered as one torch scaler's ``update()`` after both steps would, in either
    order of the steps (the decoder's unused scaler was lowered instead, and the encoder's
    grew: every later step of the decoder overflowed again; then, with the encoder stepping
    first, its clean step reset hysteresis and growth before the decoder's overflow came)."""
    torch.manual_seed(0)
    enc, dec = nn.Linear(4, 8), nn.Linear(8, 1)
    with torch.no_grad():
        enc.weight.mul_(2000.0)  # h ~ 1e3: dec.weight's gradient ~ h * 2**15 overflows
    enc = zeroshard.shard(enc, stage=stage, mixed_precision="fp16")
    dec = zeroshard.shard(dec, stage=stage, mixed_precision="fp16")
    scalers = [zeroshard.DynamicLossScaler(init_scale=2.0**15, **settings) for _ in range(2)]
    opt_enc = zeroshard.optimizer(enc, torch.optim.SGD, lr=0.1, loss_scaler=scalers[0])
    opt_dec = zeroshard.optimizer(dec, torch.optim.SGD, lr=0.1, loss_scaler=scalers[1])
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    taken = []
    for _ in range(3):
        opt_enc.backward(dec(enc(x * (1e4 if both else 1.0))).float().mean())
        if order == "enc_first":
            taken.append([opt_enc.step(), opt_dec.step()])
        else:
            dec_taken = opt_dec.step()
            taken.append([opt_enc.step(), dec_taken])
        opt_enc.zero_grad()
        opt_dec.zero_grad()
    return {"taken": taken, "scales": [s.scale for s in scalers]}


@pytest.mark.parametrize("order", ["enc_first", "dec_first"])
@pytest.mark.parametrize("both", [False, True], ids=["decoder", "both"])
@pytest.mark.parametrize(
    "settings, scale, stage",
    [({}, 2.0**12, 2), ({"hysteresis": 2}, 2.0**14, 3), ({"growth_interval": 1}, 2.0**12, 3)],
    ids=["default", "hysteresis", "growth"],
)
def test_an_overflow_in_the_other_model_lowers_the_scale_used(
    workers2, stage, order, both, settings, scale
):
    for r in workers2.run(_overflow_in_the_other_model, stage, order, both, settings):
        assert r["taken"] == [[not both, False]] * 3, r
        assert r["scales"] == [scale, 2.0**15], r


def test_a_frozen_model_in_some_micro_steps_only(lone_process):
    """A frozen model (a perceptual or reference net, no gradients) reached by one micro-step's
    loss only: a trained model's backward speaks for the models it reaches, but one without
    trainable parameters keeps nothing unreduced (it was left accumulating, and a later
    backward at another loss scale raised "scaled by 8192 but the unreduced gradients it adds
    to by 1024")."""
    torch.manual_seed(0)
    trained = zeroshard.shard(nn.Linear(4, 4), stage=2)
    frozen = zeroshard.shard(nn.Linear(4, 1).requires_grad_(False), stage=2)
    scaler = zeroshard.DynamicLossScaler(init_scale=1024, growth_interval=1)
    opt = zeroshard.optimizer(trained, torch.optim.SGD, lr=0.01, loss_scaler=scaler)
    x = torch.randn(8, 4)
    for step in range(3):
        first = frozen(trained(x)) if step == 0 else trained(x)
        opt.backward(first.square().mean(), sync=False)
        opt.backward(trained(x).square().mean())
        assert opt.step()
        opt.zero_grad()
    opt.backward(frozen(trained(x)).square().mean())  # (raised)
    assert not zeroshard.engine_of(frozen).scaling.accumulating


def _copied() -> list[str]:
    """What ``torch.save``, ``pickle.dumps``, ``copy.copy`` and ``copy.deepcopy`` of the
    optimizer say (a bare weakref TypeError; a copy whose ``step()`` raised AttributeError)."""
    model = zeroshard.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), stage=3)
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    said = []
    for copy_it in (lambda: torch.save(opt, io.BytesIO()), lambda: pickle.dumps(opt)):
        with pytest.raises(TypeError) as info:
            copy_it()
        said.append(str(info.value))
    for copy_it in (copy.copy, copy.deepcopy):
        with pytest.raises(TypeError) as info:
            copy_it(opt)
        said.append(str(info.value))
    return said


def test_the_optimizer_is_not_copied_or_pickled(workers2):
    for said in workers2.run(_copied):
        assert all("a zeroshard optimizer" in s and "state_dict()" in s for s in said), said


def _step_raised_partway(stage: int) -> dict:
    """A step that raised in its second sub-group (an out-of-memory, a Ctrl-C there): the
    first sub-group keeps its update, as a torch optimizer's parameters do, and every rank's
    parameters follow the masters (a rank's own slice is its master's memory at stages 1-2:
    the ranks' parameters differed by 1.5, and a step with no gradient then moved them)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    wrap, config = zeroshard.wrap.by_class(nn.Linear), zeroshard.ShardConfig(bucket_bytes=0)
    model = zeroshard.shard(model, stage=stage, wrap=wrap, config=config)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().mean().backward()

    def out_of_memory(*args):
        raise RuntimeError("out of memory")

    handle = opt.sub_optimizers[1].register_step_pre_hook(out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        opt.step()
    handle.remove()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    masters = zeroshard.full_state_dict(model, rank0_only=False)
    opt.zero_grad()
    opt.step()  # no gradient: nothing moves
    return {
        "params": params,
        "off masters": max((params[k] - masters[k]).abs().max().item() for k in params),
        "moved": max((p - params[k]).abs().max().item() for k, p in model.named_parameters()),
        "subgroups": len(opt.sub_optimizers),
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_a_step_that_raised_partway_leaves_the_ranks_alike(workers2, stage):
    first, second = workers2.run(_step_raised_partway, stage)
    for r in (first, second):
        assert r["subgroups"] >= 2 and r["off masters"] == 0 and r["moved"] == 0, r
    assert all(torch.equal(v, second["params"][k]) for k, v in first["params"].items())


def _load_a_bad_entry(bad_entry: str) -> list[str]:
    """An optimizer state dict with one entry of the wrong shape, or one state missing: the
    error on every rank and nothing loaded (the rank holding that piece raised alone, the other
    waited in a gather until the group's timeout; a missing state was loaded and the step of
    that rank alone failed)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    model = zeroshard.shard(model, stage=3, wrap=zeroshard.wrap.by_class(nn.Linear))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.0)
    model(torch.randn(2, 4)).square().mean().backward()
    opt.step()
    saved = opt.state_dict()
    bad = {**saved, "state": {k: dict(v) for k, v in saved["state"].items()}}
    if bad_entry == "shape":
        bad["state"]["3.bias"]["exp_avg"] = torch.zeros(3, 3)
    elif bad_entry == "missing":
        del bad["state"]["3.bias"]["exp_avg_sq"]
    else:  # AdamW's states into an SGD with momentum (it kept none of them, then stepped)
        opt = zeroshard.optimizer(model, torch.optim.SGD, lr=1e-3, momentum=0.9)
        model(torch.randn(2, 4)).square().mean().backward()
        opt.step()
    bad["param_groups"] = [dict(g, lr=1.0) for g in saved["param_groups"]]
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(bad)
    return [str(info.value), opt.param_groups[0]["lr"]]


@pytest.mark.parametrize("bad_entry", ["shape", "missing", "class"])
def test_a_bad_optimizer_state_entry_is_refused_on_every_rank(workers2, bad_entry):
    expected = {
        "shape": "optimizer state 'exp_avg' of 3.bias has shape (3, 3)",
        "missing": "optimizer state of 3.bias lacks 'exp_avg_sq' (it has 'exp_avg', 'step';",
        "class": "optimizer state of 0.weight holds 'exp_avg', 'exp_avg_sq', 'step', none of",
    }[bad_entry]
    for said, lr in workers2.run(_load_a_bad_entry, bad_entry):
        assert said.startswith(expected), said
        assert said.endswith("nothing was loaded") and lr == 1e-3, (said, lr)


def _a_step_raising_partway(stage: int, ranks: tuple[int, ...], at: int, reload: bool) -> dict:
    """Three steps; the second raises on ``ranks`` at their sub-group ``at`` (0: before any),
    and the loop goes on (the error caught; with ``reload``, the state from before it loaded
    at once). Returns each step's result, whether a forward is refused after them, and whether
    every rank holds the same parameters once a state from before is loaded."""
    from unittest import mock

    from zeroshard.model_states import optimizer

    model, _ = _pair(stage, config=zeroshard.ShardConfig(bucket_bytes=0))  # a flat per unit
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    step_subgroup, calls = optimizer.ShardedOptimizer._step_subgroup, []

    def failing(self, sg, unused):
        calls.append(sg)
        if dist.get_rank() in ranks and len(calls) == at + 1:
            raise RuntimeError("out of memory (simulated)")
        return step_subgroup(self, sg, unused)

    said, saved = [], None
    for step in range(3):
        x, y, mine = _batch(step)
        opt.backward((model(x[mine]) - y[mine]).square().mean())
        if step == 1:
            saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        patch = mock.patch.object(optimizer.ShardedOptimizer, "_step_subgroup", failing)
        try:
            with patch if step == 1 else contextlib.nullcontext():
                said.append(opt.step())
        except RuntimeError as exc:
            said.append(str(exc))
        if reload and step == 1:  # (every rank: a collective)
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        opt.zero_grad()
    try:
        model(x[mine])
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    opt.backward((model(x[mine]) - y[mine]).square().mean())
    after_load = opt.step()
    full = zeroshard.full_state_dict(model, rank0_only=False)
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, [v.double().sum().item() for v in full.values()])
    return {
        "said": said,
        "refused": refused,
        "after_load": after_load,
        "same": digests[0] == digests[1],
    }


OOM = "out of memory (simulated)"
APART = "the last optimizer.step() raised partway on some rank"


@pytest.mark.parametrize(
    "stage, ranks, at, reload, apart",
    [
        (1, (0,), 1, False, False),
        (2, (0,), 1, False, False),
        (0, (0,), 1, False, True),
        (0, (0,), 0, False, True),  # before its first sub-group, the other rank stepped all
        (0, (0, 1), 1, False, False),  # every copy stopped at the same one: they agree
        (0, (0,), 1, True, False),  # a state loaded at once: the copies agree again
    ],
    ids=["stage1", "stage2", "stage0", "stage0-at-first", "stage0-both-alike", "stage0-reload"],
)
def test_a_step_raising_partway(workers2, stage, ranks, at, reload, apart):
    # Stages 1-2: the next step ran into a false OrderMismatch on every rank (the failing rank
    # never closed its ledger's step). Stage 0: each rank keeps its own masters, and the ranks
    # trained apart without a word (7e-3 after three steps): refused until a state is loaded,
    # where the copies differ only.
    results = workers2.run(_a_step_raising_partway, stage, ranks, at, reload)
    for rank, r in enumerate(results):
        first, second, third = r["said"]
        assert first is True and r["after_load"] is True and r["same"], r
        assert second == (OOM if rank in ranks else True), r
        if apart:
            assert third.startswith(APART) and r["refused"] == third, r
        else:
            assert third is True and r["refused"] == "", r


@pytest.mark.parametrize("stage, step_in_backward", [(0, False), (1, False), (3, False), (3, True)])
@pytest.mark.parametrize("edit", ["take out", "move", "reverse", "delete"])
def test_param_groups_changed_by_hand_are_refused(lone_process, stage, step_in_backward, edit):
    # Torch reads each group's "params" at every step; the sub-groups were built once, and a
    # piece looked up its settings by index: a parameter taken out of its group (or moved to a
    # group with lr 0) kept training at its old lr, reversed groups swapped their lrs, and a
    # deleted group raised a bare IndexError; all silently but the last.
    torch.manual_seed(0)
    model = zeroshard.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), stage=stage)
    groups = [
        {"params": [model[0].weight, model[0].bias], "lr": 0.1},
        {"params": [model[1].weight, model[1].bias], "lr": 0.2},
    ]
    opt = zeroshard.optimizer(
        model, torch.optim.SGD, groups, lr=0.1, step_in_backward=step_in_backward
    )
    opt.backward(model(torch.randn(3, 4)).sum())
    opt.step()
    opt.zero_grad()
    opt.param_groups[1]["lr"] = 0.05  # (settings change in place, as a scheduler's)
    if edit == "take out":
        opt.param_groups[1]["params"].pop(0)
    elif edit == "move":
        opt.param_groups[0]["params"].append(opt.param_groups[1]["params"].pop(0))
    elif edit == "reverse":
        opt.param_groups.reverse()
    else:
        del opt.param_groups[1]
    with pytest.raises(ValueError, match=r"opt.param_groups were changed by hand"):
        opt.backward(model(torch.randn(3, 4)).sum())
        opt.step()
    with pytest.raises(ValueError, match=r"opt.param_groups were changed by hand"):
        opt.state_dict()
    if not step_in_backward:  # torch's own loss.backward(), then step(): refused there too
        model(torch.randn(3, 4)).sum().backward()
        with pytest.raises(ValueError, match=r"opt.param_groups were changed by hand"):
            opt.step()


def test_torch_s_grad_scaler_over_fp16_gradients_at_stage_0_names_the_fix(lone_process):
    # .grad holds FP16 copies there: GradScaler's own "Attempting to unscale FP16 gradients."
    # (stages 1-3 named zeroshard's loss scaler already).
    torch.manual_seed(0)
    model = zeroshard.shard(nn.Linear(4, 2), stage=0, mixed_precision="fp16")
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(torch.randn(3, 4)).float().square().mean()).backward()
    with pytest.raises(
        ValueError, match=r"GradScaler cannot unscale .* at stage 0: .grad holds FP16"
    ) as info:
        scaler.step(opt)
    assert "shard(..., mixed_precision='fp16') gives the optimizer a DynamicLossScaler" in str(
        info.value
    )


def _settings_apart(stage: int) -> dict:
    """A learning rate a rank set alone (ReduceLROnPlateau stepped on the rank's own metric):
    each rank had stepped its own shard with its own rate, without a word."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    model = zeroshard.shard(model, stage=stage, wrap=zeroshard.wrap.by_class(nn.Linear))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    out = {}
    for step in range(3):
        model(torch.randn(2, 4)).square().mean().backward()
        before = copy.deepcopy(zeroshard.full_state_dict(model, rank0_only=False))
        try:
            opt.step()
        except ValueError as exc:
            out["said"], out["at"] = str(exc), step
            after = zeroshard.full_state_dict(model, rank0_only=False)
            out["untouched"] = all(torch.equal(v, after[k]) for k, v in before.items())
            break
        opt.zero_grad()
        scheduler.step(-step if dist.get_rank() == 0 else step)  # rank 1's worsens
    opt.param_groups[0]["lr"] = 1e-3  # alike again: the step goes on
    out["stepped"] = opt.step()
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_settings_that_differ_between_ranks_are_refused_at_the_step(workers2, stage):
    for r in workers2.run(_settings_apart, stage):
        assert r["at"] == 2 and r["untouched"] and r["stepped"], r
        assert "param group 0's 'lr' is 0.01 on rank 0, 0.001 on rank 1" in r["said"], r
        assert r["said"].endswith("Nothing was stepped"), r


def _frozen_with_a_grad(stage: int) -> dict:
    """A frozen parameter in the optimizer's groups, its .grad set by hand on rank 0: torch's
    SGD steps it; the sharded optimizer stepped the others and ignored it, saying True (then
    refused it on rank 0 alone, rank 1 waiting in the step's agreement)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[0].weight.requires_grad_(False)
    model = zeroshard.shard(model, stage=stage, wrap=zeroshard.wrap.by_class(nn.Linear))
    opt = zeroshard.optimizer(model, torch.optim.SGD, list(model.parameters()), lr=0.1)
    opt.backward(model(torch.ones(2, 4)).sum())
    if dist.get_rank() == 0:
        model[0].weight.grad = torch.ones(3, 4)
    with pytest.raises(ValueError) as info:
        opt.step()
    opt.zero_grad()  # drops it: the next steps go on
    opt.backward(model(torch.ones(2, 4)).sum())
    return {"said": str(info.value), "dropped": model[0].weight.grad is None, "step": opt.step()}


@pytest.mark.parametrize("stage", [0, 3])
def test_a_grad_set_on_a_frozen_parameter_is_refused(workers2, stage):
    for r in workers2.run(_frozen_with_a_grad, stage):
        assert r["said"].startswith("0.weight does not train (requires_grad=False"), r
        assert "was set (on rank 0)" in r["said"] and r["said"].endswith("Nothing was stepped")
        assert r["dropped"] and r["step"], r


def _tensor_lr_apart() -> list[str]:
    """A tensor learning rate (fused / capturable optimizers) or a numpy one that one rank
    changed alone: the settings check read plain Python numbers only, and let them through."""
    import numpy as np

    said = []
    for lr in (torch.tensor(0.01), np.float32(0.01)):
        torch.manual_seed(0)
        model = zeroshard.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), stage=3)
        opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=lr)
        model(torch.randn(2, 4)).square().mean().backward()
        assert opt.step()
        model(torch.randn(2, 4)).square().mean().backward()
        if dist.get_rank() == 1:
            g = opt.param_groups[0]
            g["lr"] = g["lr"].fill_(0.02) if torch.is_tensor(lr) else np.float32(0.02)
        with pytest.raises(ValueError) as info:
            opt.step()
        said.append(str(info.value))
    return said


def test_tensor_and_numpy_settings_that_differ_between_ranks_are_refused(workers2):
    for tensor, numpy in workers2.run(_tensor_lr_apart):
        assert "param group 0's 'lr' is 0.0099999" in tensor and "on rank 1" in tensor, tensor
        assert "'lr' is np.float32(0.01) on rank 0, np.float32(0.02) on rank 1" in numpy, numpy
