"""Shared fixtures: pools of real gloo processes, started once per session and reused."""

from __future__ import annotations

import gc
import os

# Two pytest-xdist workers share the cores: torch's OpenMP threads that spin while they wait
# held them from the other worker's (a one-rank run of 8 steps in a test process took 1-8 s
# beside a busy process, 1.2 s with waiting threads asleep). Read as torch loads, so first.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from zeroshard.testing import Workers


def pytest_collection_finish(session):
    """What collection built (every test module, torch, transformers) lives all session: frozen
    out of the cycle collector's sight, so that each full collection (the command line's
    teardown makes two per run in this process) scans only what the tests made since (it
    took about 0.15 s each in a whole-suite session)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def workers1():
    with Workers(1) as w:
        yield w


@pytest.fixture(scope="session")
def workers2():
    with Workers(2) as w:
        yield w


@pytest.fixture(scope="session")
def workers4():
    with Workers(4) as w:
        yield w


@pytest.fixture
def lone_process():
    """No process group before the test, none after it (the test starts one in this process,
    e.g. through ``Mesh.from_env`` or ``shard``)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    saved = {k: os.environ.pop(k) for k in ("RANK", "MASTER_ADDR") if k in os.environ}
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.update(saved)
