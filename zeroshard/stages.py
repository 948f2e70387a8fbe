"""The one table of ZeRO-DP stages: which model states each stage partitions across data-parallel
ranks. Engine and planner code ask this table; they never branch on ``stage >= 2``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    """Which model states a stage partitions across the data-parallel ranks (True = each rank
    holds 1/Nd of it, False = every rank holds all of it)."""

    optimizer_states: bool
    gradients: bool
    parameters: bool


STAGES: dict[int, Partition] = {
    0: Partition(False, False, False),  # plain data parallel
    1: Partition(True, False, False),  # optimizer states sharded
    2: Partition(True, True, False),  # + gradients (reduce-scatter)
    3: Partition(True, True, True),  # + parameters (fully sharded)
}


def partition(stage: int) -> Partition:
    """The row of ``STAGES`` for ``stage``; a ValueError for anything but 0-3."""
    try:
        return STAGES[stage]
    except (KeyError, TypeError):
        raise ValueError(
            f"stage must be 0, 1, 2 or 3 (ZeRO-DP stages), got {stage!r}; pick one of those"
        ) from None
