"""Host memory that zeroshard's engine streams NVMe-placed model states through, per rank: the
optimizer states of the sub-groups in flight, the masters and gradient shards read around the
step, and the stores' staging pools. ``zeroshard plan`` counts it in the cpu column as
``offload_staging``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from zeroshard.model_states.param_swap import MAX_WRITES
from zeroshard.model_states.state_swap import NUM_SLOTS
from zeroshard.offload.store import OffloadConfig
from zeroshard.offload.tiers import Tier
from zeroshard.stages import partition

if TYPE_CHECKING:
    from zeroshard.planner.describe import ModelDescription
    from zeroshard.planner.memory import MemoryConfig


MASTER_BYTES = 4
"""Bytes per element of an FP32 master."""
STAGING_POOL_BYTES = OffloadConfig.num_buffers * OffloadConfig.block_bytes
"""One ``TensorStore``'s staging pool at its defaults."""
STATE_SLOTS = NUM_SLOTS
"""Sub-groups whose optimizer states are in host memory at once during an NVMe step: one read
ahead, one stepping, one written back; at the first step the states torch creates take the third
slot's room until they are packed (``zeroshard.model_states.state_swap``)."""
MASTERS_AT_STEP = 2 + MAX_WRITES
"""NVMe-placed masters in memory at once during the step: the sub-group stepping, the next one
read ahead, and those written back (``param_swap.MAX_WRITES``); outside the step, the
``num_units_prefetch + param_prefetch`` read ahead of their gathers (``param_swap``'s window),
more with a deeper read-ahead."""
GRAD_SHARDS_AT_STEP = 2
"""NVMe-placed FP32 gradient shards in memory during the step: the one used, the next read."""


def offload_staging_bytes(model: ModelDescription, config: MemoryConfig) -> int:
    """Host memory zeroshard's engine uses to stream NVMe-placed model states, per rank (bytes),
    at the optimizer step, when it is largest. For a unit's shard of ``u`` elements (the largest
    unit / the ranks sharding it):

    * ``STATE_SLOTS x K' x u`` of optimizer states: K' is K less the FP32 master when K
      includes it (masters are streamed on their own);
    * ``MASTERS_AT_STEP x 4 x u`` of masters (the read-ahead window's when larger) and
      ``GRAD_SHARDS_AT_STEP x 4 x u`` of gradient shards;
    * one staging pool per store (optimizer states and gradients share one, masters have theirs,
      and activation checkpoints on NVMe theirs).

    At stages 0-2 a sub-group is the engine's flat buffer of consecutive units up to
    ``bucket_bytes`` (``sub_group_numels``), not one unit; fewer sub-groups than slots hold
    fewer slots.

    0 without NVMe placements; only the activations' pool when the largest unit is unknown."""
    activations = STAGING_POOL_BYTES if config.activations_tier is Tier.NVME else 0
    p, bpp = config.placement, config.bytes_per_param
    groups = sub_group_numels(model, config)
    unit = model.unit_numel if groups is None else max(groups, default=0)
    if not unit or Tier.NVME not in (p.params, p.grads, p.optimizer_states):
        return activations

    def held(slots: int) -> int:  # (fewer sub-groups than slots take fewer slots)
        return slots if groups is None else min(slots, len(groups))

    part = partition(config.stage)
    ways = config.num_mp_ranks * (config.num_shard_ranks if part.optimizer_states else 1)
    shard = math.ceil(unit / ways)
    total, stores = 0, 0
    if p.optimizer_states is Tier.NVME:
        master_in_k = MASTER_BYTES if bpp.params < MASTER_BYTES else 0
        total += held(STATE_SLOTS) * (bpp.optimizer_states - master_in_k) * shard
        stores += 1
    if p.params is Tier.NVME:
        window = config.num_units_prefetch + config.param_prefetch
        total += held(max(MASTERS_AT_STEP, window)) * MASTER_BYTES * shard
        stores += 1
    if p.grads is Tier.NVME:
        total += held(GRAD_SHARDS_AT_STEP) * MASTER_BYTES * shard
        stores += p.optimizer_states is not Tier.NVME
    return total + stores * STAGING_POOL_BYTES + activations


def sub_group_numels(model: ModelDescription, config: MemoryConfig) -> list[int] | None:
    """Elements of each optimizer sub-group, whole (before sharding): one per unit, the root's
    first, where parameters are partitioned (a FlatParam per unit); else the flat buffers
    ``zeroshard.sharding`` fills with consecutive units (the root first) up to
    ``config.bytes_per_param.params x numel <= bucket_bytes``, the root alone when the whole
    model is larger than one. ``None`` when the units are unknown (the largest alone, or none)."""
    from zeroshard.planner.timeline import unit_numels

    if model.block_unit_numels is None and model.shape is None:
        return None
    root, units = model.root_numel or 0, unit_numels(model)
    if partition(config.stage).parameters:
        return [n for n in (root, *units) if n]
    room = config.bucket_bytes // max(config.bytes_per_param.params, 1)
    groups = [root] if root + sum(units) > room else []
    held = 0 if groups else root
    for numel in units:
        if held and held + numel > room:
            groups.append(held)
            held = 0
        held += numel
    return [n for n in (*groups, held) if n]
