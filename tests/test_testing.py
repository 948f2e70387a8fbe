"""The multi-rank harness: results per rank, and a failing rank reported with its traceback."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from zeroshard.testing import WorkerError, Workers


def _rank_and_sum() -> tuple[int, int]:
    import torch

    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    return dist.get_rank(), int(t.item())


def _rank_one_fails() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank one")
    dist.barrier()  # rank 0 waits in a collective that rank 1 never joins


def test_results_come_back_per_rank(workers2):
    assert workers2.run(_rank_and_sum) == [(0, 3), (1, 3)]


def test_a_failing_rank_is_reported_with_its_traceback_and_the_pool_recovers():
    with Workers(2, timeout_s=60) as workers:
        with pytest.raises(WorkerError, match=r"(?s)rank 1 failed in _rank_one_fails.*boom"):
            workers.run(_rank_one_fails)
        # The stuck peer was killed; the next run starts a fresh pool.
        assert workers.run(_rank_and_sum) == [(0, 3), (1, 3)]


def _rank_zero_crashes() -> None:
    import ctypes

    if dist.get_rank() == 0:
        ctypes.string_at(0)  # a segmentation fault, as a native bug gives


def _rank_one_exits() -> None:
    import os

    if dist.get_rank() == 1:
        os._exit(3)


def test_a_rank_that_dies_is_reported_with_its_signal_and_stack():
    """A crash gives its signal and the Python stack where it happened (the worker's stderr
    belongs to whichever test started the pool, so it is not where anyone looks)."""
    with Workers(2, timeout_s=60) as workers:
        with pytest.raises(WorkerError) as crashed:
            workers.run(_rank_zero_crashes)
        message = str(crashed.value)
        assert message.startswith("rank 0 died running _rank_zero_crashes (SIGSEGV):"), message
        assert "Segmentation fault" in message and "in _rank_zero_crashes" in message, message
        with pytest.raises(
            WorkerError, match=r"rank 1 died running _rank_one_exits \(exit code 3\)"
        ):
            workers.run(_rank_one_exits)
        assert workers.run(_rank_and_sum) == [(0, 3), (1, 3)]
