"""Where activation checkpoints are kept: whole, partitioned over the tensor-parallel ranks (Pa),
and on the CPU or NVMe tier of the tensor store (Pa+cpu): ZeRO-R's activation levers.

With activation checkpointing (``zeroshard.residual_states.activations``) the only tensors kept
for backward inside a span are the span's inputs, saved once per span by its checkpoint frame.
``CheckpointKeeper.hooks()`` is a pair of saved-tensor hooks entered around that save:

    pack    (forward)    whole: keep the tensor. Pa: flatten it, pad it to a multiple of the
                         tensor-parallel degree Nm (no divisibility asked of any shape) and keep
                         this rank's 1/Nm piece, a copy, so that the full tensor can be freed
                         (every rank of a tensor-parallel group holds the same checkpoint: the
                         layers' outputs are replicated there). +cpu/+nvme: the piece is written
                         to the store asynchronously and dropped from the device once written.
    unpack  (backward,   bring the piece back (started ahead, see below), all-gather the Nm
             once per     pieces over the tensor-parallel group, unpad: the tensor as saved.
             recompute)

Prefetch: unpacking checkpoint i starts reading checkpoint i-1 back from the store (the one the
next recomputation needs, backward going in reverse order), so its transfer overlaps span i's
recomputation and backward.

Bytes are counted per tier as they are held (``held`` and ``peak``, bytes per rank): the figure
``zeroshard plan --partition-activations [--offload-activations]`` predicts as
``activation_checkpoints``. Pa's all-gathers are counted in the ledger under scope ``TENSOR``,
label "activations": one per checkpoint per recomputation.
"""

from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from zeroshard import collectives as C
from zeroshard.offload.folder import clear_crashed
from zeroshard.offload.store import OffloadConfig, TensorStore
from zeroshard.offload.tiers import SwapHandle, Tier

TIERS = ("device", "cpu", "nvme")


@dataclass
class CheckpointBytes:
    """Bytes of activation checkpoints this rank holds, per tier (``TIERS``)."""

    held: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    peak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    def add(self, tier: str, nbytes: int) -> None:
        self.held[tier] += nbytes
        self.peak[tier] = max(self.peak[tier], self.held[tier])

    def reset_peak(self) -> None:
        self.peak = dict(self.held)


class _Packed:
    """One saved checkpoint: this rank's piece (on the device, or in the store under ``name``)."""

    __slots__ = ("shape", "dtype", "device", "numel", "whole", "piece", "tier", "name", "fetch")
    __slots__ += ("version", "stride", "__weakref__")

    def __init__(self, t: torch.Tensor, *, whole: bool) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        # A view of another layout (a transposed one: batch_first attention's output) comes
        # back in it: kernels, and so what the recomputation saves, follow the strides.
        self.stride = None if t.is_contiguous() else t.stride()
        self.whole = whole  # kept as it is, on the device
        self.numel = t.numel()
        self.piece: torch.Tensor | None = None  # 1D ceil(numel / Nm) (whole: the tensor itself)
        self.tier = "device"
        self.name: str | None = None  # the store's name while the piece lives there
        self.fetch: SwapHandle | None = None  # a read back under way (prefetch)
        self.version = version_of(t)  # (whole: written in place since, it is another tensor)


