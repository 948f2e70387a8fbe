"""Hooks a user registers on a sharded model after ``shard()``, on real gloo ranks against the
same hooks on an unsharded reference trained in the same test (full batch = both ranks'
batches): post-accumulate-grad hooks that replace ``.grad``, forward pre-hooks prepended in
front of the engine's under activation checkpointing, forward hooks on the root that read its
weights, and an optimizer stepped inside a gradient hook (PyTorch's optimizer-in-backward
recipe), which stage 3 refuses.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard import wrap
from zeroshard.engine import ShardConfig

STAGES = [0, 1, 2, 3]
TOL = 1e-5


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (8 rows); rank r trains on rows 4r..4r+3."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)


def _mine(t: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    return t[4 * rank : 4 * rank + 4]


def _pair(stage: int, config: ShardConfig | None = None):
    torch.manual_seed(0)
    ref = Net()
    model = zeroshard.shard(
        copy.deepcopy(ref), stage=stage, wrap=wrap.by_class(Block), config=config
    )
    return model, ref


def _step_both(model, ref, opt, ref_opt, step: int) -> tuple[float, float]:
    """One SGD step of the sharded model (this rank's rows) and of the reference (all rows) on
    ``step``'s batch; the two gradients' inf-norms (the global one, torch's)."""
    x, y = _batch(step)
    opt.backward(((model(_mine(x)) - _mine(y)) ** 2).mean())
    norm = opt.clip_grad_norm(float("inf"))
    opt.step()
    opt.zero_grad()
    ((ref(x) - y) ** 2).mean().backward()
    ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    ref_opt.step()
    ref_opt.zero_grad()
    return norm.item(), ref_norm.item()


def _diff(model: nn.Module, ref: nn.Module) -> float:
    full = zeroshard.full_state_dict(model, rank0_only=False)
    return max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())


# ----------------------------------------------------------------------------- post-accumulate
def _replacing_post_accumulate_hook(stage: int, bucket_bytes: int | None, how: str) -> dict:
    model, ref = _pair(stage, None if bucket_bytes is None else ShardConfig(bucket_bytes=0))

    def hook(p: torch.Tensor) -> None:
        p.grad = p.grad * 3 if how == "scale" else None

    for m in (model, ref):  # after shard(): behind the engine's own hooks
        m.blocks[1].fc.weight.register_post_accumulate_grad_hook(hook)
        m.head.weight.register_post_accumulate_grad_hook(hook)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        _step_both(model, ref, opt, ref_opt, step)
    return {"diff": _diff(model, ref)}


@pytest.mark.parametrize("bucket_bytes", [None, 0], ids=["default", "unit_buckets"])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("how", ["scale", "none"])
def test_a_post_accumulate_hook_that_replaces_the_gradient(workers2, stage, bucket_bytes, how):
    # The hook's gradient is what is reduced and stepped on: at stages 1-2 the bucket reduced
    # the one it had bound (the edit dropped), and at stage 0 each rank stepped on its own
    # edited, unreduced gradient later (the ranks trained apart).
    for r in workers2.run(_replacing_post_accumulate_hook, stage, bucket_bytes, how):
        assert r["diff"] < TOL, r


# ----------------------------------------------------------------------------- prepended pre-hook
def _prepended_pre_hook_with_checkpoints(stage: int, every: int) -> dict:
    model, ref = _pair(stage, ShardConfig(checkpoint_every=every))

    def double(m: nn.Module, args: tuple) -> tuple:
        return (args[0] * 2,)

    for m in (model, ref):
        m.blocks[1].register_forward_pre_hook(double, prepend=True)  # ahead of the engine's
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    out = {}
    for step in range(2):
        norm, ref_norm = _step_both(model, ref, opt, ref_opt, step)
        out[f"norm{step}"] = abs(norm / ref_norm - 1)
    out["diff"] = _diff(model, ref)
    return out


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("every", [1, 2])
def test_a_prepended_pre_hook_runs_once_under_checkpointing(workers2, stage, every):
    # The recomputation starts from the inputs the engine's hook got, which the prepended hook
    # had already doubled: it ran again there (x * 4), and the gradients were off (0.44).
    for r in workers2.run(_prepended_pre_hook_with_checkpoints, stage, every):
        assert max(r.values()) < TOL, r


# ----------------------------------------------------------------------------- root forward hooks
def _root_forward_hook_reads_weights(stage: int, reshard_root: bool) -> dict:
    model, ref = _pair(stage, ShardConfig(reshard_root_after_forward=reshard_root))

    def hook(m: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output + 0.01 * m.head.weight.norm()

    for m in (model, ref):
        m.register_forward_hook(hook)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    out = {}
    for step in range(2):
        x, y = _batch(step)
        with torch.no_grad():  # evaluation: the root frees its weights after the forward
            out[f"eval{step}"] = (model(x) - ref(x)).abs().max().item()
        _step_both(model, ref, opt, ref_opt, step)
    out["diff"] = _diff(model, ref)
    # after the hook's forward the root is at rest again (its placeholders)
    if stage == 3:
        with torch.no_grad():
            model(_batch(0)[0])
        out["at_rest"] = float(not model.head.weight.isnan().all().item())
    return out


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("reshard_root", [False, True], ids=["root_kept", "root_resharded"])
def test_a_forward_hook_on_the_root_reads_its_weights(workers2, stage, reshard_root):
    # At stage 3 the root freed its weights before the user's hooks ran: NaN in every
    # evaluation, and with reshard_root_after_forward every step skipped as non-finite.
    for r in workers2.run(_root_forward_hook_reads_weights, stage, reshard_root):
        assert max(r.values()) < TOL, r


# ------------------------------------------------------------------------- optimizer in backward
def _optimizer_in_a_gradient_hook() -> dict:
    model, ref = _pair(3)
    opts = {p: torch.optim.SGD([p], lr=1.0) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]
    x, y = _batch(0)
    try:
        ((model(_mine(x)) - _mine(y)) ** 2).mean().backward()
        error = ""
    except RuntimeError as e:
        error = str(e)
    out = {"error": error, "untouched": _diff(model, ref)}
    # The model trains on after the error, as its twin does.
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for handle in handles:
        handle.remove()
    opt.zero_grad()
    for step in range(1, 3):
        _step_both(model, ref, opt, ref_opt, step)
    out["after"] = _diff(model, ref)
    return out


def test_an_optimizer_stepped_in_a_gradient_hook_is_refused_at_stage_3(workers2):
    # Each rank adopted its own write into its shard (an update that was neither rank's
    # gradient nor their average), without a word.
    for r in workers2.run(_optimizer_in_a_gradient_hook):
        assert "written during the backward" in r["error"], r
        assert "step_in_backward=True" in r["error"], r
        assert r["untouched"] == 0.0, r
        assert r["after"] < TOL, r


class _Clamped(Block):
    """A block that clamps its own weight in place in its forward (a max-norm constraint):
    a recomputation does it again inside the backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.clamp_(-0.2, 0.2)
        return super().forward(x)


def _forward_writes_recomputed() -> float:
    torch.manual_seed(0)
    ref = nn.Sequential(_Clamped(), _Clamped(), nn.Linear(16, 1))
    config = ShardConfig(checkpoint_every=1)
    model = zeroshard.shard(copy.deepcopy(ref), stage=3, wrap=wrap.by_class(Block), config=config)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        _step_both(model, ref, opt, ref_opt, step)
    return _diff(model, ref)


def test_a_forward_writing_its_weights_is_recomputed_without_error(workers2):
    # The recomputation's write is the forward's own, not the backward's: it was taken for an
    # optimizer stepping in a gradient hook.
    for diff in workers2.run(_forward_writes_recomputed):
        assert diff < TOL, diff


def _summon_in_a_root_hook(stage: int) -> dict:
    model, ref = _pair(stage)
    seen = []

    def hook(m: nn.Module, args: tuple, output: torch.Tensor) -> None:
        with zeroshard.summon_full_params(m):  # (the forward is over for the user's hooks)
            seen.append(m.blocks[0].fc.weight.norm().item())

    model.register_forward_hook(hook)
    x, y = _batch(0)
    with torch.no_grad():
        model(x)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    opt.backward(((model(_mine(x)) - _mine(y)) ** 2).mean())
    opt.step()
    want = ref.blocks[0].fc.weight.norm().item()
    return {"norms": max(abs(n - want) for n in seen), "calls": len(seen)}


@pytest.mark.parametrize("stage", [0, 3])
def test_summon_full_params_inside_a_forward_hook_on_the_root(workers2, stage):
    for r in workers2.run(_summon_in_a_root_hook, stage):
        assert r["calls"] == 2 and r["norms"] < TOL, r


def _root_hook_raises() -> dict:
    model, ref = _pair(3)

    def hook(m: nn.Module, args: tuple, output: torch.Tensor) -> None:
        raise RuntimeError("a hook of the user's")

    handle = model.register_forward_hook(hook)
    with pytest.raises(RuntimeError, match="a hook of the user's"):
        model(_batch(0)[0])
    handle.remove()
    held = zeroshard.engine_of(model).root.is_gathered  # (freed at once, as a forward that raised)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    _step_both(model, ref, opt, ref_opt, 1)
    return {"held": held, "diff": _diff(model, ref)}


def test_a_root_forward_hook_that_raises_frees_the_forward(workers2):
    for r in workers2.run(_root_hook_raises):
        assert not r["held"] and r["diff"] < TOL, r
