"""Activation-checkpoint spans as the engine forms them (``zeroshard.residual_states.activations``):
up to ``ci`` consecutive units while each one's first input is the previous one's output, and at
stage 3 which units a span's recomputation gathers and frees before their own backward. Used by
the planner's timeline (memory) and its communication volume."""

from __future__ import annotations


def recompute_freed(
    first: tuple[int, ...], i: int, num_prefetch: int, inner: tuple[bool, ...] = ()
) -> tuple[int, ...]:
    """Forward indices of the units that unit ``i``'s backward recomputes and frees until their
    own backward, at stage 3 (``first``: ``first_units``; none unless ``i`` ends a span of more
    than ``1 + num_prefetch`` units that count, ``inner`` as there): gathered one at a time, and
    each gathered again later."""
    if not first or (i + 1 < len(first) and first[i + 1] == first[i]):
        return ()
    members = [j for j in range(first[i], i + 1) if not (inner and inner[j])]
    return tuple(members[: max(0, len(members) - 1 - num_prefetch)])


def first_units(
    num_units: int,
    ci: int,
    chained: tuple[bool, ...] = (),
    inner: tuple[bool, ...] = (),
    calls: tuple[int, ...] = (),
) -> list[int]:
    """The first unit of each unit's span (forward order), as the engine forms them: up to
    ``ci`` consecutive units while each one's input is the previous one's output (``chained``,
    measured; empty: all). A unit that runs inside another unit, or not at all (``inner``), is
    recomputed with the unit before it and counts for nothing: it neither opens a span nor takes
    a place in one. A unit the root calls n > 1 times (``calls``: ALBERT's shared layer) is
    given its first call's span; the engine never puts a module twice in one span, so its later
    calls open a span each (``span_starts``), the last of which the next units may join."""
    first: list[int] = []
    members, open_first = 0, 0  # the open span's units that count towards ci, its first
    for i in range(num_units):
        if first and inner and inner[i]:
            first.append(first[-1])
            continue
        joins = bool(first) and (not chained or chained[i]) and members < ci
        members = members + 1 if joins else 1
        first.append(open_first if joins else i)
        open_first = first[-1]
        if calls and calls[i] > 1:
            members, open_first = 1, i  # its last call's span, open
    return first


def span_starts(first: list[int], calls: tuple[int, ...] = ()) -> list[int]:
    """Per unit, how many spans its calls open (``first_units``): 1 for a span's first unit, 0
    for one that joins, and one more for each further call of a unit called again."""
    return [(first[i] == i) + (max(1, calls[i]) - 1 if calls else 0) for i in range(len(first))]
