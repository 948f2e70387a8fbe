"""A rank's own range of a tensor's flattened elements, as checkpoint chunks: no gather needed.

A rank of a sharded model holds, of each parameter (and of each element-wise optimizer state,
e.g. Adam's ``exp_avg``), one contiguous range ``[start, start + numel)`` of its row-major
flattened elements: its part of the FlatParam's master (``FlatParam.piece_range``).
``model.state_dict()`` turns that into FSDP2's layout (a row chunk of every parameter), which
takes an all-gather per FlatParam. A checkpoint does not need it: ``FlatRange`` writes the range
as it is, cut into at most ``2 * ndim - 1`` boxes (a partial first row, whole rows, a partial last
row, recursively in the trailing dimensions), each a contiguous run of the range and a chunk of
the tensor's global shape with its offsets. ``torch.distributed.checkpoint`` (DCP) records chunks
of any shape in its metadata, and its load planner reads any overlap between saved and wanted
chunks, so the files stay DCP's format: they load at any world size and stage, and into FSDP2's
``Shard(0)`` state dicts.

A ``FlatRange`` is a state-dict entry that DCP's default planners understand through the hooks
DTensor uses (``__create_write_items__``, ``__create_chunk_list__``, ``size()``); the planners of
``zeroshard.checkpoint_planner`` look its boxes up. Loading writes straight into ``data`` (the
master, or the optimizer state itself).

A tensor-parallel rank holds a piece of each split parameter (``zeroshard.tensor_parallel``); its
``FlatRange`` carries a ``Split`` saying where the piece lies in the whole tensor, and its boxes
are placed there: every rank writes its part at the whole tensor's offsets, so the files hold the
unsplit model (they load at any tensor-parallel degree, or none).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

Box = tuple[tuple[int, ...], tuple[int, ...], int, int]
"""(offsets, sizes, lo, hi): a box of a tensor, and the flat element range ``[lo, hi)`` it is."""


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """The row-major flat range ``[lo, hi)`` of a tensor of ``shape`` as boxes, in order, each a
    contiguous run of elements (at most ``2 * len(shape) - 1``; none when the range is empty)."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,) if shape else (), (hi - lo,) if shape else (), lo, hi)]
    row = math.prod(shape[1:])
    first, last = lo // row, (hi - 1) // row  # the rows the range touches
    if first == last:  # within one row: recurse into it
        base = first * row
        return [
            ((first, *offsets), (1, *sizes), base + a, base + b)
            for offsets, sizes, a, b in boxes(shape[1:], lo - base, hi - base)
        ]
    out: list[Box] = []
    whole_lo, whole_hi = math.ceil(lo / row), hi // row  # rows covered whole
    if lo < whole_lo * row:
        out += boxes(shape, lo, whole_lo * row)
    if whole_lo < whole_hi:
        zeros = (0,) * (len(shape) - 1)
        sizes = (whole_hi - whole_lo, *shape[1:])
        out.append(((whole_lo, *zeros), sizes, whole_lo * row, whole_hi * row))
    if whole_hi * row < hi:
        out += boxes(shape, whole_hi * row, hi)
    return out


