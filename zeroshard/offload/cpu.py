"""Host memory: byte views of tensors, copies between host and device, and the in-memory tiers.

Every tier moves tensors as flat byte ranges: a tensor of any dtype is viewed as a 1D uint8 tensor
and cut into blocks, so the store's scheduling does not care about dtypes and a round trip is exact
bit for bit (bf16 and fp16 included). The copies here run on the store's I/O threads; when an
accelerator (CUDA, XPU, Ascend NPU) is involved each thread copies on its own stream, a generic
``torch.Stream``, so swaps overlap the compute on the caller's stream.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from zeroshard.accelerator import pin_host_memory

from .tiers import OffloadError, TensorMeta, Tier

__all__ = ["MemoryBackend", "copy_bytes", "flat_bytes", "new_host_bytes", "ready_event"]


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1D uint8 view sharing its storage."""
    if not tensor.is_contiguous():
        raise ValueError("the tensor must be contiguous; pass tensor.contiguous()")
    flat = tensor.reshape(-1)  # 1D, a view because the tensor is contiguous (0-dim gives 1 elem)
    return flat.view(torch.uint8)


def _accelerator_device(*tensors: torch.Tensor) -> torch.device | None:
    """The device of the first tensor not in host memory, or None if all are on the CPU."""
    return next((t.device for t in tensors if t.device.type != "cpu"), None)


def ready_event(*tensors: torch.Tensor) -> torch.Event | None:
    """Mark, on the caller's current stream, the point after which the tensors may be copied.

    Recorded in the caller's thread at call time: the I/O thread's stream waits for it, so a swap
    never reads a tensor the caller's kernels are still writing, nor overwrites one still read.
    None when every tensor is on the CPU (host copies need no ordering).
    """
    device = _accelerator_device(*tensors)
    if device is None:
        return None
    event = torch.Event(device=device)
    event.record(torch.accelerator.current_stream(device))
    return event


_streams = threading.local()  # per I/O thread: {device: side stream}, made on first device copy


def _thread_stream(device: torch.device) -> torch.Stream:
    """This I/O thread's own stream on ``device``: its copies queue behind no other thread's."""
    streams = getattr(_streams, "by_device", None)
    if streams is None:
        streams = _streams.by_device = {}
    if device not in streams:
        streams[device] = torch.Stream(device=device)
    return streams[device]


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, ready: torch.Event | None = None) -> None:
    """Copy 1D uint8 `src` into `dst` and return once the bytes are there.

    Host-to-host copies are plain (torch releases the GIL while copying). A copy touching an
    accelerator tensor runs on this thread's side stream after `ready`, and that stream is
    synchronized before returning because the caller may hand the host buffer to the next block
    at once.
    """
    assert dst.numel() == src.numel(), (dst.numel(), src.numel())
    device = _accelerator_device(dst, src)
    if device is None:
        dst.copy_(src)
        return
    stream = _thread_stream(device)
    with stream:
        if ready is not None:
            stream.wait_event(ready)  # the caller's kernels on these bytes are done
        dst.copy_(src, non_blocking=True)  # DMA when the host side is pinned
    stream.synchronize()  # the host buffer may be reused as soon as we return


def new_host_bytes(nbytes: int) -> torch.Tensor:
    """A 1D uint8 host tensor, pinned when an accelerator is present so copies from it are DMA."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_host_memory())


@dataclass
class _Slot:
    meta: TensorMeta
    data: torch.Tensor | None  # 1D uint8 [meta.nbytes] in the tier, None while unwritten
    error: BaseException | None = None  # why the last swap_out failed, if it did


class MemoryBackend:
    """The DEVICE and CPU tiers: one private copy per tensor, in device memory or host RAM.

    The capacity of these tiers is their memory, so their storage grows with what is swapped out;
    only the NVMe tier stages through the fixed buffer pool. Copies are split into the same blocks
    as file I/O so one large tensor uses every I/O thread.
    """

    def __init__(self, tier: Tier) -> None:
        assert tier in (Tier.DEVICE, Tier.CPU)
        self.tier = tier
        self._slots: dict[str, _Slot] = {}

    def stored_bytes(self) -> int:
        return sum(s.data.numel() for s in list(self._slots.values()) if s.data is not None)

    def names(self) -> list[str]:
        return [n for n, s in list(self._slots.items()) if s.data is not None]

    # -- writes ----------------------------------------------------------------------------------
    def reserve(self, meta: TensorMeta) -> int:
        return 0  # memory tiers allocate in begin_write; an out-of-memory error names itself

    def begin_write(self, meta: TensorMeta, src: torch.Tensor, reserved_bytes: int) -> _WriteCtx:
        slot = self._slots.get(meta.name)
        device = src.device if self.tier is Tier.DEVICE else torch.device("cpu")
        data = None if slot is None else slot.data
        if data is None or data.numel() != meta.nbytes or data.device != device:
            # a new or resized tensor gets new storage; a same-size rewrite reuses it
            if device.type == "cpu":
                data = new_host_bytes(meta.nbytes)
            else:
                data = torch.empty(meta.nbytes, dtype=torch.uint8, device=device)
        slot = _Slot(meta=meta, data=None)
        self._slots[meta.name] = slot
        return _WriteCtx(slot, data)

    def write_block(self, ctx: _WriteCtx, start: int, src: torch.Tensor, ready) -> None:
        copy_bytes(ctx.data[start : start + src.numel()], src, ready)

    def end_write(self, ctx: _WriteCtx, error: BaseException | None) -> BaseException | None:
        if error is None:
            ctx.slot.data = ctx.data  # only a complete copy becomes readable
        else:
            ctx.slot.error = error
            error = OffloadError(f"swap_out({ctx.slot.meta.name!r}) to {self.tier.value} failed")
            error.__cause__ = ctx.slot.error
        return error

    # -- reads -----------------------------------------------------------------------------------
    def begin_read(self, name: str) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            raise OffloadError(f"tensor {name!r} is not in the {self.tier.value} tier")
        if slot.data is None:
            raise OffloadError(
                f"tensor {name!r} has no valid copy in the {self.tier.value} tier: its last "
                f"swap_out failed ({slot.error!r})"
            )
        return slot

    def read_block(self, slot: _Slot, start: int, dst: torch.Tensor, ready) -> None:
        copy_bytes(dst, slot.data[start : start + dst.numel()], ready)

    def end_read(self, slot: _Slot) -> None:
        pass

    # -- lifetime --------------------------------------------------------------------------------
    def release(self, name: str) -> None:
        self._slots.pop(name, None)

    def close(self, keep: bool) -> None:
        if keep:
            raise ValueError(f"close(keep=True) needs the NVMe tier; {self.tier.value} is volatile")
        self._slots.clear()


@dataclass
class _WriteCtx:
    slot: _Slot
    data: torch.Tensor  # 1D uint8, the storage being filled