class CheckpointKeeper:
    """Saved-tensor hooks that keep checkpoints whole, partitioned (Pa) and/or offloaded."""

    def __init__(
        self,
        *,
        device: torch.device,
        ledger: C.Ledger,
        tp_group: dist.ProcessGroup | None = None,
        partition: bool = False,
        offload: str | None = None,
        store: OffloadConfig | None = None,
    ) -> None:
        """``tp_group``: the tensor-parallel ranks holding the same checkpoints (None: none);
        ``partition``: keep 1/Nm of each over them (Pa); ``offload``: None, "cpu" or "nvme"
        (``store``: the NVMe store's configuration)."""
        tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        if partition and tp_size < 2:
            raise ValueError(
                "partition_activations splits checkpoints over tensor-parallel ranks, and there "
                "are none (tp=1): build the mesh with zeroshard.tensor_parallel.mesh_2d(tp) with "
                "tp >= 2, or drop partition_activations"
            )
        if offload not in (None, "cpu", "nvme"):
            raise ValueError(f"activations={offload!r}: use None, 'cpu' or 'nvme'")
        if offload == "nvme" and store is None:
            raise ValueError("activations='nvme' needs a folder for the swap files")
        self.device, self.ledger = device, ledger
        self.parts = tp_size if partition else 1
        self.tp_group = tp_group
        self.tp_rank = dist.get_rank(tp_group) if partition else 0
        self.offload = offload
        self._store_config = store or (OffloadConfig(tier=Tier.CPU) if offload else None)
        self._store: TensorStore | None = None
        self._names = itertools.count()
        self._order: list[weakref.ref[_Packed]] = []  # this forward's checkpoints, in order
        self._checking = self.parts > 1  # until the first backward (see _check_replicated)
        self.bytes = CheckpointBytes()
        self.reset_stats()

    @property
    def store(self) -> TensorStore | None:
        """The tensor store of offloaded pieces (opened at the first one)."""
        if self._store is None and self._store_config is not None:
            if self._store_config.tier is Tier.NVME:
                clear_crashed(Path(self._store_config.folder))  # (else left behind, empty)
            self._store = TensorStore(self._store_config)
        return self._store

    def stats(self) -> dict[str, float]:
        """Bytes of checkpoint pieces written to and read back from the swap files, and the
        seconds backward blocked on a read, since ``reset_stats``; empty unless on NVMe."""
        if self.offload != "nvme":
            return {}
        return {
            "activation_read_bytes": self.read_bytes,
            "activation_write_bytes": self.write_bytes,
            "activation_wait_s": self.wait_s,
        }

    def reset_stats(self) -> None:
        self.read_bytes = self.write_bytes = 0
        self.wait_s = 0.0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # ----------------------------------------------------------------- forward
    def _pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, AsyncCollectiveTensor):
            t = t.wait()  # a tensor-parallel layer's output: its all-reduce done before we copy
        # Kept as they are: integers, empty tensors, tensors off this rank's device (not
        # collectives' business), and everything when neither partitioned nor offloaded.
        whole = (
            not t.is_floating_point()
            or t.numel() == 0
            or t.device != self.device
            or (self.parts == 1 and not self.offload)
        )
        if not whole and self._checking:
            self._check_replicated(t.detach())
        packed = _Packed(t, whole=whole)
        packed.piece = t if whole else self._own_piece(t.detach())
        nbytes = _nbytes(packed.piece)
        if not whole and self.offload:
            packed.tier = self.offload
            packed.name = f"activation{next(self._names)}"
            store = self.store
            assert store is not None
            # Written asynchronously; the store holds the device copy until then, not us.
            store.swap_out(packed.name, packed.piece)
            self.write_bytes += nbytes
            packed.piece = None
        weakref.finalize(packed, self._forget, packed.name, nbytes, packed.tier)
        self.bytes.add(packed.tier, nbytes)
        if whole:
            return packed
        self._order = [r for r in self._order if r() is not None]
        self._order.append(weakref.ref(packed))
        return packed

    def _check_replicated(self, t: torch.Tensor) -> None:
        """Pa keeps 1/Nm of a checkpoint per rank, assuming every tensor-parallel rank holds the
        same tensor; a unit boundary between a column-parallel and a row-parallel layer breaks
        that (each rank's input is its own slice) and the all-gather would stitch different
        tensors together. Checked over the first forward that saves checkpoints (two sums per
        checkpoint, one small all-reduce): the units and the plan do not change after."""
        stats = torch.stack([t.float().sum(), t.float().abs().sum()])
        both = torch.cat([stats, -stats])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.tp_group)
        if not torch.allclose(both[:2], -both[2:], rtol=1e-5, atol=0.0, equal_nan=True):
            raise ValueError(
                f"partition_activations: a checkpointed span input of shape {tuple(t.shape)} "
                "differs across the tensor-parallel ranks, so it cannot be split over them: "
                "a unit starts between a column-parallel layer and its row-parallel pair (e.g. "
                "wrap=by_class(nn.Linear): wrap whole blocks, whose inputs are replicated), or "
                "the ranks drew different random numbers before it (dropout with a seed of its "
                "own per rank: seed the tensor-parallel ranks alike); or drop "
                "partition_activations"
            )

    def _chunk(self, numel: int) -> int:
        """Elements of one rank's piece of a checkpoint of ``numel`` elements (padded)."""
        return -(-numel // self.parts)

    def _own_piece(self, t: torch.Tensor) -> torch.Tensor:
        """1D ``_chunk(numel)`` elements: this rank's piece of ``t`` flattened, zero-padded at
        the end (a copy, so that ``t`` itself can be freed)."""
        n = t.numel()
        chunk = self._chunk(n)
        flat = t.reshape(-1)
        lo, hi = min(n, self.tp_rank * chunk), min(n, (self.tp_rank + 1) * chunk)
        piece = torch.empty(chunk, dtype=t.dtype, device=t.device)
        piece[: hi - lo].copy_(flat[lo:hi])
        piece[hi - lo :].zero_()
        return piece

    def _forget(self, name: str | None, nbytes: int, tier: str) -> None:
        """A checkpoint was freed: uncount it, and release its copy in the store if any."""
        self.bytes.add(tier, -nbytes)
        store = self._store
        if name is not None and store is not None and not store.closed:
            store.release(name)

    # ----------------------------------------------------------------- backward
    def _unpack(self, packed: _Packed) -> torch.Tensor:
        self._checking = False
        if packed.whole:
            assert packed.piece is not None
            check_version(packed.piece, packed.version, "a checkpointed span's input")
            return packed.piece
        self._prefetch_before(packed)
        piece = self._read(packed)
        if self.parts == 1:
            return _laid_out(piece, packed)
        full = torch.empty(piece.numel() * self.parts, dtype=packed.dtype, device=packed.device)
        C.all_gather(
            full,
            piece,
            group=self.tp_group,
            ledger=self.ledger,
            label="activations",
            scope=C.TENSOR,
            async_op=False,
        )
        return _laid_out(full[: packed.numel], packed)

    def _read(self, packed: _Packed) -> torch.Tensor:
        """This rank's piece on the device: the kept one, or the store's (waiting for a read
        started by the prefetch, else reading now)."""
        if packed.name is None:
            assert packed.piece is not None
            return packed.piece
        if packed.fetch is None:
            packed.fetch = self._start_read(packed)
        fetch, packed.fetch = packed.fetch, None
        start = time.perf_counter()
        piece = fetch.wait()
        self.wait_s += time.perf_counter() - start
        return piece

    def _start_read(self, packed: _Packed) -> SwapHandle:
        store = self.store
        assert store is not None and packed.name is not None
        into = torch.empty(self._chunk(packed.numel), dtype=packed.dtype, device=packed.device)
        self.read_bytes += _nbytes(into)
        return store.swap_in(packed.name, into=into)

    def _prefetch_before(self, packed: _Packed) -> None:
        """Start reading the checkpoint saved just before ``packed`` (backward's next)."""
        alive = [p for r in self._order if (p := r()) is not None]
        index = next((i for i, p in enumerate(alive) if p is packed), None)
        if index is None or index == 0:
            return
        previous = alive[index - 1]
        if previous.name is not None and previous.fetch is None:
            previous.fetch = self._start_read(previous)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def _laid_out(values: torch.Tensor, packed: _Packed) -> torch.Tensor:
    """``values`` (1D, the checkpoint's elements in row-major order) in its shape and, where
    it was not contiguous, its strides (a copy)."""
    whole = values[: packed.numel].view(packed.shape)
    if packed.stride is None:
        return whole
    out = torch.empty_strided(packed.shape, packed.stride, dtype=packed.dtype, device=packed.device)
    return out.copy_(whole)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter (None for an inference tensor, which has none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def check_version(t: torch.Tensor, version: int | None, what: str) -> None:
    """Raise autograd's error when ``t``, kept to recompute a span from (not saved by autograd,
    which would have checked it), was written in place since (``version``, from
    ``version_of``): the recomputation would compute another forward's gradient."""
    now = version_of(t)
    if version is None or now is None or now == version:
        return
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: {what} ({t.dtype}, shape {tuple(t.shape)}) is at version {now}; expected "
        f"version {version} instead. Activation checkpointing (checkpoint_every) recomputes the "
        "span from it in backward: after the units that take a tensor, replace it (x = x + y) "
        "rather than write it in place (x += y)"
    )
