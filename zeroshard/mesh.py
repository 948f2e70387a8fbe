"""Process groups for data parallelism, and the one place that reads torchrun's variables.

``torchrun`` (``torch.distributed.run``) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; ``Mesh.from_env`` reads them, picks this rank's device and backend
(``zeroshard.accelerator.placement``: the accelerator torch finds, CUDA, Ascend NPU or Intel XPU,
with nccl, hccl or xccl; else CPU with gloo) and initializes the default process group if nobody
has, logging that it did.

Hybrid sharding (HSDP, ZeRO++ hpZ): ``mesh.hybrid_sharded(k)`` or ``Mesh.from_device_mesh(dm)``
(a 2-D ``DeviceMesh`` with dims ("replicate", "shard")) splits the data-parallel ranks into shard
groups of k consecutive ranks. Model states are partitioned inside a shard group (``shard_group``,
``shard_rank``, ``shard_size``) and replicated across groups: ranks with the same ``shard_rank``
hold the same shards and form a ``replicate_group``. ``group``, ``rank`` and ``world_size`` stay
the whole data-parallel job (gradient averaging, agreement flags, checkpoints).

Nothing here changes process-wide settings behind the caller's back. Sharing the node's CPU cores
among its ranks is an explicit call, ``mesh.share_cpu_threads()``, that the train command makes.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from zeroshard.accelerator import device_of_backend, placement, set_device
from zeroshard.watchdog import (
    StartTimeout,
    diagnosed,
    group_timeout_s,
    inherit_timeout,
    register_process,
)

if TYPE_CHECKING:  # imported when first used: DTensor costs `import zeroshard` ~0.5 s
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
"""How long a collective waits for every rank before ``CollectiveTimeout`` (``Mesh.from_env``)."""

HYBRID_DIMS = ("replicate", "shard")
"""The dim names of a 2-D ``DeviceMesh`` for hybrid sharding: replicas x ranks of a shard group."""

_HYBRID_MESHES: dict[tuple, tuple[object, DeviceMesh]] = {}
"""Meshes made by ``Mesh.hybrid_sharded``, per (ranks, shard group size, device type): models
sharded alike share process groups instead of creating new ones each time (``cached_mesh``)."""
_HYBRID_TP_MESHES: dict[tuple, tuple[object, DeviceMesh]] = {}
"""3-D (replicate, shard, tp) meshes per (world size, tp, shard group size, device type)."""
_SUB_GROUPS: dict[tuple, tuple[object, dist.ProcessGroup]] = {}
"""The process group of a DeviceMesh's ranks where they are part of the world, per rank set."""


T = TypeVar("T")


def cached_mesh(cache: dict, key: tuple, make: Callable[[], T]) -> T:
    """``cache``'s mesh (or process group) for ``key`` in this job's default process group,
    made by ``make`` the first time (a collective: every rank makes the same calls, so the
    caches agree). A job that
    destroys its process group and starts another gets new meshes: the key holds the default
    group's id, and the entry the group itself, so that the id is not reused meanwhile."""
    default = dist.distributed_c10d._get_default_group()
    for dead in [k for k, (group, _) in cache.items() if group is not default]:
        del cache[dead]  # a destroyed job's meshes: freed now, not at the interpreter's exit
    full = (id(default), *key)
    if full not in cache:
        cache[full] = (default, make())
    return cache[full][1]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def cpu_threads_per_rank(local_world_size: int, cores: int | None = None) -> int:
    """Compute threads for each of ``local_world_size`` ranks sharing ``cores`` (default: those
    this process may run on), so that together they use every core once and no more."""
    if cores is None:  # the cores this process may run on (a container's or taskset's share)
        affinity = getattr(os, "sched_getaffinity", None)
        cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


