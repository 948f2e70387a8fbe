"""Each unit's backward working set, followed on meta (``zeroshard.planner.backward_peak``): the
bytes a residual MLP's backward holds beyond what is saved, worked out by hand per activation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.planner import saved

VOCAB, HIDDEN, FFN = 32, 8, 24
BATCH, SEQ = 2, 8  # 16 tokens: no activation has an embedding's 32 x 8 elements


class Block(nn.Module):
    def __init__(self, act) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, act) -> None:
        super().__init__()
        self.emb, self.block = nn.Embedding(VOCAB, HIDDEN), Block(act)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.block(self.emb(x))).flatten(0, 1), y.flatten())


def _working(act) -> int:
    found = saved.measure(
        Net(act), ("block",), vocab_size=VOCAB, call="xy", micro_batch_size=BATCH, seq_len=SEQ
    )
    return found.unit_backward_bytes[0]


@pytest.mark.parametrize(
    "act, ffn_gradients",
    [
        # GELU saves its input; fc2 saves GELU's output and releases it before GELU's backward
        # makes its gradient: one FFN-wide gradient beyond what is saved.
        (nn.GELU(), 1),
        # ReLU saves its output, which is fc2's saved input too: alive through ReLU's backward,
        # beside the gradient coming in and the one going out.
        (nn.ReLU(), 2),
    ],
)
def test_a_residual_mlp_s_backward(act, ffn_gradients):
    """Exactly: the weights' gradients (through a transpose before their ``AccumulateGrad``) are
    model states, left to the timeline's own term."""
    tokens, fp32 = BATCH * SEQ, 4
    residual_gradient = tokens * HIDDEN * fp32  # the block's output gradient, to both branches
    assert _working(act) == ffn_gradients * tokens * FFN * fp32 + residual_gradient
