"""``ShardConfig``: how the engine's schedule trades memory for overlap and communication (the
keyword-only options of ``zeroshard.shard(..., config=...)``), validated at construction.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """How the schedule trades memory for overlap."""

    num_prefetch: int = 1
    """Units gathered ahead of the one computing (forward and backward; partitioned parameters
    only). At most ``1 + num_prefetch`` non-root units are gathered at once, one more while
    backward recomputes a span of ``checkpoint_every`` units longer than that."""
    reshard_root_after_forward: bool = False
    """Free the root unit's parameters after forward too (saves memory, costs one more
    all-gather of the root per step)."""
    reduce_every_micro_step: bool = False
    """With partitioned gradients: reduce-scatter on every micro-step of gradient accumulation
    and accumulate into the shard (saves the full gradient's memory, costs communication)."""
    bucket_bytes: int = 25 * 2**20
    """With replicated parameters (stages 0-2): consecutive units share one flat buffer of up to
    this many bytes, reduced in one collective once all its units' backward is done (0: one
    buffer per unit). Stage 3 always gathers and reduces per unit."""
    max_inflight_reductions: int = 1
    """Gradient reductions in flight at once, counting the one being started: the oldest is
    finished before another starts beyond this. Bounds the full-gradient buffers alive at
    stages 2-3 (1: a unit's reduction overlaps the next unit's backward, then is finished
    before that unit's gradient is collected)."""
    sync_module_states: bool = True
    """Broadcast rank 0's parameters and buffers at shard time so every rank starts identical
    (False: each rank keeps its own; they must then agree, as FSDP2 assumes)."""
    checkpoint_every: int = 0
    """Activation checkpointing (ZeRO-R, the article's ``ci``): spans of this many chained units
    keep only their inputs for backward and recompute the rest (0: off; 1: every unit on its
    own). See ``zeroshard.residual_states.activations``."""
    constant_buffers: bool = True
    """Stage 3: gathered units borrow their memory from buffers made once and kept (ZeRO-R's
    constant-size buffers, ``zeroshard.residual_states.buffers``): no allocation per gather,
    for ``1 + num_prefetch`` units' memory per unit size kept between steps. Stages 2-3 on the
    CPU: each unit's collected full gradient borrows a pooled tensor, kept through one backward
    (``TensorPool``). False: each gather and each collection allocates, and each free returns the
    memory (the least memory at rest)."""
    trim_host_memory: float = 0.03
    """Training on the CPU: when an optimizer step ends with the process this fraction above its
    size after 10 steps, return the memory the allocator holds freed to the system
    (``malloc_trim``), so that it does not grow by fragmentation (0: never;
    ``zeroshard.residual_states.host_heap``)."""
    partition_activations: bool = False
    """ZeRO-R's Pa: each span's saved input is kept 1/Nm per tensor-parallel rank and
    all-gathered before its recomputation (needs ``checkpoint_every`` and a tensor-parallel mesh,
    ``zeroshard.tensor_parallel.mesh_2d``). See ``zeroshard.residual_states.partitioned``."""
    shard_group_size: int = 0
    """Hybrid sharding (HSDP, ZeRO++ hpZ): partition model states inside groups of this many
    consecutive ranks and replicate them across groups (0: over every rank). It must divide the
    world size; ignored, with a warning, at stage 0. See ``zeroshard.mesh.Mesh.hybrid_sharded``."""

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _of_kind(f.name, getattr(self, f.name), f.type))
        if self.shard_group_size < 0:
            raise ValueError(
                f"shard_group_size must be >= 0 (0: shard over every rank), got "
                f"{self.shard_group_size!r}"
            )
        if self.bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0, got {self.bucket_bytes}")
        if self.num_prefetch < 0:
            raise ValueError(f"num_prefetch must be >= 0, got {self.num_prefetch}")
        if self.checkpoint_every < 0:
            raise ValueError(
                f"checkpoint_every must be >= 0 (0: off, k: units per span), got "
                f"{self.checkpoint_every}"
            )
        if self.partition_activations and not self.checkpoint_every:
            raise ValueError(
                "partition_activations partitions activation checkpoints, and there are none: "
                "set checkpoint_every (e.g. 1) too"
            )
        if not self.trim_host_memory >= 0:
            raise ValueError(
                f"trim_host_memory must be a fraction >= 0 (growth that triggers a trim, 0: "
                f"never), got {self.trim_host_memory!r}"
            )
        if self.max_inflight_reductions < 1:
            raise ValueError(
                f"max_inflight_reductions must be >= 1, got {self.max_inflight_reductions}"
            )


def _of_kind(name: str, value: object, kind: str) -> object:
    """``value`` as the option's ``kind`` ("int", "float" or "bool", its annotation): a number
    of the kind in any form (a numpy int, ``5e8`` for bytes, as DeepSpeed's configs write them)
    becomes a plain one; anything else (``"2"``, a bool for a number) is a TypeError."""
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind == "bool" and isinstance(value, bool):
        return value
    whole = number and (isinstance(value, numbers.Integral) or float(value).is_integer())
    if kind == "int" and whole:
        return int(value)
    if kind == "float" and number:
        return float(value)
    what = "a whole number" if kind == "int" else kind
    raise TypeError(f"ShardConfig({name}=...) takes {what}, got {value!r}")
