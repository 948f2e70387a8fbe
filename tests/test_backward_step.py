"""The optimizer step inside backward (``step_in_backward``) against the plain step.

Each multi-rank test trains the same model twice in the same process, with the plain step and
with ``step_in_backward``, and compares losses and parameters bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from parity_models import ResidualMlp, batch, build, loss_of, param_groups

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


def _two_backwards() -> list[str]:
    """A second backward before the step, then one after a step without zero_grad: each an
    error; zero_grad then recovers."""
    model, opt = _make("gpt", 3, True)
    x, y = batch("gpt", 0, 2)
    said = []
    for steps in (0, 1):
        opt.zero_grad()
        opt.backward(loss_of("gpt", model, x, y))
        if steps:
            opt.step()
        try:
            opt.backward(loss_of("gpt", model, x, y))
            said.append("no error")
        except RuntimeError as e:
            said.append(str(e))
    opt.zero_grad()
    opt.backward(loss_of("gpt", model, x, y))
    said.append(f"stepped after zero_grad: {opt.step()}")
    for m in model.children():  # a submodule's zero_grad counts too (a GAN's netD.zero_grad())
        m.zero_grad()
    opt.backward(loss_of("gpt", model, x, y))
    said[-1] += f", after the submodules': {opt.step()}"
    return said


def test_a_second_backward_before_the_step_or_zero_grad_is_an_error(workers2):
    for before_step, before_zero_grad, then in workers2.run(_two_backwards):
        assert "second backward before optimizer.step()" in before_step, before_step
        assert "sync=False" in before_step, before_step
        assert "after optimizer.step() without zero_grad()" in before_zero_grad, before_zero_grad
        assert then == "stepped after zero_grad: True, after the submodules': True", then


def _autograd_grad_of_the_inputs() -> list[bool]:
    """``torch.autograd.grad`` of the input (a saliency map, a gradient penalty) before the
    step's backward reaches no parameter: no update (it failed as a second backward). Per
    stage (and with ``zero_grad(set_to_none=False)``): the parameters equal the plain step's."""
    from torch import nn

    same = []
    for stage, set_to_none in ((2, True), (3, True), (3, False)):
        params = []
        for sib in (False, True):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(4, 16), nn.Sequential(nn.Linear(16, 16), nn.Tanh()),
                                nn.Linear(16, 1))  # fmt: skip
            model = zeroshard.shard(net, stage=stage, wrap=zeroshard.wrap.by_size(200))
            opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=0.1, step_in_backward=sib)
            for step in range(2):
                g = torch.Generator().manual_seed(step * 10 + torch.distributed.get_rank())
                x = torch.randn(2, 4, generator=g).requires_grad_()
                loss = model(x).square().mean()
                (gx,) = torch.autograd.grad(loss, x, retain_graph=True)
                opt.backward(loss * gx.square().sum())
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)  # (False: kept zeros are not reached)
            with zeroshard.summon_full_params(model, writeback=False):
                params.append([p.detach().clone() for p in model.parameters()])
        same.append(all(torch.equal(a, b) for a, b in zip(*params)))
    return same


def test_autograd_grad_of_the_inputs_is_no_update(workers2):
    assert workers2.run(_autograd_grad_of_the_inputs) == [[True, True, True]] * 2


def _lr_set_after_the_backward(tensor_lr: bool) -> list:
    model, opt = _make("gpt", 3, True)
    x, y = batch("gpt", 0, 2)
    said = []
    for step in range(2):
        opt.backward(loss_of("gpt", model, x, y))
        if step == 0:  # a warm-up written between backward and step: the updates are done
            for g in opt.param_groups:
                if tensor_lr:
                    g["lr"] = torch.tensor(0.0)
                else:
                    g["lr"] = 0.0
        try:
            said.append(opt.step())
        except ValueError as e:
            said.append(str(e))
        opt.zero_grad()
    return said


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_a_hyperparameter_set_after_the_backward_is_an_error(workers2, tensor_lr):
    """A plain step would use it; the updates in backward used the old one (ignored before)."""
    for first, second in workers2.run(_lr_set_after_the_backward, tensor_lr):
        assert first.startswith("param group 0's lr changed from"), first
        assert "Set hyperparameters before the backward" in first, first
        assert second is True  # the next step, set before its backward, is taken


