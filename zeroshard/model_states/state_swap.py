"""Optimizer states on NVMe (ZeRO-Infinity): swapped sub-group by sub-group around the step.

The sharded optimizer steps one *sub-group* (one trainable FlatParam's pieces, one torch
optimizer) at a time. With ``Offload(optimizer="nvme")`` each sub-group's element-wise states
(Adam's ``exp_avg`` and ``exp_avg_sq``: 8 bytes per element this rank owns) live as one record in
the rank's ``TensorStore``; only a ring of ``NUM_SLOTS`` host buffers holds states in memory:

    step, sub-group i:  read i+1 ahead  |  step i (fused AdamW)  |  write i-1 behind
    after the step:     read sub-group 0 into a slot, and the next ones into the store's fixed
                        pool of staging buffers (as many as it holds), overlapping the next
                        forward and backward; the last writes finish meanwhile

so host memory for optimizer states is ``NUM_SLOTS`` records (3 sub-groups), not all of them,
plus the store's pool (``OffloadConfig.num_buffers * block_bytes``, 64 MiB by default).
Scalar states (``step``) stay in the torch optimizer's dicts. The FP32 master stays in memory:
the engine reads it after the step to refresh the compute parameters.

Tensors and who holds them (this rank only; nothing here is communicated):

    slot     # 1D uint8, NUM_SLOTS x the largest record, page-aligned so the disk reads and
             #   writes it in place; a sub-group's states are views into it while resident
    record   # on NVMe: the sub-group's element-wise states, each at a 4096-aligned offset

Outside ``step()`` any access to a sub-optimizer's ``state`` (``optimizer_state_dict``,
``zeroshard.checkpoint``, memory trackers) first reads that sub-group's states back into tensors
of their own (``Where.LOOSE``), which stay until the next step streams them out again, so a
state dict never sees missing or stale states. ``ShardedOptimizer.states_in_memory()`` does this
for every sub-group at once and streams them back out on exit.

Every read is checksummed by the store; a failed or corrupted read stops training with an
``OffloadError`` naming the sub-group, and every later step raises it again.
"""

from __future__ import annotations

import enum
import logging
import time
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.model_states.optimizer_args import step_inner
from zeroshard.model_states.swap_space import check_host_memory, check_space
from zeroshard.model_states.swappers import StopsOnFailure, open_store, stopping_on_refusal
from zeroshard.offload import (
    SwapHandle,
)
from zeroshard.offload.folder import padded_bytes
from zeroshard.signals import deferred

if TYPE_CHECKING:
    from zeroshard.mesh import Mesh
    from zeroshard.model_states.subgroups import SubGroup
    from zeroshard.offload.placement import Offload

log = logging.getLogger(__name__)

NUM_SLOTS = 3
"""Sub-groups whose states are in memory at once during the step: one read ahead, one
stepping, one being written back."""


class Where(enum.Enum):
    """Where a sub-group's element-wise states are, and which buffers are alive."""

    NEW = "new"  # none yet (before its first step): nothing stored, no slot
    STORED = "stored"  # only in the store: the state dicts hold the scalar states alone
    READING = "reading"  # being read into its slot (the slot is held)
    IN_SLOT = "in_slot"  # resident as views of its slot
    WRITING = "writing"  # resident in its slot and being written; the slot is held until done
    LOOSE = "loose"  # resident in tensors of their own (made by torch, touched, or loaded)


@dataclass(frozen=True)
class _Entry:
    """One element-wise state tensor of a sub-group within its record."""

    piece: int  # index into the sub-group's pieces, torch's parameter order
    key: str
    dtype: torch.dtype
    numel: int
    offset_bytes: int  # into the record, a multiple of ALIGN_BYTES


@dataclass
class _Swap:
    """The swap state of one sub-group."""

    name: str  # the record's name in the store
    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]  # the pieces, torch's order (keys of optimizer.state)
    where: Where = Where.NEW
    layout: list[_Entry] = field(default_factory=list)
    record_bytes: int = 0
    slot: torch.Tensor | None = None  # 1D uint8, held while READING / IN_SLOT / WRITING
    handle: SwapHandle | None = None


