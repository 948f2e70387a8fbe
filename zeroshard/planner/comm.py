"""Data-parallel communication per training step, per collective (§4).

Stage 0 all-reduces the gradients (2 Psi elements moved per device: a reduce-scatter and an
all-gather in the ring). Stages 1 and 2 reduce-scatter the gradients to their owners and
all-gather the updated parameters (Psi + Psi). Stage 3 all-gathers each unit's parameters before
its forward and again before its backward, and reduce-scatters the gradients (3 Psi, 1.5x plain
data parallel). Volumes are the papers' per-device counts; the exact ring moves (Nd - 1) / Nd of
them, and zeroshard's padding adds at most Nd - 1 elements per unit.

Hybrid sharding (HSDP; ``ShardConfig(shard_group_size=k)``) shards stages 1-3 inside groups of k
ranks and replicates across the Nd / k groups: inside a group the volumes above (Nd = k), and
across groups the ring all-reduce of each rank's 1/k gradient shard, 2 Psi / k elements, after
each reduce-scatter. The two run on different links (inside a node, across nodes), so each
collective carries the ledger's scope (``zeroshard.collectives``: ``shard`` or ``replicate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from zeroshard.stages import partition

SHARD, REPLICATE = "shard", "replicate"
"""The ledger's scopes (``zeroshard.collectives``): inside a shard group (every rank without
hybrid sharding) and across shard groups."""


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective of a training step, as the per-device volume it moves."""

    op: str
    """``all_reduce``, ``reduce_scatter`` or ``all_gather`` (the ledger's op names)."""
    label: str
    """What it moves: ``params`` or ``grads`` (the ledger's labels in ``zeroshard.collectives``,
    so a calibration compares ``ledger.summary()["all_gather/params"]`` with these)."""
    when: str
    """``forward``, ``backward`` or ``after step``."""
    numel: int
    """Elements each device sends (and receives)."""
    num_bytes: int
    """``numel`` times the bytes of its dtype."""
    every_micro_batch: bool
    """True when it runs in every micro-batch (gathered parameters, gradients reduce-scattered to
    sharded owners); False when once per optimizer step (replicated gradients accumulate
    locally and are reduced once)."""
    scope: str = SHARD
    """Which ranks it spans: ``shard`` (inside a shard group, every rank without hybrid sharding)
    or ``replicate`` (across shard groups, hybrid sharding only): the ledger's scopes."""

    @property
    def name(self) -> str:
        return f"{self.op} {self.label} ({self.when})"


