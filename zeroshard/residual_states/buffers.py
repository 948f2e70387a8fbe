"""Constant-size buffers (ZeRO-R's CB): memory made once and lent, step after step, to the
storages that need it for a while (stage 3's gathered units, ``BufferPool``) and to the tensors
that need it for a while (stages 2-3's collected full gradients on the CPU, ``TensorPool``).

A gathered unit's ``full`` must keep one storage object for its whole life: autograd's saved views
point at it, and see the refill of the next gather. Freeing it between uses (``resize_(0)``) and
allocating again costs a fresh allocation per gather; for a large unit on the CPU that is an
``mmap`` whose pages are faulted in again at every gather (measured on this machine: a fresh
400 MB buffer allocated and touched in 132 ms, the same buffer reused in 14 ms). ``BufferPool``
instead swaps memory in and out of the storage object (``UntypedStorage._swap_data_ptr_``): the
storage gets a pool buffer's memory at ``lend`` and gives it back at ``take_back``, the same
object throughout.

Buffers are kept per (device, bytes): the units of one size (a transformer's blocks) share them.
The pool grows only when every buffer of a size is lent (the first step's peak, or a
``summon_full_params`` holding every unit); after ``take_back`` it keeps as many free buffers per
size as were lent at once in the last window (``settle``: the engine ends one as each training
forward of the model starts), ``keep`` before the first, and frees the rest. A pattern that
recurs every step (a block used twice in a forward stays gathered between its uses, beside the
computing and the prefetched ones) thus allocates in its first steps only, and an unusual
moment pins its memory for one window at most. ``made`` counts the buffers ever allocated.
``keep=0`` keeps nothing: each lend allocates and each take-back frees (memory only while
gathered, an allocation per gather).

In backward, after each unit's prefetch, the free buffers that no gather left in that backward
will take are freed (``trim``), as far as those lent and borrowed then come back to make up the
next window's count: one kept idle through the last units' backward sat in its peak.

The pool never holds more bytes, lent and free together, than were lent at once in the last
window or in this one (the most the step had in use at once): free buffers of other sizes are
freed, oldest first, to make room, and one given back beyond it is freed. Units of one size
reuse their buffers as above; units no two of one size (a CNN's widening stages) allocate at
each gather as without the pool, instead of every unit staying gathered between steps. A unit's
gradient on the CPU borrows the buffer its parameters gave back (``borrow``, through
``TensorPool``'s ``spare``); the next gather of that size may then allocate one (at most one
per step for a transformer's blocks, where the gradients' own tensors were one per size).
"""

from __future__ import annotations

from collections import defaultdict

import torch