def _layout(params: list[torch.Tensor], states: dict) -> tuple[list[_Entry], int]:
    """The element-wise states (tensors shaped like their piece) at aligned offsets, and the
    record's size in bytes."""
    entries, offset = [], 0
    for i, p in enumerate(params):
        st = dict.get(states, p, {})  # no swap-in: this describes what is resident
        for key in sorted(st):
            v = st[key]
            if torch.is_tensor(v) and v.ndim >= 1 and v.shape == p.shape:
                entries.append(_Entry(i, key, v.dtype, v.numel(), offset))
                offset += padded_bytes(v.numel() * v.element_size())
    return entries, offset


def state_bytes_per_element(
    optimizer_cls: type, defaults: dict[str, Any], group: dict[str, Any] | None = None
) -> int:
    """Bytes of element-wise state ``optimizer_cls`` keeps per parameter element (AdamW: 8),
    measured on a two-element probe stepped once with ``group``'s settings over ``defaults``
    (a group's own ``amsgrad=True`` or ``momentum`` adds states its defaults lack)."""
    probe = torch.zeros(2, requires_grad=True)
    probe.grad = torch.zeros(2)
    settings = {k: v for k, v in (group or {}).items() if k != "params"}
    opt = optimizer_cls([{**settings, "params": [probe]}], **defaults)
    step_inner(opt)  # (torch's global step hooks are the user's step's, not this probe's)
    st = opt.state[probe]
    return sum(
        v.element_size() for v in st.values() if torch.is_tensor(v) and v.shape == probe.shape
    )


def state_bytes_per_group(
    optimizer_cls: type, defaults: dict[str, Any], subgroups: list[SubGroup]
) -> list[list[int]]:
    """``state_bytes_per_element`` of each torch param group of each sub-group (one probe per
    distinct setting). ``record_bytes`` sums them over a sub-group's pieces."""
    seen: dict[str, int] = {}
    out = []
    for sg in subgroups:
        sizes = []
        for group in sg.optimizer.param_groups:
            key = repr(sorted((k, repr(v)) for k, v in group.items() if k != "params"))
            if key not in seen:
                seen[key] = state_bytes_per_element(optimizer_cls, defaults, group)
            sizes.append(seen[key])
        out.append(sizes)
    return out


def record_bytes(sg: SubGroup, per_element: list[int]) -> int:
    """Bytes of sub-group ``sg``'s element-wise states (``per_element``: of each torch param
    group, from ``state_bytes_per_group``), unpadded."""
    return sum(n * p.tensor.numel() for n, pieces in zip(per_element, sg.pieces) for p in pieces)


class _SwappedState(defaultdict):
    """A sub-optimizer's ``state``: reading it outside the step swaps the sub-group in first."""

    def __init__(self, swapper: StateSwapper, index: int, states: dict) -> None:
        super().__init__(dict, states)
        self._swapper = weakref.ref(swapper)  # the swapper owns the optimizers, not vice versa
        self._index = index

    def _touch(self) -> None:
        swapper = self._swapper()
        if swapper is not None:
            swapper.touch(self._index)

    def __getitem__(self, key: Any) -> Any:
        self._touch()
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._touch()
        return super().get(key, default)

    def items(self):  # type: ignore[override]
        self._touch()
        return super().items()

    def values(self):  # type: ignore[override]
        self._touch()
        return super().values()


