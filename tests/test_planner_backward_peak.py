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


class Square(torch.autograd.Function):
    """``x * x`` whose backward, ``2 * x * g``, holds a product beside the gradient it makes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * g


class SquareModule(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Square.apply(x)


SEED = 4
"""The loss's own gradient (one FP32 element), alive through the whole backward."""


@pytest.mark.parametrize(
    "act, ffn_gradients",
    [
        # GELU saves its input; fc2 saves GELU's output and releases it before GELU's backward
        # makes its gradient: one FFN-wide gradient beyond what is saved.
        (nn.GELU(), 1),
        # ReLU saves its output, which is fc2's saved input too: alive through ReLU's backward,
        # beside the gradient coming in and the one going out.
        (nn.ReLU(), 2),
        # In place on a view (``linear`` of a 3-D input returns one): autograd's ``CopySlices``
        # holds the gradient scattered into the base's shape, its own result, a clone of the
        # view's part and ReLU's gradient at once, inside one node.
        (nn.ReLU(inplace=True), 4),
        # A custom Function, saving its input as GELU does: its backward's ``2 * x`` is held
        # beside the product it makes.
        (SquareModule(), 2),
    ],
    ids=["gelu", "relu", "relu-in-place", "custom-function"],
)
def test_a_residual_mlp_s_backward(act, ffn_gradients):
    """Exactly, temporaries inside a node included: the weights' gradients (through a
    transpose before their ``AccumulateGrad``) are model states, left to the timeline's own
    term. (In place and custom Functions were planned one or two gradients low: a ResNet's
    ``ReLU(inplace=True)`` 11-17% under its measured peak.)"""
    tokens, fp32 = BATCH * SEQ, 4
    residual_gradient = tokens * HIDDEN * fp32  # the block's output gradient, to both branches
    assert _working(act) == ffn_gradients * tokens * FFN * fp32 + residual_gradient + SEED


class Sliced(nn.Module):
    """One projection sliced in two and summed (a fused projection's halves)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 2 * FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return x + self.fc2(h[..., :FFN] + h[..., FFN:])


def test_two_gradients_into_one_input_exist_together():
    """Each slice's backward makes a gradient of the whole projection's width; the second one
    exists beside the first until autograd sums them (in place, as the engine does on a device:
    not a third beside them, as on meta). fc2 saved the sum (released at its backward), fc1 its
    input: beyond them, the block's output gradient, the sum's, and two of the projection's
    width. The second was left out (a fused qkv sliced in three, GPT-NeoX's, was planned 21%
    low)."""
    net = Net(nn.GELU())
    net.block = Sliced()
    found = saved.measure(
        net, ("block",), vocab_size=VOCAB, call="xy", micro_batch_size=BATCH, seq_len=SEQ
    )
    tokens, fp32 = BATCH * SEQ, 4
    want = tokens * (HIDDEN + FFN + 2 * 2 * FFN) * fp32 - tokens * FFN * fp32 + SEED
    assert found.unit_backward_bytes[0] == want


def test_a_mixture_of_experts_backward_is_followed_in_fp32():
    """Qwen2-MoE's experts multiply through ``torch._grouped_mm``, whose weight gradient (2-D by
    2-D) reached the BF16-only meta kernel in FP32: the backward failed on meta and the sizes'
    estimate stood in, without a word (Mixtral +7.3% at stage 2)."""
    pytest.importorskip("transformers")
    import warnings

    from test_planner_hf import HF_CONFIGS

    from zeroshard.planner import calibrate

    model = calibrate.describe_case(calibrate.HFCase(config=HF_CONFIGS["qwen2_moe"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = model.activations.at(micro_batch_size=2, seq_len=16, activation_bytes=4)
    assert len(found.unit_backward_bytes) == len(found.unit_bytes) > 0


class Positioned(nn.Module):
    """The residual MLP, then a learned tensor of the activation's own shape added (a ViT's
    position embedding at batch 1), or the same values as a buffer."""

    def __init__(self, learned: bool) -> None:
        super().__init__()
        self.mlp = Block(nn.GELU())
        pos = torch.zeros(1, SEQ, HIDDEN)
        if learned:
            self.pos = nn.Parameter(pos)
        else:
            self.register_buffer("pos", pos)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) + self.pos


def test_a_gradient_shared_by_a_parameter_and_an_activation_stays():
    # The add passes one gradient to both: taken for the parameter's (a model state), it was
    # dropped from the plan while the activation's backward still held it (one gradient low).
    found = []
    for learned in (True, False):
        net = Net(nn.GELU())
        net.block = Positioned(learned)
        found.append(
            saved.measure(
                net, ("block",), vocab_size=VOCAB, call="xy", micro_batch_size=1, seq_len=SEQ
            ).unit_backward_bytes[0]
        )
    assert found[0] == found[1] > 0, found
