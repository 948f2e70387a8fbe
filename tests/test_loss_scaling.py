"""Loss scaling: the scalers' rules in one process, then inf/NaN gradients on 2 gloo ranks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
from parity_models import batch, build, loss_of

import zeroshard
from zeroshard.loss_scaling import DynamicLossScaler, LossScaler

# --------------------------------------------------------------------- scalers (one process)


def test_dynamic_scaler_halves_on_inf_and_doubles_after_growth_interval():
    s = DynamicLossScaler(growth_interval=3)
    assert s.scale == 2.0**16
    s.update(True)
    assert s.scale == 2.0**15 and s.num_skipped == 1
    for _ in range(2):
        s.update(False)
    assert s.scale == 2.0**15
    s.update(False)
    assert s.scale == 2.0**16


def test_hysteresis_tolerates_consecutive_overflows():
    s = DynamicLossScaler(init_scale=64.0, hysteresis=2)
    s.update(True)
    assert s.scale == 64.0  # skipped, not lowered yet
    s.update(False)  # a clean step restores the count
    s.update(True)
    assert s.scale == 64.0
    s.update(True)
    assert s.scale == 32.0


def test_minimum_scale_is_a_clear_error():
    s = DynamicLossScaler(init_scale=4.0, min_scale=2.0)
    s.update(True)
    assert s.scale == 2.0
    with pytest.raises(FloatingPointError, match="minimum loss scale 2.0") as raised:
        s.update(True)
    # NaN from a stage-3 parameter read at rest halves the scale to its minimum too: the error
    # names that cause, not only divergence (it advised a lower learning rate alone).
    assert "NaN placeholder" in str(raised.value) and "2 step(s) skipped" in str(raised.value)


def test_scaler_state_round_trips_and_config_errors():
    s = DynamicLossScaler(growth_interval=5)
    s.update(True)
    s.update(False)
    t = DynamicLossScaler(growth_interval=5)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    inf = float("inf")  # (accepted: every gradient inf, every step skipped)
    for bad in (
        dict(min_scale=0.0),
        dict(growth_factor=1.0),
        dict(growth_interval=0),
        dict(init_scale=inf, min_scale=inf, max_scale=inf),
        dict(max_scale=inf),
    ):
        with pytest.raises(ValueError):
            DynamicLossScaler(**bad)
    with pytest.raises(ValueError):
        LossScaler(scale=float("inf"))


@pytest.mark.parametrize(
    "bad", [dict(growth_interval=2.5), dict(growth_interval=True), dict(hysteresis=1.5),
            dict(init_scale="1024"), dict(backoff_factor=None)],
)  # fmt: skip
def test_a_count_that_is_not_an_int_is_refused_as_torch_s_grad_scaler_refuses_it(bad):
    # growth_interval=2.5 acted as 3, True as 1, hysteresis=1.5 as 2 (and was saved as 1.5).
    name = next(iter(bad))
    with pytest.raises(TypeError, match=name):
        DynamicLossScaler(**bad)
    assert DynamicLossScaler(growth_interval=np.int64(3), init_scale=np.float32(8)).scale == 8


def test_a_scaler_of_another_kind_keeps_its_own_scale():
    """Resuming an FP32/BF16 run in FP16 (or the reverse): the skipped-step count carries
    over, the scale does not (a static 1.0 would leave FP16 at its minimum)."""
    static = LossScaler()
    static.update(True)
    dynamic = DynamicLossScaler(init_scale=2.0**16)
    dynamic.load_state_dict(static.state_dict())
    assert dynamic.scale == 2.0**16 and dynamic.num_skipped == 1
    dynamic.update(True)
    fresh = LossScaler()
    fresh.load_state_dict(dynamic.state_dict())
    assert fresh.scale == 1.0 and fresh.num_skipped == 2
    old = {"scale": 1.0, "num_skipped": 0}  # saved before states named their kind
    dynamic.load_state_dict(old)
    assert dynamic.scale == 2.0**15  # halved by its own overflow above, not set to 1.0


def test_a_grad_scaler_state_is_read_as_a_dynamic_scalers():
    """Moving an AMP run to zeroshard: ``torch.amp.GradScaler``'s state gives its scale, clean
    steps and settings to a ``DynamicLossScaler`` (it was ignored: the scale stayed 65536), and
    not to a static scaler (which took 1024 as a fixed scale)."""
    amp = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    state = amp.state_dict()
    state["_growth_tracker"] = 3
    dynamic = DynamicLossScaler()
    dynamic.load_state_dict(state)
    assert (dynamic.scale, dynamic.growth_interval) == (1024.0, 7)
    assert dynamic.state_dict()["clean_steps"] == 3
    static = LossScaler()
    static.load_state_dict(state)
    assert static.scale == 1.0


def test_the_scale_applied_to_an_fp16_loss_stays_within_fp16():
    """An FP16 loss's gradient is the scale itself, in FP16: 2**16 overflows (65504 at most)."""
    half, full = torch.ones((), dtype=torch.float16), torch.ones(())
    dynamic = DynamicLossScaler()
    assert dynamic.scale_for(full) == 2.0**16
    assert dynamic.scale_for(half) == dynamic.scale == 2.0**15
    assert (half.float() * dynamic.scale).half().isfinite()
    with pytest.raises(ValueError, match=r"overflows the gradient of a torch.float16 loss.*65504"):
        LossScaler(scale=2.0**16).scale_for(half)
    assert LossScaler(scale=40000.0).scale_for(half) == 40000.0  # within FP16's range
    assert LossScaler(scale=2.0**16).scale_for(full) == 2.0**16


