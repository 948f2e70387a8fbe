"""Gradient buckets: how a FlatParam's gradient reaches its owner, and this rank's reduced shard.

One ``GradBucket`` per trainable ``FlatParam``. The stage decides the collective once, at
construction (``Reduction``): an all-reduce (replicated optimizer states, stage 0), a reduce-scatter
in place into this rank's slice (replicated gradients, stage 1), or a reduce-scatter into a new
shard so that the full gradient can be freed at once (partitioned gradients, stages 2-3).

Tensors and who holds them (N ranks, ``range`` = the FlatParam's optimizer range):

    full_grad   # 1D padded_numel, this rank's local (unreduced) gradient. With ``as_views``
                #   (see there) in param_dtype, bound at the unit's pre-backward and persistent
                #   when gradients are replicated; otherwise in reduce_dtype, made at the
                #   reduction from autograd's own per-parameter tensors.
    shard_grad  # 1D range numel, FP32, this rank's reduced (mean) gradient, read by the optimizer;
                #   accumulates over reductions until ``zero``.
"""

from __future__ import annotations

import enum

import torch

from zeroshard import collectives as C
from zeroshard.model_states.flat_param import FlatParam
from zeroshard.model_states.partition import shard_range
from zeroshard.precision import MASTER_DTYPE
from zeroshard.stages import Partition
from zeroshard.streams import on_side_stream


class Reduction(enum.Enum):
    ALL_REDUCE = "all_reduce"
    """Every rank keeps every gradient (optimizer states replicated)."""
    SCATTER_IN_PLACE = "scatter_in_place"
    """Reduce-scatter into this rank's slice of the persistent full gradient."""
    SCATTER_AND_FREE = "scatter_and_free"
    """Reduce-scatter into a new shard; the full gradient is freed right after."""

    @classmethod
    def of(cls, partition: Partition) -> Reduction:
        if not partition.optimizer_states:
            return cls.ALL_REDUCE
        return cls.SCATTER_AND_FREE if partition.gradients else cls.SCATTER_IN_PLACE


