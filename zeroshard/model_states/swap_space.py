"""Room for offloaded model states, checked before step 1: the swap folder's free bytes and the
host memory for staging, per node (the ranks of a node share one disk and one memory).

Each check is a collective that every rank of the group leaves alike: when any rank's node is
short, every rank raises, naming the first short rank's figures (a rank that passed alone would
wait for the others in its next collective, and report them as gone).
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zeroshard.offload import OffloadSetupError, SwapSpaceError
from zeroshard.offload.folder import free_bytes
from zeroshard.residual_states.host_heap import memory_available_bytes

if TYPE_CHECKING:
    from zeroshard.mesh import Mesh
    from zeroshard.offload import TensorStore


_promised: weakref.WeakKeyDictionary[TensorStore, int] = weakref.WeakKeyDictionary()
"""This process's stores that passed ``check_space`` -> the bytes it counted for them: until they
have written them, the free space that the check saw still holds them."""


def check_space(store: TensorStore, need_bytes: int, mesh: Mesh) -> None:
    """Fail before step 1 when ``store``'s folder cannot hold the states of this node's ranks
    (each rank's need taken as the largest rank's, the ranks of a node sharing one disk), counting
    what this process's other live stores on that disk were promised and have not written yet
    (a second optimizer, the masters beside the optimizer states, another model)."""
    folder = Path(store.config.folder)
    promised = _unwritten_on_the_disk_of(folder)
    short = _first_short(free_bytes(folder), need_bytes + promised, mesh)
    if short is not None:
        where, free, node_bytes = short
        others = (
            f" ({promised} bytes a rank of them for this process's other offload stores on that "
            "disk, not yet written: del an optimizer or model no longer used)"
            if promised
            else ""
        )
        raise SwapSpaceError(
            f"offload folder {folder.parent} has {free} bytes free on {where}, the offloaded "
            f"states of its {mesh.local_world_size} rank(s) need {node_bytes}{others}: short by "
            f"{node_bytes - free} bytes; free space or pass Offload(folder=...) "
            "(--offload-folder) on a larger disk"
        )
    _promised[store] = need_bytes


def _unwritten_on_the_disk_of(folder: Path) -> int:
    """Bytes the live stores of ``_promised`` on ``folder``'s filesystem have yet to write."""
    device = os.stat(folder).st_dev
    total = 0
    for store, need in list(_promised.items()):
        try:
            same_disk = not store.closed and os.stat(store.config.folder).st_dev == device
        except OSError:  # its folder is gone: it holds nothing there
            continue
        if same_disk:
            total += max(0, need - store.stats()["stored_bytes"])
    return total


def check_host_memory(need_bytes: int, mesh: Mesh, slots: int) -> None:
    """Fail before step 1 when this node's memory cannot hold the host staging of its ranks
    (``slots`` sub-groups' states and the store's pool each): an offloaded run must not find
    out by exhausting the host."""
    available = memory_available_bytes()
    short = _first_short(available, need_bytes, mesh)
    if short is not None:
        where, available, node_bytes = short
        raise OffloadSetupError(
            f"streaming optimizer states from NVMe needs {node_bytes} bytes of host memory for "
            f"the {mesh.local_world_size} rank(s) of {where} ({slots} sub-groups' states and "
            f"a staging pool each), {available} are available: short by "
            f"{node_bytes - available} bytes; wrap the model into smaller units (the largest "
            "sets it) or free memory"
        )


def _first_short(have: int | None, need_bytes: int, mesh: Mesh) -> tuple[str, int, int] | None:
    """(whose node, its bytes, what its ranks need together) for the first rank whose node has
    less than that, else None; ``have`` None: unknown, never short. One all-gather: every rank
    gets the same answer. A node's ranks need together ``local_world_size`` times the largest
    rank's need."""
    mine = torch.tensor([-1 if have is None else have, need_bytes], dtype=torch.int64)
    every = [mine.to(mesh.device)]
    if mesh.world_size > 1:
        every = [torch.empty_like(every[0]) for _ in range(mesh.world_size)]
        dist.all_gather(every, mine.to(mesh.device), group=mesh.group)
    rows = [t.tolist() for t in every]
    node_bytes = max(n for _, n in rows) * mesh.local_world_size
    for rank, (h, _) in enumerate(rows):
        if h >= 0 and node_bytes > h:
            return ("this node" if rank == mesh.rank else f"rank {rank}'s node"), h, node_bytes
    return None
