"""zeroshard.model_states.flat_param: the parameters a user holds.

At stages 0-2 they are views into a FlatParam's ``full`` buffer, refreshed from the FP32
masters after each step. Code between ``step()`` and the next forward (an EMA, a weight norm,
``nn.init`` under ``no_grad``) must see the stepped values, and what it writes must reach the
masters, in FP32 and in a narrower ``param_dtype`` alike. At stage 3 they are placeholders at
rest, and what is written while they are held gathered reaches the masters too.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard

WIDTH = 512  # large enough that a refresh still in flight after step() is seen


def _setup(stage: int, precision: str, *, policy=None, config=None, **optimizer_kw):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(6)])
    model = zeroshard.shard(
        model, stage=stage, mixed_precision=precision, wrap=policy, config=config
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-2, **optimizer_kw)
    return model, opt


def _step(model, opt, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    model(torch.randn(4, WIDTH, generator=gen)).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def _masters(model) -> dict[str, torch.Tensor]:
    return zeroshard.full_state_dict(model, rank0_only=False)


def _stale_reads_after_step(stage: int, precision: str) -> int:
    """How many parameters, read right after ``step()``, differ from the (cast) masters."""
    model, opt = _setup(stage, precision)
    stale = 0
    for step in range(3):
        _step(model, opt, step)
        read = {n: p.detach().clone() for n, p in model.named_parameters()}
        masters = _masters(model)
        stale += sum(not torch.equal(v, masters[n].to(v.dtype)) for n, v in read.items())
    return stale


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_parameters_read_right_after_a_step_hold_its_result(workers2, stage, precision):
    assert workers2.run(_stale_reads_after_step, stage, precision) == [0, 0]


def _edit(model) -> None:
    """Writes a user makes at rest: ``nn.init`` on a weight, in-place arithmetic, one row."""
    with torch.no_grad():
        nn.init.zeros_(model[1].bias)
        model[2].weight.mul_(0.5)
        model[4].weight[3].fill_(0.25)


def _writes_at_rest(stage: int, precision: str, step_in_backward: bool) -> dict:
    """Edits made outside ``summon_full_params`` train on exactly as the same edits made inside
    it (where they are written back to the masters, the documented way), and are in the
    masters that state dicts give."""
    kw = {"step_in_backward": True} if step_in_backward else {}
    runs = []
    for inside in (False, True):
        model, opt = _setup(stage, precision, **kw)
        _step(model, opt, 0)
        if inside:
            with zeroshard.summon_full_params(model):
                _edit(model)
        else:
            _edit(model)
        edited = {n: p.detach().clone() for n, p in model.named_parameters()}
        masters = _masters(model)  # the state dict sees the edit before any step
        seen = all(torch.equal(masters[n].to(v.dtype), v) for n, v in edited.items())
        for step in (1, 2):
            _step(model, opt, step)
        runs.append((seen, _masters(model)))
    (seen_out, out), (seen_in, inside) = runs
    return {
        "seen": seen_out and seen_in,
        "same": all(torch.equal(out[k], inside[k]) for k in out),
        "edit_kept": bool(out["1.bias"].abs().max() < 0.1),  # not refreshed back to the old one
    }


@pytest.mark.parametrize(
    "stage,precision,step_in_backward",
    [
        (0, "bf16", False),
        (1, "bf16", False),
        (2, "bf16", False),
        (2, "fp16", False),
        (2, "bf16", True),
        (1, "fp32", False),
    ],
)
def test_writes_to_parameters_at_rest_reach_the_masters(
    workers2, stage, precision, step_in_backward
):
    for result in workers2.run(_writes_at_rest, stage, precision, step_in_backward):
        assert result == {"seen": True, "same": True, "edit_kept": True}


def _fill_at_rest(where: str, how: str) -> dict:
    """Stage 3: a fill-like write to a parameter at rest (it succeeds on the stride-0
    placeholder) is an error at the next forward, summon or state dict, and the placeholders
    read NaN again after it. Through ``.data`` (``p.data.zero_()``: no version bump) the write
    was lost without a word, and the placeholder it wrote was every model's: another model's
    parameters at rest read 0.5 instead of NaN."""
    model, opt = _setup(3, "fp32")
    other, _ = _setup(3, "fp32")
    _step(model, opt, 0)
    with torch.no_grad():
        if how == "init":
            nn.init.constant_(model[2].weight, 0.5)
        else:
            model[2].weight.data.fill_(0.5)
    out = {"other_nan": bool(other[2].weight.isnan().all())}
    try:
        if where == "forward":
            model(torch.randn(2, WIDTH))
        elif where == "summon":
            with zeroshard.summon_full_params(model):
                pass
        else:
            model.state_dict()
        out["error"] = ""
    except ValueError as exc:
        out["error"] = str(exc)
    out["nan_again"] = bool(model[2].weight.isnan().all())
    _step(model, opt, 1)  # and training goes on
    return out


@pytest.mark.parametrize("how", ["init", "data"])
@pytest.mark.parametrize("where", ["forward", "summon", "state_dict"])
def test_a_write_to_a_parameter_at_rest_at_stage_3_is_an_error(workers2, where, how):
    said = "2.weight" if how == "init" else "2.weight (through .data)"
    for out in workers2.run(_fill_at_rest, where, how):
        assert out["error"].startswith(f"{said} was written while at rest"), out
        assert "summon_full_params" in out["error"] and out["nan_again"], out
        assert out["other_nan"], out


def _cast_after_shard(stage: int) -> dict:
    """``model.half()`` after shard is an error; the parameters get the engine's memory back,
    so the model trains on afterwards (it stayed broken: every call, ``load_state_dict``
    included, raised the same error; then each call gave one unit's back, one per call)."""
    model, opt = _setup(stage, "fp32", policy=zeroshard.wrap.by_class(nn.Linear))
    before = _masters(model)
    model.half()  # the module's parameters no longer view the engine's buffers
    try:
        model(torch.randn(2, WIDTH).half())
        said = ""
    except ValueError as exc:
        said = str(exc)
    model(torch.randn(2, WIDTH))  # every unit's parameters given back at once (one per call)
    model.load_state_dict(before)
    _step(model, opt, 0)
    return {"said": said, "trained": bool(torch.isfinite(_masters(model)["0.weight"]).all())}


def _moved_after_shard(stage: int, swap: bool) -> dict:
    """``model.to("meta")`` after shard is an error naming the move, and the model trains on as
    an unmoved twin: it raised "not the parameter zeroshard.shard() flattened there" (with a
    warning of 12 parameters added), or under torch's ``swap_module_params_on_conversion``
    "Cannot copy out of meta tensor" / "incompatible tensor type" from inside the engine, and
    every later call (a state dict too) failed the same way."""
    model, opt = _setup(stage, "fp32", policy=zeroshard.wrap.by_class(nn.Linear))
    twin, twin_opt = _setup(stage, "fp32", policy=zeroshard.wrap.by_class(nn.Linear))
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        model.to("meta")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model(torch.randn(2, WIDTH))
            said = ""
        except ValueError as exc:
            said = str(exc)
    for m, o in ((model, opt), (twin, twin_opt)):
        _step(m, o, 0)
    a, b = _masters(model), _masters(twin)
    return {
        "said": said,
        "warned": [str(w.message)[:60] for w in caught],
        "same": all(torch.equal(a[k], b[k]) for k in b),
    }


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_move_after_shard_is_an_error_and_the_model_trains_on(workers2, stage, swap):
    for r in workers2.run(_moved_after_shard, stage, swap):
        assert r["said"].startswith("0.weight was moved to meta after zeroshard.shard()"), r
        assert r["warned"] == [] and r["same"], r


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_cast_after_shard_is_an_error_naming_mixed_precision(workers2, stage):
    for r in workers2.run(_cast_after_shard, stage):
        assert r["said"].startswith("0.weight's data was replaced after zeroshard.shard()"), r
        assert "mixed_precision='bf16'" in r["said"] and r["trained"], r


def _replaced_in_place_of(stage: int) -> float:
    """Data replaced in the parameters' own dtype and shape (``model.half().float()``, then
    ``vector_to_parameters``) is taken as written values, as torch and FSDP2 take them: the
    largest difference from plain torch doing the same, after a step."""
    model, opt = _setup(stage, "fp32")
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(6)])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with zeroshard.summon_full_params(model) if stage == 3 else contextlib.nullcontext():
        for m in (model, ref):
            m.half().float()  # values rounded to FP16
            vec = torch.nn.utils.parameters_to_vector(m.parameters())
            torch.nn.utils.vector_to_parameters(vec * 0.5, m.parameters())
    world = dist.get_world_size()
    x = torch.randn(4 * world, WIDTH, generator=torch.Generator().manual_seed(7))
    mine = x.chunk(world)[dist.get_rank()]
    model(mine).square().mean().backward()
    ref(x).square().mean().backward()
    opt.step(), ref_opt.step()
    full = _masters(model)
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_data_replaced_in_its_own_dtype_is_taken_as_written(workers2, stage):
    for worst in workers2.run(_replaced_in_place_of, stage):
        assert worst < 1e-5, worst


