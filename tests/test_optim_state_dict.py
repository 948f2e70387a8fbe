"""Which piece of a sub-group holds a parameter's range, when an optimizer state dict is loaded
(``zeroshard.optim_state_dict._owner``): found by bisection, as the scan it replaced did."""

from __future__ import annotations

import random

from zeroshard.optim_state_dict import _owner


def _scan(span: range, pieces: list[range]) -> int | None:
    """The scan ``_owner`` replaced (quadratic over a sub-group's parameters)."""
    return next(
        (
            j
            for j, p in enumerate(pieces)
            if span.stop > span.start and p.start <= span.start and span.stop <= p.stop
        ),
        None,
    )


def test_the_owner_is_the_scan_s():
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, 60), rng.randint(1, 8)))
        bounds = [0, *cuts, 60]
        pieces = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        pieces += [range(c, c) for c in rng.sample(bounds, 2)]  # empty pieces where others start
        rng.shuffle(pieces)  # (the sub-group's order is torch's parameter order)
        spans = sorted((p.start, p.stop, j) for j, p in enumerate(pieces))
        for _ in range(20):
            a = rng.randrange(0, 61)
            span = range(a, min(60, a + rng.randint(0, 10)))
            found = _owner(span, spans)
            expected = _scan(span, pieces)
            assert found == expected, (span, pieces, found, expected)