@dataclass(frozen=True)
class Split:
    """Where a tensor-parallel piece lies in the whole tensor: piece ``index`` of ``count`` equal
    pieces along ``dim``. With ``groups`` > 1 (fused q, k, v projections) the dim is ``groups``
    blocks, each split alike, and the piece is piece ``index`` of every block, concatenated."""

    dim: int
    index: int
    count: int
    groups: int = 1

    def whole(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole tensor's shape, from the piece's."""
        return (*shape[: self.dim], shape[self.dim] * self.count, *shape[self.dim + 1 :])

    def place(self, box: Box, shape: tuple[int, ...]) -> list[Box]:
        """A box of the piece (of ``shape``) as boxes of the whole tensor: the same elements (the
        same flat range of the piece), cut where the piece's rows leave a fused block."""
        offsets, sizes, lo, hi = box
        rows = shape[self.dim] // self.groups  # the piece's rows of each block
        start, stop = offsets[self.dim], offsets[self.dim] + sizes[self.dim]
        cuts = [start, *range((start // rows + 1) * rows, stop, rows), stop]
        if len(cuts) == 2:
            return [(self._at(offsets, start, rows), sizes, lo, hi)]
        if any(n != 1 for n in sizes[: self.dim]):
            raise ValueError(f"box {box} of a piece of shape {shape} does not cut at {self.dim}")
        # Cut, the box's first dim longer than 1 is ``dim``, whose trailing dims are whole
        # (``boxes``): each part is a contiguous run of the range.
        stride = math.prod(sizes[self.dim + 1 :])
        out = []
        for a, b in zip(cuts, cuts[1:]):
            size = (*sizes[: self.dim], b - a, *sizes[self.dim + 1 :])
            first = lo + (a - start) * stride
            out.append((self._at(offsets, a, rows), size, first, first + (b - a) * stride))
        return out

    def _at(self, offsets: tuple[int, ...], row: int, rows: int) -> tuple[int, ...]:
        """``offsets`` of the piece, with its ``row`` along ``dim``, in the whole tensor."""
        whole = (row // rows) * rows * self.count + self.index * rows + row % rows
        return (*offsets[: self.dim], whole, *offsets[self.dim + 1 :])


@dataclass(eq=False)
class FlatRange:
    """Elements ``[start, start + data.numel())`` of a tensor of global ``shape``, held here.

    ``data`` is 1D (any dtype and device): a view of the master or of an optimizer state, so a
    load fills it in place. ``dtype`` is what is saved (the state dict's dtype for the entry).
    With ``split``, the tensor of ``shape`` is a tensor-parallel piece of a larger one, and the
    range is saved and loaded as the part of that one (``size()``) it is."""

    shape: torch.Size
    dtype: torch.dtype
    start: int
    data: torch.Tensor
    split: Split | None = None
    _boxes: dict[tuple[int, ...], Box] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.shape = torch.Size(self.shape)
        shape = tuple(self.shape)
        found = boxes(shape, self.start, self.start + self.data.numel())
        if self.split is not None:
            found = [b for box in found for b in self.split.place(box, shape)]
        self._boxes = {b[0]: b for b in found}

    def size(self) -> torch.Size:
        """The global shape (DCP compares it with the checkpoint's): the whole tensor's."""
        if self.split is None:
            return self.shape
        return torch.Size(self.split.whole(tuple(self.shape)))

    def placed(self, split: Split) -> FlatRange:
        """This range of a tensor-parallel piece, saved and loaded as part of the whole tensor."""
        return FlatRange(self.shape, self.dtype, self.start, self.data, split)

    @property
    def nbytes(self) -> int:
        """Bytes written for this rank's range, in ``dtype``."""
        return self.data.numel() * self.dtype.itemsize

    def box(self, offsets: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """The box at ``offsets``: a view of ``data`` (in ``data``'s dtype) of the box's sizes."""
        _, sizes, lo, hi = self._boxes[tuple(offsets)]
        return self.data[lo - self.start : hi - self.start].view(sizes)

    def snapshot(self) -> FlatRange:
        """A copy on the CPU in ``dtype``: later changes to ``data`` do not reach it."""
        data = self.data.detach().to("cpu", self.dtype, copy=True)
        return FlatRange(self.shape, self.dtype, self.start, data, self.split)

    # DCP's hooks (what DTensor implements): one write item, or chunk to read, per box.
    def __create_write_items__(self, fqn: str, obj: object) -> list:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        properties = TensorProperties.create_from_tensor(torch.empty(0, dtype=self.dtype))
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                    properties=properties,
                    size=self.size(),
                ),
            )
            for offsets, sizes, _, _ in self._boxes.values()
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [
            ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            for offsets, sizes, _, _ in self._boxes.values()
        ]
