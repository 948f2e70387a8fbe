"""The optimizer step inside backward (``step_in_backward``) against the plain step.

Each multi-rank test trains the same model twice in the same process, with the plain step and
with ``step_in_backward``, and compares losses and parameters bit for bit."""

from __future__ import annotations

import pytest
import torch
from parity_models import batch, build, loss_of, param_groups

import zeroshard

PER_RANK_BATCH = 2


def _make(kind: str, stage: int, step_in_backward: bool, mixed_precision=None, **config):
    torch.manual_seed(0)
    model, policy = build(kind)
    model = zeroshard.shard(
        model,
        stage=stage,
        wrap=policy,
        mixed_precision=mixed_precision,
        config=zeroshard.ShardConfig(bucket_bytes=0, **config),
    )
    opt = zeroshard.optimizer(
        model,
        torch.optim.AdamW,
        param_groups(model, 0.1),
        lr=1e-2,
        step_in_backward=step_in_backward,
    )
    return model, opt


def _train(kind: str, model, opt, steps: int, accum: int = 1) -> dict:
    """Train on the same global batches; the LR changes every step (set before backward: with
    ``step_in_backward`` the updates happen there). Records whether any reduced gradient shard
    was left alive at the end of each backward."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    engine = zeroshard.engine_of(model)
    losses, shards_left = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (1 + step)
        x, y = batch(kind, step, PER_RANK_BATCH * world)
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        for i, (xm, ym) in enumerate(zip(x[mine].chunk(accum), y[mine].chunk(accum))):
            loss = loss_of(kind, model, xm, ym) / accum
            opt.backward(loss, sync=i == accum - 1)
        shards_left.append(sum(b.shard_grad is not None for b in engine.buckets))
        assert opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with zeroshard.summon_full_params(model, writeback=False):
        params = [p.detach().float().clone() for p in model.parameters()]
    return {"losses": losses, "params": params, "shards_left": shards_left}


def _parity(kind: str, stage: int, mixed_precision=None, accum: int = 1, **config) -> dict:
    ref = _train(kind, *_make(kind, stage, False, mixed_precision, **config), 4, accum)
    got = _train(kind, *_make(kind, stage, True, mixed_precision, **config), 4, accum)
    same = all(torch.equal(a, b) for a, b in zip(ref["params"], got["params"]))
    return {
        "losses_equal": ref["losses"] == got["losses"],
        "params_equal": same,
        "ref_shards_left": ref["shards_left"],
        "shards_left": got["shards_left"],
    }


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("kind", ["gpt", "frozen_mlp", "odd"])
def test_equals_the_plain_step_bit_for_bit(workers2, stage, kind):
    for r in workers2.run(_parity, kind, stage):
        assert r["losses_equal"] and r["params_equal"], r
        # The point of the mode: no reduced shard outlives its update.
        assert r["shards_left"] == [0] * 4 and min(r["ref_shards_left"]) > 0, r


def test_a_hugging_face_model(workers2):
    pytest.importorskip("transformers")
    for r in workers2.run(_parity, "hf_gpt2", 3):
        assert r["losses_equal"] and r["params_equal"] and r["shards_left"] == [0] * 4, r


def test_hybrid_sharding_on_four_ranks(workers4):
    # Shard groups of 2, replicated twice: the shard is all-reduced across groups before it steps.
    for r in workers4.run(_parity, "gpt", 3, shard_group_size=2):
        assert r["losses_equal"] and r["params_equal"] and r["shards_left"] == [0] * 4, r


def test_bf16_gradient_accumulation_and_micro_step_reductions(workers2):
    for r in workers2.run(_parity, "gpt", 3, "bf16", accum=2):
        assert r["losses_equal"] and r["params_equal"], r
    for r in workers2.run(_parity, "gpt", 3, accum=2, reduce_every_micro_step=True):
        assert r["losses_equal"] and r["params_equal"], r


class _Skips(torch.nn.Module):
    """Three linear units; the forward skips ``b`` (no rank's backward reaches it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(5, 5) for _ in range(3))

    def forward(self, x):
        return self.c(torch.tanh(self.a(x)))


def _unused_on_every_rank() -> dict:
    """A parameter that no rank's backward reaches keeps its value and gets no optimizer state
    (AdamW would decay it otherwise), as with the plain step."""
    out = {}
    for sib in (False, True):
        torch.manual_seed(0)
        model = zeroshard.shard(_Skips(), stage=3, wrap=zeroshard.wrap.by_class(torch.nn.Linear))
        opt = zeroshard.optimizer(
            model, torch.optim.AdamW, lr=1e-2, weight_decay=0.5, step_in_backward=sib
        )
        for _ in range(2):
            opt.backward(model(torch.randn(3, 5)).square().mean())
            assert opt.step()
            opt.zero_grad()
        with zeroshard.summon_full_params(model, writeback=False):
            out[sib] = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(0)
    built = _Skips()
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(out[False], out[True])),
        "b_untouched": torch.equal(out[True][2], built.b.weight.detach()),
    }


