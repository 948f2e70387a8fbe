"""``zeroshard.collectives`` on gloo: large all-gathers run as in-place all-reduces (no
temporary as large as the output) and train exactly as gloo's own gathers."""

from __future__ import annotations

import threading
import time

import torch
from parity_models import batch, build

import zeroshard
import zeroshard.collectives as C
from zeroshard.residual_states.host_heap import resident_bytes


def _with_threshold(threshold: int, fn, *args):
    saved = C.GATHER_BY_ALL_REDUCE_BYTES
    C.GATHER_BY_ALL_REDUCE_BYTES = threshold  # the workers are reused: restored below
    try:
        return fn(*args)
    finally:
        C.GATHER_BY_ALL_REDUCE_BYTES = saved


def _train_stage3() -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model, policy = build("gpt")
    model = zeroshard.shard(model, stage=3, wrap=policy)
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-2)
    losses = []
    for step in range(3):
        x, y = batch("gpt", step, 2)
        loss = model(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with zeroshard.summon_full_params(model, writeback=False):
        return losses, [p.detach().clone() for p in model.parameters()]


def test_gathers_by_all_reduce_train_exactly_as_gloo_s_own(workers2):
    own = workers2.run(_with_threshold, 1 << 62, _train_stage3)
    by_all_reduce = workers2.run(_with_threshold, 0, _train_stage3)
    for (losses_a, params_a), (losses_b, params_b) in zip(own, by_all_reduce, strict=True):
        assert losses_a == losses_b
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))


def _gather_128_mib() -> dict:
    """Gather 128 MiB; the most the process grew meanwhile (resident pages sampled every ms:
    workers are reused, so their high-water mark may predate this test)."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    n = (128 << 20) // 4
    output = torch.full((n,), float("nan"))  # touched: its pages are resident before
    shard = torch.arange(n // world, dtype=torch.float32) + rank * (n // world)
    before, peak, done = resident_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes() or 0)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        C.all_gather(output, shard, group=None, ledger=C.Ledger(), async_op=False)
    finally:
        done.set()
        sampler.join()
    exact = torch.equal(output, torch.arange(n, dtype=torch.float32))
    return {"exact": exact, "grown": peak[0] - (before or 0)}


def test_a_large_gather_needs_no_temporary(workers2):
    for r in workers2.run(_gather_128_mib):
        assert r["exact"], r
        assert r["grown"] < 32 << 20, r  # gloo's own gather: +128 MiB
    for r in workers2.run(_with_threshold, 1 << 62, _gather_128_mib):
        assert r["exact"] and r["grown"] > 96 << 20, r  # what the test would see without it
