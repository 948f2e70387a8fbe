"""Process groups for data parallelism, and the one place that reads torchrun's variables.

``torchrun`` (``torch.distributed.run``) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; ``Mesh.from_env`` reads them, initializes the default process group
(gloo on CPU, nccl on CUDA) if nobody has, and picks this rank's device.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """The data-parallel ranks one sharded model spans (a 1-D mesh)."""

    rank: int
    """This process's rank in ``group`` (0-based)."""
    world_size: int
    """Number of data-parallel ranks (Nd)."""
    local_rank: int = 0
    """Rank among the processes on this node; picks the CUDA device."""
    local_world_size: int = 1
    """Processes on this node; CPU threads are divided among them."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where parameters, gradients and collectives live on this rank."""
    group: dist.ProcessGroup | None = None
    """The process group; ``None`` means the default (world) group."""

    @property
    def backend(self) -> str:
        return dist.get_backend(self.group) if dist.is_initialized() else "none"

    @classmethod
    def from_env(
        cls, *, backend: str | None = None, timeout_s: float = 300.0, device: str | None = None
    ) -> Mesh:
        """The mesh of the current job, initializing the default process group if needed.

        Outside torchrun (no RANK variable) it is a one-rank world, still with a real gloo/nccl
        group so that the same code path runs. ``backend`` defaults to nccl when CUDA is available
        and gloo otherwise; ``timeout_s`` bounds how long a collective waits for a dead peer.
        """
        rank = _env_int("RANK", 0)
        world_size = _env_int("WORLD_SIZE", 1)
        local_rank = _env_int("LOCAL_RANK", 0)
        local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
        use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
        dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            if "MASTER_ADDR" not in os.environ:
                # A lone process: a one-rank group on a private port-free store.
                store = dist.HashStore()
                dist.init_process_group(
                    backend or ("nccl" if use_cuda else "gloo"),
                    store=store,
                    rank=0,
                    world_size=1,
                    timeout=datetime.timedelta(seconds=timeout_s),
                )
            else:
                dist.init_process_group(
                    backend or ("nccl" if use_cuda else "gloo"),
                    timeout=datetime.timedelta(seconds=timeout_s),
                    device_id=dev if use_cuda else None,
                )
            rank, world_size = dist.get_rank(), dist.get_world_size()
        if not use_cuda:
            # Ranks on one node share its cores: one compute thread each unless told otherwise,
            # so that ranks do not oversubscribe the CPU and distort each other's timing.
            cores = os.cpu_count() or 1
            torch.set_num_threads(max(1, cores // max(1, local_world_size)))
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            device=dev,
        )

    @classmethod
    def current(cls) -> Mesh:
        """The mesh of an already initialized default group (or ``from_env`` if none)."""
        if not dist.is_initialized():
            return cls.from_env()
        local_rank = _env_int("LOCAL_RANK", 0)
        use_cuda = dist.get_backend() == "nccl"
        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=local_rank,
            local_world_size=_env_int("LOCAL_WORLD_SIZE", 1),
            device=torch.device("cuda", local_rank) if use_cuda else torch.device("cpu"),
        )


def launched_by_torchrun() -> bool:
    """Whether this process is a rank of a torchrun (``torch.distributed.run``) job."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "MASTER_ADDR" in os.environ
    )
