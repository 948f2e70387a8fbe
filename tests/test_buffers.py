"""Constant buffers and flat RSS (ZeRO-R, issue 13 items 4 and 5): after the first step, training
makes the same large allocations every step, and the process does not grow.

Allocations come from ``torch.profiler`` (``profile_memory``), read from its raw event tree so
that those inside ops and on gloo's threads count too; each belongs to the step that began last
before it. Every step waits for the parameter all-gathers its optimizer step started (stages
1-2), so that they fall inside it. RSS is checked with glibc's defaults: the engine returns what
each step freed (``ShardConfig.trim_host_memory``). ``bench/bench_residual.py`` measures the
same at more sizes, and RSS over 500 steps.
"""

from __future__ import annotations

import bisect
import resource

import pytest
import torch
import torch.distributed as dist

import zeroshard
from zeroshard.engine import ShardConfig
from zeroshard.models.gpt import GPT, Block, GPTConfig

# Blocks of 3 MiB (the gathered units, their gradients); activations stay under 1 MiB.
CFG = GPTConfig(n_layer=2, n_embd=256, n_head=4, block_size=32, vocab_size=256)
BLOCK_BYTES = 4 * sum(p.numel() for p in Block(CFG).parameters())
MiB = 1 << 20
BATCH, SEQ = 4, 32


def _model(stage: int):
    torch.manual_seed(0)
    model = zeroshard.shard(
        GPT(CFG),
        stage=stage,
        wrap=zeroshard.wrap.by_class(Block),
        config=ShardConfig(checkpoint_every=1),
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    tok = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1), generator=gen)
    x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()

    def step() -> None:
        opt.backward(model(x, y))
        opt.step()
        opt.zero_grad()

    return step


def _walk(events):
    for e in events:
        yield e
        yield from _walk(e.children)