def _two_optimizers(
    stage: int, kinds: tuple[bool, bool], rebuilt: bool, shared: bool, gan: bool = False
) -> dict:
    """Two optimizers over disjoint units (``kinds``: which steps in backward), the first built
    twice when ``rebuilt`` (a replacement: only the second steps), against the same two plain
    torch optimizers on the unsharded model; each steps then zeroes in turn after one backward,
    or (``gan``) each zeroes, runs a backward of its own loss that reaches both parts, and
    steps. ``shared``: the two parts in one bucket (the root unit, or stage 2's default
    bucket)."""
    import copy

    import torch.nn.functional as F
    from torch import nn

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    wrap = None if shared else zeroshard.wrap.by_class(nn.Linear)
    config = zeroshard.ShardConfig(bucket_bytes=25 * 2**20 if shared else 0)
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage, wrap=wrap, config=config)
    parts = (list(model[0].parameters()), list(model[2].parameters()))

    def build(i: int):
        make = torch.optim.SGD if i == 0 else torch.optim.AdamW
        sib = kinds[i]
        return zeroshard.optimizer(model, make, parts[i], lr=0.1, step_in_backward=sib)

    first = build(0)
    if rebuilt:
        first = build(0)
    opts = [first, build(1)]
    refs = [torch.optim.SGD(ref[0].parameters(), lr=0.1), torch.optim.AdamW(ref[2].parameters())]
    refs[1].param_groups[0]["lr"] = 0.1
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
        mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
        if gan:  # the second loss: another target, so the two backwards differ
            for i, (o, r) in enumerate(zip(opts, refs)):
                o.zero_grad()
                o.backward(F.cross_entropy(model(x[mine]), (y[mine] + i) % 2))
                o.step()
                r.zero_grad()
                F.cross_entropy(ref(x), (y + i) % 2).backward()
                r.step()
            continue
        opts[0].backward(F.cross_entropy(model(x[mine]), y[mine]))
        for o in opts:
            o.step()
            o.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        for o in refs:
            o.step()
            o.zero_grad()
    full = zeroshard.full_state_dict(model, rank0_only=False)
    return {k: (full[k] - v).abs().max().item() for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize(
    "kinds, rebuilt, shared",
    [
        ((True, True), False, False),
        ((True, False), False, False),
        ((True, True), True, False),
        ((False, False), False, True),
        ((False, False), True, True),
    ],
)
def test_several_optimizers_each_step_their_own_parameters(workers2, stage, kinds, rebuilt, shared):
    # Every optimizer stepping in backward took every unit, and any optimizer's zero_grad
    # dropped every gradient: the others' parameters stayed put.
    for diffs in workers2.run(_two_optimizers, stage, kinds, rebuilt, shared):
        assert max(diffs.values()) < 1e-6, diffs


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_gan_loop_of_two_optimizers_as_in_torch(workers2, stage):
    # zero_grad; backward; step per optimizer: in a shared bucket the first one's zero_grad
    # must keep nothing of its own and the second's must keep the first one's gradients.
    for diffs in workers2.run(_two_optimizers, stage, (False, False), False, True, True):
        assert max(diffs.values()) < 1e-6, diffs


@pytest.mark.parametrize("stage", [2, 3])
def test_a_gan_loop_steps_only_the_optimizer_whose_backward_runs(workers2, stage):
    # Both step in backward; each one's loss reaches the other's parameters too, which must
    # accumulate (as torch's .grad), not step: the discriminator stepped twice per iteration.
    for diffs in workers2.run(_two_optimizers, stage, (True, True), False, False, True):
        assert max(diffs.values()) < 1e-6, diffs


def _an_overflow_in_one_optimizer(stage: int, sib: bool) -> tuple[list, list, float]:
    """Two optimizers over two branches in units of their own; ``a`` steps every iteration,
    ``b`` every second one (accumulating), and ``a``'s gradient overflows at the first. Returns
    each one's ``step()`` results and the largest difference from torch (``a``'s overflowed
    step skipped by hand)."""
    import copy

    from torch import nn

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.a(x).square().mean() + self.b(y).square().mean()

    torch.manual_seed(0)
    ref = Two()
    model = zeroshard.shard(
        copy.deepcopy(ref), stage=stage, wrap=zeroshard.wrap.by_class(nn.Linear),
        config=zeroshard.ShardConfig(bucket_bytes=0),
    )  # fmt: skip
    opt_a = zeroshard.optimizer(model, torch.optim.SGD, list(model.a.parameters()), lr=0.1)
    opt_b = zeroshard.optimizer(
        model, torch.optim.SGD, list(model.b.parameters()), lr=0.1, step_in_backward=sib
    )
    ref_a = torch.optim.SGD(ref.a.parameters(), lr=0.1)
    ref_b = torch.optim.SGD(ref.b.parameters(), lr=0.1)
    taken_a, taken_b = [], []
    g = torch.Generator().manual_seed(1)
    for it in range(4):
        x, y = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
        if it == 0:
            x[0, 0] = float("inf")
        model(x, y).backward()
        ref(x, y).backward()
        taken_a.append(opt_a.step())
        opt_a.zero_grad()
        if it > 0:  # the inf gradient is not applied
            ref_a.step()
        ref_a.zero_grad()
        if sib or it % 2 == 1:
            taken_b.append(opt_b.step())
            opt_b.zero_grad()
            ref_b.step()
            ref_b.zero_grad()
    full = zeroshard.full_state_dict(model, rank0_only=False)
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return taken_a, taken_b, diff


@pytest.mark.parametrize("stage, sib", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_an_overflow_skips_its_own_optimizer_only(workers2, stage, sib):
    # One inf/NaN flag per model: b's steps were skipped until a and b had both zeroed since.
    for taken_a, taken_b, diff in workers2.run(_an_overflow_in_one_optimizer, stage, sib):
        assert taken_a == [False, True, True, True], taken_a
        assert all(taken_b), taken_b
        assert diff < 1e-6, diff


def _after_a_replacement_and_an_overflow(stage: int) -> list[bool]:
    """An optimizer replaced by a new one over the same parameters, the old one still
    referenced (by an old scheduler): an inf gradient skips one step of the new one, not every
    step after it (the old one never zeroes again)."""
    from torch import nn

    torch.manual_seed(0)
    model = zeroshard.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), stage=stage)
    old = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(old, 10)  # keeps ``old`` alive
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    taken = []
    for step in range(3):
        x = torch.ones(2, 4) * (float("inf") if step == 0 else 1.0)
        opt.backward(model(x).sum())
        taken.append(opt.step())
        opt.zero_grad()
    assert scheduler.optimizer is old
    return taken


