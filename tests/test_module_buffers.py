"""The model's buffers under the engine (``zeroshard.module_buffers``): dtypes kept through a
conversion of the whole model and through loads that assign."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zeroshard


def _bn_model(stage: int, precision: str | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    return zeroshard.shard(
        model, stage=stage, wrap=zeroshard.wrap.by_class(nn.Linear), mixed_precision=precision
    )


def _trained_twins(stage: int, x: torch.Tensor) -> tuple:
    """Two sharded BatchNorm models, alike, each trained one SGD step on ``x``; their
    optimizers."""
    model, twin = _bn_model(stage), _bn_model(stage)
    opts = [zeroshard.optimizer(m, torch.optim.SGD, lr=0.1) for m in (model, twin)]
    for m, opt in zip((model, twin), opts):
        opt.backward(m(x).sum())
        opt.step()
        opt.zero_grad()
    return model, twin, opts


def _converted_then_on(stage: int, convert: str) -> dict:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    model, twin, opts = _trained_twins(stage, x)
    getattr(model, convert)()
    with pytest.raises(ValueError) as raised:
        model(x)
    out = {"said": "cast back" in str(raised.value) and "1.running_mean" in str(raised.value)}
    losses = []
    for m, opt in zip((model, twin), opts):  # (train mode: batch statistics, the same)
        loss = m(x).sum()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out["losses"] = losses
    out["dtypes"] = sorted({str(b.dtype) for b in model.buffers() if b.is_floating_point()})
    model.eval(), twin.eval()
    with torch.no_grad():  # running statistics as the conversion rounded them
        out["eval_gap"] = (model(x) - twin(x)).abs().max().item()
    return out


@pytest.mark.parametrize("convert", ["half", "double"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_model_converted_after_shard_goes_on_with_its_buffers(workers2, stage, convert):
    # The parameters were given the engine's memory back, the buffers were left converted: the
    # next call raised torch's "expected scalar type Float but found Half" from BatchNorm, and
    # load_state_dict did not mend it.
    for r in workers2.run(_converted_then_on, stage, convert):
        assert r["said"], r
        assert r["dtypes"] == ["torch.float32"], r
        assert r["losses"][0] == pytest.approx(r["losses"][1], abs=1e-6), r
        assert r["eval_gap"] < 1e-2, r


def _moved_to_meta_then_filled(stage: int) -> dict:
    """``model.to("meta")`` after training a step: said, the buffers named (their values are
    gone); every call says so until they are loaded again, then training goes on as a twin's."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    model, twin, opts = _trained_twins(stage, x)
    saved = {n: b.clone() for n, b in model.named_buffers()}
    model.to("meta")
    said = []
    for _ in range(2):
        with pytest.raises(ValueError) as raised:
            model(x)
        said.append(str(raised.value))
    model.load_state_dict(saved, strict=False, assign=True)
    model.eval(), twin.eval()
    with torch.no_grad():
        gap = (model(x) - twin(x)).abs().max().item()
    return {"said": said, "gap": gap}


@pytest.mark.parametrize("stage", [0, 3])
def test_buffers_moved_to_meta_are_named_until_filled_again(workers2, stage):
    # The parameters were given back, the buffers were left on meta: every later call raised
    # torch's "Tensor on device meta is not on the expected device cpu!" from BatchNorm.
    for r in workers2.run(_moved_to_meta_then_filled, stage):
        first, then = r["said"]
        assert "weight was moved to meta after zeroshard.shard()" in first, first
        assert "buffers moved to meta have no values left (1.running_mean, " in first, first
        assert then.startswith("after model.to('meta') following zeroshard.shard(): buffers"), then
        assert r["gap"] == 0.0, r


def _assigned(stage: int) -> dict:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    model = _bn_model(stage, "bf16")
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    opt.backward(model(x).float().sum())
    opt.step()
    opt.zero_grad()
    model.eval()
    with torch.no_grad():
        before = model(x).float()
    state = zeroshard.full_state_dict(model, rank0_only=False)
    given = str(state["1.running_mean"].dtype)
    model.load_state_dict(state, assign=True)
    with torch.no_grad():
        after = model(x).float()
    return {
        "given": given,
        "dtype": str(model[1].running_mean.dtype),
        "same": torch.equal(before, after),
    }


@pytest.mark.parametrize("stage", [0, 3])
def test_a_load_that_assigns_keeps_the_buffers_compute_dtype(workers2, stage):
    # State dicts give BF16-cast buffers in their declared FP32; assign=True put those FP32
    # tensors in the model, and BatchNorm's next call raised "expected scalar type BFloat16".
    for r in workers2.run(_assigned, stage):
        assert r == {"given": "torch.float32", "dtype": "torch.bfloat16", "same": True}, r


def test_a_plain_load_leaves_buffers_changed_on_purpose(lone_process):
    # Casting back is for loads that assign: a plain one copies into the buffers as they are.
    model = _bn_model(3)
    model[1].running_var = model[1].running_var.double()
    model.load_state_dict(model.state_dict())
    assert model[1].running_var.dtype == torch.float64