def dp_communication(
    num_params: int,
    *,
    stage: int,
    num_mp_ranks: int = 1,
    param_dtype_bytes: int = 2,
    reduce_dtype_bytes: int = 2,
    num_params_kept_gathered: int = 0,
    num_dp_ranks: int | None = None,
    shard_group_size: int | None = None,
    num_params_replicated: int = 0,
    reduce_every_micro_batch: bool = True,
    num_params_trainable: int | None = None,
    num_params_gathered_again: int = 0,
) -> tuple[Collective, ...]:
    """The collectives of one step and their per-device volume: 2 Psi elements for stages 0-2,
    3 Psi for stage 3 (Psi / Nm each with model parallelism). Gradients travel in
    ``reduce_dtype_bytes``, parameters in ``param_dtype_bytes``. ``num_params_kept_gathered``:
    stage 3 parameters that stay gathered from forward to backward and are not gathered again
    (zeroshard keeps the root unit unless ``ShardConfig.reshard_root_after_forward``).
    ``num_params_replicated``: parameters tensor parallelism leaves whole on every rank (not
    divided by Nm; counted first among those kept gathered, the root unit being both).

    Hybrid sharding: ``num_dp_ranks`` Nd sharded in groups of ``shard_group_size`` k (both or
    neither; k must divide Nd). With k < Nd, stages 1-3 add the all-reduce of the 1/k gradient
    shard across groups (scope ``replicate``), 2 * ceil(Psi / k) elements, when the gradients are
    reduce-scattered (every micro-batch at stages 2-3). Stage 0 shards nothing: its all-reduce
    spans every rank, as the engine ignores ``shard_group_size`` there.

    ``num_params_gathered_again``: stage 3 parameters gathered once more in backward (units a
    checkpoint's recomputation gathered and freed before their own backward, ``gathered_again``).

    ``reduce_every_micro_batch=False`` (``MemoryConfig.accumulate_unreduced``): stages 2-3
    reduce the gradients once per step, after the last micro-batch, as stages 0-1 do.

    ``num_params_trainable`` (None: all): frozen parameters have no gradient to reduce and are
    not gathered again after a step, which leaves them as they were; stage 3 gathers them at
    every use all the same (in proportion, with tensor parallelism)."""
    for name, value in (("num_params", num_params), ("num_mp_ranks", num_mp_ranks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (
        ("param_dtype_bytes", param_dtype_bytes),
        ("reduce_dtype_bytes", reduce_dtype_bytes),
    ):
        if value not in (1, 2, 4, 8):
            raise ValueError(f"{name} must be 1, 2, 4 or 8, got {value!r}")
    if not 0 <= num_params_kept_gathered <= num_params:
        raise ValueError(
            f"num_params_kept_gathered must be in [0, num_params], got {num_params_kept_gathered}"
        )
    part = partition(stage)
    num_groups = num_shard_groups(num_dp_ranks, shard_group_size)
    replicated = min(num_params_replicated, num_params)
    psi = math.ceil((num_params - replicated) / num_mp_ranks) + replicated
    kept_whole = min(num_params_kept_gathered, replicated)
    kept = kept_whole + math.ceil((num_params_kept_gathered - kept_whole) / num_mp_ranks)

    def trained(numel: int) -> int:
        if num_params_trainable is None:
            return numel
        return math.ceil(numel * min(num_params_trainable, num_params) / num_params)

    def grads(op: str, numel: int) -> Collective:
        return Collective(
            op=op,
            label="grads",
            when="backward",
            numel=numel,
            num_bytes=numel * reduce_dtype_bytes,
            every_micro_batch=part.gradients and reduce_every_micro_batch,
        )

    def params(when: str) -> Collective:
        again = math.ceil(num_params_gathered_again / num_mp_ranks)
        numel = {"backward": psi - kept + again, "after step": trained(psi)}.get(when, psi)
        return Collective(
            op="all_gather",
            label="params",
            when=when,
            numel=numel,
            num_bytes=numel * param_dtype_bytes,
            every_micro_batch=when != "after step",
        )

    inter: tuple[Collective, ...] = ()
    if num_groups > 1 and part.optimizer_states:
        # This rank's 1/k gradient shard, all-reduced with its replicas in the other groups
        # (the ring's 2n, as the ledger counts it), right after each reduce-scatter.
        numel = 2 * math.ceil(trained(psi) / shard_group_size)
        inter = (replace(grads("all_reduce", numel), scope=REPLICATE),)
    if part.parameters:
        return params("forward"), params("backward"), grads("reduce_scatter", trained(psi)), *inter
    if part.optimizer_states:
        return grads("reduce_scatter", trained(psi)), *inter, params("after step")
    # The ring all-reduce: a reduce-scatter and an all-gather of Psi each (the ledger's 2 numel).
    return (grads("all_reduce", 2 * trained(psi)),)


def num_shard_groups(num_dp_ranks: int | None, shard_group_size: int | None) -> int:
    """Nd / k: the shard groups that replicate each other (1 without hybrid sharding); a
    ``ValueError`` naming the fix when k does not divide Nd."""
    if (num_dp_ranks is None) != (shard_group_size is None):
        raise ValueError(
            "hybrid sharding needs num_dp_ranks and shard_group_size together; give both or neither"
        )
    if num_dp_ranks is None:
        return 1
    for name, value in (("num_dp_ranks", num_dp_ranks), ("shard_group_size", shard_group_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if shard_group_size > num_dp_ranks or num_dp_ranks % shard_group_size:
        divisors = ", ".join(str(d) for d in range(1, num_dp_ranks + 1) if num_dp_ranks % d == 0)
        why = "is larger than" if shard_group_size > num_dp_ranks else "does not divide"
        raise ValueError(
            f"shard_group_size {shard_group_size} {why} num_dp_ranks {num_dp_ranks}; use a "
            f"divisor of {num_dp_ranks} ({divisors})"
        )
    return num_dp_ranks // shard_group_size


def by_scope(collectives: tuple[Collective, ...]) -> dict[str, tuple[Collective, ...]]:
    """``collectives`` split into ``shard`` (inside a group) and ``replicate`` (across)."""
    return {s: tuple(c for c in collectives if c.scope == s) for s in (SHARD, REPLICATE)}


def total_bytes(collectives: tuple[Collective, ...], num_micro_batches: int = 1) -> int:
    """Bytes per optimizer step of ``num_micro_batches``: those that run every micro-batch
    repeat."""
    return sum(c.num_bytes * _repeats(c, num_micro_batches) for c in collectives)


def total_numel(collectives: tuple[Collective, ...], num_micro_batches: int = 1) -> int:
    """Elements per optimizer step (as ``total_bytes``)."""
    return sum(c.numel * _repeats(c, num_micro_batches) for c in collectives)


def _repeats(c: Collective, num_micro_batches: int | None) -> int:
    return num_micro_batches if num_micro_batches and c.every_micro_batch else 1


def scope_seconds(
    collectives: tuple[Collective, ...],
    *,
    intra_bandwidth_bytes_per_s: float,
    inter_bandwidth_bytes_per_s: float | None = None,
    num_micro_batches: int | None = None,
    group_ranks: dict[str, int] | None = None,
) -> dict[str, float]:
    """Seconds per scope, without overlap: ``shard`` collectives at the intra-group (in-node)
    bandwidth, ``replicate`` ones at the inter-group (inter-node) bandwidth (default: the
    intra-group one). The engine runs the inter-group all-reduce after each reduce-scatter,
    not overlapped with compute, so the two add. With ``num_micro_batches`` a step of that
    many micro-batches: the collectives that run every micro-batch repeat. ``group_ranks``
    (``scope_ranks``): a scope whose groups hold one rank moves nothing, 0 s (its volume is
    the papers' count all the same, as the engine's ledger counts it)."""
    inter = inter_bandwidth_bytes_per_s or intra_bandwidth_bytes_per_s
    alone = {scope for scope, n in (group_ranks or {}).items() if n == 1}
    out = {}
    for scope, bw in ((SHARD, intra_bandwidth_bytes_per_s), (REPLICATE, inter)):
        num_bytes = sum(
            c.num_bytes * _repeats(c, num_micro_batches) for c in collectives if c.scope == scope
        )
        out[scope] = 0.0 if scope in alone else comm_seconds(num_bytes, bw)
    return out


def scope_ranks(stage: int, num_dp_ranks: int, shard_group_size: int | None) -> dict[str, int]:
    """Ranks in each scope's groups: ``shard`` the shard group (every data-parallel rank
    without hybrid sharding, and at stage 0, which ignores it), ``replicate`` the groups' count."""
    k = num_dp_ranks if shard_group_size is None or stage == 0 else shard_group_size
    return {SHARD: k, REPLICATE: num_dp_ranks // k}


def comm_seconds(num_bytes: float, bandwidth_bytes_per_s: float) -> float:
    """Time to move ``num_bytes`` at ``bandwidth_bytes_per_s`` (no overlap, no latency)."""
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s!r}")
    return num_bytes / bandwidth_bytes_per_s


def gathered_again(model, config) -> int:
    """Stage 3: the parameters each step's backward gathers once more than once per unit, for
    ``dp_communication``: a unit called n times (ALBERT's shared layers) n - 1 times more, one
    gather per call's backward; with activation checkpoints, the units a recomputation
    gathers and frees before their own backward (``spans.recompute_freed``); 0 at stages 0-2.
    ``model``: a ``ModelDescription``, ``config``: a ``MemoryConfig``."""
    from zeroshard.planner import saved, spans, timeline

    if not partition(config.stage).parameters:
        return 0
    if model.block_unit_numels is None and model.shape is None:
        return 0  # (a parameter count alone: no units to gather)
    numels = timeline.unit_numels(model)
    measured = saved.at_config(model, config)
    chained, inner, calls = (
        (measured.chained, measured.inner, measured.calls) if measured is not None else ((), (), ())
    )
    again = sum((n - 1) * numels[i] for i, n in enumerate(calls) if n > 1)
    if not config.activation_checkpointing:
        return again
    ci = config.num_layers_per_checkpoint
    first = tuple(spans.first_units(len(numels), ci, chained, inner, calls))
    prefetch = config.num_units_prefetch
    return again + sum(
        numels[j]
        for i in range(len(numels))
        for j in spans.recompute_freed(first, i, prefetch, inner)
    )
