"""Pure arithmetic of flat, padded, sharded buffers (no tensors, no process groups).

A unit's parameters are concatenated into one 1D buffer of ``numel`` elements, each starting
at a multiple of ``ALIGN_BYTES`` (``layout``), padded to ``padded_numel``, a multiple of the
world size N; rank r owns the contiguous range ``[r * shard_numel, (r + 1) * shard_numel)``.
"""

from __future__ import annotations

ALIGN_BYTES = 16
"""Where each parameter starts in a flat buffer, in bytes of the model's dtype: a view of a
parameter as another dtype (``torch.view_as_complex`` of real pairs, which the complex
parameters' error suggests) needs an even element offset, and vector loads prefer alignment."""


def layout(numels: list[int], itemsize: int) -> tuple[list[int], int]:
    """Each parameter's first element in a flat buffer of ``itemsize``-byte elements (offsets
    rounded up to ``ALIGN_BYTES``, at least 2 elements), and the buffer's ``numel`` (the end
    of the last one). Elements between parameters belong to none: zeros, as the padding."""
    align = max(2, ALIGN_BYTES // itemsize)
    offsets, end = [], 0
    for n in numels:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + n
    return offsets, end


def padded_numel(numel: int, world_size: int) -> int:
    """Smallest multiple of ``world_size`` that is >= ``numel`` (and >= world_size: every rank
    gets at least one element, so a collective never sees an empty shard)."""
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return max(1, -(-numel // world_size)) * world_size


def shard_range(rank: int, padded: int, num_shards: int) -> tuple[int, int]:
    """``[start, end)`` of shard ``rank`` of ``padded`` elements cut in ``num_shards`` shards."""
    if padded % num_shards:
        raise ValueError(f"padded size {padded} is not a multiple of {num_shards} shards")
    if not 0 <= rank < num_shards:
        raise ValueError(f"rank {rank} outside [0, {num_shards})")
    size = padded // num_shards
    return rank * size, (rank + 1) * size


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The overlap of two half-open ranges; ``(x, x)`` (empty) when they do not overlap."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else (lo, lo)
