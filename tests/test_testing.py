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


_KEPT: list = []


def _keep_and_return_a_tensor():
    import torch

    _KEPT[:] = [torch.arange(6.0)]  # a live tensor of the test: a parameter, a gradient
    return _KEPT[0]


def _is_kept_tensor_shared() -> bool:
    return _KEPT.pop().is_shared()


def test_a_returned_tensor_is_copied_and_keeps_its_memory(workers2):
    # multiprocessing's pickler moved it into shared memory in place, freeing its heap memory
    # under whatever still pointed at it in the worker, which goes on to run the next tests
    for result in workers2.run(_keep_and_return_a_tensor):
        assert result.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert workers2.run(_is_kept_tensor_shared) == [False, False]


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
        workers.run(_rank_and_sum)
        with pytest.raises(WorkerError) as crashed:
            workers.run(_rank_zero_crashes)
        message = str(crashed.value)
        assert message.startswith("rank 0 died running _rank_zero_crashes (SIGSEGV):"), message
        assert "Segmentation fault" in message and "in _rank_zero_crashes" in message, message
        # what else ran in the dead process (a heap corrupted earlier crashes a later test)
        assert message.endswith(
            "the same processes ran before it (oldest first): test_testing._rank_and_sum"
        ), message
        with pytest.raises(
            WorkerError, match=r"rank 1 died running _rank_one_exits \(exit code 3\)"
        ):
            workers.run(_rank_one_exits)
        assert workers.run(_rank_and_sum) == [(0, 3), (1, 3)]