def test_a_parameter_no_rank_reached_is_left_alone(workers2):
    for r in workers2.run(_unused_on_every_rank):
        assert r == {"equal": True, "b_untouched": True}, r


def _nonfinite() -> dict:
    """Rank 1's loss is NaN: every rank's ``step`` returns False and no master turns NaN."""
    model, opt = _make("gpt", 3, True)
    engine = zeroshard.engine_of(model)
    before = [f.master.clone() for f in engine.flat_params]
    x, y = batch("gpt", 0, 2)
    loss = loss_of("gpt", model, x, y)
    if torch.distributed.get_rank() == 1:
        loss = loss * float("nan")
    opt.backward(loss)
    stepped = opt.step()
    opt.zero_grad()
    masters_finite = all(bool(torch.isfinite(f.master).all()) for f in engine.flat_params)
    # The first bucket reduced (the last block's) already saw the NaN: nothing was updated.
    unchanged = all(torch.equal(a, f.master) for a, f in zip(before, engine.flat_params))
    loss = loss_of("gpt", model, x, y)  # a finite step afterwards works
    opt.backward(loss)
    return {
        "stepped": stepped,
        "finite": masters_finite,
        "unchanged": unchanged,
        "next": opt.step(),
        "skipped": opt.loss_scaler.num_skipped,
    }


def test_a_nonfinite_gradient_on_one_rank_skips_on_every_rank(workers2):
    for r in workers2.run(_nonfinite):
        assert r == {"stepped": False, "finite": True, "unchanged": True, "next": True,
                     "skipped": 1}, r  # fmt: skip


def _two_backwards() -> str:
    model, opt = _make("gpt", 3, True)
    x, y = batch("gpt", 0, 2)
    opt.backward(loss_of("gpt", model, x, y))
    try:
        opt.backward(loss_of("gpt", model, x, y))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_second_backward_before_the_step_is_an_error(workers2):
    for msg in workers2.run(_two_backwards):
        assert "second backward before optimizer.step()" in msg and "sync=False" in msg, msg


def _misuse(stage: int, what: str) -> str:
    model, _ = build("gpt")
    model = zeroshard.shard(model, stage=stage, mixed_precision="fp16" if what == "fp16" else None)
    try:
        opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3, step_in_backward=True)
        if what == "clip":
            opt.clip_grad_norm(1.0)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "stage,what,expected",
    [
        (1, "", "needs partitioned gradients (stage 2 or 3)"),
        (0, "", "needs partitioned gradients (stage 2 or 3)"),
        (3, "fp16", "FP16 dynamic loss scaling"),
        (3, "clip", "drop step_in_backward to clip gradients"),
    ],
)
def test_what_it_cannot_do_is_refused_with_the_fix(lone_process, stage, what, expected):
    assert expected in _misuse(stage, what)


def _peaks() -> dict:
    """MemTracker's per-rank peak over a step, plain and with ``step_in_backward``, on a model
    whose states dominate (few tokens), and the rank's gradient-shard bytes."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from zeroshard.models.gpt import GPT, Block, GPTConfig

    out = {}
    for sib in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=12, n_embd=64, n_head=2, block_size=16))
        model = zeroshard.shard(model, stage=3, wrap=zeroshard.wrap.by_class(Block))
        opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3, step_in_backward=sib)
        x, y = batch("gpt", 0, 1)
        opt.backward(model(x[:, :4], y[:, :4]))  # states exist before tracking
        opt.step()
        opt.zero_grad()
        tracker = MemTracker()
        engine = zeroshard.engine_of(model)
        tracker.track_external(*[f.master for f in engine.flat_params], model, opt)
        with tracker:
            opt.backward(model(x[:, :4], y[:, :4]))
            opt.step()
            opt.zero_grad()
        out[sib] = sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
        out["shards"] = sum(4 * f.master.numel() for f in engine.flat_params)
    return out


def test_the_peak_loses_the_gradient_shards(workers2):
    for r in workers2.run(_peaks):
        # Plain: the shards pile up through backward, beside every state (12 blocks: most of
        # them are alive at the peak). Here only the one in flight is, so the peak drops by most
        # of the rank's shard bytes.
        assert r[True] <= r[False] - 0.6 * r["shards"], r
