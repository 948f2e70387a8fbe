"""Data-parallel communication per training step, per collective (§4).

Stage 0 all-reduces the gradients (2 Psi elements moved per device: a reduce-scatter and an
all-gather in the ring). Stages 1 and 2 reduce-scatter the gradients to their owners and
all-gather the updated parameters (Psi + Psi). Stage 3 all-gathers each unit's parameters before
its forward and again before its backward, and reduce-scatters the gradients (3 Psi, 1.5x plain
data parallel). Volumes are the papers' per-device counts; the exact ring moves (Nd - 1) / Nd of
them, and zeroshard's padding adds at most Nd - 1 elements per unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zeroshard.stages import partition


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
) -> tuple[Collective, ...]:
    """The collectives of one step and their per-device volume: 2 Psi elements for stages 0-2,
    3 Psi for stage 3 (Psi / Nm each with model parallelism). Gradients travel in
    ``reduce_dtype_bytes``, parameters in ``param_dtype_bytes``. ``num_params_kept_gathered``:
    stage 3 parameters that stay gathered from forward to backward and are not gathered again
    (zeroshard keeps the root unit unless ``ShardConfig.reshard_root_after_forward``)."""
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
    psi = math.ceil(num_params / num_mp_ranks)
    kept = math.ceil(num_params_kept_gathered / num_mp_ranks)

    def grads(op: str, numel: int) -> Collective:
        return Collective(
            op=op,
            label="grads",
            when="backward",
            numel=numel,
            num_bytes=numel * reduce_dtype_bytes,
            every_micro_batch=part.gradients,
        )

    def params(when: str) -> Collective:
        numel = psi - kept if when == "backward" else psi
        return Collective(
            op="all_gather",
            label="params",
            when=when,
            numel=numel,
            num_bytes=numel * param_dtype_bytes,
            every_micro_batch=when != "after step",
        )

    if part.parameters:
        return params("forward"), params("backward"), grads("reduce_scatter", psi)
    if part.optimizer_states:
        return grads("reduce_scatter", psi), params("after step")
    # The ring all-reduce: a reduce-scatter and an all-gather of Psi each (the ledger's 2 numel).
    return (grads("all_reduce", 2 * psi),)


def total_bytes(collectives: tuple[Collective, ...]) -> int:
    return sum(c.num_bytes for c in collectives)


def total_numel(collectives: tuple[Collective, ...]) -> int:
    return sum(c.numel for c in collectives)


def comm_seconds(num_bytes: float, bandwidth_bytes_per_s: float) -> float:
    """Time to move ``num_bytes`` at ``bandwidth_bytes_per_s`` (no overlap, no latency)."""
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s!r}")
    return num_bytes / bandwidth_bytes_per_s
