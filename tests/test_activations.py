"""Activation checkpointing every k units (ZeRO-R): parity with unsharded training, spans formed
from chained units, and what is saved for backward."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from parity_models import batch, train_gpt_both

import zeroshard
from zeroshard.engine import ShardConfig
from zeroshard.models.gpt import GPT, Block, GPTConfig

CFG = GPTConfig(n_layer=5, n_embd=32, n_head=2, block_size=16, vocab_size=256)


def _train(stage: int, every: int, steps: int = 4) -> dict:
    """Sharded training with checkpoint_every against an unsharded reference, same batches."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = zeroshard.shard(
        copy.deepcopy(ref),
        stage=stage,
        wrap=zeroshard.wrap.by_class(Block),
        config=ShardConfig(checkpoint_every=every, bucket_bytes=0),
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    result = train_gpt_both(model, ref, opt, ref_opt, steps)
    spans = zeroshard.engine_of(model).checkpointing.num_spans
    return dict(result, spans_per_step=spans / steps)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("every", [1, 2, 5])
def test_checkpoint_every_k_units_matches_unsharded_training(workers2, stage, every):
    for r in workers2.run(_train, stage, every):
        assert r["loss"] < 1e-5 and r["param"] < 1e-5, r
        assert r["spans_per_step"] == math.ceil(CFG.n_layer / every), r


def _saved_bytes(every: int) -> int:
    """Bytes autograd keeps for backward outside checkpoint spans, for one forward."""
    torch.manual_seed(0)
    model = zeroshard.shard(
        GPT(CFG),
        stage=3,
        wrap=zeroshard.wrap.by_class(Block),
        config=ShardConfig(checkpoint_every=every),
    )
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x, y = batch("gpt", 0, 2)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    loss.backward()
    # The spans' inputs are saved through the checkpoint keeper's own hooks, which count them.
    checkpointing = zeroshard.engine_of(model).checkpointing
    kept = checkpointing.keeper.bytes.peak["device"] if checkpointing else 0
    return sum(saved.values()) + kept


def test_longer_spans_save_less(workers2):
    sizes = {k: workers2.run(_saved_bytes, k)[0] for k in (0, 1, 5)}
    assert sizes[0] > sizes[1] > sizes[5], sizes


def _broken_chain() -> int:
    """A model that feeds every block the embedding, not the previous block: no chain."""

    class Fan(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            return sum(b(x) for b in self.blocks).square().mean()

    torch.manual_seed(0)
    model = zeroshard.shard(
        Fan(),
        stage=3,
        wrap=zeroshard.wrap.by_class(torch.nn.Linear),
        config=ShardConfig(checkpoint_every=4),
    )
    model(torch.randn(3, 8, requires_grad=True)).backward()
    return zeroshard.engine_of(model).checkpointing.num_spans


def test_units_not_chained_get_a_span_each(workers2):
    assert workers2.run(_broken_chain) == [4, 4]


def test_checkpoint_every_must_not_be_negative():
    with pytest.raises(ValueError, match="checkpoint_every"):
        ShardConfig(checkpoint_every=-1)
