"""Returning freed host memory when the process grows (``zeroshard.residual_states.host_heap``)."""

from __future__ import annotations

import pytest

from zeroshard.residual_states import host_heap


def test_trims_only_when_the_process_outgrows_its_working_size(monkeypatch):
    sizes = iter([100] * 3 + [102, 104, 103, 106])  # after the warm-up steps
    trims = []
    monkeypatch.setattr(host_heap, "resident_bytes", lambda: next(sizes))
    monkeypatch.setattr(host_heap, "trim", lambda: trims.append(True) or True)
    keeper = host_heap.HeapKeeper(slack=0.03)
    for _ in range(host_heap.WARMUP_STEPS - 1):
        keeper.after_step()  # warming up: no size read, no trim
    assert keeper.working_bytes is None and not trims
    keeper.after_step()  # step 10: the working size
    assert keeper.working_bytes == 100
    for _ in range(6):
        keeper.after_step()
    assert keeper.trims == 2 and len(trims) == 2  # at 104 and 106, not at 102 or 103


def test_trim_returns_memory_here():
    if host_heap._malloc_trim() is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    assert host_heap.trim() is True
    assert host_heap.resident_bytes() > 0
