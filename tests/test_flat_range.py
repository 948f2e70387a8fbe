"""zeroshard.flat_range: a flat element range as boxes that tile it, and as DCP chunks."""

from __future__ import annotations

import math
import random

import pytest
import torch

from zeroshard.flat_range import FlatRange, Split, boxes


def _check_tiling(shape: tuple[int, ...], lo: int, hi: int) -> None:
    """The boxes, in order, are contiguous runs that cover exactly [lo, hi) of ``shape``."""
    found = boxes(shape, lo, hi)
    assert len(found) <= max(1, 2 * len(shape) - 1)
    flat = torch.arange(math.prod(shape)).view(shape) if shape else torch.tensor(0)
    at = lo
    for offsets, sizes, a, b in found:
        assert a == at and b > a and math.prod(sizes) == b - a
        region = flat[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
        assert torch.equal(region.reshape(-1), torch.arange(a, b)), (shape, lo, hi, offsets)
        at = b
    assert at == hi or (lo >= hi and not found)


@pytest.mark.parametrize("shape", [(), (7,), (4, 3), (3, 4, 5), (2, 3, 4, 5), (1, 1, 9), (6, 1)])
def test_boxes_tile_every_range(shape):
    n = math.prod(shape)
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            _check_tiling(shape, lo, hi)


def test_boxes_tile_random_ranges_of_large_shapes():
    rng = random.Random(0)
    for _ in range(200):
        shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        lo = rng.randint(0, n)
        _check_tiling(shape, lo, rng.randint(lo, n))


def test_flat_range_views_and_chunks():
    data = torch.arange(2.0, 9.0)  # elements 2..8 of a (4, 3) tensor
    r = FlatRange((4, 3), torch.bfloat16, 2, data)
    chunks = r.__create_chunk_list__()
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [
        ((0, 2), (1, 1)),
        ((1, 0), (2, 3)),
    ]
    r.box((1, 0)).fill_(-1)  # a view: writes reach data
    assert data.tolist() == [2.0, -1, -1, -1, -1, -1, -1]
    items = r.__create_write_items__("w", r)
    assert [i.tensor_data.properties.dtype for i in items] == [torch.bfloat16] * 2
    assert all(i.tensor_data.size == torch.Size((4, 3)) for i in items)
    assert r.nbytes == 7 * 2 and r.size() == torch.Size((4, 3))
    copy = r.snapshot()
    data.zero_()
    assert copy.data.dtype == torch.bfloat16 and copy.data[0].item() == 2.0


def _pieces(whole: torch.Tensor, dim: int, count: int, groups: int) -> list[torch.Tensor]:
    """How ``zeroshard.tensor_parallel`` splits ``whole``: piece r of every block, concatenated."""
    blocks = whole.chunk(groups, dim=dim)
    return [torch.cat([b.chunk(count, dim=dim)[r] for b in blocks], dim=dim) for r in range(count)]


@pytest.mark.parametrize(
    "shape, dim, count, groups",
    [
        ((12, 5), 0, 2, 3),
        ((12, 5), 0, 2, 1),
        ((6, 8), 1, 4, 1),
        ((24,), 0, 2, 3),
        ((4, 6, 3), 1, 3, 1),
    ],
)
def test_ranges_of_tensor_parallel_pieces_are_placed_in_the_whole_tensor(shape, dim, count, groups):
    """Every rank's range of every piece, written at its boxes' offsets, rebuilds the whole
    tensor exactly once: the saved files are the unsplit model's."""
    whole = torch.arange(float(math.prod(shape))).view(shape)
    rebuilt, hits = torch.full(shape, -1.0), torch.zeros(shape)
    rng = random.Random(1)
    for index, piece in enumerate(_pieces(whole, dim, count, groups)):
        flat = piece.reshape(-1)
        cuts = sorted({0, flat.numel(), *(rng.randint(0, flat.numel()) for _ in range(3))})
        for lo, hi in zip(cuts, cuts[1:]):  # the data-parallel ranks' ranges of the piece
            split = Split(dim, index, count, groups)
            r = FlatRange(piece.shape, torch.float32, lo, flat[lo:hi].clone()).placed(split)
            assert r.size() == torch.Size(shape)
            for chunk in r.__create_chunk_list__():
                at = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
                rebuilt[at] = r.box(tuple(chunk.offsets))
                hits[at] += 1
            assert r.snapshot().size() == torch.Size(shape)
    assert torch.equal(rebuilt, whole) and bool((hits == 1).all())
