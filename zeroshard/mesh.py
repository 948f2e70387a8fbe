"""Process groups for data parallelism, and the one place that reads torchrun's variables.

``torchrun`` (``torch.distributed.run``) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; ``Mesh.from_env`` reads them, picks this rank's device and backend
(``zeroshard.accelerator.placement``: the accelerator torch finds, CUDA, Ascend NPU or Intel XPU,
with nccl, hccl or xccl; else CPU with gloo) and initializes the default process group if nobody
has, logging that it did.

Nothing here changes process-wide settings behind the caller's back. Sharing the node's CPU cores
among its ranks is an explicit call, ``mesh.share_cpu_threads()``, that the train command makes.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zeroshard.accelerator import device_of_backend, placement, set_device

log = logging.getLogger(__name__)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def cpu_threads_per_rank(local_world_size: int, cores: int | None = None) -> int:
    """Compute threads for each of ``local_world_size`` ranks sharing ``cores`` (default: all
    of this machine's), so that together they use every core once and no more."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """The data-parallel ranks one sharded model spans (a 1-D mesh)."""

    rank: int
    """This process's rank in ``group`` (0-based)."""
    world_size: int
    """Number of data-parallel ranks (Nd)."""
    local_rank: int = 0
    """Rank among the processes on this node; picks the accelerator index."""
    local_world_size: int = 1
    """Processes on this node (``share_cpu_threads`` divides the cores among them)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where parameters, gradients and collectives live on this rank."""
    group: dist.ProcessGroup | None = None
    """The process group; ``None`` means the default (world) group."""

    @property
    def backend(self) -> str:
        return dist.get_backend(self.group) if dist.is_initialized() else "none"

    @classmethod
    def from_env(
        cls,
        *,
        backend: str | None = None,
        timeout_s: float = 300.0,
        device: str | torch.device | None = None,
    ) -> Mesh:
        """The mesh of the current job, initializing the default process group if needed.

        Outside torchrun (no MASTER_ADDR variable) it is a one-rank world, still with a real
        process group so that the same code path runs. ``device`` is "cpu", "cuda", "npu",
        "xpu" (optionally "cuda:1") or None for the accelerator torch finds; ``backend`` is a
        ``torch.distributed`` backend or None for the device's default (cuda: nccl, npu: hccl,
        xpu: xccl, cpu: gloo); see ``zeroshard.accelerator.placement`` for the rules and errors.
        ``timeout_s`` bounds how long a collective waits for a dead peer.

        It makes the chosen accelerator device current (``torch.accelerator.set_device_index``)
        and leaves torch's CPU thread count alone: call ``share_cpu_threads`` for that.
        """
        rank = _env_int("RANK", 0)
        world_size = _env_int("WORLD_SIZE", 1)
        local_rank = _env_int("LOCAL_RANK", 0)
        local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
        where = placement(device=device, backend=backend, local_rank=local_rank)
        dev = where.device
        set_device(where)
        if not dist.is_initialized():
            timeout = datetime.timedelta(seconds=timeout_s)
            if "MASTER_ADDR" not in os.environ:
                # A lone process: a one-rank group on a private port-free store.
                store = dist.HashStore()
                dist.init_process_group(
                    where.backend, store=store, rank=0, world_size=1, timeout=timeout
                )
            else:
                dist.init_process_group(
                    where.backend,
                    timeout=timeout,
                    device_id=dev if where.is_accelerator else None,
                )
            rank, world_size = dist.get_rank(), dist.get_world_size()
            log.info(
                "started the default process group: %s, rank %d of %d, on %s (%s)",
                where.backend,
                rank,
                world_size,
                dev,
                where.reason,
            )
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            device=dev,
        )

    @classmethod
    def current(cls) -> Mesh:
        """The mesh of an already initialized default group (or ``from_env`` if none, which
        starts a group and logs that it did)."""
        if not dist.is_initialized():
            return cls.from_env()
        local_rank = _env_int("LOCAL_RANK", 0)
        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=local_rank,
            local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
            device=device_of_backend(dist.get_backend(), local_rank),
        )

    def share_cpu_threads(self) -> int:
        """Give torch ``cpu_threads_per_rank(local_world_size)`` compute threads; return it.

        Process-wide (``torch.set_num_threads``), so it is an explicit call, never a side effect:
        ranks on one node share its cores, and without it each would start one thread per core
        and oversubscribe the CPU, distorting each other's timing. The train command calls it
        for ranks on CPU; call it yourself in your own scripts where that matters.
        """
        num_threads = cpu_threads_per_rank(self.local_world_size)
        torch.set_num_threads(num_threads)
        log.info(
            "torch compute threads set to %d (%d ranks on this node)",
            num_threads,
            self.local_world_size,
        )
        return num_threads


def launched_by_torchrun() -> bool:
    """Whether this process is a rank of a torchrun (``torch.distributed.run``) job."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "MASTER_ADDR" in os.environ
    )