class _Rotary(nn.Module):
    """A RoPE-like layer: FP32 frequencies kept non-persistent (mixed precision leaves them)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("freq", torch.tensor([1.0, 0.5, 0.25, 1 / 3]), persistent=False)

    def forward(self, x):
        return self.fc(x) * torch.cos(x.float() * self.freq).to(x.dtype)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_conversion_to_the_compute_dtype_is_said_and_undone(lone_process, stage):
    # model.to(bfloat16) under bf16 mixed precision left every parameter as it was: nothing
    # was said, and the FP32 buffers stayed rounded to BF16 for good (2.0e-3 off a twin).
    x = torch.randn(3, 4)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(zeroshard.shard(_Rotary(), stage=stage, mixed_precision="bf16"))
    converted, twin = models
    converted.to(torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"buffers were converted .*freq \(bfloat16, was float32\)"
    ):
        converted(x)
    assert converted.freq.dtype == torch.float32
    assert not torch.equal(converted.freq, twin.freq)  # (1/3 as BF16 rounded it)
    converted.freq.copy_(twin.freq)
    assert torch.equal(converted(x), twin(x))


class _Caching(nn.Module):
    """A module that keeps a cache buffer in the dtype it last computed in."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(4), persistent=False)

    def forward(self, x):
        self.cache = x.detach().double().mean(0)  # its own choice of dtype, assigned
        return self.fc(x) + self.cache.float()


def test_a_buffer_the_module_assigns_in_another_dtype_is_its_choice(lone_process):
    model = zeroshard.shard(_Caching(), stage=3)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    for _ in range(3):  # (not taken for a conversion to undo at the next call)
        opt.backward(model(torch.randn(2, 4)).sum())
        opt.step()
        opt.zero_grad()
    assert model.cache.dtype == torch.float64


class _Ema(nn.Module):
    """Keeps an FP32 running mean of its inputs by assignment (a VQ-VAE codebook's EMA), its
    buffer saved with the model (so ``buffer_dtype`` casts it at shard time)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        if self.training:
            self.ema = 0.9 * self.ema.float() + 0.1 * x.detach().float().mean(0)
        return self.fc(x)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_buffer_the_module_assigns_in_its_declared_dtype_is_its_choice(lone_process, stage):
    # Under bf16 (buffer_dtype BF16) an FP32 EMA the forward assigns was taken for a state
    # dict's entry, cast back at the step, which raised "buffers were converted" every time.
    torch.manual_seed(0)
    model = zeroshard.shard(_Ema(), stage=stage, mixed_precision="bf16")
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    ema = torch.zeros(4)  # the same statistic, kept by hand
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        opt.backward(model(x).float().sum())
        opt.step()
        opt.zero_grad()
        ema = 0.9 * ema + 0.1 * x.bfloat16().float().mean(0)  # (the root's inputs are cast)
    assert model.ema.dtype == torch.float32
    torch.testing.assert_close(model.ema, ema, rtol=0, atol=1e-6)
    assert model.state_dict()["ema"].dtype == torch.float32


class _SharedNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm_a = nn.BatchNorm1d(4)
        self.norm_b = self.norm_a  # one module under two names

    def forward(self, x):
        return self.norm_b(self.norm_a(self.fc(x)))


@pytest.mark.parametrize("stage", [0, 3])
def test_a_module_under_two_names_gives_its_buffers_in_their_dtype_under_both(lone_process, stage):
    # State dicts gave the BF16-cast statistics back in FP32 under the first name only.
    torch.manual_seed(0)
    plain = _SharedNorm()
    model = zeroshard.shard(copy.deepcopy(plain), stage=stage, mixed_precision="bf16")
    want = {k: v.dtype for k, v in plain.state_dict().items()}
    assert {k: v.dtype for k, v in model.state_dict().items()} == want
    full = zeroshard.full_state_dict(model, rank0_only=False)
    assert {k: v.dtype for k, v in full.items()} == want


class _Resizing(nn.Module):
    """Registers its buffer anew from the state dict's entry as it loads (to take another
    shape), before torch's copy."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("stat", torch.ones(4))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if prefix + "stat" in state_dict:
            self.register_buffer("stat", state_dict[prefix + "stat"].clone())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x):
        return self.fc(x) * self.stat


@pytest.mark.parametrize("stage", [0, 3])
def test_a_buffer_a_module_registers_anew_as_it_loads_keeps_the_compute_dtype(lone_process, stage):
    # The FP32 entry it registered was taken for the module's choice (the output went FP32),
    # or, before, for a conversion ("buffers were converted" at the next forward).
    model = zeroshard.shard(nn.Sequential(_Resizing()), stage=stage, mixed_precision="bf16")
    state = model.state_dict()
    assert state["0.stat"].dtype == torch.float32
    model.load_state_dict(state)
    assert model[0].stat.dtype == torch.bfloat16
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16