@pytest.mark.parametrize("stage", [0, 3])
def test_a_replaced_optimizer_does_not_hold_back_the_new_one(workers2, stage):
    for taken in workers2.run(_after_a_replacement_and_an_overflow, stage):
        assert taken == [False, True, True], taken


def _half_replaced() -> tuple[str, float]:
    """Fine-tuning the last block with a new optimizer while the old one, which stepped in
    backward, lives on in its scheduler: the old one went on updating the other blocks in
    every backward (0.01 off torch after one step), then failed with "received gradients again
    after its update". Refused, naming the fix; after it, the new one trains as torch."""
    import gc

    from torch import nn

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])

    ref, model = build(), zeroshard.shard(build(), stage=3, wrap=zeroshard.wrap.by_class(nn.Linear))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-2, step_in_backward=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    try:
        zeroshard.optimizer(model, torch.optim.SGD, list(model[2].parameters()), lr=0.1)
        said = "no error"
    except ValueError as exc:
        said = str(exc)
    del sched, opt
    gc.collect()
    before = zeroshard.full_state_dict(model, rank0_only=False)
    ref.load_state_dict(before)
    new = zeroshard.optimizer(model, torch.optim.SGD, list(model[2].parameters()), lr=0.1)
    ref_opt = torch.optim.SGD(ref[2].parameters(), lr=0.1)
    xs = torch.cat([torch.randn(2, 4, generator=torch.Generator().manual_seed(r)) for r in (0, 1)])
    model(x).square().mean().backward()
    ref(xs).square().mean().backward()
    new.step(), ref_opt.step()
    full = zeroshard.full_state_dict(model, rank0_only=False)
    return said, max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


