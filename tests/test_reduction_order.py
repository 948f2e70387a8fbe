"""The one order in which every rank issues its gradient reductions at stages 0-2: a bucket
ready early waits for those ahead of it, and after the first backward the order is rank 0's
order of it, on every rank (unit rules here; on 2 gloo ranks against unsharded training).
Per-rank routes at every stage: ``tests/test_engine_use.py``."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from parity_models import Cell
from torch import nn

import zeroshard
from zeroshard import wrap
from zeroshard.engine import ShardConfig
from zeroshard.model_states.reduction_order import ReductionOrder

LONE = SimpleNamespace(world_size=1, tp_size=1, device=torch.device("cpu"), group=None)


def test_a_bucket_ready_early_waits_for_those_ahead_of_it():
    order = ReductionOrder(["root", "a", "b", "c"])  # registered; the backward starts at c
    assert order.ready(["b"]) == []
    assert order.is_waiting("b")
    assert order.ready(["c"]) == ["c", "b"]
    assert not order.is_waiting("b")
    assert order.ready(["root"]) == []
    assert order.ready(["a"]) == ["a", "root"]
    order.end_backward(LONE)  # learned from this backward: b, c, root, a
    assert order.learned and order.order == ["b", "c", "root", "a"]
    assert order.ready(["b"]) == ["b"]  # now in turn
    order.forget()  # an interrupted backward: nothing waits, the next starts from the first
    assert order.ready(["b"]) == ["b"]


def test_buckets_no_backward_reached_come_last_in_the_learned_order():
    order = ReductionOrder(["root", "a", "b", "c"])
    order.ready(["b"])
    order.end_backward(LONE)
    assert order.order == ["b", "c", "a", "root"]
    order = ReductionOrder(["root", "a"])
    order.end_backward(LONE)  # a backward that reduced nothing (no_sync) teaches nothing
    assert not order.learned and order.order == ["a", "root"]


class _UNetLike(nn.Module):
    """Registered down, up, mid; run down, mid, up (diffusers' U-Net registers its middle
    block after its up blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList([Cell(), Cell()])
        self.up = nn.ModuleList([Cell(), Cell()])
        self.mid = Cell()
        self.head = nn.Linear(8, 1)

    def forward(self, x, skip_mid: bool = False):
        for cell in self.down:
            x = cell(x)
        if not skip_mid:
            x = self.mid(x)
        for cell in self.up:
            x = cell(x)
        return self.head(x)


def _learned_order(stage: int) -> dict:
    """Rank 1 skips the middle block in step 1 (a per-rank path), then both run alike: the
    order every rank takes is rank 0's of step 1, and in step 2 no bucket waits."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = _UNetLike()
    model = zeroshard.shard(
        copy.deepcopy(ref),
        stage=stage,
        wrap=wrap.by_class(Cell),
        config=ShardConfig(bucket_bytes=0),  # a bucket per unit
    )
    engine = zeroshard.engine_of(model)
    names = {b: b.flat.name for b in engine.buckets}
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    waited = []
    real_ready = engine.reduction_order.ready

    def ready(buckets):
        now = real_ready(buckets)
        waited.append(len(now) != len(buckets))
        return now

    engine.reduction_order.ready = ready
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(4, 8, generator=g)
        skips = [False, step == 0]  # per rank
        model(x[rank * 2 : rank * 2 + 2], skip_mid=skips[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        halves = [ref(x[r * 2 : r * 2 + 2], skip_mid=skips[r]).square().mean() for r in (0, 1)]
        (sum(halves) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 0:
            waited_in_step_1, waited[:] = any(waited), []
    with zeroshard.summon_full_params(model):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {
        "order": [names[b] for b in engine.reduction_order.order],
        "waited in step 1": waited_in_step_1,
        "waited in step 2": any(waited),
        "diff": diff,
    }


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_the_order_is_rank_0s_first_backward(workers2, stage):
    ranks = workers2.run(_learned_order, stage)
    want = ["up.1.lin", "up.0.lin", "mid.lin", "down.1.lin", "down.0.lin", "head"]  # root last
    for got in ranks:
        assert got["order"] == want, got
        assert got["waited in step 1"] and not got["waited in step 2"], got
        assert got["diff"] < 1e-5, got