class GradBucket:
    """The gradient of one trainable ``FlatParam`` (module docstring)."""

    def __init__(
        self,
        flat: FlatParam,
        *,
        partition: Partition,
        reduce_dtype: torch.dtype | None,
        num_units: int = 1,
    ) -> None:
        assert flat.requires_grad
        self.flat = flat
        self.reduction = Reduction.of(partition)
        self.reduce_dtype = reduce_dtype or flat.param_dtype
        self.num_units = num_units
        """Units whose parameters share ``flat`` (consecutive units of replicated parameters)."""
        self.full_grad: torch.Tensor | None = None
        self.shard_grad: torch.Tensor | None = None
        self._reduce: tuple[C.Handle, torch.Tensor] | None = None

    @property
    def as_views(self) -> bool:
        """Whether ``.grad`` are views into ``full_grad`` during backward (autograd accumulates in
        place) or autograd's own tensors, copied into a fresh ``full_grad`` at reduction.

        Views suit a buffer that outlives one unit's backward: replicated gradients, or a bucket
        shared by several units. A single unit's partitioned gradient (stage 3) is copied at
        reduction instead, as FSDP2 does: nothing is allocated (or zero-filled) before the unit's
        first gradient exists, which keeps the start of backward, the step's peak, lower."""
        return self.reduction is not Reduction.SCATTER_AND_FREE or self.num_units > 1

    @property
    def reducing(self) -> bool:
        return self._reduce is not None

    def bind(self) -> None:
        """Point every parameter's ``.grad`` into ``full_grad`` so autograd accumulates there
        (``as_views`` buckets only; a no-op otherwise)."""
        if not self.as_views:
            return
        flat = self.flat
        if self._reduce is not None:
            self.finish()  # reduced earlier in this backward; new gradients come after it
        if self.full_grad is None:
            self.full_grad = torch.zeros(
                flat.padded_numel, dtype=flat.param_dtype, device=flat.mesh.device
            )
        elif self.shard_grad is not None and self._shard_grad_aliases_full():
            # A second reduction before zero_grad would mix reduced and unreduced slices in
            # place: keep what was reduced apart and start the local gradient afresh.
            self.shard_grad = self.shard_grad.clone()
            self.full_grad.zero_()
        base = self.full_grad.data_ptr()
        item = self.full_grad.element_size()
        for s in flat.slots:
            grad = s.param.grad
            if grad is not None and grad.data_ptr() == base + s.offset * item:
                continue
            view = self.full_grad[s.offset : s.offset + s.numel].view(s.shape)
            if grad is not None:
                view.add_(grad)  # accumulated outside the hooks (e.g. no_sync): keep it
            s.param.grad = view

    def _collect(self) -> None:
        """``full_grad`` from autograd's per-parameter gradients (zeros where there are none),
        which are released. Made in ``reduce_dtype`` directly, so a wider reduction needs no
        second, cast copy."""
        flat = self.flat
        self.full_grad = torch.empty(
            flat.padded_numel, dtype=self.reduce_dtype, device=flat.mesh.device
        )
        with torch.no_grad():
            for s in flat.slots:
                view = self.full_grad[s.offset : s.offset + s.numel]
                grad = s.param.grad
                if grad is None:
                    view.zero_()
                    continue
                view.copy_(grad.reshape(-1))
                s.param.grad = None
            self.full_grad[flat.numel :].zero_()

    def _shard_grad_aliases_full(self) -> bool:
        assert self.shard_grad is not None and self.full_grad is not None
        return self.shard_grad.untyped_storage().data_ptr() == self.full_grad.data_ptr()

    def reduce(self) -> None:
        """Start the gradient collective of this bucket's ``Reduction`` (async)."""
        if self._reduce is not None:
            return
        # On a GPU the collect, the cast and the collective run on the reduce-scatter stream.
        with on_side_stream(self.flat.mesh.device, "reduce_scatter"):
            if not self.as_views:
                self._collect()
            elif self.full_grad is None:
                self.bind()  # every rank reduces every bucket, used or not: collectives must match
            assert self.full_grad is not None
            flat = self.flat
            n = flat.mesh.world_size
            send = self.full_grad.to(self.reduce_dtype)  # 1D padded, every rank (no copy if same)
            if self.reduce_dtype == torch.float16:
                send.div_(n)  # FP16 overflows easily: average before summing
            group, ledger = flat.mesh.group, flat.ledger
            if self.reduction is Reduction.ALL_REDUCE:
                handle = C.all_reduce(send, group=group, ledger=ledger, label="grads")
            else:
                lo, hi = shard_range(flat.mesh.rank, flat.padded_numel, n)
                in_place = self.reduction is Reduction.SCATTER_IN_PLACE
                out = send[lo:hi] if in_place else send.new_empty(hi - lo)
                handle = C.reduce_scatter(out, send, group=group, ledger=ledger)
        self._reduce = (handle, send)

    def finish(self) -> None:
        """Wait for the collective, average, accumulate into ``shard_grad`` (FP32), and free
        ``full_grad`` when gradients are partitioned."""
        if self._reduce is None:
            return
        handle, _send = self._reduce
        self._reduce = None
        out = handle.wait()
        if self.reduce_dtype != torch.float16:
            out.div_(self.flat.mesh.world_size)
        if self.reduction is Reduction.ALL_REDUCE:
            out = out[self.flat.range[0] : self.flat.range[1]]
        reduced = out.to(MASTER_DTYPE)  # 1D range numel (alias when FP32)
        if self.shard_grad is None:
            self.shard_grad = reduced
        else:
            self.shard_grad.add_(reduced)
        if self.reduction is Reduction.SCATTER_AND_FREE:
            self._free_full()

    def _free_full(self) -> None:
        if self.as_views:  # otherwise .grad are autograd's own, released at collection already
            for s in self.flat.slots:
                s.param.grad = None
        self.full_grad = None

    def zero(self) -> None:
        """Drop the reduced shard and the local gradient (keeping a persistent buffer)."""
        self.shard_grad = None
        if not self.as_views:
            for s in self.flat.slots:
                s.param.grad = None  # accumulated by autograd in no_sync micro-steps
        if self.full_grad is None:
            return
        if self.reduction is Reduction.SCATTER_AND_FREE:
            self._free_full()
        else:
            self.full_grad.zero_()  # persistent and bound: keep the allocation
