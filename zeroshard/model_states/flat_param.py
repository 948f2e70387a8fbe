"""A unit's parameters as one flat, padded, sharded buffer behind the original parameter objects.

The module keeps its own ``nn.Parameter`` objects (names, shapes, optimizer groups and state dicts
keep working); their ``.data`` are views into ``full``, and their ``.grad`` views into
``full_grad``, so autograd accumulates straight into the flat buffer that is communicated.

Buffers and who holds them (N ranks, rank r, ``range`` = this rank's optimizer range, which is
slice r of the padded buffer when optimizer states are partitioned and the whole buffer otherwise):

    full        # 1D padded_numel, param_dtype, every rank. Persistent when parameters are
                #   replicated; when they are partitioned its storage exists only while UNSHARDED
                #   (resized to 0 otherwise: autograd's saved views stay valid across the refill).
    master      # 1D range numel, FP32, this rank. Aliases full[range] when full is persistent
                #   FP32; otherwise its own storage (the only persistent copy at stage 3).
    full_grad   # 1D padded_numel, every rank's local gradient. With ``grads_as_views`` (see
                #   there) param_dtype, bound from a unit's backward on (persistent when gradients
                #   are replicated); otherwise reduce_dtype, collected at the reduction.
    shard_grad  # 1D range numel, FP32, this rank's reduced (mean) gradient, read by the optimizer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard import collectives as C
from zeroshard.mesh import Mesh
from zeroshard.model_states.partition import intersect, padded_numel, shard_range
from zeroshard.precision import MASTER_DTYPE
from zeroshard.stages import Partition


class ShardState(enum.Enum):
    SHARDED = "sharded"
    """Only ``master`` holds values; ``full``'s storage is empty (stage 3 at rest)."""
    UNSHARDED = "unsharded"
    """``full`` holds every parameter (always so when parameters are replicated)."""


@dataclass
class Slot:
    """One original parameter inside the flat buffer."""

    param: nn.Parameter
    names: list[str]
    """Every fully qualified name the model registers it under (tied weights have several)."""
    shape: torch.Size
    offset: int
    """First element in the flat buffer."""

    @property
    def numel(self) -> int:
        return self.shape.numel()