def _swapped_data(stage: int, units: str, summoned: bool, alone: bool = False) -> bool:
    """Two parameters' data swapped (``a.data, b.data = b.data, a.data``), each the other's
    memory in the engine: both must end up swapped (the second copied from the first's memory
    after it was overwritten: both held one of them), also when the two are in different
    units with buffers of their own (``units="apart"``: one bucket each), read in turn; also
    when one of them is then called on its own (``alone``), which took its own unit's in."""
    apart = units == "apart"
    policy, config = ([nn.Linear], zeroshard.ShardConfig(bucket_bytes=1)) if apart else (None, None)
    model, _ = _setup(stage, "fp32", policy=policy, config=config)
    before = _masters(model)
    with zeroshard.summon_full_params(model) if summoned else contextlib.nullcontext():
        a, b = model[1].weight, model[2].weight
        a.data, b.data = b.data, a.data
    if alone:
        model[2](torch.randn(2, WIDTH))
    full = _masters(model)
    return torch.equal(full["1.weight"], before["2.weight"]) and torch.equal(
        full["2.weight"], before["1.weight"]
    )


@pytest.mark.parametrize(
    "stage, units, summoned, alone",
    [
        (2, "one", False, False),
        (0, "apart", False, False),
        (2, "apart", False, False),
        (3, "apart", True, False),
        (0, "apart", False, True),
        (2, "apart", False, True),
    ],
)
def test_parameters_swapping_data_are_swapped(workers2, stage, units, summoned, alone):
    assert workers2.run(_swapped_data, stage, units, summoned, alone) == [True, True]


