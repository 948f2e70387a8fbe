"""Learning-rate schedules: warm-up, then cosine, linear or constant (pure arithmetic)."""

from __future__ import annotations

import math

import pytest

from zeroshard.schedule import SCHEDULES, lr_at


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_warmup_is_linear_to_the_peak(schedule):
    lrs = [
        lr_at(s, peak_lr=1.0, total_steps=100, warmup_steps=4, schedule=schedule) for s in range(5)
    ]
    assert lrs == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_linear_and_constant_after_warmup():
    kw = dict(peak_lr=2.0, total_steps=111, warmup_steps=10)
    # Halfway through the decay (step 60 of 10..110, the last): both at the midpoint.
    mid = 2.0 * (0.1 + 0.9 * 0.5)
    assert lr_at(60, schedule="cosine", **kw) == pytest.approx(mid)
    assert lr_at(60, schedule="linear", **kw) == pytest.approx(mid)
    # A quarter of the way: cosine is above linear (it decays slowly at first).
    quarter_cos = 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(35, schedule="cosine", **kw) == pytest.approx(quarter_cos)
    assert lr_at(35, schedule="linear", **kw) == pytest.approx(2.0 * (0.1 + 0.9 * 0.75))
    for schedule in ("cosine", "linear"):  # a tenth of the peak at the last step and after it
        assert lr_at(110, schedule=schedule, **kw) == pytest.approx(0.2)
        assert lr_at(500, schedule=schedule, **kw) == pytest.approx(0.2)
    assert {lr_at(s, schedule="constant", **kw) for s in range(10, 200, 7)} == {2.0}


def test_no_warmup_starts_at_the_peak_and_unknown_schedules_fail():
    assert lr_at(0, peak_lr=3.0, total_steps=10, schedule="cosine") == 3.0
    with pytest.raises(ValueError, match="choose one of cosine, linear, constant"):
        lr_at(0, peak_lr=1.0, total_steps=10, schedule="step")


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_a_warmup_that_ends_on_the_second_to_last_step(schedule):
    # The last step, right after the warm-up, stayed at the peak instead of reaching lr/10.
    lrs = [lr_at(s, peak_lr=1.0, total_steps=10, warmup_steps=9, schedule=schedule) for s in (8, 9)]
    assert lrs == [1.0, pytest.approx(0.1)]
    assert lr_at(0, peak_lr=1.0, total_steps=1, schedule=schedule) == 1.0  # one step: the peak