def test_an_optimizer_half_replacing_one_that_steps_in_backward_is_refused(workers2):
    for said, diff in workers2.run(_half_replaced):
        assert "replaces an older one that steps in backward" in said, said
        assert "del sched, opt" in said and diff < 1e-6, (said, diff)


def _split_unit(stage: int, sib_first: bool) -> str:
    from torch import nn

    torch.manual_seed(0)
    model = zeroshard.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), stage=stage)
    opts = []  # each optimizer alive while the next is built
    try:
        for i in (0, 1) if sib_first else (1, 0):
            opts.append(zeroshard.optimizer(
                model, torch.optim.SGD, list(model[i].parameters()), lr=0.1,
                step_in_backward=i == 0,
            ))  # fmt: skip
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("sib_first", [True, False])
def test_a_unit_split_between_optimizers_is_refused(workers2, stage, sib_first):
    for msg in workers2.run(_split_unit, stage, sib_first):
        assert "split between two optimizers" in msg and "one optimizer" in msg, msg
        assert ("bucket_bytes=0" in msg) == (stage == 2), msg


def _zero_grad_without_step() -> list[str]:
    import warnings

    model, opt = _make("gpt", 3, True)
    x, y = batch("gpt", 0, 2)
    opt.backward(loss_of("gpt", model, x, y))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.zero_grad()  # the updates were applied in backward: said, not silently kept
        opt.backward(loss_of("gpt", model, x, y))
        opt.step()
        opt.zero_grad()  # the usual order: nothing to say
    return [str(w.message) for w in caught]


def test_zero_grad_without_step_says_the_updates_stay(workers2):
    for said in workers2.run(_zero_grad_without_step):
        assert len(said) == 1 and "already applied" in said[0] and "they stay" in said[0], said


def _no_step_at_all(stage: int, how: str) -> float:
    """torch's optimizer-in-backward habit, backward then zero_grad() and never step(): the
    updates stay on every rank's replicas too (at stage 2 each rank kept only its own slice
    updated, and the ranks trained apart: 1e-1 off torch after 3 steps; by each submodule's
    zero_grad() too, whose next backward also raised "received gradients again"). Against
    plain torch stepping on the whole batch."""
    import warnings

    from torch import nn

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage, wrap={nn.Linear})
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, step_in_backward=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4 * world, 16, generator=torch.Generator().manual_seed(step))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ("they stay": said)
            opt.backward(model(x[4 * rank : 4 * rank + 4]).square().mean())
            if how == "optimizer":
                opt.zero_grad()
            else:  # (a GAN's netD.zero_grad() habit; here covering the whole model)
                model[0].zero_grad()
                model[2].zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = zeroshard.full_state_dict(model, rank0_only=False)
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("how", ["optimizer", "submodules"])
def test_updates_kept_without_step_reach_every_rank(workers2, stage, how):
    for diff in workers2.run(_no_step_at_all, stage, how):
        assert diff < 1e-6, diff


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