def _replaced_inside_summon_without_writeback(stage: int, nested: bool) -> bool:
    """Data replaced (``p.data = t``, ``p.set_(t)``) inside ``summon_full_params(writeback=
    False)`` is undone on exit, as writes in place are (at stages 0-2, and at stage 3 inside a
    summon that writes back, the parameter kept the new data, which the next forward took in
    as a write)."""
    model, _ = _setup(stage, "fp32")
    before = _masters(model)
    outer = zeroshard.summon_full_params(model) if nested else contextlib.nullcontext()
    with outer, zeroshard.summon_full_params(model, writeback=False):
        model[0].weight.data = torch.zeros(WIDTH, WIDTH)
        with torch.no_grad():
            model[1].bias.set_(torch.ones(WIDTH))
    model(torch.randn(2, WIDTH))
    after = _masters(model)
    return all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("nested", [False, True], ids=["alone", "nested"])
def test_data_replaced_inside_a_summon_without_writeback_is_undone(workers2, stage, nested):
    assert workers2.run(_replaced_inside_summon_without_writeback, stage, nested) == [True, True]


class _Momentum(nn.Module):
    """MoCo's key encoder: a frozen copy of ``q`` moved towards it inside every forward by
    replacing its data (``pk.data = pk.data * m + pq.data * (1 - m)``, facebookresearch/moco)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)
        self.k.load_state_dict(self.q.state_dict())
        self.k.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for pq, pk in zip(self.q.parameters(), self.k.parameters()):
                pk.data = pk.data * 0.5 + pq.data * 0.5
        return (self.q(x) * self.k(x)).sum()


def _momentum_in_forward(stage: int, wrap) -> float | str:
    """Largest difference from torch after 3 steps, or the error."""
    torch.manual_seed(0)
    ref = _Momentum()
    torch.manual_seed(0)
    model = zeroshard.shard(_Momentum(), stage=stage, wrap=wrap)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    try:
        for step in range(3):
            x = torch.full((2, 4), step + 1.0)
            ref(x).backward(), ref_opt.step(), ref_opt.zero_grad()
            opt.backward(model(x)), opt.step(), opt.zero_grad()
    except ValueError as exc:
        return str(exc)
    full = zeroshard.full_state_dict(model, rank0_only=False)
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_data_replaced_inside_a_forward_is_kept(workers2, stage):
    """At stage 3 the root's gathered parameters were given their views back at its reshard
    after the backward, and the replaced data was lost without a word (k off by 0.41)."""
    for worst in workers2.run(_momentum_in_forward, stage, None):
        assert worst < 1e-6, worst


def test_data_replaced_at_rest_before_its_gather_is_an_error(workers2):
    """Units at rest when their data is replaced (their values are NaN placeholders there): the
    gather overwrote the replacement without a word."""
    for said in workers2.run(_momentum_in_forward, 3, nn.Linear):
        assert isinstance(said, str) and "while its unit was at rest (stage 3" in said, said
        assert "summon_full_params" in said


def _resize_after_shard(stage: int) -> str:
    model, _ = _setup(stage, "fp32")
    with torch.no_grad():  # as resize_token_embeddings does: new data of another shape
        model[0].weight.data = torch.zeros(WIDTH + 3, WIDTH)
    try:
        model(torch.randn(2, WIDTH))
    except ValueError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("stage", [0, 3])
def test_a_parameter_resized_after_shard_is_an_error_saying_so(workers2, stage):
    for said in workers2.run(_resize_after_shard, stage):
        assert said.startswith("0.weight was changed after zeroshard.shard() (its shape"), said
        assert "change the model before sharding it" in said


def _summon_without_writeback_nested(stage: int) -> dict:
    """An inner ``summon_full_params(writeback=False)`` undoes its writes also inside an outer
    summon (at stage 3 the outer one keeps units gathered and would write them back); a step
    inside it is refused (undo it or not: ambiguous)."""
    model, opt = _setup(stage, "fp32")
    before = _masters(model)
    outer = zeroshard.summon_full_params(model)
    inner = zeroshard.summon_full_params(model, writeback=False)
    with outer, inner, torch.no_grad():
        model[0].weight.add_(1.0)
    after = _masters(model)
    model(torch.randn(2, WIDTH)).square().mean().backward()
    refused = []
    for inside in (opt.step, lambda: model.load_state_dict(before)):
        try:
            with zeroshard.summon_full_params(model, writeback=False):
                inside()
        except ValueError as exc:
            refused.append(str(exc))
    return {"undone": all(torch.equal(before[k], after[k]) for k in before), "refused": refused}


@pytest.mark.parametrize("stage", [0, 3])
def test_writes_inside_an_inner_summon_without_writeback_are_undone(workers2, stage):
    for out in workers2.run(_summon_without_writeback_nested, stage):
        assert out["undone"], out
        step, load = out["refused"]
        assert step.startswith("optimizer.step() inside summon_full_params"), out
        assert load.startswith("load_state_dict inside summon_full_params"), out


def _summon_with_writeback_inside_one_without(stage: int, precision: str) -> float:
    """Writes inside ``summon_full_params(writeback=False)``, then a helper's own summon
    (``writeback=True``) running a forward: its writes stay visible inside the outer level,
    whose exit undoes everything. The inner exit
    wrote them into the masters at stage 3 (0.1 off), and at stages 0-2 in BF16 the forward's
    adoption of writes did (and rounded the masters to BF16)."""
    model, _ = _setup(stage, precision, policy=zeroshard.wrap.by_class(nn.Linear))
    before = _masters(model)
    with zeroshard.summon_full_params(model, writeback=False):
        with torch.no_grad():
            model[1].weight.add_(0.1)
        with zeroshard.summon_full_params(model), torch.no_grad():
            model[2].bias.fill_(7.0)
            model(torch.randn(2, WIDTH))
        visible = bool((model[2].bias == 7.0).all())  # until the outer level's exit
    after = _masters(model)
    off = max((after[k] - v).abs().max().item() for k, v in before.items())
    return off if visible else float("inf")


@pytest.mark.parametrize("stage, precision", [(0, "bf16"), (2, "bf16"), (3, "fp32"), (3, "bf16")])
def test_a_summon_inside_one_without_writeback_writes_nothing_back(workers2, stage, precision):
    assert workers2.run(_summon_with_writeback_inside_one_without, stage, precision) == [0.0, 0.0]


def _named_and_unsharded_optimizers() -> dict:
    """``zeroshard.optimizer`` takes ``named_parameters()`` as torch.optim does; a backward at
    stage 2 with no zeroshard optimizer on the model (a torch one over ``parameters()`` would
    see no gradient) warns."""
    torch.manual_seed(0)
    model = zeroshard.shard(nn.Sequential(nn.Linear(WIDTH, WIDTH)), stage=2)
    x = torch.randn(2, WIDTH, requires_grad=True)
    with warnings.catch_warnings():  # a gradient of the input alone (saliency, FGSM): silent
        warnings.simplefilter("error")
        torch.autograd.grad(model(x).square().mean(), x)
    with pytest.warns(UserWarning, match="the model has no zeroshard.optimizer"):
        model(torch.randn(2, WIDTH)).square().mean().backward()
    opt = zeroshard.optimizer(model, torch.optim.SGD, model.named_parameters(), lr=0.1)
    first = _masters(model)["0.weight"].clone()
    _step(model, opt, 0)
    try:
        opt.state[model[0].weight]  # keyed by the rank's pieces: an error that says where to look
        said = ""
    except KeyError as exc:
        said = str(exc)
    return {
        "trained": not torch.equal(first, _masters(model)["0.weight"]),
        "state_by_param": "zeroshard.optimizer_state_dict(opt)" in said,
    }


def test_named_parameters_and_the_missing_optimizer_warning(workers2):
    expected = {"trained": True, "state_by_param": True}
    assert workers2.run(_named_and_unsharded_optimizers) == [expected] * 2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class _Net(nn.Module):
    """A root (``inp``, ``head``) around two block units."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(4, 8), nn.Linear(8, 2)
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])

    def forward(self, x):
        return self.head(self.blocks[1](self.blocks[0](self.inp(x))))


