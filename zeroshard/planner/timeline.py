"""The engine's timeline: what zeroshard's engine keeps alive on a device, moment by moment
through one training step without activation checkpointing (the loss's backward, each unit's
backward and post-backward, the gradient reduction, the optimizer step).

``zeroshard.planner.memory.plan_memory`` counts the device this way when
``MemoryConfig.activation_checkpointing`` is False and the model has a transformer shape or
measured activations; ``MemoryBreakdown.peak`` is then the composition of the largest moment, which
``zeroshard.planner.calibrate`` holds against MemTracker's per-rank peak.

Units: the root unit (what no wrapped module owns: embeddings, final norm, an untied head) and the
model's other units, each of its own size when the description knows them (a model built and
wrapped as the engine wraps it, ``describe.from_module``/``from_hf_config``), else one
transformer block each. Activations are what autograd saves in each unit and in the root, measured
on the built model (``zeroshard.planner.saved``, ``ActivationTerms``); a model described by its
shape alone follows the reference GPT's pre-LN block (``saved_activation_bytes_per_layer``).

Every function is arithmetic on numbers, except that a built model's activations are measured
once per batch, sequence length and activation width (on meta, then remembered); all sizes are
bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zeroshard.offload.tiers import Tier
from zeroshard.planner import saved
from zeroshard.planner.describe import ModelDescription
from zeroshard.planner.memory import (
    ACTIVATION_BYTES,
    MODEL_STATES,
    RESIDUAL_STATES,
    MemoryConfig,
    logits_bytes,
)
from zeroshard.stages import partition

STAT_BYTES = 4
"""A LayerNorm saves its per-token mean and reciprocal standard deviation in fp32."""
INDEX_BYTES = 8
"""Token ids, targets and positions are int64."""

Moment = tuple[str, dict[str, int]]
"""When (``"loss backward"``, ``"unit backward k"``...) and the device bytes per category then."""


def saved_activation_bytes_per_layer(
    *,
    micro_batch_size: int,
    seq_len: int,
    hidden_size: int,
    num_heads: int,
    activation_bytes: int = ACTIVATION_BYTES,
    flash_attention: bool = False,
) -> int:
    """What autograd keeps from one pre-LN block's forward to its backward (the reference GPT):
    ``bsz * seq * (16 * hd * a + attention + 4 * 4)`` bytes, ``a`` bytes per activation.

    The 16 hd elements per token: ln_1's input and output (2 hd), the fused qkv output (3 hd;
    q, k and v are views of it), the attention output (hd; its transpose-reshape is a view), the
    residual after attention (hd), ln_2's output (hd), the MLP's hidden before and after GELU
    (4 hd + 4 hd). Attention adds one fp32 log-sum-exp per head with ``flash_attention``, else the
    heads x seq probabilities (the papers' ``2 * heads * seq`` bytes in fp16). Each LayerNorm
    saves a mean and a reciprocal deviation in fp32. Measured on CPU (``saved_tensors_hooks``):
    exactly 16 hd + heads + 4 fp32 elements per token. The ZeRO-Infinity paper's AWM counts
    16 hd *bytes* (8 fp16 elements), half of this; Megatron-LM's count (34 hd bytes in fp16 with
    dropout masks) agrees with ours."""
    attention = num_heads * (STAT_BYTES if flash_attention else seq_len * activation_bytes)
    per_token = 16 * hidden_size * activation_bytes + attention + 2 * 2 * STAT_BYTES
    return micro_batch_size * seq_len * per_token


def unit_numels(model: ModelDescription) -> list[int]:
    """Parameters of each unit other than the root, in forward order: the description's own
    (``block_unit_numels``), else one ``block_unit_numel`` per transformer block."""
    if model.block_unit_numels is not None:
        return list(model.block_unit_numels)
    assert model.shape is not None
    return [model.block_unit_numel or 0] * model.shape.num_layers


@dataclass(frozen=True, kw_only=True)
class ActivationTerms:
    """The activation bytes alive at each moment of the timeline, and the transient gradients
    beside them (``activation_terms``)."""

    at_loss: int
    """Everything saved, at the loss's backward."""
    logits: int
    """The loss's backward: the logits' share (the reference GPT: the saved fp32
    log-probabilities and two gradients of their size; measured: the two gradients, the saved
    log-probabilities being in ``at_loss``)."""
    at_unit: tuple[int, ...]
    """At each unit's backward (backward order): the activations still saved and the residual
    stream's and the largest intermediate gradients."""
    at_post: tuple[int, ...]
    """At each unit's post-backward: that unit's activations freed, the residual stream's
    gradient held."""
    after: int
    """After the last unit's backward (the token ids)."""
    grad_working: int
    """Gradients outside the flat buffers during a unit's backward: the largest operator's weight
    gradient and the head's gradients (a tied embedding's, from the logits; measured: every root
    parameter the head and the loss use)."""
    held_grad: int
    """Of those, what outlives the unit's backward: the head's gradients."""


