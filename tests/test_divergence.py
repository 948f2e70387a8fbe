"""``DivergenceGuard`` on a real sharded model and optimizer (one rank, in this process)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import zeroshard
from zeroshard.divergence import Diverged, DivergenceGuard
from zeroshard.models.gpt import GPT, PRESETS, Block


@pytest.fixture
def sharded():
    mesh = zeroshard.Mesh.from_env()  # a one-rank gloo group, no port
    torch.manual_seed(0)
    model = zeroshard.shard(GPT(PRESETS["nano"]), stage=3, wrap=zeroshard.wrap.by_class(Block))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    yield mesh, model, opt
    del model, opt
    dist.destroy_process_group()


def _step(model, opt, guard, step: int, *, poison: bool = False) -> bool:
    x = torch.randint(0, 256, (2, 16))
    loss = model(x, x)
    if poison:
        loss = loss * float("inf")
    opt.backward(loss)
    stepped = guard.step(step, loss.item())
    opt.zero_grad()
    return stepped


def test_consecutive_skips_then_divergence(sharded):
    _, model, opt = sharded
    guard = DivergenceGuard(opt, max_skipped_steps=3, num_skipped=5)
    assert _step(model, opt, guard, 1)
    assert not _step(model, opt, guard, 2, poison=True)
    assert _step(model, opt, guard, 3)  # a clean step resets the count
    assert not _step(model, opt, guard, 4, poison=True)
    assert not _step(model, opt, guard, 5, poison=True)
    with pytest.raises(Diverged, match=r"^diverged at step 6: 3 consecutive non-finite gradient"):
        _step(model, opt, guard, 6, poison=True)
    assert guard.num_skipped == 5 + 4  # the resumed run's, plus this run's


def test_non_finite_master_weight(sharded):
    _, model, opt = sharded
    guard = DivergenceGuard(opt, max_skipped_steps=10)
    guard.check_masters(0)  # finite: no error
    master = opt.sub_optimizers[-1].param_groups[0]["params"][0]  # an FP32 master shard
    master.view(-1)[0] = math.inf
    with pytest.raises(Diverged, match=r"^diverged at step 7: non-finite master weights"):
        guard.check_masters(7)


def test_non_finite_validation_loss(sharded):
    _, _, opt = sharded
    guard = DivergenceGuard(opt, max_skipped_steps=10)
    guard.check_validation(3, 2.5)
    with pytest.raises(Diverged, match=r"^diverged at step 3: validation loss inf"):
        guard.check_validation(3, math.inf)


def test_non_finite_before_any_update_names_other_causes(sharded):
    # It said "lower the learning rate" for a loss that was NaN before any update (at stage
    # 3, usually a parameter read outside its unit: its NaN placeholder at rest).
    _, model, opt = sharded
    guard = DivergenceGuard(opt, max_skipped_steps=2)
    with pytest.raises(Diverged, match="validation loss nan") as before:
        guard.check_validation(0, math.nan)
    assert "before any update, so not the learning rate" in str(before.value)
    assert "placeholder at rest" in str(before.value) and "--lr" not in str(before.value)
    assert not _step(model, opt, guard, 1, poison=True)
    with pytest.raises(Diverged, match="placeholder at rest"):
        _step(model, opt, guard, 2, poison=True)
    opt.zero_grad()  # (the raise came before _step's)
    guard.num_consecutive_skipped = 0
    assert _step(model, opt, guard, 3)  # once a step was taken: the learning rate again
    with pytest.raises(Diverged, match=r"\(--lr\)") as after:
        guard.check_validation(3, math.nan)
    assert "placeholder" not in str(after.value)