def _net(stage: int, precision: str, **optimizer_kw):
    torch.manual_seed(0)
    model = zeroshard.shard(
        _Net(), stage=stage, wrap=zeroshard.wrap.by_class(_Block), mixed_precision=precision
    )
    return model, zeroshard.optimizer(model, torch.optim.SGD, lr=0.0, **optimizer_kw)


def _by_parts(model, x):
    """The loop over submodules of a user who never calls the root (which would cast the
    inputs to ``param_dtype``)."""
    h = model.inp(x.to(model.inp.weight.dtype))
    for block in model.blocks:
        h = block(h)
    return model.head(h)


def _writes_kept(stage: int, precision: str, sib: bool, where: str) -> list[float]:
    """A write under ``no_grad`` to parameters that are held (the root at stage 3 between a
    forward and its backward; any parameter at stages 1-2), ``where``: "between" a forward and
    its backward, or "before" a forward of submodules called on their own (no root forward).
    With lr 0 the step changes nothing, so each written bias must come out written: it was
    lost at stage 3 (the root resharded after backward without the write) and with
    ``step_in_backward`` at stages 1-2 in a narrower dtype (the refresh after the in-backward
    update overwrote it). Returns each written bias' change (1.0 expected)."""
    model, opt = _net(stage, precision, step_in_backward=sib)
    written = [model.head.bias] + ([model.blocks[1].fc.bias] if stage < 3 else [])
    with zeroshard.summon_full_params(model):
        before = [p.detach().float().clone() for p in written]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    if where == "before":
        with torch.no_grad():
            for p in written:
                p.add_(1.0)
    loss = (model(x) if where == "between" else _by_parts(model, x)).float().square().mean()
    if where == "between":
        with torch.no_grad():
            for p in written:
                p.add_(1.0)
    opt.backward(loss)
    opt.step()
    with zeroshard.summon_full_params(model):
        return [(p.detach().float() - b).mean().item() for p, b in zip(written, before)]