@dataclass(frozen=True, kw_only=True)
class Hybrid:
    """Hybrid sharding: this rank's shard group and replicate group (``Mesh.hybrid_sharded``)."""

    shard_size: int
    """Ranks per shard group (k): model states are partitioned 1/k among them."""
    shard_rank: int
    """This rank's place in its shard group (which 1/k shard it holds)."""
    shard_group: dist.ProcessGroup
    """This rank's shard group: k consecutive ranks (parameter all-gathers, gradient
    reduce-scatters, the grad-norm sum)."""
    num_replicas: int
    """Shard groups (world_size / k): copies of every shard."""
    replica_rank: int
    """Which shard group this rank is in."""
    replicate_group: dist.ProcessGroup
    """The ranks holding the same shard as this one, one per shard group (the gradient
    all-reduce of the 1/k shard)."""
    device_mesh: DeviceMesh
    """The 2-D ("replicate", "shard") ``DeviceMesh`` of the same ranks (state-dict DTensors)."""


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """The data-parallel ranks one sharded model spans: a 1-D mesh, or with ``hybrid`` shard
    groups inside it (module docstring)."""

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
    hybrid: Hybrid | None = None
    """Shard and replicate groups inside ``group`` (None: shard over every rank of it)."""
    tp_group: dist.ProcessGroup | None = None
    """With tensor parallelism (``zeroshard.tensor_parallel.mesh_2d``): the ranks that split
    this rank's layers; ``group`` is then the data-parallel dim only. None: no tensor
    parallelism."""

    @property
    def backend(self) -> str:
        return dist.get_backend(self.group) if dist.is_initialized() else "none"

    @property
    def tp_size(self) -> int:
        """Ranks of ``tp_group`` (Nm, the article's model-parallel degree); 1 without one."""
        return 1 if self.tp_group is None else dist.get_world_size(self.tp_group)

    @property
    def tp_rank(self) -> int:
        """This rank's place in ``tp_group`` (which piece of each split layer it holds)."""
        return 0 if self.tp_group is None else dist.get_rank(self.tp_group)

    @property
    def global_rank(self) -> int:
        """This process's rank in the default group: unique across every dim (data, tensor
        parallel), for per-rank file names."""
        return dist.get_rank() if dist.is_initialized() else self.rank

    @property
    def is_first(self) -> bool:
        """Whether this is the mesh's first rank (data-parallel and tensor-parallel rank 0;
        global rank 0 in a mesh over the whole job): the one ``rank0_only`` results go to."""
        return self.rank == 0 and self.tp_rank == 0

    # ----------------------------------------------------------------- sharding queries
    @property
    def shard_size(self) -> int:
        """Ranks the model states are partitioned over (k with hybrid sharding, else all)."""
        return self.hybrid.shard_size if self.hybrid else self.world_size

    @property
    def shard_rank(self) -> int:
        """Which shard this rank holds (its rank in ``shard_group``)."""
        return self.hybrid.shard_rank if self.hybrid else self.rank

    @property
    def shard_group(self) -> dist.ProcessGroup | None:
        """The group of ``shard_size`` ranks sharing the model states (``None``: world)."""
        return self.hybrid.shard_group if self.hybrid else self.group

    @property
    def num_replicas(self) -> int:
        """Copies of every shard: world_size / shard_size (1 without hybrid sharding)."""
        return self.hybrid.num_replicas if self.hybrid else 1

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        """The ranks holding this rank's shard (None without hybrid sharding)."""
        return self.hybrid.replicate_group if self.hybrid else None

    # ----------------------------------------------------------------- hybrid sharding
    def hybrid_sharded(self, shard_group_size: int) -> Mesh:
        """This mesh with shard groups of ``shard_group_size`` consecutive ranks of ``group``
        (hybrid sharding); the same mesh when the size is the whole world.

        A collective: every rank of ``group`` calls it (it creates the subgroups, through a 2-D
        ``DeviceMesh``). A ValueError naming the fix when the size does not divide the world."""
        k, n = shard_group_size, self.world_size
        divisors = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"shard_group_size must be a positive int, got {k!r}")
        # (a sub-mesh's, beside tensor parallelism: its data-parallel ranks, not the world's)
        size = f"world size {n}" if n == dist.get_world_size() else f"{n} data-parallel ranks"
        if k > n:
            raise ValueError(
                f"shard_group_size={k} is larger than the {size}; use a divisor of {n} ({divisors})"
            )
        if n % k:
            raise ValueError(
                f"shard_group_size={k} does not divide the {size}; use a divisor of {n} "
                f"({divisors})"
            )
        if self.hybrid is not None and self.hybrid.shard_size != k:
            raise ValueError(
                f"the mesh has shard groups of {self.hybrid.shard_size} ranks already, "
                f"shard_group_size asks for {k}; pass one of the two"
            )
        from torch.distributed.device_mesh import DeviceMesh

        if self.tp_group is not None and self.hybrid is None and k != n:
            return self._with(self._hybrid_beside_tensor_parallel(k))
        group = self.group if self.group is not None else dist.group.WORLD
        # None: nothing to make for this rank's data-parallel group (the whole group shards)
        wanted = None if self.hybrid is not None or k == n else k
        groups = [(tuple(dist.get_process_group_ranks(group)), wanted)]
        if self.group is not None and self.tp_group is None:
            # A DeviceMesh makes its groups over the whole world: every rank makes every
            # data-parallel group's mesh, in one order; every stage that asks joins, also one
            # with nothing to make (it skipped the collective the others waited in).
            every: list = [None] * dist.get_world_size()
            with diagnosed("all_gather_object", "the hybrid shard groups", None):
                dist.all_gather_object(every, groups[0])
            groups = sorted(set(every), key=repr)
        mine = None
        for ranks, size in groups:  # (every rank makes them all, also one that wants none)
            if size is None:
                continue
            layout = torch.tensor(ranks, dtype=torch.int).view(len(ranks) // size, size)
            made = cached_mesh(
                _HYBRID_MESHES,
                (ranks, size, self.device.type),
                lambda layout=layout: DeviceMesh(
                    self.device.type, layout, mesh_dim_names=HYBRID_DIMS
                ),
            )
            mine = made if self.global_rank in ranks else mine
        return self if wanted is None else self._with(mine)

    def _hybrid_beside_tensor_parallel(self, k: int) -> DeviceMesh:
        """This rank's (replicate, shard) mesh of a 3-D (replicate, shard, tp) mesh over the
        world: every rank makes the same groups, whichever data-parallel group it is in. The
        data-parallel mesh of ``zeroshard.tensor_parallel.mesh_2d`` has rank ``d * tp + t`` at
        data-parallel index d; so does the 3-D one, with d = replica * k + shard."""
        from torch.distributed.device_mesh import init_device_mesh

        tp, world = self.tp_size, dist.get_world_size()
        if self.world_size * tp != world:
            raise ValueError(
                f"hybrid sharding beside tensor parallelism needs the data-parallel mesh of "
                f"tensor_parallel.mesh_2d over the whole job ({self.world_size} x tp={tp} ranks "
                f"!= {world}); build the mesh with mesh_2d"
            )
        dims, shape = (*HYBRID_DIMS, "tp"), (self.world_size // k, k, tp)
        mesh = cached_mesh(
            _HYBRID_TP_MESHES,
            (world, tp, k, self.device.type),
            lambda: init_device_mesh(self.device.type, shape, mesh_dim_names=dims),
        )
        return mesh[HYBRID_DIMS]

    @classmethod
    def from_group(cls, group: dist.ProcessGroup, *, device: torch.device | None = None) -> Mesh:
        """The 1-D mesh over the ranks of ``group`` (``dist.new_group(ranks)``), from this
        process's rank and the size there; a ValueError on a rank outside it."""
        base = cls.current()
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"rank {dist.get_rank()} is not in this process group: shard a model over a "
                "group only on that group's ranks"
            )
        whole = dist.get_world_size(group) == dist.get_world_size()
        return replace(
            base,
            rank=rank,
            world_size=dist.get_world_size(group),
            group=None if whole else group,
            device=device or base.device,
        )

    def check_group(self) -> None:
        """A ValueError when ``rank`` / ``world_size`` are not this process's rank in ``group``
        and the group's size (a ``Mesh`` made by hand): the shards were cut at one rank and
        gathered at another, and stages 1-3 trained on mixed-up weights without a word."""
        if not dist.is_initialized():
            return
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if (self.rank, self.world_size) != (rank, size):
            where = "is not in it" if rank < 0 else f"is rank {rank} of its {size}"
            raise ValueError(
                f"Mesh(rank={self.rank}, world_size={self.world_size}) disagrees with its "
                f"group, where this process {where}: pass the group itself (shard(..., "
                "mesh=group)), or zeroshard.Mesh.from_group(group)"
            )

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh, *, device: torch.device | None = None):
        """The mesh of a ``DeviceMesh``: 1-D, plain sharding over its ranks; 2-D with dims
        ("replicate", "shard"), hybrid sharding (``init_device_mesh(device_type, (num_replicas,
        k), mesh_dim_names=("replicate", "shard"))``, as FSDP2's HSDP takes it). A ValueError
        on a rank outside it."""
        ranks = device_mesh.mesh.flatten().tolist()
        if dist.is_initialized() and dist.get_rank() not in ranks:
            raise ValueError(
                f"rank {dist.get_rank()} is not in this DeviceMesh (ranks {ranks}): shard a "
                "model over a mesh only on that mesh's ranks"
            )
        if device_mesh.ndim == 1:
            return cls.from_group(device_mesh.get_group(), device=device)
        names = device_mesh.mesh_dim_names
        if device_mesh.ndim != 2 or tuple(names or ()) != HYBRID_DIMS:
            tp = tuple(names or ()) == ("dp", "tp")  # mesh_2d's first value
            raise ValueError(
                f"a DeviceMesh for hybrid sharding needs dims {HYBRID_DIMS}, got "
                f"{tuple(names) if names else 'unnamed'} of shape {tuple(device_mesh.shape)}; "
                "build it with init_device_mesh(device_type, (num_replicas, shard_group_size), "
                f"mesh_dim_names={HYBRID_DIMS})"
                + (
                    "; for tensor_parallel.mesh_2d's 2-D mesh, pass its second value, the "
                    "data-parallel Mesh (device_mesh, mesh = mesh_2d(tp); shard(..., mesh=mesh))"
                    if tp
                    else ""
                )
            )
        base = cls.current()
        group = None
        if len(ranks) != dist.get_world_size():  # a part of the world: a group of its ranks,
            group = cached_mesh(  # once (one per shard() leaked a group and its sockets)
                _SUB_GROUPS,
                tuple(sorted(ranks)),
                lambda: dist.new_group(sorted(ranks), use_local_synchronization=True),
            )
            inherit_timeout(group)
        base = replace(
            base,
            rank=dist.get_rank(group),
            world_size=len(ranks),
            group=group,
            device=device or base.device,
        )
        return base._with(device_mesh)

    def _with(self, dm: DeviceMesh) -> Mesh:
        """This mesh with the shard and replicate groups of the 2-D ``dm``."""
        num_replicas, k = dm.shape
        hybrid = Hybrid(
            shard_size=k,
            shard_rank=dm.get_local_rank("shard"),
            shard_group=dm.get_group("shard"),
            num_replicas=num_replicas,
            replica_rank=dm.get_local_rank("replicate"),
            replicate_group=dm.get_group("replicate"),
            device_mesh=dm,
        )
        # The job's collective timeout, not the backend's default for new groups (30 min, gloo).
        inherit_timeout(hybrid.shard_group, hybrid.replicate_group)
        return replace(self, hybrid=hybrid)

    def without_hybrid(self) -> Mesh:
        """This mesh sharding over every rank of ``group`` (no shard groups)."""
        return replace(self, hybrid=None)

    @classmethod
    def from_env(
        cls,
        *,
        backend: str | None = None,
        timeout_s: float | None = None,
        device: str | torch.device | None = None,
    ) -> Mesh:
        """The mesh of the current job, initializing the default process group if needed.

        Outside torchrun (no MASTER_ADDR variable) it is a one-rank world, still with a real
        process group so that the same code path runs. ``device`` is "cpu", "cuda", "npu",
        "xpu" (optionally "cuda:1") or None for the accelerator torch finds; ``backend`` is a
        ``torch.distributed`` backend or None for the device's default (cuda: nccl, npu: hccl,
        xpu: xccl, cpu: gloo); see ``zeroshard.accelerator.placement`` for the rules and errors.
        ``timeout_s`` (default ``DEFAULT_TIMEOUT_S``, 5 minutes) bounds how long a collective
        waits for a rank that stopped answering; then every waiting rank raises
        ``zeroshard.watchdog.CollectiveTimeout`` naming the collective, the unit and the rank
        that did not arrive. It applies to the default group this call starts and to the
        groups zeroshard makes from it (hybrid sharding's shard and replicate groups); groups
        you make with ``dist.new_group`` take their own ``timeout=``. Asked for when a group is
        already running with another timeout, it is ignored with a warning.

        It makes the chosen accelerator device current (``torch.accelerator.set_device_index``)
        and leaves torch's CPU thread count alone: call ``share_cpu_threads`` for that.
        """
        local_rank = _env_int("LOCAL_RANK", 0)
        local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
        where = placement(device=device, backend=backend, local_rank=local_rank)
        dev = where.device
        set_device(where)
        if timeout_s is not None and (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not 0 < timeout_s < 10**9  # (inf: timedelta's OverflowError)
        ):
            raise ValueError(
                f"timeout_s must be a positive, finite number of seconds, got {timeout_s!r}"
            )
        if dist.is_initialized() and timeout_s is not None:
            running = group_timeout_s(None)
            if running is not None and abs(running - timeout_s) > 1e-3:
                warnings.warn(
                    f"timeout_s={timeout_s:g} ignored: the default process group is already "
                    f"running with a {running:g} s timeout; pass timeout_s where it is started",
                    stacklevel=2,
                )
        if not dist.is_initialized():
            timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
            if "MASTER_ADDR" not in os.environ:
                # A lone process: a one-rank group on a private port-free store.
                store = dist.HashStore()
                dist.init_process_group(
                    where.backend, store=store, rank=0, world_size=1, timeout=timeout
                )
            else:
                try:
                    dist.init_process_group(
                        where.backend,
                        timeout=timeout,
                        device_id=dev if where.is_accelerator else None,
                    )
                except (dist.DistStoreError, dist.DistNetworkError) as exc:
                    # A wait for the other ranks timed out, or rank 0's store never answered
                    # (its host and port: MASTER_ADDR, MASTER_PORT).
                    where_to = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '?')}"
                    raise StartTimeout(
                        f"rank {os.environ.get('RANK', '?')} could not start the process group "
                        f"({str(exc).strip().splitlines()[0]}): another rank did not join it "
                        f"within the timeout, or rank 0's store at {where_to} never answered "
                        "(stopped, hung or dead while starting; RANK and MASTER_ADDR left over "
                        "in the environment); look at its output, or raise the timeout "
                        "(Mesh.from_env(timeout_s=...), zeroshard train --timeout) if it is "
                        "only slow to start"
                    ) from None
            log.info(
                "started the default process group: %s, rank %d of %d, on %s (%s)",
                where.backend,
                dist.get_rank(),
                dist.get_world_size(),
                dev,
                where.reason,
            )
        register_process()
        # The running group's ranks (a group the caller started without torchrun's variables,
        # mp.spawn's: RANK and WORLD_SIZE unset read 0 of 1, and gradients were summed, not
        # averaged)
        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
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
        register_process()
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