def _step_twice(stage: int) -> dict:
    """One backward, then step() twice: the second is refused and changes nothing; after
    zero_grad and another backward, training goes on as with steps taken once."""
    model, opt = _make("gpt", stage, True)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    x, y = batch("gpt", 0, PER_RANK_BATCH * world)
    mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
    opt.backward(loss_of("gpt", model, x[mine], y[mine]))
    assert opt.step()
    before = zeroshard.full_state_dict(model, rank0_only=False)
    with pytest.raises(ValueError, match="step_in_backward=True: its gradients were applied") as e:
        opt.step()
    after = zeroshard.full_state_dict(model, rank0_only=False)
    opt.zero_grad()
    opt.backward(loss_of("gpt", model, x[mine], y[mine]))
    assert opt.step()  # (the refusal is gone once new gradients came)
    return {
        "said": str(e.value),
        "moved": max((after[k] - v).abs().max().item() for k, v in before.items()),
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_a_second_step_after_one_backward_is_refused(workers2, stage):
    # It stepped again on zero gradients (momentum and Adam's moments moved on), silently:
    # torch's second step takes the same gradients again, which were freed in backward here.
    for r in workers2.run(_step_twice, stage):
        assert r["moved"] == 0.0, r


def _a_new_optimizer_after_the_backward(stage: int) -> dict:
    """An optimizer made again (a notebook cell run twice) between the backward of one with
    step_in_backward, which applied and freed the gradients, and the step: the new one's step
    returned True and applied nothing (torch's steps on the same .grad)."""
    model, opt = _make("gpt", stage, True)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    x, y = batch("gpt", 0, PER_RANK_BATCH * world)
    mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
    opt.backward(loss_of("gpt", model, x[mine], y[mine]))
    again = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="applied and freed during the last backward by an"):
        again.step()
    again.zero_grad()  # then it trains as any optimizer
    opt.backward(loss_of("gpt", model, x[mine], y[mine]))  # (its backward: plain reductions)
    return {"stepped": again.step()}


@pytest.mark.parametrize("stage", [2, 3])
def test_another_optimizer_cannot_step_on_gradients_applied_in_backward(workers2, stage):
    assert workers2.run(_a_new_optimizer_after_the_backward, stage) == [{"stepped": True}] * 2


def _part_zeroed_then_step(stage: int, bucket_bytes: int | None) -> list[str]:
    """A GAN's habit with step_in_backward: a submodule's zero_grad() between the backward and
    step() (the step raised "step() again after the step of the same backward" when the first
    fix ended the whole step there); said once per step (its updates stay), the ranks'
    replicas equal."""
    import warnings

    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    config = None if bucket_bytes is None else zeroshard.ShardConfig(bucket_bytes=bucket_bytes)
    model = zeroshard.shard(model, stage=stage, wrap={nn.Linear}, config=config)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, step_in_backward=True)
    rank = dist.get_rank()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            opt.backward(model(x).square().mean())
            model[2].zero_grad()
            opt.step()
            opt.zero_grad()
    said = [str(w.message) for w in caught if "zero_grad" in str(w.message)]
    v = torch.cat(
        [
            p.detach().reshape(-1)
            for p in zeroshard.full_state_dict(model, rank0_only=False).values()
        ]
    )
    both = [torch.zeros_like(v) for _ in range(2)]
    dist.all_gather(both, v)
    return said + (["ranks apart"] if not torch.equal(both[0], both[1]) else [])


@pytest.mark.parametrize("stage, bucket_bytes", [(2, None), (2, 1), (3, None)])
def test_a_submodule_zeroed_between_backward_and_step(workers2, stage, bucket_bytes):
    for said in workers2.run(_part_zeroed_then_step, stage, bucket_bytes):
        assert len(said) == 2 and all("they stay" in s for s in said), said


def _another_optimizer_s_backward_after_the_step(stage: int) -> str:
    torch.manual_seed(0)
    enc = zeroshard.shard(torch.nn.Linear(4, 8), stage=stage)
    dec = zeroshard.shard(torch.nn.Linear(8, 1), stage=stage)
    enc_opt = zeroshard.optimizer(enc, torch.optim.Adam, lr=0.1, step_in_backward=True)
    dec_opt = zeroshard.optimizer(dec, torch.optim.Adam, lr=0.1)
    h = enc(torch.randn(2, 4))
    enc_opt.backward(h.pow(2).mean(), retain_graph=True)  # the encoder steps in here
    try:
        dec_opt.backward(dec(h).pow(2).mean())  # ... and gets gradients again
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("stage", [2, 3])
def test_gradients_another_optimizer_brings_after_the_step_are_refused(workers2, stage):
    # They were kept for a step that had happened and dropped at zero_grad: the encoder took
    # the auxiliary loss's step alone, 0.2 from one step on the sum, without a word.
    for said in workers2.run(_another_optimizer_s_backward_after_the_step, stage):
        assert "received gradients again after its update" in said, said