def _large_allocations(stage: int, steps: int = 6, min_bytes: int = MiB) -> list[list[int]]:
    """Per step, the sorted sizes of the allocations of at least ``min_bytes``."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    step = _model(stage)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i in range(steps):
            with record_function(f"buffers_step_{i}"):
                step()
    events = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    starts = sorted(e.start_time_ns for e in events if e.name.startswith("buffers_step_"))
    assert len(starts) == steps, starts
    sizes: list[list[int]] = [[] for _ in range(steps)]
    for e in events:
        if e.tag == _EventType.Allocation and e.extra_fields.alloc_size >= min_bytes:
            i = bisect.bisect_right(starts, e.start_time_ns) - 1
            if i >= 0:
                sizes[i].append(e.extra_fields.alloc_size)
    return [sorted(s) for s in sizes]


@pytest.mark.parametrize("stage", [2, 3])
def test_large_allocations_are_the_same_every_step(workers2, stage):
    for rank, sizes in enumerate(workers2.run(_large_allocations, stage)):
        later = sizes[1:]  # step 1 makes the optimizer states: once
        # Not vacuous: the profiler sees the gradient shards (half a block on 2 ranks), made
        # at every reduction (gathered units and collected gradients are pooled: none).
        assert later[0] and later[0][-1] >= BLOCK_BYTES // 2, (rank, later[0])
        for i, s in enumerate(later[1:], start=3):
            new = sorted(set(s) - set(later[0]))
            assert s == later[0], (
                f"rank {rank}, stage {stage}: step {i} allocates {len(s)} buffers >= 1 MiB "
                f"({sum(s)} B) against {len(later[0])} ({sum(later[0])} B) at step 2; "
                f"sizes new since step 2: {new}"
            )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _rss_growth(stage: int, warmup: int, steps: int) -> dict:
    step = _model(stage)
    for _ in range(warmup):
        step()
    at = _rss_bytes()
    samples = []
    for _ in range(steps):
        step()
        samples.append(_rss_bytes())
    return {"at_warmup": at, "end": samples[-1], "max": max(samples)}


RSS_BOUND = 0.05
"""Growth allowed over 40 steps after warm-up (the issue's bound; the engine trims at 3%)."""


def test_rss_stays_flat_after_warm_up(workers2):
    # glibc's defaults: without the engine's malloc_trim on growth (trim_host_memory),
    # RSS at stage 3 drifts by 0-7% over 40 steps from one run to the next (fragmentation by
    # the buffers freed and made again every step; bench/bench_residual.py, 500 steps).
    stage = 3  # the stage that frees and makes again the most buffers every step
    for rank, r in enumerate(workers2.run(_rss_growth, stage, 10, 40)):
        growth = (r["max"] - r["at_warmup"]) / r["at_warmup"]
        assert growth <= RSS_BOUND, (
            f"rank {rank}, stage {stage}: RSS grew {growth:.1%} over 40 steps after warm-up "
            f"({r['at_warmup'] / MiB:.1f} -> max {r['max'] / MiB:.1f} MiB, "
            f"end {r['end'] / MiB:.1f} MiB)"
        )


def test_a_pool_lends_the_same_memory_to_a_storage_that_keeps_its_views():
    from zeroshard.residual_states.buffers import BufferPool

    pool = BufferPool(keep=1)
    full = torch.empty(8)
    view = full[2:4]  # made while the storage has memory, like autograd's saved views
    full.untyped_storage().resize_(0)
    owners = [object(), object()]
    pool.lend(owners[0], full.untyped_storage(), 32)
    full.copy_(torch.arange(8.0))
    assert view.tolist() == [2.0, 3.0]
    first = full.data_ptr()
    pool.take_back(owners[0], full.untyped_storage())
    assert full.untyped_storage().nbytes() == 0 and pool.free_bytes == 32
    pool.lend(owners[0], full.untyped_storage(), 32)
    assert full.data_ptr() == first and pool.made == 1  # the same memory, nothing new
    other = torch.empty(8)
    other.untyped_storage().resize_(0)
    pool.lend(owners[1], other.untyped_storage(), 32)  # every buffer lent: a second one
    assert pool.made == 2 and other.data_ptr() != first
    pool.take_back(owners[0], full.untyped_storage())
    pool.take_back(owners[1], other.untyped_storage())  # keep=1: this one is freed
    assert pool.free_bytes == 32 and len(pool.tensors()) == 1
    with pytest.raises(RuntimeError, match="holds 32 bytes already"):
        pool.lend(owners[1], torch.empty(8).untyped_storage(), 32)


@pytest.mark.parametrize("at", ["append", "pop"])
def test_a_signal_in_the_free_list_s_bookkeeping_leaves_the_pool_whole(at):
    # Python runs a signal's handler as a call returns: a Ctrl-C after the free list's append
    # (or pop) and before the pool noted it left a buffer in the list it did not know (or
    # known and not in the list): every later use of the pool raised (KeyError, StopIteration;
    # an explorer). The list is now changed last.
    import contextlib
    import signal

    from zeroshard.residual_states.buffers import BufferPool

    armed = [True]

    class Interrupting(list):
        def append(self, item) -> None:
            super().append(item)
            if at == "append" and armed:
                armed.clear()
                signal.raise_signal(signal.SIGINT)  # (Python's handler: a KeyboardInterrupt)

        def pop(self, *args):
            out = super().pop(*args)
            if at == "pop" and armed:
                armed.clear()
                signal.raise_signal(signal.SIGINT)
            return out

    pool, owner = BufferPool(keep=1), object()
    pool._free.default_factory = Interrupting
    full = torch.empty(8)
    full.untyped_storage().resize_(0)
    pool.lend(owner, full.untyped_storage(), 32)
    with contextlib.suppress(KeyboardInterrupt):
        pool.take_back(owner, full.untyped_storage())  # (append)
    with contextlib.suppress(KeyboardInterrupt):
        pool.lend(owner, full.untyped_storage(), 32)  # (pop)
    if not pool.holds(owner):  # (interrupted inside lend: as the gather's clean-up does)
        full.untyped_storage().resize_(0)
    for _ in range(3):  # every later lend, return and trim works
        if pool.holds(owner):
            pool.take_back(owner, full.untyped_storage())
        pool.lend(owner, full.untyped_storage(), 32)
        pool.trim({})
    assert full.untyped_storage().nbytes() == 32 and not armed


def _pool_over_steps(constant: bool) -> dict:
    torch.manual_seed(0)
    model = zeroshard.shard(
        GPT(CFG),
        stage=3,
        wrap=zeroshard.wrap.by_class(Block),
        config=ShardConfig(constant_buffers=constant),
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    engine = zeroshard.engine_of(model)
    pool = engine.flat_params[0].buffers
    made = []
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(5):
        x = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=gen)
        opt.backward(model(x, torch.roll(x, -1, dims=1)))
        opt.step()
        opt.zero_grad()
        made.append(pool.made)
    root, block = (u.flat_params[0] for u in engine.units[:2])
    return {
        "made": made,
        "at_rest": pool.free_bytes,
        "block": block.padded_numel * 4,
        "root": root.padded_numel * 4,
    }


def test_gathered_units_borrow_buffers_made_in_the_first_step_only(workers2):
    for r in workers2.run(_pool_over_steps, True):
        # Two blocks' buffers (the one computing and the prefetched) and the root's, made in
        # the first step, kept and lent again in every later one.
        assert r["made"] == [3] * 5, r
        assert r["at_rest"] == 2 * r["block"] + r["root"], r
    for r in workers2.run(_pool_over_steps, False):
        # Nothing kept: every gather allocates again, and nothing stays between steps.
        assert all(b > a for a, b in zip(r["made"], r["made"][1:])) and r["at_rest"] == 0, r


class _Reusing(torch.nn.Module):
    """Blocks in the order ``order`` (a block used twice in one forward, as shared layers do:
    it stays gathered between its uses, beside the computing and the prefetched blocks)."""

    def __init__(self, order: tuple[int, ...]) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(CFG.vocab_size, CFG.n_embd)
        self.blocks = torch.nn.ModuleList(Block(CFG) for _ in range(max(order) + 1))
        self.order = order

    def forward(self, x):
        h = self.emb(x)
        for i in self.order:
            h = self.blocks[i](h)
        return h.pow(2).mean()


def _idle_in_each_backward(num_blocks: int) -> dict:
    """Free bytes the pool holds as each block's backward runs (the last of 4 steps), and
    buffers made per step."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=num_blocks, n_embd=64, n_head=4, block_size=16, vocab_size=128)
    model = zeroshard.shard(GPT(cfg), stage=3, wrap=zeroshard.wrap.by_class(Block))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    pool = zeroshard.engine_of(model).flat_params[0].buffers
    idle: dict[int, int] = {}
    for i, block in enumerate(model.blocks):
        block.mlp.register_full_backward_pre_hook(
            lambda *_, i=i: idle.__setitem__(i, pool.free_bytes)
        )
    made = []
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(4):
        x = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
        opt.backward(model(x, torch.roll(x, -1, dims=1)))
        opt.step()
        opt.zero_grad()
        made.append(pool.made)
    return {"idle": idle, "made": made}


@pytest.mark.parametrize("num_blocks", [2, 4])
def test_the_last_units_backward_holds_no_idle_buffer(workers2, num_blocks):
    for r in workers2.run(_idle_in_each_backward, num_blocks):
        # The first block's backward gathers nothing more this step: its own buffer and the
        # one the second block's gradient borrowed come back, enough for the next forward.
        # The third was kept idle through it, in the peak of backward (27 MiB at `100m`:
        # 756.3 against FSDP2's 748.8 MiB, now 748.8).
        assert r["idle"][0] == 0, r
        # No allocation more per step: at most the one a gradient's borrow costs (above).
        assert all(b - a <= 1 for a, b in zip(r["made"][1:], r["made"][2:])), r


def _reused_blocks_pool(order: tuple[int, ...]) -> dict:
    torch.manual_seed(0)
    model = zeroshard.shard(_Reusing(order), stage=3, wrap=zeroshard.wrap.by_class(Block))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    engine = zeroshard.engine_of(model)
    pool, grad_pool = engine.flat_params[0].buffers, engine.buckets[0].pool
    gen = torch.Generator().manual_seed(dist.get_rank())
    made, at_rest = [], []

    def step():
        opt.backward(model(torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=gen)))
        opt.step()
        opt.zero_grad()
        made.append(pool.made + grad_pool.made)  # gathers' buffers and gradients' tensors
        at_rest.append(pool.free_bytes)

    for _ in range(5):
        step()
    with zeroshard.summon_full_params(model):  # an unusual moment: every block gathered
        pass
    for _ in range(3):
        step()
    return {"made": made, "at_rest": at_rest}


@pytest.mark.parametrize("order", [(0, 1, 2, 3, 4, 0), (3, 2, 1, 0, 1, 2, 3)])
def test_a_block_used_twice_per_forward_allocates_in_the_first_steps_only(workers2, order):
    for r in workers2.run(_reused_blocks_pool, order):
        made, at_rest = r["made"], r["at_rest"]
        # Step 1 keeps `keep` buffers, step 2 (the first to prefetch) those step 1 lent at once,
        # step 3 on those step 2 did. From then on at most one allocation per step: a unit's
        # gradient borrows the gather buffer its parameters gave back, and the next gather of
        # that size may then make one (the gradients' own tensors were two per step, one per
        # unit size; before that, the gathers made one or two more at every step).
        per_step = [b - a for a, b in zip(made, made[1:])]
        assert all(n <= 1 for n in per_step[2:4] + per_step[5:]), r  # made[5]: the summon's
        # The summon's buffers stay one step (its window ends as step 7's forward starts).
        assert at_rest[6:] == at_rest[2:4], r


def test_a_tensor_pool_gives_the_same_memory_back_and_keeps_at_most_keep():
    from zeroshard.residual_states.buffers import TensorPool

    pool = TensorPool(keep=1)
    a = pool.take(8, torch.float32, torch.device("cpu"))
    first = a.data_ptr()
    pool.give(a)
    b = pool.take(8, torch.float32, torch.device("cpu"))
    assert b.data_ptr() == first and pool.made == 1  # the same memory, nothing new
    c = pool.take(8, torch.float32, torch.device("cpu"))  # every one lent: a second one
    d = pool.take(8, torch.bfloat16, torch.device("cpu"))  # another dtype: its own key
    assert pool.made == 3 and c.data_ptr() != first
    for t in (b, c, d):
        pool.give(t)
    assert len(pool.tensors()) == 2  # keep=1 per key: one float32, one bfloat16
    e = pool.take(16, torch.float32, torch.device("cpu"))  # a size none is free for
    assert pool.tensors() == [e]  # those kept for other sizes are freed first
    with pytest.raises(RuntimeError, match="did not come from this pool"):
        pool.give(torch.empty(8))
    with pytest.raises(ValueError, match="keep must be >= 0"):
        TensorPool(keep=-1)


def _grad_pool_over_steps(stage: int, constant: bool, step_in_backward: bool) -> dict:
    torch.manual_seed(0)
    model = zeroshard.shard(
        GPT(CFG),
        stage=stage,
        wrap=zeroshard.wrap.by_class(Block),
        config=ShardConfig(constant_buffers=constant, bucket_bytes=0),
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3, step_in_backward=step_in_backward)
    engine = zeroshard.engine_of(model)
    pool = engine.buckets[0].pool
    made, held = [], []
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(4):
        x = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=gen)
        opt.backward(model(x, torch.roll(x, -1, dims=1)))
        if pool is not None:
            made.append(pool.made)
            held.append(len(pool.tensors()))
        opt.step()
        opt.zero_grad()
    return {"pooled": pool is not None, "made": made, "held": held}


@pytest.mark.parametrize("stage", [2, 3])
def test_collected_gradients_reuse_memory_within_a_backward(workers2, stage):
    for r in workers2.run(_grad_pool_over_steps, stage, True, False):
        # One reduction in flight at a collection: one tensor per unit size (the blocks', the
        # root's) per backward, not one per unit, none held once backward ends. Stage 3: none,
        # each unit's gradient borrows the gather buffer its parameters just gave back.
        want = [0] * 4 if stage == 3 else [2, 4, 6, 8]
        assert r["pooled"] and r["made"] == want and r["held"] == [0] * 4, r
    for r in workers2.run(_grad_pool_over_steps, stage, True, True):
        # With the step in backward the shard is the full gradient's own slice: not pooled.
        assert r["made"] == [0] * 4 and r["held"] == [0] * 4, r
    for r in workers2.run(_grad_pool_over_steps, stage, False, False):
        assert not r["pooled"], r


_WIDTHS = (32, 48, 64, 80, 96, 112)  # five units, no two of one size (a CNN's widening stages)


def _distinct_sizes_pool(steps: int) -> dict:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b) for a, b in zip(_WIDTHS, _WIDTHS[1:])]
    model = zeroshard.shard(
        torch.nn.Sequential(*layers), stage=3, wrap=zeroshard.wrap.by_class(torch.nn.Linear)
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    engine = zeroshard.engine_of(model)
    gen = torch.Generator().manual_seed(dist.get_rank())
    at_rest = []
    for _ in range(steps):
        opt.backward(model(torch.randn(4, _WIDTHS[0], generator=gen)).pow(2).mean())
        opt.step()
        opt.zero_grad()
        at_rest.append(sum(pool.free_bytes for pool in engine.buffer_pools()))
    units = [u.flat_params[0].padded_numel * 4 for u in engine.units if u.flat_params]
    return {"at_rest": at_rest, "units": units}


def test_units_of_distinct_sizes_are_not_all_kept_gathered(workers2):
    # Buffers were kept per size: with no two units of one size, the pool kept a buffer for
    # every unit, the whole model gathered between steps (stage 3 holding what stage 2 does).
    # It keeps what the step gathered at once at most (two neighbours: computing, prefetched).
    for r in workers2.run(_distinct_sizes_pool, 4):
        units = r["units"]
        assert len(units) == len(_WIDTHS) - 1, r
        most = max(a + b for a, b in zip(units, units[1:]))
        assert 0 < r["at_rest"][-1] <= most < sum(units), r


def _widening_peak(constant: bool) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    widths = (64, 128, 256, 512, 1024)
    layers = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    model = zeroshard.shard(
        torch.nn.Sequential(*layers),
        stage=3,
        wrap=zeroshard.wrap.by_class(torch.nn.Linear),
        config=ShardConfig(constant_buffers=constant),
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    engine = zeroshard.engine_of(model)
    gen = torch.Generator().manual_seed(dist.get_rank())

    def step() -> None:
        opt.backward(model(torch.randn(8, widths[0], generator=gen)).pow(2).mean())
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    tracker = MemTracker()
    tensors = [t for f in engine.flat_params for t in (f.full, f.master)]
    tensors += [t for pool in engine.buffer_pools() for t in pool.tensors()]  # free ones too
    tracker.track_external(*[t for t in tensors if t is not None], model, opt.optimizer)
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_a_unit_s_gradient_takes_the_buffer_its_parameters_gave_back(workers2):
    # The last unit's gather buffer, kept for the next step, sat idle while its gradient was
    # collected into new memory: the peak 22% above constant_buffers=False (10% above FSDP2).
    pooled, unpooled = workers2.run(_widening_peak, True), workers2.run(_widening_peak, False)
    for a, b in zip(pooled, unpooled):
        assert a <= 1.03 * b, (a, b)


def _made_per_step(inference: bool) -> list[int]:
    torch.manual_seed(0)
    model = zeroshard.shard(_Reusing((0, 1, 2, 3, 0)), stage=3, wrap=zeroshard.wrap.by_class(Block))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    engine = zeroshard.engine_of(model)
    pool, grad_pool = engine.flat_params[0].buffers, engine.buckets[0].pool
    gen = torch.Generator().manual_seed(dist.get_rank())
    made = []
    for _ in range(6):
        x = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=gen)
        opt.backward(model(x))
        opt.step()
        opt.zero_grad()
        if inference:  # an evaluation between steps
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
        made.append(pool.made + grad_pool.made)
    return [b - a for a, b in zip(made, made[1:])]


def test_an_evaluation_between_steps_allocates_nothing_more(workers2):
    # Each forward ended the pool's window: an evaluation's (no backward, fewer units gathered
    # at once) set what the next training step could keep, and it allocated again every step.
    for trained, evaluated in zip(
        workers2.run(_made_per_step, False), workers2.run(_made_per_step, True)
    ):
        assert evaluated[2:] == trained[2:], (trained, evaluated)


def _inference_after_a_summon() -> dict:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b) for a, b in zip(_WIDTHS, _WIDTHS[1:])]
    model = zeroshard.shard(
        torch.nn.Sequential(*layers), stage=3, wrap=zeroshard.wrap.by_class(torch.nn.Linear)
    )
    engine = zeroshard.engine_of(model)
    with zeroshard.summon_full_params(model):  # every unit gathered at once
        pass
    with torch.no_grad():
        for _ in range(3):  # inference alone: each forward still ends a window
            model(torch.randn(2, _WIDTHS[0]))
    units = [u.flat_params[0].padded_numel * 4 for u in engine.units if u.flat_params]
    held = sum(pool.free_bytes for pool in engine.buffer_pools())
    return {"held": held, "window": max(a + b for a, b in zip(units, units[1:]))}


def test_inference_alone_lets_a_summon_s_buffers_go(workers2):
    for r in workers2.run(_inference_after_a_summon):
        assert r["held"] <= r["window"], r
