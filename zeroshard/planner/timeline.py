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
from collections import Counter
from dataclasses import dataclass, replace

from zeroshard.offload.tiers import Tier
from zeroshard.planner import saved, spans
from zeroshard.planner.describe import ModelDescription, trained_bytes
from zeroshard.planner.memory import (
    ACTIVATION_BYTES,
    MODEL_STATES,
    RESIDUAL_STATES,
    BytesPerParam,
    MemoryConfig,
    buffer_bytes,
    logits_bytes,
    model_states,
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
    num_mp_ranks: int = 1,
) -> int:
    """What autograd keeps from one pre-LN block's forward to its backward (the reference GPT),
    per tensor-parallel rank: ``bsz * seq * (4 hd a + 12 hd a / Nm + attention / Nm + 4 * 4)``
    bytes, ``a`` bytes per activation.

    The 16 hd elements per token: ln_1's input and output (2 hd), the fused qkv output (3 hd;
    q, k and v are views of it), the attention output (hd; its transpose-reshape is a view), the
    residual after attention (hd), ln_2's output (hd), the MLP's hidden before and after GELU
    (4 hd + 4 hd). Attention adds one fp32 log-sum-exp per head with ``flash_attention``, else the
    heads x seq probabilities (the papers' ``2 * heads * seq`` bytes in fp16). Each LayerNorm
    saves a mean and a reciprocal deviation in fp32. Measured on CPU (``saved_tensors_hooks``):
    exactly 16 hd + heads + 4 fp32 elements per token. The ZeRO-Infinity paper's AWM counts
    16 hd *bytes* (8 fp16 elements), half of this; Megatron-LM's count (34 hd bytes in fp16 with
    dropout masks) agrees with ours. Split ``Nm`` ways by tensor parallelism (Megatron's
    ``10 + 24 / t``): what lies between a column-parallel linear and its row-parallel partner
    (qkv, the heads, the attention output, the MLP hidden: 12 hd and the attention term); the
    layer norms' inputs and outputs (4 hd) are whole on every rank."""
    attention = num_heads * (STAT_BYTES if flash_attention else seq_len * activation_bytes)
    split = math.ceil((12 * hidden_size * activation_bytes + attention) / num_mp_ranks)
    per_token = 4 * hidden_size * activation_bytes + split + 2 * 2 * STAT_BYTES
    return micro_batch_size * seq_len * per_token


def unit_numels(model: ModelDescription) -> list[int]:
    """Parameters of each unit other than the root, in forward order: the description's own
    (``block_unit_numels``), else one ``block_unit_numel`` per transformer block."""
    if model.block_unit_numels is not None:
        return list(model.block_unit_numels)
    assert model.shape is not None
    return [model.block_unit_numel or 0] * model.shape.num_layers


def bucket_per_unit(model: ModelDescription, stage: int, bucket_bytes: int) -> bool:
    """Whether the engine gives every unit (the root included) a gradient bucket of its own:
    always with partitioned parameters; with replicated ones when no two consecutive units fit
    in ``bucket_bytes`` together (FP32: 4 bytes per element), as ``zeroshard.sharding`` closes
    a bucket before a unit that would overflow it (the root first, then the blocks)."""
    if partition(stage).parameters:
        return True
    if model.block_unit_numels is None and model.shape is None:
        return False
    sizes = [model.root_numel or 0, *unit_numels(model)]
    return all(4 * (a + b) > bucket_bytes for a, b in zip(sizes, sizes[1:]))


def as_engine_buckets(model: ModelDescription, config: MemoryConfig) -> MemoryConfig:
    """``config`` with the engine's gradient buckets (``bucket_per_unit``) and its default
    constant buffers where the plan follows the engine (its timeline, or no checkpoints); the
    papers' sum keeps the given buckets."""
    if config.engine_timeline or not config.activation_checkpointing:
        per_unit = bucket_per_unit(model, config.stage, config.bucket_bytes)
        pooled = config.constant_buffers is not False  # (the engine's default unless said)
        return replace(config, bucket_per_unit=per_unit, constant_buffers=pooled)
    return config


@dataclass(frozen=True, kw_only=True)
class ActivationTerms:
    """The activation bytes alive at each moment of the timeline, and the transient gradients
    beside them (``activation_terms``). Checkpoints (the spans' inputs) are counted apart:
    ``checkpoints_*`` are those on the device."""

    at_loss: int
    """Everything saved, at the loss's backward (checkpoints apart)."""
    logits: int
    """The loss's backward: the logits' share (the reference GPT: the saved fp32
    log-probabilities and two gradients of their size; measured: the two gradients, the saved
    log-probabilities being in ``at_loss``)."""
    at_unit: tuple[int, ...]
    """At each unit's backward (backward order): the activations still saved (with
    checkpoints: its span's, recomputed) and the residual stream's and the largest intermediate
    gradients."""
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
    tied_held: int = 0
    """Of ``held_grad``, what autograd holds wherever gradients go: the head's gradient of a
    weight the embedding shares, kept until the embedding's adds to it (the others are copied
    into a persistent gradient bucket as soon as they are made, where there is one)."""
    at_unit_copied: tuple[int, ...] = ()
    """``at_unit`` with each parameter's gradient alive while the operator making it runs, where
    it is copied into a persistent bucket at once (``SavedActivations.
    unit_backward_copied_bytes``; the largest one's is in ``grad_working`` otherwise); empty:
    not followed."""
    at_unit_held: tuple[int, ...] = ()
    """``at_unit`` with the unit's own parameters' gradients made up to each moment of its
    backward, where autograd holds them until the unit's post-backward (a bucket per unit:
    ``SavedActivations.unit_backward_held_bytes``); empty: not followed (the largest one's is
    in ``grad_working``)."""
    at_forward: int | None = None
    """The forward's own peak (measured on meta: ``SavedActivations.forward_peak_bytes``): what it
    saved so far and what it holds unsaved (the logits, transformers' key cache); ``None``
    without a measurement. With checkpoints, measured with every unit's saves dropped
    (``saved.CheckpointedForward``), the checkpoints apart (``checkpoints_at_forward``)."""
    tied_grad: int = 0
    """The root's own backward (its embeddings), beside ``held_grad``: a weight the head shares
    gets its second gradient there, and autograd sums the two into a third tensor."""
    checkpoints_at_forward: int = 0
    """Checkpoints on the device at ``at_forward``'s moment, beside it (with checkpoints)."""
    checkpoints_at_loss: int = 0
    """Checkpoints on the device at the loss's backward: every span's input."""
    checkpoints_at_unit: tuple[int, ...] = ()
    """... at each unit's backward (backward order): the spans not passed yet."""
    checkpoints_total: int = 0
    """Every span's input, wherever kept (the CPU with ``offload_activations``)."""
    span_first: tuple[int, ...] = ()
    """With checkpoints: per unit in forward order, the first unit of its span."""
    span_inner: tuple[bool, ...] = ()
    """Per unit in forward order, whether it runs inside another unit or not at all (it takes
    no place in a span: ``spans.first_units``); empty: none."""
    unit_ran: tuple[bool, ...] = ()
    """Per unit in forward order, whether its forward ran (measured); empty: all did."""


