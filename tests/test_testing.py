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
