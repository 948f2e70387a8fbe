"""Activation-checkpoint spans as the engine forms them (``zeroshard.residual_states.activations``):
up to ``ci`` consecutive units while each one's first input is the previous one's output, and at
stage 3 which units a span's recomputation gathers and frees before their own backward. Used by
the planner's timeline (memory) and its communication volume."""

from __future__ import annotations


def recompute_freed(first: tuple[int, ...], i: int, num_prefetch: int) -> range:
    """Forward indices of the units that unit ``i``'s backward recomputes and frees until their
    own backward, at stage 3 (``first``: ``first_units``; empty unless ``i`` ends a span longer than
    ``1 + num_prefetch``): gathered one at a time, and each gathered again later."""
    if not first or (i + 1 < len(first) and first[i + 1] == first[i]):
        return range(0)
    return range(first[i], max(first[i], i - num_prefetch))


def first_units(num_units: int, ci: int, chained: tuple[bool, ...] = ()) -> list[int]:
    """The first unit of each unit's span (forward order), as the engine forms them: up to
    ``ci`` consecutive units while each one's input is the previous one's output (``chained``,
    measured; empty: all)."""
    first: list[int] = []
    for i in range(num_units):
        joins = i > 0 and (not chained or chained[i]) and i - first[-1] < ci
        first.append(first[-1] if joins else i)
    return first
