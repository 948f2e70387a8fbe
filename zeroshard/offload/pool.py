"""A fixed pool of reusable, aligned host buffers: the staging memory of the NVMe tier.

Every byte that goes to or comes from a swap file passes through one of `num_buffers` buffers of
`buffer_bytes` each (the article's constant-size buffers, DESIGN.md §5): the store's memory does
not grow with the model, only the number of blocks in flight is bounded. The buffers are one slab,
aligned for O_DIRECT and pinned when an accelerator is present, so that device copies from them
are DMA.

A buffer is in one of three states:
- free: on the free list;
- held: taken by one I/O task, which always gives it back when its block is done;
- cached: filled by a prefetch with a verified block, waiting for the swap_in that claims it.
  Cached buffers are clean copies of data on disk, so a task that needs a buffer and finds none
  free evicts the oldest cached one instead of waiting. Hence no wait can last forever: a held
  buffer comes back when its task ends, and a cached one can always be taken.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

__all__ = ["BufferPool", "aligned_empty"]


def aligned_empty(
    shape: tuple[int, ...], dtype: torch.dtype, *, align_bytes: int, pin_memory: bool
) -> torch.Tensor:
    """An uninitialized host tensor whose first byte is `align_bytes`-aligned."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    raw = torch.empty(nbytes + align_bytes, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % align_bytes
    return raw[skip : skip + nbytes].view(dtype).view(shape)


class BufferPool:
    """`num_buffers` aligned host buffers of `buffer_bytes`, allocated on first use."""

    def __init__(
        self, *, num_buffers: int, buffer_bytes: int, align_bytes: int, pin_memory: bool
    ) -> None:
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {num_buffers}")
        if buffer_bytes % align_bytes:
            raise ValueError(f"buffer_bytes={buffer_bytes} must be a multiple of {align_bytes}")
        self.num_buffers = num_buffers
        self.buffer_bytes = buffer_bytes
        self.align_bytes = align_bytes
        self.pin_memory = pin_memory
        self._slab: torch.Tensor | None = None  # 1D uint8, the aligned part of the allocation
        self._views: list[torch.Tensor] = []  # 1D uint8 [buffer_bytes] each, views of the slab
        self._cond = threading.Condition()
        self._free: list[int] = list(range(num_buffers))
        # (name, block) -> buffer index; insertion order is eviction order (oldest first)
        self._cached: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.num_evictions = 0  # prefetched blocks dropped before use: a sign the pool is small
        self.max_in_use = 0  # high-water mark of held + cached buffers, for tests and tuning

    # -- memory ----------------------------------------------------------------------------------
    @property
    def allocated_bytes(self) -> int:
        return 0 if self._slab is None else self.num_buffers * self.buffer_bytes

    def _allocate(self) -> None:
        # One slab with slack, sliced at the first aligned address: the CPU and pinned allocators
        # only promise 64-byte alignment, O_DIRECT wants the filesystem's block alignment.
        nbytes = self.num_buffers * self.buffer_bytes + self.align_bytes
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        skip = -raw.data_ptr() % self.align_bytes
        self._slab = raw[skip : skip + self.num_buffers * self.buffer_bytes]
        assert self._slab.data_ptr() % self.align_bytes == 0
        self._views = list(self._slab.view(self.num_buffers, self.buffer_bytes).unbind(0))

    def view(self, index: int) -> torch.Tensor:
        """The buffer as a 1D uint8 tensor of `buffer_bytes` (valid while the caller holds it)."""
        return self._views[index]

    def memoryview(self, index: int, nbytes: int) -> memoryview:
        """The first `nbytes` of a buffer as a writable memoryview, for os.preadv / os.pwritev."""
        return memoryview(self._views[index].numpy()).cast("B")[:nbytes]

    # -- ownership -------------------------------------------------------------------------------
    def _note_use(self) -> None:
        in_use = self.num_buffers - len(self._free)
        self.max_in_use = max(self.max_in_use, in_use)

    def acquire(self) -> int:
        """Take a buffer, evicting the oldest cached block if none is free; may wait."""
        with self._cond:
            if self._slab is None:
                self._allocate()
            while True:
                if self._free:
                    index = self._free.pop()
                    self._note_use()
                    return index
                if self._cached:
                    _, index = self._cached.popitem(last=False)
                    self.num_evictions += 1
                    return index
                # every buffer is held by a running task; each gives its buffer back when done
                self._cond.wait()

    def try_acquire(self) -> int | None:
        """Take a free buffer without evicting or waiting: what a prefetch (a hint) may use."""
        with self._cond:
            if self._slab is None:
                self._allocate()
            if not self._free:
                return None
            index = self._free.pop()
            self._note_use()
            return index

    def release(self, index: int) -> None:
        with self._cond:
            assert index not in self._free, f"buffer {index} released twice"
            self._free.append(index)
            self._cond.notify()

    # -- prefetched blocks -----------------------------------------------------------------------
    def put_cached(self, name: str, block: int, index: int) -> None:
        """Park a held buffer holding a verified copy of block `block` of tensor `name`."""
        with self._cond:
            old = self._cached.pop((name, block), None)
            if old is not None:
                self._free.append(old)
            self._cached[(name, block)] = index
            self._cond.notify()  # a waiter may now evict it

    def take_cached(self, name: str, block: int) -> int | None:
        """Claim a prefetched block: the caller now holds the buffer and must release it."""
        with self._cond:
            return self._cached.pop((name, block), None)

    def drop_cached(self, name: str) -> None:
        """Forget prefetched blocks of `name` (its data changed or was released)."""
        with self._cond:
            for key in [k for k in self._cached if k[0] == name]:
                self._free.append(self._cached.pop(key))
            self._cond.notify_all()

    def num_cached(self) -> int:
        with self._cond:
            return len(self._cached)

    def num_free(self) -> int:
        with self._cond:
            return len(self._free)

    def close(self) -> None:
        """Return the memory; the pool allocates again if used after this."""
        with self._cond:
            self._cached.clear()
            self._free = list(range(self.num_buffers))
            self._slab = None
            self._views = []