@dataclass(frozen=True)
class _PerUnit:
    """What autograd saves, per unit in forward order (see ``saved.SavedActivations``)."""

    unit: tuple[int, ...]
    before: tuple[int, ...]
    tail: int
    inputs: tuple[int, ...]
    largest: tuple[int, ...]
    chained: tuple[bool, ...] = ()
    working: tuple[int, ...] = ()
    """Each unit's backward working bytes beyond what is saved up to it (measured:
    ``SavedActivations.unit_backward_bytes``); empty: its input's gradient and one of its
    largest saved tensor's size."""
    inner: tuple[bool, ...] = ()
    """Units run inside another unit, or not at all (``SavedActivations.inner``)."""
    calls: tuple[int, ...] = ()
    """How many times the root called each unit (``SavedActivations.calls``); empty: once."""
    copied: tuple[int, ...] = ()
    """``working`` with parameters' gradients in as they are made
    (``SavedActivations.unit_backward_copied_bytes``); empty: not followed."""
    held: tuple[int, ...] = ()
    """``working`` with the unit's own parameters' gradients kept from their making on
    (``SavedActivations.unit_backward_held_bytes``); empty: not followed."""

    def backward_working(self, i: int, working: tuple[int, ...] | None = None) -> int:
        """Unit ``i``'s: ``working`` (default ``self.working``; ``copied``, ``held``), or where
        it is empty its input's and largest saved tensor's sizes."""
        working = self.working if working is None else working
        return working[i] if working else self.inputs[i] + self.largest[i]