@pytest.mark.parametrize("kind", [LossScaler, DynamicLossScaler])
def test_a_streak_of_skipped_steps_goes_on_after_a_load(kind):
    """Saved inside a streak and loaded into a fresh scaler, the streak went on from 0: no
    warning at the 10th skip in a row, and the error at the minimum scale said 7 where the
    uninterrupted run said 11."""

    def said(scaler, outcomes):
        out = []
        for found_inf in outcomes:
            scaler.update(found_inf)
            out.append(scaler.skip_warning())
        return out

    outcomes = [False] + [True] * 11
    whole = kind()
    want = said(whole, outcomes)
    first = kind()
    got = said(first, outcomes[:6])
    resumed = kind()
    resumed.load_state_dict(first.state_dict())
    got += said(resumed, outcomes[6:])
    assert got == want and resumed.state_dict() == whole.state_dict()
    assert resumed.num_skipped_in_a_row == 11


def test_a_scaler_of_lower_hysteresis_lowers_at_once_after_a_load():
    # The saved hysteresis_left (2) was taken as it was: the first overflow after the resume
    # did not lower the scale of a scaler made with hysteresis=1.
    saved = DynamicLossScaler(init_scale=1024.0, hysteresis=2)
    saved.update(False)
    resumed, fresh = (DynamicLossScaler(init_scale=1024.0, hysteresis=1) for _ in range(2))
    resumed.load_state_dict(saved.state_dict())
    resumed.update(True)
    fresh.update(True)
    assert resumed.scale == fresh.scale == 512.0


def test_a_static_scale_warns_when_skipped_steps_repeat():
    """fp32/bf16 skip inf/NaN steps with nothing to lower: a run that skipped every step (a
    stage-3 loss reading parameters at rest) trained nothing without a word. ``step()`` warns
    with ``skip_warning``'s line once it is complete."""
    s = LossScaler()
    said = []
    for found_inf in [True] * 12 + [False, True]:
        s.update(found_inf)
        said += [s.skip_warning()] if s.skip_warning() else []
    assert len(said) == 3, said  # the 1st and 10th in a row, then the 1st of a new streak
    assert "(1 step(s) in a row, 1 in all" in said[0] and "(10 step(s)" in said[1]
    assert "summon_full_params" in said[0] and "(1 step(s) in a row, 13 in all" in said[2]
    assert s.num_skipped == 13 and s.num_skipped_in_a_row == 1
    assert LossScaler(warn_on_skip=False).skip_warning() is None
    assert "static scale" not in said[0]
    large = LossScaler(scale=2.0**17)  # its FP16 gradients overflow at every step
    large.update(True)
    assert "a static scale of 131072 may itself overflow FP16" in large.skip_warning()
    dynamic = DynamicLossScaler()  # fp16: the lowered scale is the remedy, not a warning
    dynamic.update(True)
    assert dynamic.skip_warning() is None