def _penalty_before_the_blocks() -> str:
    """One backward a step, a block's bias also read by a penalty before the blocks run (so
    its gradient comes after the block's update), stepped in the backward at stage 2."""
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 4)
            self.blocks = nn.ModuleList(ResidualMlp(4, 8) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            penalty = self.blocks[0].fc2.bias.sum()
            x = self.inp(x)
            for block in self.blocks:
                x = block(x)
            return x.square().mean() + penalty

    torch.manual_seed(0)
    policy, config = zeroshard.wrap.by_class(ResidualMlp), zeroshard.ShardConfig(bucket_bytes=0)
    model = zeroshard.shard(Net(), stage=2, wrap=policy, config=config)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, step_in_backward=True)
    try:
        for _ in range(2):
            opt.backward(model(torch.randn(2, 4)))
            opt.step()
            opt.zero_grad()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_gradient_after_the_update_in_one_backward_is_named(workers2):
    # It blamed "a second backward before optimizer.step()", of which there was none.
    for said in workers2.run(_penalty_before_the_blocks):
        assert "received gradients again after its update" in said, said
        assert "also read outside the unit, earlier in the forward" in said, said


def _plain_backward_through_a_stepped_discriminator(stage: int) -> str:
    """A GAN's loop with plain ``loss.backward()``: the generator's loss reaches the
    discriminator, whose optimizer stepped in the backward before and has no zero_grad since."""
    from torch import nn

    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    wrap = zeroshard.wrap.by_class(nn.Linear)
    gen = zeroshard.shard(gen, stage=stage, wrap=wrap)
    disc = zeroshard.shard(disc, stage=stage, wrap=wrap)
    opt_g = zeroshard.optimizer(gen, torch.optim.SGD, lr=0.1)
    opt_d = zeroshard.optimizer(disc, torch.optim.SGD, lr=0.1, step_in_backward=True)
    z = torch.randn(2, 4)
    opt_d.zero_grad()
    disc(gen(z).detach()).mean().backward()
    opt_d.step()
    opt_g.zero_grad()
    try:
        (-disc(gen(z)).mean()).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("stage", [2, 3])
def test_a_plain_backward_of_another_loss_after_the_step_names_the_optimizer_s_backward(
    workers2, stage
):
    # The error said only "call zero_grad() after each step()": done, the generator's plain
    # backward stepped the discriminator on the generator's loss without a word.
    for said in workers2.run(_plain_backward_through_a_stepped_discriminator, stage):
        assert "after optimizer.step() without zero_grad()" in said, said
        assert "run it through that one instead, opt_g.backward(loss)" in said, said


def _inside_summon(stage: int) -> dict:
    """Forward and backward inside ``summon_full_params`` (writeback=True: what the README
    gives for a gradient penalty at stage 3), with and without ``step_in_backward``. At stage 3
    the summon's exit wrote the units' values from before their update back over it: nothing
    trained, step() said True."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for sib in (False, True):
        model, opt = _make("gpt", stage, sib)
        for step in range(3):
            x, y = batch("gpt", step, PER_RANK_BATCH * world)
            mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
            with zeroshard.summon_full_params(model):
                opt.backward(loss_of("gpt", model, x[mine], y[mine]))
            assert opt.step()
            opt.zero_grad()
        with zeroshard.summon_full_params(model, writeback=False):
            out[sib] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_a_backward_inside_summon_full_params_keeps_its_update(workers2, stage):
    for r in workers2.run(_inside_summon, stage):
        assert all(torch.equal(a, b) for a, b in zip(r[False], r[True]))
