"""Stages 0-3 on real gloo ranks against single-process training computed in the same test."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from parity_models import batch, build, loss_of, param_groups

import zeroshard
from zeroshard.engine import ShardConfig

PER_RANK_BATCH = 4


def _parity(
    kind: str,
    stage: int,
    *,
    steps: int = 20,
    accum: int = 1,
    clip: float | None = None,
    config: ShardConfig | None = None,
    optim: str = "adamw",
) -> dict:
    """Train a sharded copy and an unsharded reference on the same global batches.

    The reference sees the whole global batch in one process; the sharded model sees this rank's
    rows, split into ``accum`` micro-batches. Returns the largest loss and parameter differences.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref, policy = build(kind)
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage, wrap=policy, config=config)
    if optim == "adamw":
        # lr 1e-3: Adam turns rounding noise in gradients that are zero in exact arithmetic
        # (the attention key bias) into steps of size lr, in any data-parallel implementation.
        make = lambda m: dict(params=param_groups(m, 0.1), lr=1e-3)  # noqa: E731
        cls = torch.optim.AdamW
    else:
        make = lambda m: dict(params=m.parameters(), lr=1e-2, momentum=0.9)  # noqa: E731
        cls = torch.optim.SGD
    opt = zeroshard.optimizer(model, cls, **make(model))
    ref_opt = cls(**make(ref))
    max_loss_diff = max_norm_diff = 0.0
    for step in range(steps):
        x, y = batch(kind, step, PER_RANK_BATCH * world)
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        xs, ys = x[mine].chunk(accum), y[mine].chunk(accum)
        total = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            loss = loss_of(kind, model, xm, ym) / accum
            opt.backward(loss, sync=i == accum - 1)
            total += loss.detach()
        dist.all_reduce(total)
        ref_loss = loss_of(kind, ref, x, y)
        ref_loss.backward()
        if clip is not None:
            norm = opt.clip_grad_norm(clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in ref.parameters() if p.requires_grad], clip
            )
            max_norm_diff = max(max_norm_diff, abs(norm.item() - ref_norm.item()))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        max_loss_diff = max(max_loss_diff, abs(total.item() / world - ref_loss.item()))
    with zeroshard.summon_full_params(model):
        param_diff = max(
            (a - b).abs().max().item() if a.numel() else 0.0
            for a, b in zip(model.parameters(), ref.parameters())
        )
    return {"loss": max_loss_diff, "param": param_diff, "norm": max_norm_diff}


def _check(results: list[dict], tol: float = 1e-5) -> None:
    for rank, r in enumerate(results):
        assert r["loss"] < tol and r["param"] < tol and r["norm"] < 1e-4, (rank, r)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["gpt", "frozen_mlp", "odd"])
def test_parity_two_ranks(workers2, kind, stage):
    _check(workers2.run(_parity, kind, stage))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_parity_four_ranks(workers4, stage):
    _check(workers4.run(_parity, "gpt", stage, steps=10))