def activation_terms(model: ModelDescription, config: MemoryConfig) -> ActivationTerms:
    """``ActivationTerms`` for ``model`` trained as ``config``: measured on the model itself when
    it was built (``model.activations``, ``zeroshard.planner.saved``), else the reference GPT's
    pre-LN block (``saved_activation_bytes_per_layer``) for ``model.shape``."""
    c, g = config, config.bytes_per_param.grads
    num_units = len(unit_numels(model))
    s = saved.at_config(model, c)
    if s is not None:
        assert len(s.unit_bytes) == num_units, (len(s.unit_bytes), num_units)
        fwd = range(num_units - 1, -1, -1)  # the forward index of each unit in backward order

        def kept(i: int) -> int:
            """Saved by units before ``i`` and by the root before unit ``i`` (inclusive)."""
            return sum(s.unit_bytes[:i]) + sum(s.before_unit_bytes[: i + 1])

        held = s.tail_param_numel * g  # the head's gradients, until the root's reduction
        return ActivationTerms(
            at_loss=s.total_bytes,
            logits=2 * s.largest_tail_tensor_bytes,
            at_unit=tuple(
                kept(i) + s.unit_bytes[i] + s.unit_input_bytes[i] + s.largest_unit_tensor_bytes[i]
                for i in fwd
            ),
            at_post=tuple(kept(i) + s.unit_input_bytes[i] for i in fwd),
            after=s.before_unit_bytes[0] if num_units else 0,
            grad_working=model.activations.largest_param_numel * g + held,
            held_grad=held,
        )
    shape = model.shape
    assert shape is not None
    nl, hd, a = shape.num_layers, shape.hidden_size, c.activation_bytes
    tokens = c.micro_batch_size * c.seq_len
    layer = saved_activation_bytes_per_layer(
        micro_batch_size=c.micro_batch_size,
        seq_len=c.seq_len,
        hidden_size=hd,
        num_heads=shape.num_heads,
        activation_bytes=a,
        flash_attention=c.flash_attention,
    )
    # Token ids (saved by the embedding), targets (by the loss), positions (one row, shared).
    ids = 2 * tokens * INDEX_BYTES + c.seq_len * INDEX_BYTES
    head = tokens * (2 * hd * a + 2 * STAT_BYTES)  # ln_f's input and output, its statistics
    tied = shape.vocab_size * hd * g if shape.tied_embeddings else 0
    return ActivationTerms(
        at_loss=nl * layer + head + ids,
        logits=logits_bytes(
            micro_batch_size=c.micro_batch_size, seq_len=c.seq_len, vocab_size=shape.vocab_size
        ),
        # The gradients of the MLP hidden (4 hd) and of the residual stream (hd).
        at_unit=tuple(max(0, nl - k) * layer + ids + tokens * 5 * hd * a for k in range(num_units)),
        at_post=tuple(max(0, nl - k - 1) * layer + ids + tokens * hd * a for k in range(num_units)),
        after=ids,
        grad_working=(4 * hd * hd + hd) * g + tied,
        held_grad=tied,
    )