class FlatParam:
    """One unit's parameters that share ``requires_grad``; see the module docstring."""

    def __init__(
        self,
        params: list[tuple[nn.Parameter, list[str]]],
        *,
        mesh: Mesh,
        partition: Partition,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        ledger: C.Ledger,
        sync_module_states: bool = True,
    ) -> None:
        self.mesh, self.partition, self.ledger = mesh, partition, ledger
        self.requires_grad = params[0][0].requires_grad
        orig_dtype = params[0][0].dtype
        self.param_dtype = param_dtype or orig_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.slots: list[Slot] = []
        offset = 0
        for p, names in params:
            self.slots.append(Slot(p, names, p.shape, offset))
            offset += p.numel()
        self.numel = offset
        self.padded_numel = padded_numel(self.numel, mesh.world_size)
        num_opt_shards = mesh.world_size if partition.optimizer_states else 1
        self.range = shard_range(
            mesh.rank if partition.optimizer_states else 0, self.padded_numel, num_opt_shards
        )
        self.num_units = 1  # units sharing this buffer (a bucket of replicated parameters)
        self.state = ShardState.UNSHARDED
        self.full_grad: torch.Tensor | None = None
        self.shard_grad: torch.Tensor | None = None
        self._gather: C.Handle | None = None
        self._reduce: tuple[C.Handle, torch.Tensor] | None = None
        self._init_storage(sync_module_states, orig_dtype)

    # ----------------------------------------------------------------- construction
    def _init_storage(self, sync_module_states: bool, orig_dtype: torch.dtype) -> None:
        device = self.mesh.device
        # 1D padded_numel, model dtype, every rank: the values as the model was built.
        flat = torch.zeros(self.padded_numel, dtype=orig_dtype, device=device)
        with torch.no_grad():
            for s in self.slots:
                flat[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        if sync_module_states and self.mesh.world_size > 1:
            # Every rank starts from rank 0's values, as DDP does.
            C.broadcast(flat, src=0, group=self.mesh.group)
        lo, hi = self.range
        if self.partition.parameters:
            self.full = torch.empty(self.padded_numel, dtype=self.param_dtype, device=device)
        else:
            self.full = flat if flat.dtype == self.param_dtype else flat.to(self.param_dtype)
        # A persistent FP32 ``full`` already is the master: its slice is this rank's shard.
        self.master_aliases_full = not self.partition.parameters and (
            self.param_dtype == MASTER_DTYPE
        )
        self.master: torch.Tensor | None
        if self.master_aliases_full:
            self.master = self.full[lo:hi]
        elif self.requires_grad or self.partition.parameters:
            self.master = flat[lo:hi].to(MASTER_DTYPE, copy=True)
        else:
            self.master = None  # frozen and replicated: ``full`` is all there is
        for s in self.slots:
            s.param.data = self.full[s.offset : s.offset + s.numel].view(s.shape)
        if self.partition.parameters:
            self.reshard()

    # ----------------------------------------------------------------- parameters
    def unshard(self, *, async_op: bool = True) -> None:
        """Start gathering ``full`` from every rank's ``master`` (no-op if already unsharded)."""
        if self.state is ShardState.UNSHARDED or self._gather is not None:
            return
        storage = self.full.untyped_storage()
        storage.resize_(self.padded_numel * self.full.element_size())
        assert self.master is not None
        shard = self.master  # 1D shard_numel, this rank's
        if shard.dtype != self.param_dtype:
            # Cast straight into this rank's slot of ``full`` and gather in place: no temporary.
            lo, hi = shard_range(self.mesh.rank, self.padded_numel, self.mesh.world_size)
            shard = self.full[lo:hi]
            shard.copy_(self.master)
        self._gather = C.all_gather(
            self.full, shard, group=self.mesh.group, ledger=self.ledger, async_op=async_op
        )

    def wait_unshard(self) -> None:
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
            self.state = ShardState.UNSHARDED

    def reshard(self) -> None:
        """Free ``full``'s storage; only meaningful when parameters are partitioned."""
        if not self.partition.parameters:
            return
        self.wait_unshard()
        self.full.untyped_storage().resize_(0)
        self.state = ShardState.SHARDED

    def sync_after_step(self) -> C.Handle | None:
        """Bring a replicated ``full`` up to date with the updated ``master``: a copy when this
        rank owns all of it, else an all-gather of every rank's shard (in place when ``master``
        aliases ``full``). Partitioned parameters are gathered afresh before their next use."""
        if self.partition.parameters or not self.requires_grad:
            return None
        assert self.master is not None
        if not self.partition.optimizer_states:
            if not self.master_aliases_full:
                self.full.copy_(self.master)
            return None
        shard = self.master.to(self.param_dtype)  # 1D shard_numel (no copy in FP32)
        return C.all_gather(self.full, shard, group=self.mesh.group, ledger=self.ledger)

    # ----------------------------------------------------------------- gradients
    @property
    def grads_as_views(self) -> bool:
        """Whether ``.grad`` are views into ``full_grad`` during backward (autograd accumulates in
        place) or autograd's own tensors, copied into a fresh ``full_grad`` at reduction.

        Views suit a buffer that outlives one unit's backward: replicated gradients, or a bucket
        shared by several units. A single unit's partitioned gradient (stage 3) is copied at
        reduction instead, as FSDP2 does: nothing is allocated (or zero-filled) before the unit's
        first gradient exists, which keeps the start of backward, the step's peak, lower."""
        return not self.partition.gradients or self.num_units > 1

    def bind_grads(self) -> None:
        """Point every parameter's ``.grad`` into ``full_grad`` so autograd accumulates there
        (``grads_as_views`` buffers only; a no-op otherwise)."""
        if not self.requires_grad or not self.grads_as_views:
            return
        if self.full_grad is None:
            self.full_grad = torch.zeros(
                self.padded_numel, dtype=self.param_dtype, device=self.mesh.device
            )
        elif self.shard_grad is not None and self._shard_grad_aliases_full():
            # A second reduction before zero_grad would mix reduced and unreduced slices in
            # place: keep what was reduced apart and start the local gradient afresh.
            self.shard_grad = self.shard_grad.clone()
            self.full_grad.zero_()
        for s in self.slots:
            grad = s.param.grad
            if grad is not None and grad.data_ptr() == self._grad_ptr(s):
                continue
            view = self.full_grad[s.offset : s.offset + s.numel].view(s.shape)
            if grad is not None:
                view.add_(grad)  # accumulated outside the hooks (e.g. no_sync): keep it
            s.param.grad = view

    def _collect_grads(self) -> None:
        """``full_grad`` from autograd's per-parameter gradients (zeros where there are none),
        which are released: the reduction's input when gradients are not views. It is made in
        ``reduce_dtype`` directly, so a wider reduction needs no second, cast copy."""
        self.full_grad = torch.empty(
            self.padded_numel, dtype=self.reduce_dtype, device=self.mesh.device
        )
        with torch.no_grad():
            for s in self.slots:
                view = self.full_grad[s.offset : s.offset + s.numel]
                if s.param.grad is None:
                    view.zero_()
                else:
                    view.copy_(s.param.grad.reshape(-1))
                    s.param.grad = None
            self.full_grad[self.numel :].zero_()

    def _grad_ptr(self, s: Slot) -> int:
        assert self.full_grad is not None
        return self.full_grad.data_ptr() + s.offset * self.full_grad.element_size()

    def _shard_grad_aliases_full(self) -> bool:
        assert self.shard_grad is not None and self.full_grad is not None
        return self.shard_grad.untyped_storage().data_ptr() == self.full_grad.data_ptr()

    def reduce_grads(self) -> None:
        """Start the gradient collective of the table's kind: all-reduce (replicated optimizer),
        reduce-scatter in place into this rank's slice (replicated gradients), or reduce-scatter
        into a new shard (partitioned gradients, so ``full_grad`` can be freed)."""
        if not self.requires_grad or self._reduce is not None:
            return
        if not self.grads_as_views:
            self._collect_grads()
        assert self.full_grad is not None, "bind_grads() precedes the reduction of views"
        n = self.mesh.world_size
        send = self.full_grad.to(self.reduce_dtype)  # 1D padded, every rank (no copy if same)
        if self.reduce_dtype == torch.float16:
            send.div_(n)  # FP16 overflows easily: average before summing
        group, ledger = self.mesh.group, self.ledger
        if not self.partition.optimizer_states:
            handle = C.all_reduce(send, group=group, ledger=ledger, label="grads")
        else:
            lo, hi = shard_range(self.mesh.rank, self.padded_numel, n)
            out = send[lo:hi] if not self.partition.gradients else send.new_empty(hi - lo)
            handle = C.reduce_scatter(out, send, group=group, ledger=ledger)
        self._reduce = (handle, send)

    def finish_reduce(self) -> None:
        """Wait for the gradient collective, average, accumulate into ``shard_grad`` (FP32), and
        free ``full_grad`` when gradients are partitioned."""
        if self._reduce is None:
            return
        handle, _send = self._reduce
        self._reduce = None
        out = handle.wait()
        if self.reduce_dtype != torch.float16:
            out.div_(self.mesh.world_size)
        if not self.partition.optimizer_states:
            out = out[self.range[0] : self.range[1]]
        reduced = out.to(MASTER_DTYPE)  # 1D range numel (alias when FP32)
        if self.shard_grad is None:
            self.shard_grad = reduced
        else:
            self.shard_grad.add_(reduced)
        if self.partition.gradients:
            self.free_full_grad()

    def free_full_grad(self) -> None:
        for s in self.slots:
            s.param.grad = None
        self.full_grad = None

    def zero_grad(self) -> None:
        self.shard_grad = None
        if not self.grads_as_views:
            for s in self.slots:
                s.param.grad = None  # accumulated by autograd in no_sync micro-steps
        if self.full_grad is None:
            return
        if self.partition.gradients:
            self.free_full_grad()
        else:
            self.full_grad.zero_()  # persistent and bound: keep the allocation

    # ----------------------------------------------------------------- optimizer view
    def pieces(self) -> list[tuple[Slot, slice]]:
        """For each slot, the slice of ``master`` / ``shard_grad`` that this rank owns (possibly
        empty)."""
        lo, hi = self.range
        out = []
        for s in self.slots:
            a, b = intersect((s.offset, s.offset + s.numel), (lo, hi))
            out.append((s, slice(a - lo, b - lo)))
        return out