def activation_terms(model: ModelDescription, config: MemoryConfig) -> ActivationTerms:
    """``ActivationTerms`` for ``model`` trained as ``config``: measured on the model itself when
    it was built (``model.activations``, ``zeroshard.planner.saved``), else the reference GPT's
    pre-LN block (``saved_activation_bytes_per_layer``) for ``model.shape``.

    With activation checkpointing every ``ci`` units (``config.activation_checkpointing``), as
    the engine runs it (``zeroshard.residual_states.activations``): a span of ``ci`` units saves
    only its input (1/Nm with Pa or sequence parallelism, on the CPU with
    ``offload_activations``); backward recomputes the span when it reaches its last unit, so that
    all of the span's activations exist then and are freed unit by unit. The span being
    recomputed holds its input as its first unit's saved input (a whole one gathered anew when
    the checkpoint is split)."""
    c, g = config, config.bytes_per_param.grads
    num_units = len(unit_numels(model))
    s = saved.at_config(model, c)
    if s is not None:
        assert len(s.unit_bytes) == num_units, (len(s.unit_bytes), num_units)
        per = _PerUnit(
            s.unit_bytes,
            s.before_unit_bytes,
            s.tail_bytes,
            s.unit_input_bytes,
            s.largest_unit_tensor_bytes,
            s.chained,
            s.unit_backward_bytes,
            s.inner,
            s.calls,
            s.unit_backward_copied_bytes,
            s.unit_backward_held_bytes,
        )
        held = s.tail_param_numel * g  # the head's gradients, until the root's reduction
        tied = 2 * s.tied_param_numel * g
        at_forward = None if c.activation_checkpointing else s.forward_peak_bytes
        checkpointed_forward = s.checkpointed_forward if c.activation_checkpointing else None
        logits = s.loss_gradient_bytes
        grad_working = model.activations.largest_param(c.num_mp_ranks) * g + held
    else:
        per, logits, grad_working, held = _gpt_per_unit(model, c, num_units)
        tied = 2 * held  # (the reference GPT's held gradient is its tied embedding's)
        at_forward, checkpointed_forward = None, None
    checkpointing = c.activation_checkpointing
    ci = c.num_layers_per_checkpoint if checkpointing else 1
    span = spans.first_units(num_units, ci, per.chained, per.inner, per.calls)  # each's first
    starts = spans.span_starts(span, per.calls) if checkpointing else [0] * num_units

    def kept(nbytes: int) -> int:
        """What a span's frame keeps of an input of ``nbytes``: 1/Nm when split (Pa) ..."""
        return math.ceil(nbytes / c.num_mp_ranks) if c.splits_checkpoints else nbytes

    def on_device(nbytes: int) -> int:
        """... and of that, on the device: nothing where offloaded."""
        return 0 if c.offload_activations else kept(nbytes)

    piece, total = [0] * num_units, 0  # piece: one span input a unit opens, on the device
    for i in range(num_units):
        total += starts[i] * kept(per.inputs[i])
        piece[i] = on_device(per.inputs[i])
    ckpt = [n * p for n, p in zip(starts, piece)]  # the span inputs each unit's calls open
    calls = [max(1, n) for n in per.calls] if per.calls else [1] * num_units
    # The extra inputs (``saved.ExtraInput``) the engine keeps on the device: (the first unit
    # of the first span given one, whose backward frees it; bytes). A span's first call's
    # positional ones are the frame's saved inputs, kept as its input is (``on_device``).
    given: list[tuple[int, int]] = []
    kept_too = [0] * num_units  # per unit: of its saves, bytes of extra inputs kept anyway
    for extra in s.extra_inputs if s is not None and checkpointing else ():
        holders = [
            (span[u], on_device(extra.nbytes) if positional and span[u] == u else extra.nbytes)
            for u, positional in extra.given
        ]
        holders = [(f, n) for f, n in holders if n]
        if holders:
            given.append((min(f for f, _ in holders), max(n for _, n in holders)))
        # The unit that saves it (an attention's mask) saves the kept storage itself again
        # when recomputed: no second one beside it. Not where its recomputation gets a copy
        # (a span's first call's positional ones, split with Pa or offloaded: the frame's).
        saver = extra.saved_by
        if saver is None or not holders or given[-1][0] > saver:
            continue
        copied = dict(extra.given).get(saver, False) and span[saver] == saver
        if not copied or on_device(extra.nbytes) == extra.nbytes:
            kept_too[saver] += extra.nbytes
    # What a unit's recomputation saves: one call's share (a unit called n times is n spans),
    # less the extra inputs the engine keeps anyway
    own = [max(0, u - k) // n if checkpointing else u for u, k, n in zip(per.unit, kept_too, calls)]

    # Per unit: whether its input is among its saves (or the root's): a span it opens keeps its
    # input whole on the device as one of its recomputation's saves; else that storage is held
    # by the span's frame alone, a checkpoint beside them until its backward is done.
    input_saved = (s.input_saved if s is not None else ()) or (True,) * num_units

    def moment(i: int) -> tuple[int, int]:
        """Activations saved before unit ``i``'s own (earlier units' of its span, recomputed,
        and the root's before it, inclusive) and checkpoints on the device (the spans opened
        before its span, and its own piece when split: the whole one is the first unit's input)
        while its span is recomputed. A unit called again: at its first call's span or its last
        call's (alone; the earlier calls' inputs still kept), whichever holds more."""
        root = sum(per.before[: i + 1])
        if not checkpointing:
            return sum(own[:i]) + root, 0
        f = span[i]  # (joined a unit called again: its last call's span, after its others)
        mine = piece[f] if c.splits_checkpoints or not input_saved[f] else 0
        opened = sum(ckpt[:f]) + ((starts[f] - 1) * piece[f] if f != i else 0)
        first_call = (sum(own[f:i]) + root, opened + mine)
        if calls[i] == 1:
            return first_call
        split = piece[i] if c.splits_checkpoints else 0
        last_call = (root, sum(ckpt[:i]) + (starts[i] - 1) * piece[i] + split)
        return max(first_call, last_call, key=sum)

    moments = [moment(i) for i in range(num_units)]
    recomputation = s.recomputation if s is not None and checkpointing else None

    def recomputing(i: int) -> int:
        """Activations at unit ``i``'s backward while it recomputes its span (``i`` the span's
        last unit that counts; else 0): the root's saves before it, the gradients flowing into
        it, and at each unit ``j`` of the span run again, the saves of the units before it, its
        input (the span's, or what the unit before it made and left unsaved) and what its own
        forward makes and holds (up to its last save for ``i``: the recomputation stops there).
        A span holding a unit called several times: not followed (0)."""
        if recomputation is None:
            return 0
        f = span[i]
        members = [
            u for u in range(f, num_units) if span[u] == f and not (per.inner and per.inner[u])
        ]
        if not members or members[-1] != i or any(calls[u] > 1 for u in members):
            return 0
        r = recomputation
        root = sum(per.before[: i + 1])
        most = 0
        # The span's input as the recomputation holds it (a checkpoint already where its first
        # unit saves it not and it is kept whole on the device); through the whole
        # recomputation where its first unit saves it not (a copy gathered or read back).
        kept_apart = not input_saved[f] and not c.splits_checkpoints and piece[f]
        span_input = 0 if kept_apart else per.inputs[f]
        for j in members:
            base = span_input if j == f else r.passed[j] + (0 if input_saved[f] else span_input)
            now = r.made_saving[j] if j == i else r.made[j]
            most = max(most, sum(own[f:j]) + base + now)
        return root + most + r.gradients[i]

    recomputed_at = [recomputing(i) for i in range(num_units)]

    def given_beside(i: int | None) -> int:
        """Extra inputs kept on the device at unit ``i``'s backward (forward index; None: the
        loss's): those of spans not passed yet."""
        return sum(n for f, n in given if i is None or f <= i)

    at_forward_checkpoints = 0
    if checkpointed_forward is not None:
        at_forward, at_forward_checkpoints = _checkpointed_forward_peak(
            checkpointed_forward, ckpt, piece, span, starts
        )
    fwd = range(num_units - 1, -1, -1)  # the forward index of each unit in backward order
    saved_all = sum(per.before) + per.tail
    if not c.activation_checkpointing:
        saved_all += sum(per.unit)

    def at_unit(working: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """At each unit's backward (backward order), with ``working`` (empty: not followed)."""
        if working == ():
            return ()
        return tuple(
            max(moments[i][0] + own[i] + per.backward_working(i, working), recomputed_at[i])
            for i in fwd
        )

    return ActivationTerms(
        at_loss=saved_all,
        logits=logits,
        at_unit=at_unit(),
        at_unit_copied=at_unit(per.copied),
        at_unit_held=at_unit(per.held),
        at_post=tuple(moments[i][0] + per.inputs[i] for i in fwd),
        after=per.before[0] if num_units else 0,
        grad_working=grad_working,
        held_grad=held,
        tied_held=tied // 2,
        tied_grad=tied,
        at_forward=at_forward,
        checkpoints_at_forward=at_forward_checkpoints,
        checkpoints_at_loss=sum(ckpt) + given_beside(None),
        checkpoints_at_unit=tuple(moments[i][1] + given_beside(i) for i in fwd),
        checkpoints_total=total,
        span_first=tuple(span) if c.activation_checkpointing else (),
        span_inner=per.inner,
        unit_ran=s.ran if s is not None else (),
    )


def _checkpointed_forward_peak(
    forward: saved.CheckpointedForward,
    ckpt: list[int],
    piece: list[int],
    span: list[int],
    starts: list[int],
) -> tuple[int, int]:
    """The forward's peak under checkpointing: (bytes alive that the model's code makes and
    holds, checkpoints on the device beside them), at the phase where their sum is largest.
    While unit ``i`` runs, the spans opened before its span's are kept, and its span's own input
    too where ``i`` does not open it (where it does, the model's code still holds that input,
    counted in the forward's bytes); in the root after unit ``i``, every span opened so far. A
    span input the model's code still holds is counted in the forward's bytes alone.
    ``ckpt``, ``piece``, ``span``, ``starts``: per unit in forward order, as
    ``activation_terms`` computes them."""
    in_kept, after_kept = forward.in_unit_kept, forward.after_unit_kept

    def opened(upto: int, kept: frozenset[int]) -> int:
        """The spans units before ``upto`` opened, but the input the model's code still holds
        (counted in the forward's bytes: the checkpoint is the same storage)."""
        return sum(ckpt[u] - (piece[u] if u in kept and starts[u] else 0) for u in range(upto))

    best = (forward.before, 0)
    for i, (inside, after) in enumerate(zip(forward.in_unit, forward.after_unit)):
        if not inside:  # (never called from the root)
            continue
        f = span[i]
        own = (starts[f] - (f == i) - (f != i and f in in_kept[i])) * piece[f]
        held = opened(f, in_kept[i]) + max(0, own)
        best = max(best, (inside, held), (after, opened(i + 1, after_kept[i])), key=sum)
    return best


def _gpt_per_unit(
    model: ModelDescription, c: MemoryConfig, num_units: int
) -> tuple[_PerUnit, int, int, int]:
    """The reference GPT's pre-LN blocks for ``model.shape``, spread evenly over the units:
    what they save, the logits' share, the largest gradients outside the flat buffers and the
    head's held ones (``ActivationTerms``)."""
    shape = model.shape
    assert shape is not None
    nl, hd, a, g = shape.num_layers, shape.hidden_size, c.activation_bytes, c.bytes_per_param.grads
    tokens = c.micro_batch_size * c.seq_len
    layer = saved_activation_bytes_per_layer(
        micro_batch_size=c.micro_batch_size,
        seq_len=c.seq_len,
        hidden_size=hd,
        num_heads=shape.num_heads,
        activation_bytes=a,
        flash_attention=c.flash_attention,
        num_mp_ranks=c.num_mp_ranks,
    )
    # Token ids (saved by the embedding), targets (by the loss), positions (one row, shared).
    ids = 2 * tokens * INDEX_BYTES + c.seq_len * INDEX_BYTES
    head = tokens * (2 * hd * a + 2 * STAT_BYTES)  # ln_f's input and output, its statistics
    tied = shape.vocab_size * hd * g if shape.tied_embeddings else 0
    n = max(1, num_units)
    layers = [nl // n + (i < nl % n) for i in range(num_units)]
    per = _PerUnit(
        unit=tuple(k * layer for k in layers),
        before=(ids, *[0] * (num_units - 1)),
        tail=head + (0 if num_units else nl * layer),  # (the model one unit: the root saves all)
        inputs=(tokens * hd * a,) * num_units,  # the residual stream, and its gradient
        largest=(math.ceil(tokens * 4 * hd * a / c.num_mp_ranks),) * num_units,  # MLP hidden
    )
    logits = logits_bytes(
        micro_batch_size=c.micro_batch_size, seq_len=c.seq_len, vocab_size=shape.vocab_size
    )
    grad_working = math.ceil((4 * hd * hd + hd) * g / c.num_mp_ranks) + tied
    return per, logits, grad_working, tied


def _grad_master_bytes(model: ModelDescription, c: MemoryConfig) -> int:
    """Device bytes of the FP32 gradient (``BytesPerParam.grad_master``) among ``states``."""
    if not c.bytes_per_param.grad_master:
        return 0
    return model_states(
        model.num_params,
        stage=c.stage,
        num_dp_ranks=c.num_shard_ranks,
        num_mp_ranks=c.num_mp_ranks,
        bytes_per_param=BytesPerParam(
            params=0, grads=0, optimizer_states=0, grad_master=c.bytes_per_param.grad_master
        ),
        num_params_replicated=model.replicated_numel,
        num_params_trainable=model.num_trainable_params,
    )[Tier.DEVICE]["grads"]


_LENT = "_in_gather_buffers"
"""A moment's collected gradients held in the gather buffers' pool (``moments``'s ``lent``)."""


def moments(model: ModelDescription, config: MemoryConfig, states: dict[str, int]) -> list[Moment]:
    """Device bytes per category at each moment of a step that can be the peak, as zeroshard's
    engine runs a model wrapped one unit per block (the root unit owns the rest). ``states`` are
    the device's model states at rest after a step. Backward visits the units in reverse.

    ``K`` is ``config.num_buckets``: with ``bucket_per_unit``, the engine's
    ``max_inflight_reductions``, counting the one being started (1: a unit's reduction overlaps
    the next unit's backward and is finished before that unit's gradient is collected). During
    unit k's backward ``min(k, K)`` earlier reductions are in flight, each holding its unit's
    full gradient and (partitioned gradients) its shard-sized output.

    - ``loss forward`` (a built model measured on meta, no checkpoints): the forward's own peak,
      what it saved so far and what it holds unsaved (the logits, an output its code keeps,
      transformers' key cache); above the loss backward for T5.
    - ``loss backward`` (the loss's backward, before any unit's): every block's saved activations,
      the head's (the final norm's input and output), the logits at the loss; partitioned
      gradients: no full gradient yet; stage 3: the root (kept gathered after forward, or
      gathered again) and the prefetched units.
    - ``unit backward k`` (the k-th unit in backward order, at its first operator): blocks k..
      still hold their activations; the gradients of the MLP hidden (4 hd) and of the residual
      stream (hd); the largest operator's weight gradient before it is accumulated; the tied
      embedding's gradient from the logits, held by autograd until the embedding's own joins it;
      partitioned gradients: ``min(k, K)`` reductions in flight, k units' shards; stage 3: the
      root, this unit and the prefetched ones gathered.
    - ``unit backward end k`` (its post-backward hook, before anything is freed): its activations
      are gone (the residual stream's gradient remains), its whole gradient exists (autograd's
      per-parameter tensors, partitioned gradients), the same reductions in flight and units
      gathered as during its backward.

    At the post-backward the engine first frees the unit's gathered parameters (stage 3: the root
    and the prefetched units remain), then finishes the oldest reductions until ``K - 1`` remain,
    then collects the unit's gradient and starts its reduce-scatter:

    - ``unit reduction wait k`` (``reduce_stages_input``, k >= K): the oldest reduction in
      flight is waited for while the backend holds a staging copy of its input (that unit's
      full gradient); the unit's own gradient is still autograd's.
    - ``unit post-backward k`` (the collect): ``min(k, K - 1)`` reductions in flight; the unit's
      gradient is held twice, autograd's per-parameter tensors and the new flat buffer in the
      reduce dtype they are copied into (released one by one: the buffer and all of autograd's
      at its start). Its shard-sized output comes after, when autograd's are gone.

    - ``root backward`` (a head tied to the input embedding): the embedding's backward makes the
      shared weight's second gradient beside the head's, and autograd sums them into a third.

    With ``bucket_per_unit`` the root is reduced the same way, last, by the end-of-backward
    callback (``root backward end``, ``root reduction wait``, ``root post-backward``: its
    gradient includes the head's, held since the loss), then ``end of backward`` waits for the
    root's own reduction, staging its input; with replicated parameters the gradients live in
    persistent buffers (``states``) and only the staging copy comes and goes.

    - ``bucket reduction`` (replicated parameters, one bucket holding every gradient): the
      bucket's full gradient, the shard being written and the backend's staging copy.
    - ``optimizer step``: all model states, every gradient shard reduced. zeroshard builds
      Adam/AdamW fused (``fused=True`` where the device has the kernels: CPU and GPUs), one
      in-place kernel per piece: no temporaries (measured: none on CPU).

    With ``step_in_backward`` each reduction's finish steps its unit's optimizer sub-group (fused
    AdamW: no temporaries) and drops its shard, and the reduce-scatter writes into the full
    gradient's own slice: no shard exists at any moment (``grads`` 0) and there is no
    ``optimizer step`` moment. With ``grad_accum`` > 1 the moments are the last micro-batch's,
    with every gradient the earlier ones left (``memory._grads_as_trained``: the shards, or the
    whole local gradient when accumulated unreduced). A reduction in flight holds its
    shard-sized output in the reduce dtype (the gradients', ``bpp.grads``); where that is
    narrower than the shard the optimizer reads (mixed precision's FP32 ``bpp.grad_master``),
    the shard is made from it as the reduction finishes, beside it and the full gradient:
    ``unit reduction finish k`` (the oldest reduction's, before unit k's collect), ``root
    reduction finish`` (the last unit's, before the root's collect) and ``root reduction
    finish end`` (the root's own); with a single bucket, ``bucket reduction`` holds both.

    Not counted: the optimizer's step counters (4 bytes per piece) and the scalar loss.
    """
    c, bpp = config, config.bytes_per_param
    part = partition(c.stage)
    mp = c.num_mp_ranks
    act = activation_terms(model, c)
    # Non-root units in the order backward visits them; one whose forward did not run is never
    # gathered and makes no gradient.
    numels = unit_numels(model)
    ran = act.unit_ran or (True,) * len(numels)
    whole = [n if ran[i] else 0 for i, n in enumerate(numels)][::-1]
    # Bytes below divide a unit's parameters by Nm: where each unit's split is known, a unit
    # counts Nm x what a tensor-parallel rank holds of it (its split parameters 1/Nm, the rest
    # whole: an MoE layer's experts the plan leaves whole were planned 1/Nm, 11% low at tp 2).
    held = model.unit_rank_numels(mp) if mp > 1 else None
    backward = whole if held is None else [h * mp if r else 0 for h, r in zip(held[1], ran)][::-1]
    # The share of a rank's gradients reduced once some units are: what it holds of each unit
    # over what it holds in all (its replicated parameters whole, the split ones 1/Nm); the
    # whole model's shares put the unit's gradient shards in too early with tensor parallelism
    # (Llama at tp 2, 4 x 64 tokens, checkpoint_every=1: 26% of a unit's gradient too much).
    rank_whole = None if held is None else [h if r else 0 for h, r in zip(held[1], ran)][::-1]
    rank_total = None if held is None else held[0] + sum(held[1])
    runs = ran[::-1]
    num_units, root = len(backward), model.root_numel or 0
    on_device = {m: c.placement.tier(m) is Tier.DEVICE for m in MODEL_STATES}
    grads_total = trained_bytes(
        bpp.grads * model.mp_numel(mp), model.num_params, model.num_trainable_params
    )
    sib = c.step_in_backward
    num_inflight = c.num_buckets  # K, counting the reduction being started
    # Replicated gradients: an FP32 gradient beside the working copies appears at the reduction.
    # Stages 2-3 accumulating unreduced keep the whole local gradient instead (``grads``), and
    # the FP32 shards appear as the last micro-batch reduces.
    accumulating = c.accumulate_unreduced and c.grad_accum > 1 and part.gradients
    late = on_device["grads"] and (accumulating or not part.gradients)
    late_grads = _grad_master_bytes(model, c) if late else 0

    def numel(first: int, count: int, units: list[int] = backward) -> int:
        """Parameters of ``count`` units from the ``first`` in backward order (clipped)."""
        return sum(units[max(0, first) : max(0, first + count)])

    def ahead(first: int, count: int) -> int:
        """``numel``, units that never run passed over: the engine gathers and prefetches along
        the forward it recorded, in which they are not (one took a prefetched unit's place:
        stage 3 planned 5.5% low)."""
        if first < 0:
            first, count = 0, count + first
        total, i = 0, first
        while count > 0 and i < num_units:
            if runs[i]:
                total, count = total + backward[i], count - 1
            i += 1
        return total

    def grad_bytes(n: int) -> int:
        return math.ceil(bpp.grads * n / mp)

    def full_grads(first: int, count: int) -> int:
        """Unreduced flat gradients alive (partitioned gradients only): with
        ``bucket_per_unit`` those of ``count`` units from ``first`` (each collected from
        autograd's gradients at its reduction, so none exists before); else the buckets,
        allocated at their first unit's backward: the K reductions in flight and the one
        filling beside them."""
        if not part.gradients:  # (offloaded gradients too: the engine collects a unit's on
            return 0  # the device and reduces it there; only the reduced shard moves)
        if accumulating and not c.bucket_per_unit:  # the buckets are the local gradient,
            return 0  # counted in ``grads``
        if c.bucket_per_unit:
            return grad_bytes(numel(first, count))
        return min((c.num_buckets + 1) * c.bucket_bytes, grads_total)

    # Partitioned gradients with a bucket per unit: autograd holds each unit's gradients until
    # the unit's collect; otherwise they are copied into persistent buckets as they are made.
    held_until_collect = part.gradients and c.bucket_per_unit
    point_to_point = c.point_to_point_reductions and held_until_collect

    def own_grad(n: int) -> int:
        """A unit's gradient of ``n`` parameters outside the persistent buffers: autograd's own
        tensors until the collect (``held_until_collect``)."""
        return grad_bytes(n) if held_until_collect else 0

    def gathered(first: int, count: int, *, with_root: bool = True) -> int:
        """Stage 3: the root and ``count`` units from ``first`` (backward order) gathered."""
        if not part.parameters:
            return 0
        return bpp.params * root * with_root + math.ceil(bpp.params * ahead(first, count) / mp)

    def recomputed(k: int) -> int:
        """Stage 3: the unit gathered for its recomputation beside this one and the prefetched
        ones, where unit ``k`` (backward order) ends a span (``spans.recompute_freed``)."""
        if not part.parameters:
            return 0
        i, prefetch = num_units - 1 - k, c.num_units_prefetch
        freed = spans.recompute_freed(act.span_first, i, prefetch, act.span_inner)
        return math.ceil(bpp.params * max((backward[-1 - j] for j in freed), default=0) / mp)

    # A reduce-scatter in flight writes its shard-sized output in the reduce dtype (the
    # gradients', ``bpp.grads``); the shard the optimizer reads (FP32 with mixed precision,
    # ``bpp.grad_master``) is made from it when the reduction finishes. Narrower, the outputs
    # in flight count that much less than finished shards (BF16: half; counted as FP32 shards,
    # a MoE at stage 3 was planned 2-4% over).
    shard_bpe = bpp.grad_master or bpp.grads
    narrow = bpp.grads / shard_bpe if part.gradients and 0 < bpp.grads != shard_bpe else 1.0

    def share(first: int, count: int) -> float:
        """The share of this rank's gradients held by ``count`` units from ``first`` (backward
        order)."""
        if rank_whole is not None:  # (of what this tensor-parallel rank holds)
            return numel(first, count, rank_whole) / max(1, rank_total)
        return numel(first, count, whole) / model.num_params

    def moment(num_reduced: int, flying: int = 0, **residual: int) -> dict[str, int]:
        """Model states once ``num_reduced`` units' reductions have started (their shard-sized
        outputs exist; all of them and the root's when ``num_reduced > num_units``), the last
        ``flying`` of them still in flight (their outputs in the reduce dtype; the root's
        alone when ``num_reduced > num_units``), with the residual categories given."""
        now = dict(states)
        idle = dict.fromkeys(RESIDUAL_STATES, 0) | {"buffers": buffer_bytes(model, bpp)}
        if num_reduced > num_units:
            fraction = 1.0
            in_flight = (1.0 - share(0, num_units)) if flying else 0.0  # (the root's)
        else:
            fraction = min(1.0, share(0, num_reduced))
            in_flight = share(num_reduced - flying, flying) if flying else 0.0
        if c.grad_accum > 1 and part.gradients and not late_grads:  # the last micro-batch's:
            return now | idle | residual  # the earlier ones' gradients all held
        if part.gradients and not accumulating:  # shards appear as units are reduced
            now["grads"] = math.ceil(states["grads"] * fraction)
            if in_flight and narrow != 1.0:
                now["grads"] -= math.floor(states["grads"] * in_flight * (1.0 - narrow))
        elif late_grads:
            late = late_grads - math.ceil(late_grads * fraction)
            now["grads"] = states["grads"] - late
        if sib:
            now["grads"] = 0  # each shard is stepped and dropped as its reduction finishes
        return now | idle | residual

    out = []
    if act.at_forward is not None:
        # The forward's own peak, at the loss or inside it: T5's is above its loss backward
        # (its logits, its decoder's unscaled output and transformers' key cache alive unsaved).
        out.append(
            (
                "loss forward",
                moment(0, activation_working=act.at_forward,
                       activation_checkpoints=act.checkpoints_at_forward,
                       gathered_units=gathered(0, c.num_units_prefetch)),
            )
        )  # fmt: skip
    out += [
        (
            "loss backward",
            moment(
                0,
                activation_working=act.at_loss,
                activation_checkpoints=act.checkpoints_at_loss,
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
    # Gradients that go into persistent buckets as autograd makes them (stages 0-1, stage 2's
    # buckets shared by units) live only while the operator making them runs, and the head's
    # are in the root's bucket: autograd holds a tied head's alone (until the embedding's adds
    # to it). At stage 2 the root has a bucket of its own once the model fills more than one,
    # and its gradients are autograd's until its reduction, as at stage 3. (Counted as held,
    # with a weight's beside every unit's peak, they put Llama 3.3% over its peak at --ci 1.)
    head_grads = act.tied_held if not part.gradients or single_bucket else act.held_grad
    if not held_until_collect and act.at_unit_copied:  # (followed: each weight's as made)
        at_unit, unit_grads = act.at_unit_copied, head_grads
    elif held_until_collect and act.at_unit_held and not accumulating:
        # (followed: those made so far, held; accumulating unreduced, the last micro-batch's
        # may be added into the earlier ones', counted in ``grads``)
        at_unit, unit_grads = act.at_unit_held, head_grads
    else:  # (the largest weight's gradient beside every unit's peak)
        at_unit, unit_grads = act.at_unit, act.grad_working - act.held_grad + head_grads
    stages_input = c.reduce_stages_input and part.optimizer_states  # a reduce-scatter's input

    def staging(n: int) -> int:
        """The backend's copy of a waited reduce-scatter's input of ``n`` parameters."""
        return grad_bytes(n) if stages_input else 0

    def waited(j: int) -> int:
        """Parameters of the reduction waited for: unit ``j``'s, or (shared buckets) at most a
        bucket's, which a larger unit fills alone."""
        return backward[j] if c.bucket_per_unit else max(bucket_numel, backward[j])

    pooled = part.parameters and c.constant_buffers
    # Into a buffer of the same bytes as the gathered unit; stepping in backward, the
    # reduce-scatter writes into the collected gradient's own slice: nothing is borrowed.
    borrows = (
        pooled and c.gradients_in_gather_buffers and c.bucket_per_unit and not sib
    ) and bpp.grads == bpp.params

    def lent(flat_grads: int) -> dict[str, int]:
        """Collected gradients of ``flat_grads`` bytes in gather buffers at a moment, each in
        the one its unit's parameters gave back (``MemoryConfig.gradients_in_gather_buffers``),
        until its reduction finishes: the pool's bytes, not ``comm_buckets``."""
        return {_LENT: flat_grads if borrows else 0}

    def reducing(first: int, count: int, *, extra: int = 0, collected: int = 0) -> dict[str, int]:
        """``comm_buckets`` with ``count`` reductions in flight from ``first`` (backward order):
        their flat gradients and, for reduce-scatters of sends and receives (gloo) over 3 or
        more ranks, each one's inbox (its later sources' messages arrive through one
        message-sized buffer, at most its output shard); plus ``extra`` (autograd's own
        gradients, a staging copy) and ``collected`` (a gradient just collected into a flat
        buffer). The flat gradients are ``lent`` from the gather buffers where they borrow."""
        inboxes = 0
        if point_to_point and c.num_shard_ranks >= 3:
            from zeroshard.collectives import REDUCE_CHUNK_BYTES  # (torch: only when asked)

            for n in backward[max(0, first) : max(0, first + count)]:
                inboxes += min(math.ceil(grad_bytes(n) / c.num_shard_ranks), REDUCE_CHUNK_BYTES)
        flat = full_grads(first, count) + collected
        return {"comm_buckets": flat + inboxes + extra, **lent(flat)}

    def fly(count: int) -> int:
        """Reductions in flight, as ``moment`` counts them: a unit's each with a bucket per
        unit (shared buckets reduce several units at once, counted as started)."""
        return count if c.bucket_per_unit else 0

    # A reduction finishing in a narrower reduce dtype makes its FP32 shard from its output
    # while both (and its full gradient) are alive: a moment of its own, where the output
    # alone was counted (OLMoE at stage 2, BF16: 1.9% low at the bucket's reduction).
    finishes = part.gradients and narrow != 1.0 and not accumulating and not sib
    finishes = finishes and c.grad_accum == 1

    def finishing(m: dict[str, int], shard: float) -> dict[str, int]:
        """``m`` with the FP32 shard of the reduction finishing (``shard``: its share of this
        rank's gradients) beside its output."""
        return m | {"grads": m["grads"] + math.ceil(states["grads"] * shard)}

    for k in range(num_units):
        in_flight = min(k, num_inflight)  # earlier units whose reductions are not finished
        reduced = 0 if single_bucket else k
        prefetched = gathered(k + 1, c.num_units_prefetch, with_root=True)
        gathered_now = gathered(k, 1 + c.num_units_prefetch) + recomputed(k)
        out.append(
            (
                f"unit backward {k}",
                moment(
                    reduced,
                    fly(in_flight),
                    activation_working=at_unit[k],
                    activation_checkpoints=act.checkpoints_at_unit[k],
                    model_state_working=unit_grads,
                    gathered_units=gathered_now,
                    **reducing(k - in_flight, in_flight),
                ),
            )
        )
        after = dict(
            activation_working=act.at_post[k],
            activation_checkpoints=act.checkpoints_at_unit[k],
            model_state_working=head_grads,
        )
        if own_grad(backward[k]):
            out.append(
                (
                    f"unit backward end {k}",
                    moment(
                        reduced,
                        fly(in_flight),
                        **after,
                        gathered_units=gathered_now,
                        **reducing(k - in_flight, in_flight, extra=own_grad(backward[k])),
                    ),
                )
            )
        # Its parameters freed, the oldest reduction is waited for once K are in flight (the
        # backend staging a copy of that unit's gradient meanwhile); then its gradient is
        # collected into one flat buffer (held twice until autograd's are released).
        waits = k >= num_inflight and not single_bucket and stages_input
        if waits:
            out.append(
                (
                    f"unit reduction wait {k}",
                    moment(
                        reduced,
                        fly(in_flight),
                        **after,
                        gathered_units=prefetched,
                        **reducing(
                            k - in_flight,
                            in_flight,
                            extra=own_grad(backward[k]) + staging(waited(k - num_inflight)),
                        ),
                    ),
                )
            )
        if finishes and c.bucket_per_unit and k >= num_inflight:
            # (then the oldest reduction finishes, the others still in flight)
            out.append(
                (
                    f"unit reduction finish {k}",
                    finishing(
                        moment(
                            reduced,
                            fly(in_flight),
                            **after,
                            gathered_units=prefetched,
                            **reducing(k - in_flight, in_flight, extra=own_grad(backward[k])),
                        ),
                        share(k - num_inflight, 1),
                    ),
                )
            )
        left = min(k, num_inflight - 1)  # still in flight at the collect
        out.append(
            (
                f"unit post-backward {k}",
                moment(
                    reduced,
                    fly(left),
                    **after,
                    gathered_units=prefetched,
                    **reducing(
                        k - left, left, extra=own_grad(backward[k]), collected=own_grad(backward[k])
                    ),
                ),
            )
        )
    if act.tied_grad:
        # The root's own backward, before the end-of-backward callback: the input embedding's
        # gradient of a weight the head shares, added to the head's (held since the loss's
        # backward) into a new tensor. It was missing: a tied GPT-2 at stage 3 was 10.5% low.
        in_flight = min(num_units, num_inflight)
        out.append(
            (
                "root backward",
                moment(
                    0 if single_bucket else num_units,
                    fly(in_flight),
                    activation_working=act.after,
                    model_state_working=head_grads + act.tied_grad,
                    gathered_units=gathered(0, 0),
                    **reducing(num_units - in_flight, in_flight),
                ),
            )
        )
    if c.bucket_per_unit:
        # The root, last, by the end-of-backward callback: its gradient (the head's included)
        # collected and reduced like a unit's, then every reduction finished.
        in_flight = min(num_units, num_inflight)
        left = min(num_units, num_inflight - 1)
        end = dict(activation_working=act.after)
        out.append(
            (
                "root backward end",
                moment(
                    num_units,
                    fly(in_flight),
                    **end,
                    gathered_units=gathered(0, 0),
                    **reducing(num_units - in_flight, in_flight, extra=own_grad(root)),
                ),
            )
        )
        if num_units >= num_inflight and stages_input:
            out.append(
                (
                    "root reduction wait",
                    moment(
                        num_units,
                        fly(in_flight),
                        **end,
                        **reducing(
                            num_units - in_flight,
                            in_flight,
                            extra=own_grad(root) + staging(waited(num_units - num_inflight)),
                        ),
                    ),
                )
            )
        if finishes and num_units >= num_inflight:
            out.append(
                (
                    "root reduction finish",
                    finishing(
                        moment(
                            num_units,
                            fly(in_flight),
                            **end,
                            **reducing(num_units - in_flight, in_flight, extra=own_grad(root)),
                        ),
                        share(num_units - num_inflight, 1),
                    ),
                )
            )
        out.append(
            (
                "root post-backward",
                moment(
                    num_units,
                    fly(left),
                    **end,
                    **reducing(
                        num_units - left, left, extra=own_grad(root), collected=own_grad(root)
                    ),
                ),
            )
        )
        if stages_input:
            # The reductions left finished, oldest first: the root's last, alone by then, its
            # input staged meanwhile.
            out.append(
                (
                    "end of backward",
                    moment(
                        num_units + 1,
                        1,  # (the root's)
                        **end,
                        **reducing(0, 0, extra=staging(root), collected=own_grad(root)),
                    ),
                )
            )
        if finishes:
            # The root's own reduction finishing last (every unit's shard made).
            out.append(
                (
                    "root reduction finish end",
                    finishing(
                        moment(
                            num_units + 1,
                            1,
                            **end,
                            **reducing(0, 0, collected=own_grad(root)),
                        ),
                        1.0 - share(0, num_units),
                    ),
                )
            )
    if single_bucket and part.optimizer_states:
        # The bucket's reduction, after the last unit's backward: its full gradient, the shard
        # being written and the backend's staging copy of the input.
        out.append(
            (
                "bucket reduction",
                moment(
                    num_units + 1,
                    activation_working=act.after,
                    # (and where the reduce dtype is narrower, the output beside the shard)
                    comm_buckets=full_grads(0, 0)
                    + staging(bucket_numel)
                    + (math.ceil(states["grads"] * narrow) if finishes else 0),
                ),
            )
        )
    if not sib:
        out.append(
            # zeroshard builds Adam/AdamW fused (one in-place kernel per piece): no temporaries.
            ("optimizer step", moment(num_units + 1))
        )
    # The pool holds, lent or free, as much as the step gathers at once (per size as many
    # buffers as were lent at once stay free). With gradients in its buffers it holds up to the
    # most lent and borrowed at once (``room``): a buffer a gradient took is replaced by a new
    # one at the next gather, and kept, free, when the gradient gives it back.
    held = max(m["gathered_units"] for _, m in out)
    room = max(m["gathered_units"] + m.get(_LENT, 0) for _, m in out)
    # Buffers of one size stand in for each other only: units of many sizes (T5's five) leave
    # one free per size, up to ``room`` (an idle encoder-block buffer through T5's forward).
    unit_bytes = [gathered(k, 1, with_root=False) for k in range(num_units)]
    sizes, window = Counter(unit_bytes), 1 + c.num_units_prefetch
    # Per size, the most lent at once: of ``window`` consecutive units, those of that size (a
    # uniform stack: the window; blocks of two sizes by turns, one each: a buffer more per
    # size was planned, +10% for a MoE stack with experts every other layer).
    windows = [Counter(unit_bytes[i : i + window]) for i in range(max(1, num_units - window + 1))]
    at_once = {b: max(w[b] for w in windows) for b in sizes}
    per_size = gathered(0, 0) + sum(b * n for b, n in at_once.items())
    kept = min(room, max(held, per_size))

    def trimmed(k: int) -> int:
        """The most the pool holds from unit ``k``'s backward on (``BufferPool.trim`` after its
        prefetch frees what no gather left needs): the root and, per size, the buffers lent and
        borrowed with as many free as gathers are still to come, or as the next step keeps."""
        back = Counter(unit_bytes[k : k + window])
        if borrows:
            back.update(unit_bytes[max(0, k - num_inflight) : k])
        upcoming = Counter(unit_bytes[k + window :])
        per = {b: max(back[b] + upcoming[b], at_once[b]) for b in sizes}
        return gathered(0, 0) + sum(b * n for b, n in per.items())

    starts = {f"unit backward {k}": k for k in range(num_units)}
    cap = math.inf
    borrowed = False  # (since the first collect; after the step the free ones are as many as
    for name, m in out:  # were lent at once per size again)
        in_pool = m.pop(_LENT, 0)
        borrowed = (borrowed or in_pool > 0) and name != "optimizer step"
        if pooled:
            if name in starts:
                cap = min(cap, trimmed(starts[name]))
            in_use = m["gathered_units"] + in_pool
            pool = max(kept, min(room, in_use + held * borrowed))
            m["gathered_units"] = max(in_use, min(pool, cap))
            m["comm_buckets"] -= in_pool
    return out