# (at stage 3 the root is at rest before a forward: a write there is an error, tested above)
@pytest.mark.parametrize(
    "stage, precision, sib, where",
    [(3, "fp32", False, "between"), (3, "bf16", False, "between"), (3, "bf16", True, "between"),
     (2, "bf16", True, "between"), (2, "bf16", True, "before"), (2, "fp32", True, "before"),
     (1, "bf16", False, "between"), (1, "bf16", False, "before")],
)  # fmt: skip
def test_writes_to_held_parameters_survive_the_step(workers2, stage, precision, sib, where):
    for changes in workers2.run(_writes_kept, stage, precision, sib, where):
        assert all(abs(c - 1.0) < 1e-2 for c in changes), changes


def _grads_of_parameters(stage: int) -> dict:
    """``torch.autograd.grad`` and ``backward(inputs=...)`` with respect to parameters at stage 3
    in BF16: a parameter at rest was an FP32 placeholder, and each change of its dtype through
    ``.data`` dropped its gradient accumulator, so autograd no longer found it in the forward's
    graph ("appears to not have been used in the graph"; with ``inputs=`` nothing trained).
    Returns the gradient of a block's bias and the parameters after a step on one block's
    gradients only, to compare with stage 2."""
    model, opt = _net(stage, "bf16")
    opt.param_groups[0]["lr"] = 0.5
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = {"dtype at rest": str(model.blocks[0].fc.bias.dtype)}
    (grad,) = torch.autograd.grad(model(x).float().square().mean(), model.blocks[0].fc.bias)
    out["grad"] = grad.float()
    opt.backward(model(x).float().square().mean(), inputs=list(model.blocks[1].parameters()))
    opt.step()
    out["params"] = zeroshard.full_state_dict(model, rank0_only=False)
    return out