@functools.cache
def settle_collective_threads_at_exit() -> None:
    """Once per process (called by ``shard``): at exit, release the GIL for 20 ms before the
    interpreter finalizes. A gloo worker thread drops its references to a finished collective's
    tensors only once it holds the GIL; one still waiting for it when finalization begins is
    ended inside that destructor, which aborts the process ("terminate called without an
    active exception", in about 1 run in 4 of a script ending in ``destroy_process_group()``
    right after its last collective). The command line tears down in order (``tear_down``)."""
    atexit.register(time.sleep, 0.02)


def tear_down(*, clean: bool) -> None:
    """Destroy the process groups before the interpreter exits: gloo's threads destroyed during
    interpreter teardown abort the process ("terminate called without an active exception").
    ``clean``: every rank got here, so a barrier first (no rank closes a connection that
    another still reads); else at once, the peers may be gone. Sub-groups go before the default
    group, whose store they use."""
    if not dist.is_initialized():
        return
    # The model, optimizer and their pending works reach the groups through reference cycles:
    # freed now, while the groups are alive, not by the interpreter's final teardown.
    gc.collect()
    if clean:
        dist.barrier()
    # torch's own function: ``dist.destroy_process_group`` may be the one that first finishes
    # an asynchronous save (``checkpoint_async``), which the command line has waited for.
    destroy = dist.distributed_c10d.destroy_process_group
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD:
            destroy(group)
    destroy()
    gc.collect()  # the last references to the destroyed groups, while the interpreter lives
