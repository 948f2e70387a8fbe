"""Memory per device, as the ZeRO papers count it, in bytes by category and memory tier.

Model states (§3, §4): parameters, gradients, optimizer states; each is replicated or split 1/Nd
across data-parallel ranks as ``zeroshard.stages`` says (1/k with hybrid sharding in groups of k
ranks: ``MemoryConfig.shard_group_size``), split 1/Nm across model-parallel ranks,
and lives on the device, in CPU memory or on NVMe (ZeRO-Offload / ZeRO-Infinity).

Residual states (§5, §8): activation checkpoints, the activation working memory of one checkpoint
span, the model-state working memory of the largest operator, stage 3's gathered units, the
communication buckets, the logits and an allowance for fragmentation.

Two ways to count them:

- the papers' allowance (``activation_checkpointing=True``, the default): every residual category
  at its largest, summed, as ZeRO and ZeRO-Infinity size a device (activations from the papers'
  formulas, or, for a built model, from what autograd saves in it: ``_measured_checkpoints``);
- the engine's timeline (``activation_checkpointing=False``): what zeroshard's engine keeps alive,
  moment by moment through a step, for a model wrapped one unit per block
  (``zeroshard.planner.timeline``). ``MemoryBreakdown.peak`` is the composition at the largest
  moment; ``zeroshard.planner.calibrate`` holds it against MemTracker's per-rank peak.

Every function is pure arithmetic on numbers. A ``MemoryBreakdown`` names every category on every
tier (zeros included), so a calibration can hold it category by category against measured bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zeroshard.offload.tiers import Tier
from zeroshard.planner import saved
from zeroshard.planner.comm import num_shard_groups
from zeroshard.planner.describe import ModelDescription, trained_bytes
from zeroshard.planner.placement import MODEL_STATES as MODEL_STATES  # (re-exported: the
from zeroshard.planner.placement import OFFLOADS as OFFLOADS  # planner's names are memory's)
from zeroshard.planner.placement import Placement as Placement
from zeroshard.planner.placement import at_stage as at_stage
from zeroshard.planner.placement import offload_name as offload_name
from zeroshard.planner.placement import placement_problem as placement_problem
from zeroshard.planner.residual_formulas import ACTIVATION_BYTES as ACTIVATION_BYTES
from zeroshard.planner.residual_formulas import (  # (re-exported, as the placement's names)
    LOGIT_BYTES_PER_ELEMENT as LOGIT_BYTES_PER_ELEMENT,
)
from zeroshard.planner.residual_formulas import (
    activation_checkpoint_bytes as activation_checkpoint_bytes,
)
from zeroshard.planner.residual_formulas import activation_working_bytes as activation_working_bytes
from zeroshard.planner.residual_formulas import logits_bytes as logits_bytes
from zeroshard.planner.residual_formulas import (
    model_state_working_bytes as model_state_working_bytes,
)
from zeroshard.planner.staging import MASTER_BYTES, offload_staging_bytes
from zeroshard.stages import partition

RESIDUAL_STATES = (
    "activation_checkpoints",
    "activation_working",
    "model_state_working",
    "gathered_units",
    "comm_buckets",
    "logits",
    "offload_staging",
    "buffers",
    "fragmentation",
)
"""Residual-state categories (see ``residual_states`` for what each counts)."""

TIERS = tuple(Tier)


@dataclass(frozen=True, kw_only=True)
class BytesPerParam:
    """Bytes each parameter costs, per model state (mixed-precision Adam by default)."""

    params: int = 2
    """Low-precision parameters used by forward and backward (fp16/bf16: 2)."""
    grads: int = 2
    """Low-precision gradients (2)."""
    optimizer_states: int = 12
    """K: fp32 master weights, momentum and variance (12); ZeRO-Infinity adds fp32 grads (16)."""
    grad_master: int = 0
    """An FP32 gradient shard (4) beside the low-precision gradients, partitioned as the
    optimizer states are (zeroshard's mixed precision: the optimizer reads it); counted as
    ``grads``."""
    working_copies: bool = False
    """``params`` and ``grads`` are low-precision working copies of FP32 states (the masters in
    K, ``grad_master``): a stage that partitions them keeps none at rest, since each unit's are
    gathered or produced and then freed (counted by the timeline), as zeroshard's engine does."""

    def __post_init__(self) -> None:
        for name in ("params", "grads", "optimizer_states", "grad_master"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"BytesPerParam.{name} must be an int >= 0, got {value!r}")
        if self.total == 0:
            raise ValueError("BytesPerParam: all three are 0; give at least one a size")

    @property
    def total(self) -> int:
        """2 + 2 + K (+ the FP32 gradient): 16 for ZeRO, 20 for ZeRO-Infinity."""
        return self.params + self.grads + self.optimizer_states + self.grad_master


ZERO = BytesPerParam()
"""The ZeRO paper's 2 + 2 + 12 = 16 bytes per parameter."""
ZERO_INFINITY = BytesPerParam(params=2, grads=2, optimizer_states=16)
"""The ZeRO-Infinity paper's 20 bytes per parameter (fp32 gradients counted with the optimizer)."""
ENGINE_MIXED = BytesPerParam(grad_master=4, working_copies=True)
"""zeroshard's BF16/FP16 AdamW: 2-byte compute copies of the parameters (replicated at stages
0-2, gathered per unit at stage 3) and gradients (whole at stages 0-1, per unit at 2-3), FP32
masters, momentum and variance (12) and an FP32 gradient (4) partitioned with the optimizer:
20 bytes per parameter at stage 0, 4 + 16 / Nd at stage 1, 2 + 16 / Nd at 2, 16 / Nd at 3."""
FP32_ADAMW = BytesPerParam(params=4, grads=4, optimizer_states=8)
"""FP32 AdamW: the FP32 parameter is the master (4), its gradient (4), momentum and variance (8)."""
BYTES_PER_PARAM_PRESETS = {"zero": ZERO, "infinity": ZERO_INFINITY}
PRECISION_BYTES = {
    "fp32": (FP32_ADAMW, 4),
    "tf32": (FP32_ADAMW, 4),
    "bf16": (ENGINE_MIXED, 2),
    "fp16": (ENGINE_MIXED, 2),
}
"""A precision (``zeroshard train --precision``) -> (bytes per parameter, bytes per activation
element) of the engine's AdamW run: FP32 keeps no separate master; BF16 and FP16 keep FP32
masters and an FP32 gradient shard beside 2-byte working copies (ZeRO's 2 + 2 + 12
under-counted them by 11-20% at stages 0-2)."""


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """A training configuration, as far as memory is concerned."""

    stage: int
    """ZeRO-DP stage, 0-3 (``zeroshard.stages``)."""
    num_dp_ranks: int = 1
    """Data-parallel degree Nd."""
    shard_group_size: int | None = None
    """Hybrid sharding (``ShardConfig.shard_group_size``): the ranks k that partition the model
    states (stages 1-3), replicated across the Nd / k groups; must divide Nd. None: all Nd."""
    num_mp_ranks: int = 1
    """Model (tensor) parallel degree Nm: model states are split 1/Nm."""
    bytes_per_param: BytesPerParam = ZERO
    """Bytes per parameter for each model state."""
    placement: Placement = field(default_factory=Placement)
    """Where each model state lives."""
    micro_batch_size: int = 1
    """Samples per device per forward (bsz)."""
    seq_len: int = 1024
    """Tokens per sample (seq)."""
    num_layers_per_checkpoint: int = 1
    """ci: blocks between activation checkpoints (ci = nl is close to no checkpointing)."""
    partition_activations: bool = False
    """Split checkpoints 1/Nm across model-parallel ranks (ZeRO-R's Pa)."""
    offload_activations: bool | str = False
    """Where checkpoints are kept off the device: "cpu" (or True: ZeRO-R's Pa+cpu) or "nvme"
    (``Offload(activations="nvme")``: swap files, written in forward and read back ahead of
    each recomputation); False keeps them on the device (``activations_tier``)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism: checkpointed block inputs are 1/Nm per rank as they
    are, as with Pa (the layer norms' working memory is 1/Nm too: not modelled)."""
    num_units_prefetch: int = 1
    """Stage 3: units gathered ahead of the one computing."""
    param_prefetch: int = 1
    """Stage 3 with parameters on NVMe: units whose masters are read beyond the gathers ahead
    (``Offload(param_prefetch)``): ``num_units_prefetch + param_prefetch`` masters in memory
    outside the step (``staging``)."""
    constant_buffers: bool | None = None
    """Stage 3, along the engine's timeline: gathered units borrow constant-size buffers that
    stay allocated between uses, as zeroshard's engine does by default
    (``ShardConfig.constant_buffers``, ``zeroshard.residual_states.buffers.BufferPool``): the
    most the step gathers at once is held at every moment, lent or free (units no two of one
    size hold less: what is free is freed to make room). False: a unit's gathered memory exists
    only while it is gathered (FSDP2, or ``constant_buffers=False``). None: the engine's default
    (True) where the plan follows the engine (``timeline.as_engine_buckets``), else False."""
    point_to_point_reductions: bool = False
    """Partitioned gradients reduce-scattered by sends and receives, as zeroshard does on gloo
    (the CPU): over 3 or more ranks each reduction in flight receives its later sources'
    messages through an inbox of one message (``zeroshard.collectives``), counted in
    ``comm_buckets`` (a tied GPT-2 on 3-4 ranks was 1.2-2.0% low without it)."""
    gradients_in_gather_buffers: bool = False
    """Stage 3 with ``constant_buffers``, on the CPU: each unit's collected flat gradient (the
    root's too) takes the gather buffer its parameters just gave back when it has the same
    bytes (FP32 parameters and gradients), as the engine does there (``TensorPool`` with the
    ``BufferPool`` as its spare), and holds it until its reduction finishes: the pool then holds
    the most gathered and collected at once. False: accelerators, where the engine collects
    gradients into memory of their own."""
    bucket_bytes: int = 25 * 2**20
    """Size of one gradient communication bucket (constant-size buffers)."""
    num_buckets: int = 2
    """Buckets alive at once (one filling while one is reduced); with ``bucket_per_unit``, the
    reductions in flight counting the one being started (zeroshard's
    ``ShardConfig.max_inflight_reductions``: the oldest is finished before a unit's gradient is
    collected once this many are in flight)."""
    bucket_per_unit: bool = False
    """Gradients are reduced a whole wrap unit at a time, as zeroshard's engine does, instead of
    through fixed-size buckets: with partitioned gradients the buffers are units' full gradients
    (the computing unit's, collected at its post-backward, and those in flight; the root's last);
    ``bucket_bytes`` unused."""
    step_in_backward: bool = False
    """The optimizer steps each unit's sub-group as its gradient reduction finishes and drops
    the shard (``zeroshard.optimizer(..., step_in_backward=True)``; stages 2-3): gradient shards
    never accumulate, so ``grads`` is 0 on every tier at every moment (with ``grad_accum`` > 1
    the shards are held between micro-batches and stepped in the last one's backward), and the
    timeline has no end-of-step optimizer moment. The reduce-scatter writes into the full
    gradient's own slice (no separate output buffer)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    accumulate_unreduced: bool = False
    """Gradient accumulation whose micro-batches do not reduce (``no_sync`` / ``sync=False``
    at stages 2-3 without ``reduce_every_micro_step``; ``zeroshard train
    --accumulate-unreduced``): every unit's local gradient is kept whole until the last one,
    so the device holds the whole gradient (``bytes_per_param.grads`` x Psi / Nm) instead of
    the shards. Nothing changes at stages 0-1, whose gradients are whole anyway."""
    activation_checkpointing: bool = True
    """False: no checkpoints; every block keeps what autograd saves from its forward to its
    backward, and the device is counted along the engine's timeline (module docstring)."""
    engine_timeline: bool = False
    """With checkpoints too, count the device along the engine's timeline (a span recomputed at
    a time), not as the papers' sum of every term."""
    activation_bytes: int = ACTIVATION_BYTES
    """Bytes per activation element: 2 for fp16/bf16 compute, 4 for fp32."""
    flash_attention: bool = False
    """Attention saves one fp32 log-sum-exp per head and token (a fused kernel:
    ``scaled_dot_product_attention``, on CPU too) instead of the heads x seq probabilities."""
    reduce_stages_input: bool = False
    """The backend copies a reduce-scatter's input while it is waited for: one more unit gradient
    then (torch's gloo ``reduce_scatter_tensor`` does; NCCL reduces in place, and zeroshard's on
    gloo, sends and receives, stages one receive buffer of at most 4 MiB, not counted)."""
    fragmentation_fraction: float = 0.1
    """Allowance for fragmentation, as a fraction of everything else on the device."""

    def __post_init__(self) -> None:
        partition(self.stage)  # ValueError for anything but 0-3
        ones = ("num_dp_ranks", "num_mp_ranks", "micro_batch_size", "seq_len", "grad_accum")
        for name in (*ones, "num_layers_per_checkpoint"):
            _at_least(name, getattr(self, name), 1)
        for name in ("num_units_prefetch", "param_prefetch", "bucket_bytes", "num_buckets"):
            _at_least(name, getattr(self, name), 0)
        if self.shard_group_size is not None:
            num_shard_groups(self.num_dp_ranks, self.shard_group_size)  # ValueError with the fix
        if self.activation_bytes not in (1, 2, 4, 8):
            raise ValueError(f"activation_bytes must be 1, 2, 4 or 8, got {self.activation_bytes}")
        if not 0 <= self.fragmentation_fraction < 1:
            raise ValueError(
                f"fragmentation_fraction must be in [0, 1), got {self.fragmentation_fraction}"
            )
        if self.offload_activations not in (False, True, "cpu", "nvme"):
            raise ValueError(
                f"offload_activations must be False, True, 'cpu' or 'nvme', got "
                f"{self.offload_activations!r}"
            )
        problem = placement_problem(self.stage, self.placement)
        if problem:
            raise ValueError(f"{offload_name(self.placement)} at stage {self.stage}: {problem}")
        if self.step_in_backward:
            if not partition(self.stage).gradients:
                raise ValueError(
                    f"step_in_backward needs partitioned gradients (stage 2 or 3), got stage "
                    f"{self.stage}: below stage 2 every rank keeps the whole gradient until the "
                    "step, so stepping early frees nothing"
                )
            problem = placement_problem(self.stage, self.placement, step_in_backward=True)
            if problem:
                raise ValueError(
                    f"{offload_name(self.placement)}: {problem}; keep them in memory or drop "
                    "step_in_backward"
                )

    @property
    def activations_tier(self) -> Tier:
        """Where activation checkpoints are kept (``offload_activations``)."""
        if not self.offload_activations:
            return Tier.DEVICE
        return Tier.NVME if self.offload_activations == "nvme" else Tier.CPU

    @property
    def splits_checkpoints(self) -> bool:
        """Checkpoints 1/Nm per rank: partitioned (Pa) or sequence-parallel."""
        return self.partition_activations or self.sequence_parallel

    @property
    def num_shard_ranks(self) -> int:
        """The ranks a partitioned model state is split over: k with hybrid sharding, else Nd
        (the stage formulas' Nd)."""
        return self.shard_group_size or self.num_dp_ranks


def _at_least(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes per category on each tier, for one device (one rank). Every tier maps every
    category of ``MODEL_STATES + RESIDUAL_STATES`` to bytes, zeros included."""

    device: dict[str, int]
    """Accelerator memory."""
    cpu: dict[str, int]
    """Host memory this rank uses (a node holds that times its devices per node)."""
    nvme: dict[str, int]
    """NVMe bytes this rank uses."""
    notes: tuple[str, ...] = ()
    """What the estimate could not count, and why."""
    peak: dict[str, int] | None = None
    """Device bytes per category at the largest moment of a step, along the engine's timeline
    (``activation_checkpointing=False`` with a transformer shape); ``None`` otherwise. ``device``
    holds every category at its own largest, so its total bounds this one from above."""
    peak_moment: str | None = None
    """When ``peak`` happens: ``"loss backward"``, ``"unit backward k"``, ``"optimizer step"``."""
    grads_at_rest: int | None = None
    """Device gradient bytes after the step where they differ from ``device["grads"]`` (stages
    2-3 accumulating unreduced hold the whole local gradient between micro-batches, and only
    the shards once the last one is reduced; stepping in backward, the shards held between
    micro-batches are stepped and dropped: none)."""

    def on(self, tier: Tier | str) -> dict[str, int]:
        return getattr(self, Tier(tier).value)

    def peak_bytes(self) -> int:
        """The device's peak: ``peak`` summed, or every device category summed without one."""
        return sum((self.peak or self.device).values())

    def model_states_bytes(self, tier: Tier | str = Tier.DEVICE) -> int:
        return sum(self.on(tier)[c] for c in MODEL_STATES)

    def model_states_at_rest_bytes(self) -> int:
        """Device model states after the step (``grads_at_rest`` for the gradients)."""
        grads = self.device["grads"] if self.grads_at_rest is None else self.grads_at_rest
        return self.model_states_bytes(Tier.DEVICE) - self.device["grads"] + grads

    def residual_states_bytes(self, tier: Tier | str = Tier.DEVICE) -> int:
        return sum(self.on(tier)[c] for c in RESIDUAL_STATES)

    def total_bytes(self, tier: Tier | str = Tier.DEVICE) -> int:
        return sum(self.on(tier).values())

    def to_dict(self) -> dict:
        out = {t.value: dict(self.on(t)) for t in TIERS} | {"notes": list(self.notes)}
        if self.peak is not None:
            out |= {"peak": dict(self.peak), "peak_moment": self.peak_moment}
        return out


# ---- the formulas, one function per term -------------------------------------------------------


def model_states(
    num_params: int,
    *,
    stage: int,
    num_dp_ranks: int,
    num_mp_ranks: int = 1,
    bytes_per_param: BytesPerParam = ZERO,
    placement: Placement | None = None,
    num_params_replicated: int = 0,
    num_params_trainable: int | None = None,
    optimizer_numel: int | None = None,
) -> dict[Tier, dict[str, int]]:
    """Model-state bytes per device and tier: ``bytes_per_param * Psi / Nm``, divided by Nd for the
    states the stage partitions. Psi = 7.5e9, Nd = 64 gives 120, 31.4, 16.6 and 1.88 GB.
    ``num_params_replicated`` of the Psi are not divided by Nm (tensor parallelism leaves them
    whole on every rank: ``ModelDescription.replicated_numel``). Gradients and optimizer states
    are those of the ``num_params_trainable`` (None: all; frozen parameters have neither), in
    proportion. ``optimizer_numel``: the elements whose optimizer states this device holds, when
    not every trainable parameter has them (``optimizer_numel``'s function); None: the
    trainable ones' share."""
    _at_least("num_params", num_params, 1)
    _at_least("num_dp_ranks", num_dp_ranks, 1)
    _at_least("num_mp_ranks", num_mp_ranks, 1)
    _at_least("num_params_replicated", num_params_replicated, 0)  # (negative bytes came out)
    if num_params_trainable is not None:
        _at_least("num_params_trainable", num_params_trainable, 0)
        if num_params_trainable > num_params:
            raise ValueError(
                f"num_params_trainable={num_params_trainable} is more than num_params="
                f"{num_params}: the trainable parameters are some of them"
            )
    if optimizer_numel is not None:
        _at_least("optimizer_numel", optimizer_numel, 0)
    p, placement = partition(stage), placement or Placement()
    split = dict(params=p.parameters, grads=p.gradients, optimizer_states=p.optimizer_states)
    out = {t: dict.fromkeys(MODEL_STATES, 0) for t in TIERS}
    replicated = min(num_params_replicated, num_params)
    elements_x_nm = num_params - replicated + replicated * num_mp_ranks
    bpp = bytes_per_param

    def add(category: str, per_param: int, partitioned: bool, *, trained: bool = True,
            tier: str | None = None) -> None:  # fmt: skip
        if trained and category == "optimizer_states" and optimizer_numel is not None:
            out[placement.tier(category)][category] += per_param * optimizer_numel
            return
        # bytes * ((Psi - R) / Nm + R) / Nd, in integers: ceil(a / b) = -(-a // b)
        num_bytes = per_param * elements_x_nm
        if trained:
            num_bytes = trained_bytes(num_bytes, num_params, num_params_trainable)
        ways = num_mp_ranks * (num_dp_ranks if partitioned else 1)
        out[placement.tier(tier or category)][category] += -(-num_bytes // ways)

    master = min(MASTER_BYTES, bpp.optimizer_states) if bpp.working_copies else 0
    for category in ("params", "grads"):  # working copies: gathered or produced per unit, then
        if not (bpp.working_copies and split[category]):  # freed: none at rest once partitioned
            add(category, getattr(bpp, category), split[category], trained=category == "grads")
    add("grads", bpp.grad_master, p.optimizer_states)
    add("optimizer_states", bpp.optimizer_states - master, p.optimizer_states)
    # The FP32 masters beside working copies: every parameter's (frozen too), on its tier.
    add("optimizer_states", master, p.optimizer_states, trained=False, tier="params")
    return out


def optimizer_numel(model: ModelDescription, config: MemoryConfig) -> int | None:
    """Elements whose optimizer states the busiest rank holds when the loss leaves some trainable
    parameters without a gradient, so without states (``ModelDescription.stepped``); ``None``
    when every one has them, or with tensor parallelism (whose pieces are not followed): the
    trainable parameters' share."""
    if model.stepped is None or config.num_mp_ranks > 1:
        return None
    return model.stepped.busiest_rank_numel(
        stage=config.stage,
        num_shard_ranks=config.num_shard_ranks,
        bucket_bytes=config.bucket_bytes,
        param_bytes=config.bytes_per_param.params or MASTER_BYTES,
    )


def _unreduced(config: MemoryConfig) -> bool:
    """Stages 2-3 accumulating the whole local gradient between micro-batches."""
    return config.accumulate_unreduced and partition(config.stage).gradients


def _grads_as_trained(
    states: dict[Tier, dict[str, int]], model: ModelDescription, config: MemoryConfig
) -> None:
    """``grads`` as the step's schedule has them: with ``step_in_backward`` no gradient shard
    outlives its reduction (each is stepped and dropped as the reduction finishes): 0 on every
    tier, unless ``grad_accum`` > 1 (the shards wait for the last micro-batch); with
    ``accumulate_unreduced`` at stages 2-3 the device holds the whole local gradient (stage 1's
    unpartitioned figure) between micro-batches; each unit's becomes its shard as the last
    micro-batch reduces it, so the two are not counted together."""
    if config.step_in_backward and (config.grad_accum == 1 or config.accumulate_unreduced):
        for tier in states.values():
            tier["grads"] = 0
    if _unreduced(config):
        whole = model_states(
            model.num_params,
            stage=1,  # gradients whole on every rank
            num_dp_ranks=config.num_shard_ranks,
            num_mp_ranks=config.num_mp_ranks,
            bytes_per_param=config.bytes_per_param,
            num_params_replicated=model.replicated_numel,
            num_params_trainable=model.num_trainable_params,
        )
        states[Tier.DEVICE]["grads"] = whole[Tier.DEVICE]["grads"]


def buffer_bytes(model: ModelDescription, bpp: BytesPerParam) -> int:
    """The model's buffers on each rank: with the engine's mixed precision (``working_copies``)
    its persistent floating ones in the 2-byte dtype of ``bpp.params``, the rest as built."""
    if not bpp.working_copies:
        return model.buffer_bytes
    return model.buffer_bytes - model.cast_buffer_bytes + model.cast_buffer_numel * bpp.params


def residual_states(model: ModelDescription, config: MemoryConfig) -> MemoryBreakdown:
    """Residual-state bytes per device, fragmentation excluded (``plan_memory`` adds it).

    Along the engine's timeline (``activation_checkpointing=False`` or ``engine_timeline``), each
    device category is its largest over the step and ``peak`` the composition of the largest
    moment, model states included (partitioned gradient shards only as far as they exist)."""
    c, bpp = config, config.bytes_per_param
    part = partition(c.stage)
    out = {t: dict.fromkeys(RESIDUAL_STATES, 0) for t in TIERS}
    out[Tier.DEVICE]["buffers"] = buffer_bytes(model, bpp)
    notes = []
    shape, measured = model.shape, saved.at_config(model, c) is not None
    why = saved.problem(model, c)
    if why:
        fallback = "the reference GPT's formulas" if shape is not None else "not counted"
        notes.append(f"activations not measured: {why}; {fallback}")
    if (shape is not None or measured) and (c.engine_timeline or not c.activation_checkpointing):
        from zeroshard.planner import timeline  # here: it builds on this module

        states = model_states(
            model.num_params,
            stage=c.stage,
            num_dp_ranks=c.num_shard_ranks,
            num_mp_ranks=c.num_mp_ranks,
            bytes_per_param=bpp,
            placement=c.placement,
            num_params_replicated=model.replicated_numel,
            num_params_trainable=model.num_trainable_params,
            optimizer_numel=optimizer_numel(model, c),
        )
        _grads_as_trained(states, model, c)
        moments = timeline.moments(model, c, states[Tier.DEVICE])
        for category in RESIDUAL_STATES:
            out[Tier.DEVICE][category] = max(m[category] for _, m in moments)
        when, peak = max(moments, key=lambda m: sum(m[1].values()))
        if not c.activation_checkpointing and (c.offload_activations or c.splits_checkpoints):
            notes.append("no checkpoints: partitioned or offloaded activations not modelled")
        elif c.offload_activations:
            total = timeline.activation_terms(model, c).checkpoints_total
            out[c.activations_tier]["activation_checkpoints"] = total
        return MemoryBreakdown(
            device=out[Tier.DEVICE],
            cpu=out[Tier.CPU],
            nvme=out[Tier.NVME],
            notes=tuple(notes),
            peak=peak,
            peak_moment=when,
        )
    if measured:
        _measured_checkpoints(model, c, out)
    elif shape is not None:
        ci = min(c.num_layers_per_checkpoint, shape.num_layers)
        out[c.activations_tier]["activation_checkpoints"] = activation_checkpoint_bytes(
            micro_batch_size=c.micro_batch_size,
            seq_len=c.seq_len,
            hidden_size=shape.hidden_size,
            num_layers=shape.num_layers,
            num_layers_per_checkpoint=ci,
            num_mp_ranks=c.num_mp_ranks,
            partitioned=c.splits_checkpoints,
            activation_bytes=c.activation_bytes,
        )
        out[Tier.DEVICE]["activation_working"] = activation_working_bytes(
            micro_batch_size=c.micro_batch_size,
            seq_len=c.seq_len,
            hidden_size=shape.hidden_size,
            num_heads=shape.num_heads,
            num_layers_per_checkpoint=ci,
            activation_bytes=c.activation_bytes,
        )
        if c.placement.params is not Tier.DEVICE:
            # Streamed parameters: the largest operator must fit on the device at once.
            out[Tier.DEVICE]["model_state_working"] = model_state_working_bytes(
                hidden_size=shape.hidden_size
            )
        out[Tier.DEVICE]["logits"] = logits_bytes(
            micro_batch_size=c.micro_batch_size, seq_len=c.seq_len, vocab_size=shape.vocab_size
        )
    else:
        notes.append("no transformer shape: activations and logits not counted")
    if part.parameters:
        unit = model.unit_numel
        if unit is None:
            notes.append("largest unit unknown: stage-3 gathered units not counted")
        else:
            # The computing unit and the prefetched ones, gathered in full; plus the computing
            # unit's unsharded gradients before they are reduce-scattered. With tensor
            # parallelism, what a rank holds of the largest unit where the units' splits are
            # known (experts the plan leaves whole are whole), else 1/Nm of it.
            held = model.unit_rank_numels(c.num_mp_ranks) if c.num_mp_ranks > 1 else None
            ways = c.num_mp_ranks
            if held is not None:
                unit, ways = max(held[0], *held[1]), 1
            gathered = (1 + c.num_units_prefetch) * unit * bpp.params + unit * bpp.grads
            out[Tier.DEVICE]["gathered_units"] = math.ceil(gathered / ways)
    grads_bytes = trained_bytes(  # the buckets hold the trainable parameters' slots only
        bpp.grads * model.mp_numel(c.num_mp_ranks), model.num_params, model.num_trainable_params
    )
    out[Tier.DEVICE]["comm_buckets"] = min(c.num_buckets * c.bucket_bytes, grads_bytes)
    return MemoryBreakdown(
        device=out[Tier.DEVICE], cpu=out[Tier.CPU], nvme=out[Tier.NVME], notes=tuple(notes)
    )


def _measured_checkpoints(
    model: ModelDescription, c: MemoryConfig, out: dict[Tier, dict[str, int]]
) -> None:
    """The papers' activation terms from what autograd saves in ``model`` (measured on meta,
    ``zeroshard.planner.saved``), with one checkpoint every ``ci`` units: each span's input is
    kept; one span is recomputed at a time beside what the root saves (embeddings, head, the
    loss's log-probabilities); the loss's backward holds two gradients of the log-probabilities'
    size; streamed parameters need the largest operator's parameter and gradient on the device."""
    bpp = c.bytes_per_param
    s = saved.at_config(model, c)
    num_units = len(s.unit_bytes)
    ci = max(1, min(c.num_layers_per_checkpoint, num_units))
    starts = range(0, num_units, ci)
    checkpoints = sum(s.unit_input_bytes[i] for i in starts)
    if c.splits_checkpoints:
        checkpoints = math.ceil(checkpoints / c.num_mp_ranks)
    out[c.activations_tier]["activation_checkpoints"] = checkpoints
    span = max((sum(s.unit_bytes[i : i + ci]) for i in starts), default=0)
    root = sum(s.before_unit_bytes) + s.tail_bytes
    out[Tier.DEVICE]["activation_working"] = span + root
    if c.placement.params is not Tier.DEVICE:
        largest = model.activations.largest_param(c.num_mp_ranks)
        out[Tier.DEVICE]["model_state_working"] = (bpp.params + bpp.grads) * largest
    out[Tier.DEVICE]["logits"] = s.loss_gradient_bytes


def plan_memory(model: ModelDescription, config: MemoryConfig) -> MemoryBreakdown:
    """Model and residual states per device for ``config``, fragmentation allowance included."""
    states = model_states(
        model.num_params,
        stage=config.stage,
        num_dp_ranks=config.num_shard_ranks,
        num_mp_ranks=config.num_mp_ranks,
        bytes_per_param=config.bytes_per_param,
        placement=config.placement,
        num_params_replicated=model.replicated_numel,
        num_params_trainable=model.num_trainable_params,
        optimizer_numel=optimizer_numel(model, config),
    )
    at_rest = states[Tier.DEVICE]["grads"]  # (the shards; step_in_backward: stepped, dropped)
    at_rest = 0 if config.step_in_backward else at_rest
    _grads_as_trained(states, model, config)
    residual = residual_states(model, config)
    tiers = {t: states[t] | residual.on(t) for t in TIERS}
    tiers[Tier.CPU]["offload_staging"] = offload_staging_bytes(model, config)
    others = sum(tiers[Tier.DEVICE].values())
    tiers[Tier.DEVICE]["fragmentation"] = math.ceil(config.fragmentation_fraction * others)
    peak = residual.peak
    if peak is not None:
        peak = dict(peak)
        peak["fragmentation"] = math.ceil(config.fragmentation_fraction * sum(peak.values()))
    return MemoryBreakdown(
        device=tiers[Tier.DEVICE],
        cpu=tiers[Tier.CPU],
        nvme=tiers[Tier.NVME],
        notes=residual.notes,
        peak=peak,
        peak_moment=residual.peak_moment,
        grads_at_rest=at_rest if _unreduced(config) or config.step_in_backward else None,
    )