def test_gradients_with_respect_to_parameters_at_stage_3_in_bf16(workers2):
    stage2 = workers2.run(_grads_of_parameters, 2)
    for ours, ref in zip(workers2.run(_grads_of_parameters, 3), stage2):
        assert ours["dtype at rest"] == "torch.bfloat16", ours["dtype at rest"]
        assert torch.equal(ours["grad"], ref["grad"])
        moved = [k for k, v in ours["params"].items() if not torch.equal(v, _initial()[k])]
        assert sorted(moved) == ["blocks.1.fc.bias", "blocks.1.fc.weight"], moved
        for k, v in ours["params"].items():
            assert torch.equal(v, ref["params"][k]), k


def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return _Net().state_dict()


def _unfrozen_by_parts(stage: int) -> str:
    """A parameter unfrozen after ``shard()`` in a loop that calls submodules only: refused as
    through the root (it never trained, silently)."""
    torch.manual_seed(0)
    net = _Net()
    net.blocks[1].requires_grad_(False)
    model = zeroshard.shard(net, stage=stage, wrap=zeroshard.wrap.by_class(_Block))
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    model.blocks[1].requires_grad_(True)
    try:
        opt.backward(_by_parts(model, torch.randn(3, 4)).square().mean())
    except ValueError as exc:
        return str(exc)
    return "trained"


