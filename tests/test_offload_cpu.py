"""Byte views and host/device copies; device round trips run only where an accelerator (CUDA,
XPU, NPU) is present."""

import pytest
import torch

from zeroshard.accelerator import current_accelerator_type
from zeroshard.offload import OffloadConfig, TensorStore
from zeroshard.offload.cpu import copy_bytes, flat_bytes

ACCELERATOR = current_accelerator_type()
needs_accelerator = pytest.mark.skipif(
    ACCELERATOR is None or ACCELERATOR == "mps", reason="needs a CUDA, XPU or NPU accelerator"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_flat_bytes_is_a_view_of_every_byte(dtype):
    t = torch.zeros(3, 5, dtype=dtype)
    b = flat_bytes(t)
    assert b.dtype == torch.uint8 and b.numel() == t.numel() * t.element_size()
    assert b.data_ptr() == t.data_ptr()  # shares storage: no copy
    assert flat_bytes(torch.tensor(1.0)).numel() == 4  # 0-dim
    with pytest.raises(ValueError, match="contiguous"):
        flat_bytes(t.t())


def test_copy_bytes_host_to_host():
    src = torch.arange(100, dtype=torch.uint8)
    dst = torch.zeros(100, dtype=torch.uint8)
    copy_bytes(dst, src)
    assert torch.equal(dst, src)


@needs_accelerator
@pytest.mark.parametrize("tier", ["device", "cpu", "nvme"])
def test_device_round_trip_is_ordered_with_the_callers_stream(tier, tmp_path):
    folder = tmp_path / "swap" if tier == "nvme" else None
    config = OffloadConfig(tier=tier, folder=folder, block_bytes=1 << 16, num_buffers=2)
    with TensorStore(config) as store:
        if store.pool is not None:
            assert store.pool.pin_memory  # DMA from the staging buffers needs pinned memory
        dtypes = [torch.float32, torch.bfloat16, torch.float16]
        # produced by kernels still queued on the caller's stream: the swap must wait for them
        src = {
            f"p{i}": (torch.randn(50_000 + i, device=ACCELERATOR) * 3).to(d)
            for i, d in enumerate(dtypes)
        }
        for h in [store.swap_out(name, t) for name, t in src.items()]:
            h.wait()
        outs = {k: torch.full_like(v, 7) for k, v in src.items()}  # a fill still queued
        handles = {k: store.swap_in(k, into=outs[k]) for k in src}
        for k, h in handles.items():
            got = h.wait()
            assert got.device.type == ACCELERATOR and torch.equal(got, src[k]), k
