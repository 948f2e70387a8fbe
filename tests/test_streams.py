"""Side streams (``zeroshard.streams``) and the offload copies' streams and events.

On CPU there are no streams: the no-op path is tested here. The ordering logic is tested with a
fake stream that records what it was told to wait for. On a machine with an accelerator (CUDA,
XPU, NPU) the real ordering is tested too; those tests skip cleanly elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from zeroshard import streams
from zeroshard.accelerator import current_accelerator_type
from zeroshard.offload.cpu import copy_bytes, ready_event

ACCELERATOR = current_accelerator_type()
needs_accelerator = pytest.mark.skipif(
    ACCELERATOR is None or ACCELERATOR == "mps", reason="needs a CUDA, XPU or NPU accelerator"
)


def test_cpu_has_no_side_streams_and_the_block_just_runs():
    cpu = torch.device("cpu")
    assert streams.side_stream(cpu, "all_gather") is None
    ran = []
    with streams.on_side_stream(cpu, "reduce_scatter"):
        ran.append(True)
    assert ran == [True]
    assert ready_event(torch.zeros(3)) is None  # host tensors need no ordering


class _FakeStream:
    """Records the streams it waited for and whether the block ran inside it."""

    current: list[_FakeStream] = []

    def __init__(self, device=None) -> None:
        self.device, self.waited, self.entered = device, [], 0

    def wait_stream(self, other) -> None:
        self.waited.append(other)

    def __enter__(self):
        self.entered += 1
        _FakeStream.current.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _FakeStream.current.pop()


def test_a_side_stream_per_device_and_role_waits_for_the_compute_stream(monkeypatch):
    compute = _FakeStream()
    monkeypatch.setattr(streams, "_STREAMS", {})
    monkeypatch.setattr(torch, "Stream", _FakeStream)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: compute)
    dev = torch.device("cuda", 0)  # never touched: the fake stands in for the device
    gather = streams.side_stream(dev, "all_gather")
    assert gather is streams.side_stream(dev, "all_gather")  # made once, reused
    assert gather is not streams.side_stream(dev, "reduce_scatter")
    assert gather is not streams.side_stream(torch.device("cuda", 1), "all_gather")
    inside = []
    with streams.on_side_stream(dev, "all_gather"):
        inside.append(_FakeStream.current[-1])
    # its inputs were written on the compute stream: it waits for them, then runs the block
    assert gather.waited == [compute] and inside == [gather]


@needs_accelerator
def test_side_stream_work_is_ordered_after_the_compute_stream():
    dev = torch.device(ACCELERATOR, torch.accelerator.current_device_index())
    x = torch.zeros(1 << 20, device=dev)
    x += 1  # queued on the compute stream
    with streams.on_side_stream(dev, "all_gather"):
        y = x * 2  # must see x == 1
    torch.accelerator.synchronize(dev)
    assert torch.equal(y, torch.full_like(x, 2))
    assert streams.side_stream(dev, "all_gather") != torch.accelerator.current_stream(dev)


@needs_accelerator
def test_copies_to_and_from_the_device_wait_for_the_callers_kernels():
    dev = torch.device(ACCELERATOR, torch.accelerator.current_device_index())
    src = torch.randn(1 << 20, device=dev) * 3  # still queued when ready_event is recorded
    ready = ready_event(src)
    assert isinstance(ready, torch.Event)
    host = torch.empty(src.numel() * 4, dtype=torch.uint8, pin_memory=True)
    copy_bytes(host, src.view(torch.uint8), ready)
    back = torch.empty_like(src)
    copy_bytes(back.view(torch.uint8), host, ready_event(back))
    torch.accelerator.synchronize(dev)
    assert torch.equal(back, src)