class StateSwapper(StopsOnFailure):
    """The optimizer states of every sub-group on NVMe, streamed around each step (module
    docstring). Built by ``ShardedOptimizer`` when the model's ``Offload.optimizer`` is
    "nvme"; checks the folder's free space at once (before step 1)."""

    def __init__(
        self,
        subgroups: list[SubGroup],
        offload: Offload,
        mesh: Mesh,
        optimizer_cls: type,
        defaults: dict[str, Any],
        *,
        grad_bytes: int = 0,
        index: int = 0,
    ) -> None:
        self.index = index
        """Which of the model's optimizers' stores (``Offload.store_config``): 0 for the first."""
        config = offload.store_config(mesh.global_rank, index)
        per_element = state_bytes_per_group(optimizer_cls, defaults, subgroups)
        state_bytes = sum(  # each state tensor's file rounded up to 4096; per_element counts
            # 4-byte states: a float64 master's are 8 bytes
            n * padded_bytes(p.tensor.numel() * p.tensor.element_size()) // 4
            for sg, sizes in zip(subgroups, per_element)
            for n, pieces in zip(sizes, sg.pieces)
            for p in pieces
        )
        need_bytes = state_bytes + grad_bytes
        self.store = open_store(config, mesh, self)  # an unusable folder fails here, naming it
        try:
            check_space(self.store, need_bytes, mesh)
        except BaseException:
            self.store.close()
            raise
        self._swaps: list[_Swap] = []
        for i, sg in enumerate(subgroups):
            params = [p for group in sg.optimizer.param_groups for p in group["params"]]
            name = f"optimizer_states[{i}]:{sg.bucket.flat.name or '<root>'}"
            self._swaps.append(_Swap(name, sg.optimizer, params))
            sg.optimizer.state = _SwappedState(self, i, sg.optimizer.state)
        self._free: list[torch.Tensor] = []  # slots not held by any sub-group
        self._num_slots = 0  # slots allocated so far (at most NUM_SLOTS)
        self.slot_bytes = 0  # host memory of the slots, allocated on first use
        self._writing: deque[int] = deque()  # sub-groups being written, oldest first
        self._in_step = False
        self._error: str | None = None
        self.max_record_bytes = max(
            (record_bytes(sg, sizes) for sg, sizes in zip(subgroups, per_element)),
            default=0,
        )
        self.need_bytes = need_bytes
        self.reset_stats()
        staging = min(NUM_SLOTS, len(subgroups)) * self.max_record_bytes
        staging += config.num_buffers * config.block_bytes
        try:
            check_host_memory(staging, mesh, NUM_SLOTS)
        except BaseException:
            self.store.close()
            raise
        log.info(
            "offload to NVMe (%s, rank %d): %d bytes of optimizer states (up to %d per element) + "
            "%d bytes of gradient shards in swap files; host staging: %d slots x ~%d bytes "
            "(states) + up to %d bytes of store pool (read-ahead; %s)",
            config.folder,
            mesh.rank,
            state_bytes,
            max((n for sizes in per_element for n in sizes), default=0),
            grad_bytes,
            min(NUM_SLOTS, len(subgroups)),
            self.max_record_bytes,
            config.num_buffers * config.block_bytes,
            "pinned"
            if self.store.pool is not None and self.store.pool.pin_memory
            else "not pinned",
        )

    # ----------------------------------------------------------------- the step pipeline
    def begin_step(self) -> None:
        self._check()
        self._collapse()
        for i in range(len(self._swaps)):
            self._adopt(i)
        self._in_step = True

    def before(self, i: int) -> None:
        """Read sub-group ``i + 1`` ahead, then make ``i`` resident (waiting for its read)."""
        if i + 1 < len(self._swaps):
            self._start_read(i + 1)
        self._resident_in_slot(i)

    def after(self, i: int) -> None:
        """Sub-group ``i`` has stepped: start writing it back (packing loose states first)."""
        s = self._swaps[i]
        if s.where is Where.NEW:
            s.where = Where.LOOSE if _layout(s.params, s.optimizer.state)[0] else Where.NEW
        if s.where is Where.IN_SLOT and (
            _layout(s.params, s.optimizer.state)[1] != s.record_bytes or self._rebound(i)
        ):  # states made in this step (a parameter's first gradient), or replaced: repacked
            self._loosen(i)
        if s.where is Where.LOOSE:
            self._pack(i)
        if s.where is Where.IN_SLOT:
            assert s.slot is not None
            self.write_bytes += s.record_bytes
            what = f"optimizer states {s.name!r} could not be written"
            with stopping_on_refusal(self.stop, what, "states"):
                handle = self.store.swap_out(s.name, s.slot[: s.record_bytes])
            s.handle = self.timed(handle)
            s.where = Where.WRITING
            self._writing.append(i)

    def end_step(self) -> None:
        """Read ahead for the next step, overlapping its forward and backward: sub-group 0 into
        a free slot, and the next sub-groups into the store's pool of staging buffers, as many
        as it holds (a later swap_in then copies from memory instead of waiting for the disk)."""
        self._in_step = False
        if not self._swaps:
            return
        self._start_read(0)
        budget = self.store.config.num_buffers * self.store.config.block_bytes
        block = self.store.config.block_bytes
        names = []
        for s in self._swaps[1:]:
            held = -(-s.record_bytes // block) * block  # the pool holds whole blocks
            if s.where is not Where.STORED:
                continue  # resident or in flight already
            if held > budget:
                break
            budget -= held
            names.append(s.name)
            self.prefetch_bytes += s.record_bytes
        for handle in self.store.prefetch(names):
            self.timed(handle)

    def abort_step(self) -> None:
        """A step raised partway: the sub-group it raised in, resident in its slot and maybe
        partly updated, is written back as a stepped one is, and the one read ahead goes back
        to the store. Their slots stayed held otherwise, and with every slot held the next
        step found none to read into ("every slot held by a resident sub-group", at every
        step after). A failure of the store here is left for its next use to raise: the
        step's own exception is the one on its way."""
        self._in_step = False
        try:
            for i, s in enumerate(self._swaps):
                if s.where is Where.READING:
                    self._retire(i)
                elif s.where is Where.IN_SLOT:
                    self.after(i)
        except Exception:  # (self.stop keeps the store's error: raised at its next use)
            log.warning("cleaning up after an interrupted step", exc_info=True)

    # ----------------------------------------------------------------- outside the step
    def touch(self, i: int) -> None:
        """Sub-group ``i``'s states are being read outside the step: make them resident in
        tensors of their own (LOOSE), so nothing sees a missing or stale state."""
        if self._in_step:
            return
        self._check()
        self._adopt(i)
        s = self._swaps[i]
        if s.where is Where.STORED:
            self._start_read(i)
        if s.where in (Where.READING, Where.WRITING):
            self._wait(i)
        if s.where is Where.IN_SLOT:
            self._loosen(i)

    def _loosen(self, i: int) -> None:
        """Sub-group ``i``, IN_SLOT, into tensors of its own (LOOSE): its slot is freed."""
        s = self._swaps[i]
        assert s.slot is not None
        own = self.store.empty_host((s.record_bytes,), torch.uint8)
        own.copy_(s.slot[: s.record_bytes])
        self._point(i, own, only_from=s.slot)
        self._release(i)
        s.where = Where.LOOSE

    def _rebound(self, i: int) -> bool:
        """Whether the step replaced a state of sub-group ``i`` with a new tensor instead of
        updating its view of the slot (``state["buf"] = buf * m + g``, an optimizer of one's
        own): the slot, which is written back, still held the old values."""
        s = self._swaps[i]
        assert s.slot is not None
        states = (dict.__getitem__(s.optimizer.state, s.params[e.piece]) for e in s.layout)
        return any(not _within(st.get(e.key), s.slot) for st, e in zip(states, s.layout))

    def store_all(self) -> None:
        """Stream every resident sub-group back out (bounded by the slots) and wait."""
        self._check()
        for i in range(len(self._swaps)):
            self._adopt(i)
            if self._swaps[i].where in (Where.LOOSE, Where.IN_SLOT, Where.READING):
                self._resident_in_slot(i)
                self.after(i)
        self.synchronize()

    def synchronize(self) -> None:
        """Wait for every write; their slots become free."""
        while self._writing:
            self._retire(self._writing[0])

    def close(self) -> None:
        """Wait for pending I/O and delete the swap files; the states are gone afterwards."""
        if self._error is None:
            self._error = "the optimizer's offloaded states were closed"
        self.store.close()

    # ----------------------------------------------------------------- measurements
    def reset_stats(self) -> None:
        self.read_bytes = self.write_bytes = self.prefetch_bytes = 0
        self.wait_s = 0.0  # the training thread blocked on a swap
        self._intervals: list[list[float]] = []  # [issued, done] of recent swaps
        self._busy_s = 0.0  # the union of the older ones, folded by _collapse

    def stats(self) -> dict[str, float]:
        """Bytes moved, seconds any swap was in flight (``io_s``, the union of intervals) and
        seconds the caller blocked on one (``wait_s``), since ``reset_stats``; swaps still in
        flight count up to now. ``1 - wait_s / io_s`` is the fraction of I/O hidden."""
        now = time.perf_counter()
        busy = self._busy_s + _union([(t0, min(t1, now)) for t0, t1 in self._intervals])
        return {
            "read_bytes": self.read_bytes,
            "prefetch_bytes": self.prefetch_bytes,
            "write_bytes": self.write_bytes,
            "io_s": busy,
            "wait_s": self.wait_s,
            "num_slots": self._num_slots,
            "slot_bytes": self.slot_bytes,
        }

    # ----------------------------------------------------------------- internals

    def _collapse(self) -> None:
        """Fold the intervals of swaps finished before any pending one began into ``_busy_s``
        (the list would otherwise grow by every swap of every step)."""
        pending = [t0 for t0, t1 in self._intervals if t1 == float("inf")]
        cut = min(pending, default=time.perf_counter())
        self._busy_s += _union([(t0, min(t1, cut)) for t0, t1 in self._intervals if t0 < cut])
        kept = []
        for interval in self._intervals:
            if interval[1] > cut:  # pending, or finished after the cut: the rest counts later
                interval[0] = max(interval[0], cut)
                kept.append(interval)
        self._intervals = kept

    def timed(self, handle: SwapHandle) -> SwapHandle:
        """``handle``, its time in flight counted in ``stats()``."""
        interval = [time.perf_counter(), float("inf")]
        self._intervals.append(interval)
        handle.add_done_callback(lambda _: interval.__setitem__(1, time.perf_counter()))
        return handle

    def _adopt(self, i: int) -> None:
        """Take back a sub-optimizer whose ``state`` torch replaced (``load_state_dict``): its
        new dict holds resident states of their own."""
        s = self._swaps[i]
        if isinstance(s.optimizer.state, _SwappedState):
            if s.where is Where.NEW and _layout(s.params, s.optimizer.state)[0]:
                s.where = Where.LOOSE  # torch made them outside the step (``_init_states``)
            return
        if s.slot is not None:
            if s.handle is not None:  # in flight into or out of the slot the new dict no
                self._wait(i, point=False)  # longer uses: its states are not brought back
            self._release(i)
        s.optimizer.state = _SwappedState(self, i, s.optimizer.state)
        s.where = Where.LOOSE if _layout(s.params, s.optimizer.state)[0] else Where.NEW

    def _acquire(self, nbytes: int, limit: int = NUM_SLOTS) -> torch.Tensor:
        """A free slot of at least ``nbytes``: waits for the oldest write when ``limit`` slots
        are held."""
        while not self._free and self._num_slots >= limit:
            assert self._writing, "every slot held by a resident sub-group"
            self._retire(self._writing[0])
        slot = self._free.pop() if self._free else None
        if slot is None:
            self._num_slots += 1
        if slot is None or slot.numel() < nbytes:
            self.slot_bytes -= 0 if slot is None else slot.numel()
            slot = self.store.empty_host((max(nbytes, self.max_record_bytes),), torch.uint8)
            self.slot_bytes += slot.numel()
        return slot

    def _release(self, i: int) -> None:
        s = self._swaps[i]
        assert s.slot is not None
        self._free.append(s.slot)
        s.slot, s.handle = None, None

    def _start_read(self, i: int) -> None:
        s = self._swaps[i]
        if s.where is not Where.STORED:
            return  # resident, in flight, or nothing stored yet
        s.slot = self._acquire(s.record_bytes)
        self.read_bytes += s.record_bytes
        s.handle = self.timed(self.store.swap_in(s.name, into=s.slot[: s.record_bytes]))
        s.where = Where.READING

    def _wait(self, i: int, *, point: bool = True) -> None:
        """Finish sub-group ``i``'s swap in flight: READING or WRITING become IN_SLOT (a read's
        states pointed at the slot unless not ``point``)."""
        s = self._swaps[i]
        assert s.handle is not None
        t0 = time.perf_counter()
        try:
            s.handle.wait()
        except Exception as e:
            what = "read back" if s.where is Where.READING else "written"
            raise self.stop(f"optimizer states {s.name!r} could not be {what}", "states", e) from e
        finally:
            self.wait_s += time.perf_counter() - t0
        with deferred():  # (a Ctrl-C between these left it WRITING, out of ``_writing``:
            # every later step failed on removing it again)
            if s.where is Where.READING and point:
                assert s.slot is not None
                self._point(i, s.slot)
            elif s.where is Where.WRITING:
                self._writing.remove(i)
            s.handle = None
            s.where = Where.IN_SLOT

    def _retire(self, i: int) -> None:
        """Sub-group ``i``'s write is done: drop its resident states and free its slot."""
        self._wait(i)
        s = self._swaps[i]
        for e in s.layout:
            dict.__getitem__(s.optimizer.state, s.params[e.piece]).pop(e.key, None)
        self._release(i)
        s.where = Where.STORED

    def _resident_in_slot(self, i: int) -> None:
        s = self._swaps[i]
        if s.where is Where.STORED:
            self._start_read(i)
        if s.where in (Where.READING, Where.WRITING):
            self._wait(i)

    def _pack(self, i: int) -> None:
        """Copy sub-group ``i``'s loose states into a slot and point its state dict there."""
        s = self._swaps[i]
        s.layout, s.record_bytes = _layout(s.params, s.optimizer.state)
        # The loose states take a slot's room until they are copied: one slot fewer, so that a
        # first step holds no more states than the steps after it.
        slot = self._acquire(s.record_bytes, limit=NUM_SLOTS - 1)
        for e in s.layout:
            st = dict.__getitem__(s.optimizer.state, s.params[e.piece])
            view = slot[e.offset_bytes : e.offset_bytes + e.numel * e.dtype.itemsize]
            view.view(e.dtype).copy_(st[e.key].reshape(-1))
        s.slot = slot
        self._point(i, slot)
        s.where = Where.IN_SLOT

    def _point(self, i: int, record: torch.Tensor, only_from: torch.Tensor | None = None) -> None:
        """Make sub-group ``i``'s state dicts hold views of ``record`` (1D uint8); with
        ``only_from``, the states that are views of it alone (not those the step replaced)."""
        s = self._swaps[i]
        for e in s.layout:
            p = s.params[e.piece]
            st = dict.__getitem__(s.optimizer.state, p)
            if only_from is not None and not _within(st.get(e.key), only_from):
                continue
            view = record[e.offset_bytes : e.offset_bytes + e.numel * e.dtype.itemsize]
            st[e.key] = view.view(e.dtype).view(p.shape)


def _within(t: Any, record: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor in ``record``'s memory."""
    if not torch.is_tensor(t):
        return False
    start = record.data_ptr()
    return start <= t.data_ptr() < start + record.numel() * record.element_size()


def _union(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of ``intervals``."""
    busy, end = 0.0, float("-inf")
    for t0, t1 in sorted(intervals):
        if t1 > end:
            busy += t1 - max(t0, end)
            end = t1
    return busy