# --------------------------------------------------------------------- 2 ranks


def _inject_inf(name: str, stage: int) -> dict:
    """Rank 1's gradient gets an inf in the last rank's shard only (before the reduction, so
    with sharded gradients only that rank sees it): every rank must skip."""
    torch.manual_seed(0)
    model, policy = build("gpt")
    model = zeroshard.shard(model, stage=stage, wrap=policy, mixed_precision=name)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3) if name == "fp16" else None
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3, loss_scaler=scaler)
    engine = zeroshard.engine_of(model)
    rank = dist.get_rank()

    def poison(g: torch.Tensor) -> torch.Tensor:
        g = g.clone().reshape(-1)
        g[-1] = float("inf")  # the flat buffer's last element: the last rank's shard
        return g.view(engine.buckets[-1].flat.slots[-1].shape)

    def step(i: int, inject: bool = False) -> bool:
        x, y = batch("gpt", i, 8)
        last = engine.buckets[-1].flat.slots[-1].param
        hook = last.register_hook(poison) if inject and rank == 1 else None
        opt.backward(loss_of("gpt", model, x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]))
        if hook is not None:
            hook.remove()
        stepped = opt.step()
        opt.zero_grad()
        return stepped

    assert step(0)  # optimizer states exist from here on
    masters = [f.master.clone() for f in engine.flat_params]
    states = copy.deepcopy([o.state_dict() for o in opt.sub_optimizers])
    with zeroshard.summon_full_params(model):
        params = [p.detach().clone() for p in model.parameters()]
    scale_before = opt.loss_scaler.scale
    skipped = not step(1, inject=True)
    out = {
        "skipped": skipped,
        "scale": (scale_before, opt.loss_scaler.scale),
        "masters_equal": all(torch.equal(a, f.master) for a, f in zip(masters, engine.flat_params)),
        "states_equal": all(
            _same_state(a, o.state_dict()) for a, o in zip(states, opt.sub_optimizers)
        ),
    }
    with zeroshard.summon_full_params(model):
        out["params_equal"] = all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    scales = [opt.loss_scaler.scale]
    for i in range(2, 8):  # clean steps: the scale grows every growth_interval (3) of them
        assert step(i)
        scales.append(opt.loss_scaler.scale)
    out["scales"] = scales
    # The loss scaler is saved apart from the optimizer's (FSDP2-format) state dict.
    saved = opt.state_dict()
    saved_scaler = opt.loss_scaler.state_dict()
    out["saved_scaler"] = saved_scaler
    opt.loss_scaler.scale = 1.0
    opt.load_state_dict(saved)
    opt.loss_scaler.load_state_dict(saved_scaler)
    out["restored_scale"] = opt.loss_scaler.scale
    return out


def _same_state(a: dict, b: dict) -> bool:
    for k, st in a["state"].items():
        for key, t in st.items():
            if not torch.equal(torch.as_tensor(t), torch.as_tensor(b["state"][k][key])):
                return False
    return True


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_inf_on_one_rank_skips_everywhere_and_halves_the_scale(workers2, stage):
    for r in workers2.run(_inject_inf, "fp16", stage):
        assert r["skipped"] and r["scale"] == (2.0**10, 2.0**9), r
        assert r["masters_equal"] and r["states_equal"] and r["params_equal"], r
        # 6 clean steps after the skip: doubled after the 3rd and the 6th.
        assert r["scales"] == [2.0**9, 2.0**9, 2.0**9, 2.0**10, 2.0**10, 2.0**10, 2.0**11], r
        assert r["saved_scaler"]["scale"] == r["restored_scale"] == 2.0**11, r


def test_bf16_also_skips_a_step_with_inf_gradients(workers2):
    for r in workers2.run(_inject_inf, "bf16", 3):
        assert r["skipped"] and r["scale"] == (1.0, 1.0), r
        assert r["masters_equal"] and r["states_equal"] and r["params_equal"], r
