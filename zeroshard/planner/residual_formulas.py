"""The papers' closed-form residual-state terms for the reference transformer (ZeRO §5,
ZeRO-Infinity §3): activation checkpoints, the activation working memory of one recomputed span,
the model-state working memory of the largest operator and the logits, in bytes per device, from
the model's shape (micro-batch, sequence, hidden size, heads, layers, vocabulary). Used by
``zeroshard.planner.memory`` when no built model's activations were measured, and by the
planner's report to show each formula beside its value."""

from __future__ import annotations

import math

ACTIVATION_BYTES = 2
"""Bytes per activation element: the papers' fp16/bf16 (``MemoryConfig.activation_bytes``)."""
LOGIT_BYTES_PER_ELEMENT = 4 + 4 + 4
"""Per logit at the loss's backward, all fp32 whatever the compute dtype (the reference GPT takes
the cross-entropy of ``logits.float()``): the log-probabilities ``log_softmax`` saved, the
gradient coming into it from the loss and the gradient it hands back. The logits themselves are
not saved (the output matmul saves its input), so they are gone by then (measured on CPU)."""


def activation_checkpoint_bytes(
    *,
    micro_batch_size: int,
    seq_len: int,
    hidden_size: int,
    num_layers: int,
    num_layers_per_checkpoint: int,
    num_mp_ranks: int = 1,
    partitioned: bool = False,
    activation_bytes: int = ACTIVATION_BYTES,
) -> int:
    """2 * bsz * seq * hd * nl / ci: one fp16 (bsz, seq, hd) input per checkpoint span, with
    ceil(nl / ci) spans (``activation_bytes`` per element instead of fp16's 2); divided by Nm
    when partitioned across model-parallel ranks."""
    num_checkpoints = math.ceil(num_layers / num_layers_per_checkpoint)
    num_bytes = activation_bytes * micro_batch_size * seq_len * hidden_size * num_checkpoints
    return math.ceil(num_bytes / num_mp_ranks) if partitioned else num_bytes


def activation_working_bytes(
    *,
    micro_batch_size: int,
    seq_len: int,
    hidden_size: int,
    num_heads: int,
    num_layers_per_checkpoint: int,
    activation_bytes: int = ACTIVATION_BYTES,
) -> int:
    """AWM = bsz * seq * ci * (16 * hd + 2 * heads * seq): the activations of one checkpoint span
    recomputed in backward (the ZeRO-Infinity paper's count, in fp16: scaled by
    ``activation_bytes`` / 2 for other widths, e.g. twice as much in fp32)."""
    per_token_layer = 16 * hidden_size + 2 * num_heads * seq_len
    fp16 = micro_batch_size * seq_len * num_layers_per_checkpoint * per_token_layer
    return fp16 * activation_bytes // ACTIVATION_BYTES


def model_state_working_bytes(*, hidden_size: int) -> int:
    """MSWM = 4 * hd * 4hd: fp16 parameters and gradients of the largest operator (hd x 4hd)."""
    return 4 * hidden_size * 4 * hidden_size


def logits_bytes(*, micro_batch_size: int, seq_len: int, vocab_size: int) -> int:
    """bsz * seq * vocab * ``LOGIT_BYTES_PER_ELEMENT``: the logits and the loss's fp32 copies."""
    return micro_batch_size * seq_len * vocab_size * LOGIT_BYTES_PER_ELEMENT