@pytest.mark.parametrize("stage", [1, 3])
def test_a_parameter_unfrozen_after_shard_is_refused_in_a_loop_over_submodules(workers2, stage):
    for message in workers2.run(_unfrozen_by_parts, stage):
        assert "requires_grad changed after zeroshard.shard(): blocks.1.fc.weight" in message


def _gather_interrupted(stage: int) -> dict:
    """Rank 0's synchronous gather of unit ``f`` raises in its wait (a Ctrl-C while rank 1 is
    late), then it gathers the next unit ``g``, of the same size, from the pool: ``f`` keeps its
    memory (its receives are posted into it) instead of handing it to ``g``, where rank 1's late
    shard of ``f`` landed; a later wait finishes ``f``'s gather with the right values."""
    import time
    from unittest import mock

    import zeroshard.collectives as C

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    model = zeroshard.shard(model, stage=stage, wrap=zeroshard.wrap.by_class(nn.Linear))
    f, g = [x for x in zeroshard.engine_of(model).flat_params if x.partition.parameters][:2]
    assert f.padded_numel == g.padded_numel
    kept = None
    if dist.get_rank() == 0:
        real, calls = C._Exchange.wait, []

        def interrupted(exchange):
            calls.append(exchange)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return real(exchange)

        with mock.patch.object(C._Exchange, "wait", interrupted):
            with pytest.raises(KeyboardInterrupt):
                f.unshard(async_op=False)
            kept = f.full.untyped_storage().nbytes()
            g.unshard(async_op=False)
            assert g.full.data_ptr() != f.full.data_ptr()
            f.wait_unshard()
    else:
        time.sleep(0.3)
        f.unshard(async_op=False)
        f.wait_unshard()
        g.unshard(async_op=False)
    g.wait_unshard()
    out = {"kept": kept, "nbytes": f.full.numel() * f.full.element_size()}
    out.update(f=f.full.clone(), g=g.full.clone())
    for x in (f, g):
        x.reshard()
    return out


def test_a_gather_whose_wait_raised_keeps_its_memory_until_waited(workers2):
    first, second = workers2.run(_gather_interrupted, 3)
    assert first["kept"] == first["nbytes"] > 0, first["kept"]
    assert torch.equal(first["f"], second["f"]) and torch.equal(first["g"], second["g"])


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + x.T) / 2


def _replaced_at_rest() -> dict:
    """Stage 3, data replaced at rest: FSDP2's meta-init recipe (``to_empty``, then an init)
    and a parametrization removed outside ``summon_full_params``; the errors named neither
    (they spoke of dtypes), and the parametrization's left the module on its raw original."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    parametrize.register_parametrization(model[1], "weight", _Symmetric())
    model = zeroshard.shard(model, stage=3, wrap=zeroshard.wrap.by_class(nn.Linear))
    x = torch.randn(2, 4)
    before = model(x)
    said = {}
    model.to_empty(device="cpu")
    try:
        model(x)
    except ValueError as exc:
        said["to_empty"] = str(exc)
    said["undone"] = torch.equal(model(x), before)
    parametrize.remove_parametrizations(model[1], "weight", leave_parametrized=True)
    try:
        model(x)
    except ValueError as exc:
        said["removed"] = str(exc)
    return said


def test_data_replaced_at_rest_names_what_replaces_it(workers2):
    for r in workers2.run(_replaced_at_rest):
        assert r["to_empty"].startswith("0.weight's data was replaced after zeroshard.shard() "), r
        assert "model.to_empty()" in r["to_empty"] and "param_init_fn" in r["to_empty"], r
        assert r["undone"], r
        assert r["removed"].startswith("1.parametrizations.weight.original's data was"), r
        assert "1 now holds the un-parametrized original" in r["removed"], r
