"""Clipping by the global gradient norm (``zeroshard.model_states.clipping``): 2-rank gloo runs
against plain torch on the same batches."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard


def _nan_step_then_clean(stage: int) -> dict:
    """Rank 1's loss is NaN at step 1; every step clips. The reference (one process, the whole
    batch) skips step 1 itself: the sharded run must skip it on every rank and train on after
    it, step for step the same as the reference (25 elements: a padding element on 2 ranks,
    which a NaN clip coefficient must not leave NaN in a buffer kept across steps)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    taken = []
    for step in range(6):
        x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(step))
        loss = model(x[2 * rank : 2 * rank + 2]).pow(2).mean()
        if step == 1 and rank == 1:
            loss = loss * float("nan")
        opt.backward(loss)
        opt.clip_grad_norm(0.5)
        taken.append(opt.step())
        opt.zero_grad()
        if step != 1:
            ref(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            ref_opt.step()
        ref_opt.zero_grad()
    with zeroshard.summon_full_params(model):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"taken": taken, "diff": diff}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_nan_step_clipped_is_skipped_and_training_goes_on(workers2, stage):
    for r in workers2.run(_nan_step_then_clean, stage):
        assert r["taken"] == [True, False, True, True, True, True], r
        assert r["diff"] < 1e-6, r