class BufferPool:
    """Memory lent to storages that need it for a while (module docstring)."""

    def __init__(self, keep: int) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0 (free buffers kept per size), got {keep}")
        self.keep = keep
        # Buffers are tensors (1D uint8), so that memory trackers can be given them.
        self._free: dict[tuple[torch.device, int], list[torch.Tensor]] = defaultdict(list)
        self._lent: dict[int, tuple[tuple[torch.device, int], torch.Tensor]] = {}
        self.made = 0
        """Buffers allocated since construction."""
        self.made_bytes = 0
        self._lent_now: dict[tuple[torch.device, int], int] = defaultdict(int)
        self._borrowed: dict[tuple[torch.device, int], int] = defaultdict(int)
        """Buffers of a size ``borrow``ed now (a gradient in a gather buffer)."""
        self._peak: dict[tuple[torch.device, int], int] = defaultdict(int)
        """Most buffers of a size lent at once since the last ``settle``."""
        self._kept: dict[tuple[torch.device, int], int] = {}
        """Free buffers of a size kept after a take-back: the last window's peak (``settle``)."""
        self._lent_bytes = 0
        self._free_bytes = 0
        self._peak_bytes = 0
        """Most bytes lent at once since the last ``settle``."""
        self._room = 0
        """Most bytes lent at once in the last window: the pool holds at most this many, or
        ``_peak_bytes`` when more (``_make_room``)."""
        self._returned: dict[int, tuple[tuple[torch.device, int], torch.Tensor]] = {}
        """The free buffers, by ``id``, oldest given back first (the order they are freed in)."""

    def lend(self, owner: object, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory until ``take_back(owner, ...)``."""
        if id(owner) in self._lent:
            raise RuntimeError("lend: this owner holds a buffer already; take it back first")
        if storage.nbytes():
            raise RuntimeError(f"lend: the storage holds {storage.nbytes()} bytes already")
        key = (storage.device, nbytes)
        free = self._free[key]
        self._lent_bytes += nbytes
        self._peak_bytes = max(self._peak_bytes, self._lent_bytes)
        if free:
            buffer = self._unfree(key)
        else:
            self._make_room(0)  # other sizes' free buffers, beyond what this step holds at once
            buffer = self._make(storage.device, nbytes)
        _swap(storage, buffer.untyped_storage())  # storage: the memory; buffer: none
        self._lent[id(owner)] = (key, buffer)
        self._lent_now[key] += 1
        self._peak[key] = max(self._peak[key], self._lent_now[key])

    def holds(self, owner: object) -> bool:
        """Whether ``owner`` holds a buffer lent by ``lend``."""
        return id(owner) in self._lent

    def take_back(self, owner: object, storage: torch.UntypedStorage) -> None:
        """Leave ``storage`` empty; its memory goes back to the pool (``_return``: or is freed,
        when as many of its size as it keeps are free already or it does not fit). Memory
        ``storage`` did not get from ``lend`` is freed (``resize_(0)``)."""
        loan = self._lent.pop(id(owner), None)
        if loan is None:
            storage.resize_(0)
            return
        key, buffer = loan
        _swap(storage, buffer.untyped_storage())
        self._lent_now[key] -= 1
        self._lent_bytes -= key[1]
        self._return(key, buffer)

    def _return(self, key: tuple[torch.device, int], buffer: torch.Tensor) -> None:
        """``buffer`` (with its memory) back among the free ones, or freed when as many of its
        size as the pool keeps are free already or it does not fit in what the pool may
        hold."""
        if len(self._free[key]) < self._keeps(key) and self._make_room(key[1]):
            # (the list last: a Ctrl-C lands after a call returns, and between the two it left
            # a free buffer the pool did not know, its next use a KeyError)
            self._returned[id(buffer)] = (key, buffer)
            self._free_bytes += key[1]
            self._free[key].append(buffer)
        else:
            buffer.untyped_storage().resize_(0)

    def borrow(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        """A free buffer of exactly ``nbytes`` on ``device`` as a 1D uint8 tensor with its memory,
        until ``give_back``; None when none is free. A unit's full gradient takes the gathered
        memory its parameters just gave back (stage 3, FP32: the same bytes), as a caching
        allocator would, instead of new memory beside a buffer idle until the next gather.
        Counted among the bytes lent at once, not among the buffers of its size lent."""
        key = (torch.device(device), nbytes)
        if not self._free[key]:
            return None
        self._lent_bytes += nbytes
        self._peak_bytes = max(self._peak_bytes, self._lent_bytes)
        buffer = self._unfree(key)
        self._borrowed[(buffer.device, nbytes)] += 1  # (as ``give_back`` keys it)
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        """Return a buffer from ``borrow``."""
        key = (buffer.device, buffer.numel())
        self._lent_bytes -= key[1]
        self._borrowed[key] -= 1
        self._return(key, buffer)

    def _unfree(self, key: tuple[torch.device, int]) -> torch.Tensor:
        """The newest free buffer of ``key``'s size, out of the free ones."""
        free = self._free[key]
        buffer = free[-1]
        del self._returned[id(buffer)]  # (the list last, as in ``_return``: a buffer out of it
        self._free_bytes -= key[1]  # but still known broke every later step)
        free.pop()
        return buffer

    def _make_room(self, nbytes: int) -> bool:
        """Free the oldest free buffers until ``nbytes`` more fit beside those lent and free in
        what the pool may hold (module docstring); whether they fit."""
        room = max(self._room, self._peak_bytes)
        while self._returned and self._lent_bytes + self._free_bytes + nbytes > room:
            key, oldest = self._returned[next(iter(self._returned))]
            self._drop(key, oldest)
        return self._lent_bytes + self._free_bytes + nbytes <= room

    def _drop(self, key: tuple[torch.device, int], buffer: torch.Tensor) -> None:
        """Free the free ``buffer`` of ``key``'s size."""
        free = self._free[key]
        at, returned = next(i for i, b in enumerate(free) if b is buffer), id(buffer)
        del free[at]  # (no call between the two)
        del self._returned[returned]
        self._free_bytes -= key[1]
        buffer.untyped_storage().resize_(0)

    def trim(self, upcoming: dict[tuple[torch.device, int], int]) -> None:
        """Free the free buffers of each (device, bytes) that neither the lends still to come
        (``upcoming``: gathers of that size left before the window ends) nor the next window
        needs: the buffers lent and borrowed now come back by then and make up its count. One
        kept idle meanwhile sits in whatever peak comes first (the last unit's backward at
        stage 3: a block buffer, 27 MiB of the ``100m`` preset's peak)."""
        for key, free in self._free.items():
            while len(free) > max(upcoming.get(key, 0), self._next_needs(key)):
                self._drop(key, free[0])

    def idle(self) -> dict[tuple[torch.device, int], int]:
        """The free buffers per (device, bytes) where more are free than the next window needs
        beside those lent and borrowed now: what ``trim`` may free (the lends to come aside)."""
        return {k: len(f) for k, f in self._free.items() if len(f) > self._next_needs(k)}

    def _next_needs(self, key: tuple[torch.device, int]) -> int:
        """Free buffers of ``key``'s size the next window needs beyond those lent and borrowed
        now, which come back by then."""
        return self._keeps(key) - self._lent_now[key] - self._borrowed[key]

    def _keeps(self, key: tuple[torch.device, int]) -> int:
        """Free buffers of ``key``'s size to keep: none with ``keep=0`` (no pooling), else as
        many as the last window lent at once (the root's one), ``keep`` for a size it did not
        lend or before any window ended."""
        return self._kept.get(key, self.keep) if self.keep else 0

    def settle(self) -> None:
        """End a window of use (one training step, or one inference forward): from now on keep
        as many free buffers per size as were lent at once in it (the free ones beyond that
        are freed now), and start the next window's count from the buffers lent at the
        moment."""
        self._kept, self._room = dict(self._peak), self._peak_bytes
        for key, free in self._free.items():
            while len(free) > self._keeps(key):
                self._drop(key, free[-1])
        self._peak = defaultdict(int, self._lent_now)
        self._peak_bytes = self._lent_bytes
        self._make_room(0)

    def _make(self, device: torch.device, nbytes: int) -> torch.Tensor:
        self.made += 1
        self.made_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer the pool holds, free (with its memory) or lent (empty): to register with
        a memory tracker (``MemTracker.track_external``), which then counts the free ones."""
        return [b for free in self._free.values() for b in free] + [
            b for _, b in self._lent.values()
        ]

    @property
    def free_bytes(self) -> int:
        """Bytes of the free buffers the pool holds."""
        return self._free_bytes


class TensorPool:
    """1D tensors lent whole and given back, for memory made and freed at every use whose
    tensor is never aliased once given back: a unit's full gradient at stages 2-3, collected from
    autograd's per-parameter gradients, reduce-scattered into a separate shard, then dropped.

    On the CPU a fresh tensor of a unit's size is an ``mmap`` whose pages fault in on the first
    write (the module docstring's 132 against 14 ms per 400 MB); kept, they stay resident (100m,
    stage 2, 2 ranks: the gradient collection's copies 93 -> 25 ms per step). Keyed by (device,
    dtype, numel); after ``give`` at most ``keep`` free tensors per key stay, the rest are freed,
    and a ``take`` of a size none is free for frees those kept for other sizes (a large unit of
    its own, an LM head reduced first, does not stay through the rest of backward).
    The engine ``release``-s the pool at the end of each backward: its memory is made once per
    backward per unit size, and none is kept between steps (where it would add to the next
    backward's early peak, before any gradient exists).
    GPUs have a caching allocator already, and a side stream's use would need recording:
    the engine pools on the CPU only. ``spare``: stage 3's gather buffers, whose free ones of
    the right size are borrowed before anything is allocated (``BufferPool.borrow``)."""

    def __init__(self, keep: int, spare: BufferPool | None = None) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0 (free tensors kept per size), got {keep}")
        self.keep = keep
        self.spare = spare
        self._borrowed: dict[int, torch.Tensor] = {}  # id of a tensor taken -> spare's buffer
        self._free: dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]] = defaultdict(
            list
        )
        self._lent: dict[int, torch.Tensor] = {}
        self.made = 0
        """Tensors allocated since construction."""

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1D tensor of ``numel`` elements, contents undefined, until ``give``."""
        free = self._free[(torch.device(device), dtype, numel)]
        spare = None
        if not free and self.spare is not None:
            spare = self.spare.borrow(numel * dtype.itemsize, device)
        if free:
            tensor = free.pop()
        elif spare is not None:
            self._free.clear()  # (as below: those kept for other sizes are not reused)
            tensor = spare.view(dtype)
            self._borrowed[id(tensor)] = spare
        else:
            self._free.clear()  # another size now: those kept are not what is reused
            self.made += 1
            tensor = torch.empty(numel, dtype=dtype, device=device)
        self._lent[id(tensor)] = tensor
        return tensor

    def give(self, tensor: torch.Tensor) -> None:
        """Take back a tensor from ``take``; the caller holds no view of it any more."""
        if self._lent.pop(id(tensor), None) is None:
            raise RuntimeError("give: this tensor did not come from this pool's take")
        spare = self._borrowed.pop(id(tensor), None)
        if spare is not None:
            self.spare.give_back(spare)
            return
        free = self._free[(tensor.device, tensor.dtype, tensor.numel())]
        if len(free) < self.keep:
            free.append(tensor)

    def release(self) -> None:
        """Free every free tensor (lent ones stay lent)."""
        self._free.clear()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the pool holds, free or lent (for a memory tracker)."""
        return [t for free in self._free.values() for t in free] + list(self._lent.values())


_RESIZE = torch.UntypedStorage.resize_
"""torch's own ``resize_``: memory trackers (``MemTracker``) replace the class attribute."""


def _swap(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory of two storages. While a tracker has patched
    ``UntypedStorage.resize_``, each is then resized to its own new size, so that the tracker
    sees the size change it missed; only then, because such a resize copies the whole buffer
    (torch 2.13 reallocates even to the same size)."""
    a._swap_data_ptr_(b)
    if torch.UntypedStorage.resize_ is not _RESIZE:
        a.resize_(a.nbytes())
        b.resize_(b.nbytes())