def moments(model: ModelDescription, config: MemoryConfig, states: dict[str, int]) -> list[Moment]:
    """Device bytes per category at each moment of a step that can be the peak, as zeroshard's
    engine runs a model wrapped one unit per block (the root unit owns the rest). ``states`` are
    the device's model states at rest after a step. Backward visits the units in reverse.

    - ``loss backward`` (the loss's backward, before any unit's): every block's saved activations,
      the head's (the final norm's input and output), the logits at the loss; partitioned
      gradients: no full gradient yet; stage 3: the root (kept gathered after forward, or
      gathered again) and the prefetched units.
    - ``unit backward k`` (the k-th unit in backward order, at its first operator): blocks k..
      still hold their activations; the gradients of the MLP hidden (4 hd) and of the residual
      stream (hd); the largest operator's weight gradient before it is added to the flat
      gradient; the tied embedding's gradient from the logits, held by autograd until the
      embedding's own joins it; partitioned gradients: up to ``num_buckets`` earlier units' full
      gradients in flight, and k units' shards reduced; stage 3: the root, this unit and the
      prefetched ones gathered.
    - ``unit post-backward k``: block k's activations are freed (the residual stream's gradient
      remains) and its gradient is collected into one flat buffer: held twice (autograd's
      per-parameter tensors and the copy), before its shard exists (measured: MemTracker's
      peak is here for GPT-2, Llama and BERT at 2 x 16 tokens per rank).
    - ``unit reduction wait k`` (``reduce_stages_input``, more than ``num_buckets`` units
      reduced): unit k's shard exists, autograd's copy is released, and the oldest reduction in
      flight is waited for while the backend holds a staging copy of a unit's gradient.
    - ``bucket reduction`` (replicated parameters, one bucket holding every gradient): the
      bucket's full gradient, the shard being written and the backend's staging copy.
    - ``optimizer step``: all model states and the element-wise optimizer's temporaries: AdamW's
      ``sqrt(v)`` and its quotient for one piece while the previous piece's denominator is still
      bound to the loop variable, three fp32 temporaries of the largest piece (a unit's shard).

    Not counted: the optimizer's step counters (4 bytes per piece) and the scalar loss.
    """
    c, bpp = config, config.bytes_per_param
    part = partition(c.stage)
    mp = c.num_mp_ranks
    backward = unit_numels(model)[::-1]  # non-root units in the order backward visits them
    num_units, root = len(backward), model.root_numel or 0
    act = activation_terms(model, c)
    on_device = {m: c.placement.tier(m) is Tier.DEVICE for m in MODEL_STATES}
    grads_total = math.ceil(bpp.grads * model.num_params / mp)

    def numel(first: int, count: int) -> int:
        """Parameters of ``count`` units from the ``first`` in backward order (clipped)."""
        return sum(backward[max(0, first) : max(0, first + count)])

    def full_grads(first: int, count: int, *, twice: int | None = None) -> int:
        """Unreduced flat gradients alive (partitioned gradients only): with
        ``bucket_per_unit`` those of ``count`` units from ``first`` (each collected from
        autograd's gradients at its reduction, so none exists before) plus unit ``twice``'s
        second copy when given; else the buckets, allocated at their first unit's backward."""
        if not part.gradients or not on_device["grads"]:
            return 0
        if c.bucket_per_unit:
            extra = 0 if twice is None else backward[twice]
            return math.ceil(bpp.grads * (numel(first, count) + extra) / mp)
        return min(c.num_buckets * c.bucket_bytes, grads_total)

    def gathered(first: int, count: int) -> int:
        """Stage 3: the root and ``count`` units from ``first`` (backward order) gathered."""
        if not part.parameters:
            return 0
        return math.ceil(bpp.params * (root + numel(first, count)) / mp)

    def moment(num_reduced: int, **residual: int) -> dict[str, int]:
        """Model states once ``num_reduced`` units have been reduced (all of them and the root
        when ``num_reduced > num_units``), with the residual categories given."""
        now = dict(states)
        if part.gradients:  # shards appear as units are reduced
            reduced = model.num_params if num_reduced > num_units else numel(0, num_reduced)
            now["grads"] = math.ceil(states["grads"] * min(1.0, reduced / model.num_params))
        return now | dict.fromkeys(RESIDUAL_STATES, 0) | residual

    out = [
        (
            "loss backward",
            moment(
                0,
                activation_working=act.at_loss,
                logits=act.logits,
                comm_buckets=full_grads(0, 0),
                gathered_units=gathered(0, c.num_units_prefetch),
            ),
        )
    ]
    # With bucket_per_unit each unit's gradient is reduced at its post-backward; otherwise
    # (replicated parameters) consecutive units share buckets of up to bucket_bytes, and with a
    # single bucket the whole gradient is reduced once, after the last unit's backward.
    bucket_numel = min(model.num_params, c.bucket_bytes // max(1, bpp.params))
    single_bucket = not c.bucket_per_unit and bucket_numel == model.num_params
    largest = bucket_numel if single_bucket else max([root, *backward])
    staging = largest * bpp.grads if c.reduce_stages_input else 0
    for k in range(num_units):
        in_flight = min(k, c.num_buckets)  # earlier units whose reductions are not waited for
        out.append(
            (
                f"unit backward {k}",
                moment(
                    0 if single_bucket else k,
                    activation_working=act.at_unit[k],
                    model_state_working=act.grad_working,
                    comm_buckets=full_grads(k - in_flight, in_flight),
                    gathered_units=gathered(k, 1 + c.num_units_prefetch),
                ),
            )
        )
        # Its post-backward: its activations are gone and its gradient is collected from
        # autograd's per-parameter tensors into one flat buffer (held twice until autograd's are
        # released); its shard comes after, at the reduction.
        post = dict(
            activation_working=act.at_post[k],
            model_state_working=act.held_grad,
            gathered_units=gathered(k, 1 + c.num_units_prefetch),
        )
        out.append(
            (
                f"unit post-backward {k}",
                moment(
                    0 if single_bucket else k,
                    comm_buckets=full_grads(k - in_flight, 1 + in_flight, twice=k),
                    **post,
                ),
            )
        )
        # Its reduction has started (its shard exists) and the oldest reduction in flight is
        # waited for once more than ``num_buckets`` are, the backend staging a copy of that
        # unit's gradient meanwhile.
        if k >= c.num_buckets and not single_bucket and staging and part.optimizer_states:
            out.append(
                (
                    f"unit reduction wait {k}",
                    moment(
                        k + 1,
                        comm_buckets=full_grads(k - in_flight, 1 + in_flight) + staging,
                        **post,
                    ),
                )
            )
    # AdamW's loop: sqrt(v) and its quotient for this piece while the previous piece's
    # denominator is still bound to the loop variable: three temporaries of the largest piece.
    shard_ways = mp * (c.num_shard_ranks if part.optimizer_states else 1)
    # With a single bucket there is one piece per group and no previous denominator: two.
    opt_working = (2 if single_bucket else 3) * 4 * math.ceil(largest / shard_ways)
    if single_bucket and part.optimizer_states:
        # The bucket's reduction, after the last unit's backward: its full gradient, the shard
        # being written and the backend's staging copy of the input.
        out.append(
            (
                "bucket reduction",
                moment(
                    num_units + 1,
                    activation_working=act.after,
                    comm_buckets=full_grads(0, 0) + staging,
                ),
            )
        )
    out.append(
        (
            "optimizer step",
            moment(
                num_units + 1,
                model_state_working=opt_working if on_device["optimizer_states"] else 0,
            ),
        )
    )
    return out
