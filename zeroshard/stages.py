"""The one table of ZeRO-DP: which model states each stage partitions across data-parallel ranks.

Engine code asks this table what to do; it never branches on the stage number itself.

| stage | optimizer states | gradients | parameters | per-device bytes (ZeRO, K = 12)   |
|-------|------------------|-----------|------------|-----------------------------------|
| 0     | replicated       | replicated| replicated | (2 + 2 + K) Psi        (plain DP) |
| 1     | partitioned      | replicated| replicated | 2 Psi + 2 Psi + K Psi / Nd        |
| 2     | partitioned      | partitioned| replicated| 2 Psi + (2 + K) Psi / Nd          |
| 3     | partitioned      | partitioned| partitioned| (2 + 2 + K) Psi / Nd   (FSDP)     |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    """Which model states are split 1/Nd across the data-parallel ranks (True) or replicated."""

    optimizer_states: bool
    """FP32 master weights and optimizer states (Adam momentum and variance)."""
    gradients: bool
    """Gradients: reduce-scattered to their owner during backward and freed at once."""
    parameters: bool
    """Parameters: all-gathered just before a unit's forward and backward, freed right after."""


STAGES: dict[int, Partition] = {
    0: Partition(optimizer_states=False, gradients=False, parameters=False),
    1: Partition(optimizer_states=True, gradients=False, parameters=False),
    2: Partition(optimizer_states=True, gradients=True, parameters=False),
    3: Partition(optimizer_states=True, gradients=True, parameters=True),
}


def partition(stage: int) -> Partition:
    """The row of ``STAGES`` for ``stage``; a ValueError for anything but 0, 1, 2 or 3."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(
            f"stage must be 0, 1, 2 or 3 (0 = plain data parallel, 3 = FSDP), got {stage!r}"
        )
    return STAGES[stage]
