"""Clipping by the global gradient norm when each rank holds a shard of the gradients: the
p-th powers of this rank's shard summed (or their maximum), combined over the shard group (and
the tensor-parallel group), then every shard scaled by the same coefficient. Over one
optimizer's parameters only, as ``torch.nn.utils.clip_grad_norm_`` over the parameters it is
given."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from zeroshard import collectives as C
from zeroshard.watchdog import every_rank_calls

if TYPE_CHECKING:
    from zeroshard.model_states.optimizer import ShardedOptimizer

__all__ = ["clip_grad_norm", "powers"]

NORM_CHUNK = 1 << 14
"""Elements per piece whose norm is taken apart. torch's CPU kernel loses precision along one
long FP32 tensor (a 10M-element 2-norm 3.6e-4 off, a 3-norm 2.1e-3): a flat bucket's norm was
up to 20 times further from the exact one than ``torch.nn.utils.clip_grad_norm_``'s, which takes
one norm per parameter. Pieces of 16384 elements are within 3e-8 on random values (2-norm;
1.3e-6 for p = 3), 7e-7 to 9e-7 on a small GPT's or GPT-2's gradient shards at stages 0-2
(an explorer; stage 3's and FSDP2's within 1.4e-8), their p-th powers summed in FP64, at the
cost of one norm over the whole tensor. (FP64 norms of the pieces are exact and 6x slower.)"""


def powers(tensors: list[torch.Tensor], p: float) -> torch.Tensor:
    """1-D FP64, one per tensor: the sum of the p-th powers of its elements (``inf``: their
    largest magnitude, NaN if one is), from the norms of its pieces of ``NORM_CHUNK``."""
    pieces = [t.reshape(-1).split(NORM_CHUNK) for t in tensors]  # (an empty one: one piece)
    if not pieces:
        return torch.zeros(0, dtype=torch.float64)
    norms = torch.stack(torch._foreach_norm([c for chunks in pieces for c in chunks], p))
    norms = norms.to(torch.float64)
    per_tensor = (norms if math.isinf(p) else norms.pow(p)).split([len(c) for c in pieces])
    return torch.stack([n.max() if math.isinf(p) else n.sum() for n in per_tensor])


def clip_grad_norm(opt: ShardedOptimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients so that their global ``norm_type``-norm (any p > 0, or ``inf``) is
    at most ``max_norm``; returns the norm before clipping, as
    ``torch.nn.utils.clip_grad_norm_`` returns it for the unsharded model, over this
    optimizer's parameters only, as torch's clip over the parameters it is given (a second
    optimizer's are its own; with no gradient at all the norm is 0). The norm takes the
    shard group's shards (every element once; with hybrid sharding the replicas in other
    groups are not counted again): a sum of p-th powers, or a maximum."""
    try:  # as torch's: a number, a 0-dim tensor, its text
        max_norm, p = float(max_norm), float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(
            f"clip_grad_norm takes numbers, got max_norm={max_norm!r}, norm_type={norm_type!r}"
        ) from None
    if not p > 0:
        raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
    opt.engine.check_trusted()  # (a gradient dropped after a failed swap: no norm without it)
    opt._check_synchronized("clip_grad_norm", "the norm would be 0, clipping none of them")
    if opt._backward_step is not None:
        raise ValueError(
            "clip_grad_norm needs every gradient before any update, but with "
            "step_in_backward each sub-group steps as soon as its gradient is reduced; "
            "drop step_in_backward to clip gradients"
        )
    if opt._grad_swap is not None and p != 2.0:
        raise ValueError(
            f"clip_grad_norm(norm_type={norm_type}) with gradients on NVMe: their 2-norms "
            "are taken as they are written, so only norm_type=2.0 is available there"
        )
    if opt._grad_swap is not None and any(  # (it takes every bucket's norm)
        len(opt._slots.get(id(b), ())) < len(b.flat.slots) for b in opt.engine.buckets
    ):
        raise ValueError(
            "clip_grad_norm with gradients on NVMe takes the norm of every trainable "
            "parameter's gradient, but this optimizer holds only some of them: give it every "
            "trainable parameter (or freeze the others before shard()), or keep gradients in "
            "memory (Offload(gradients='cpu'))"
        )
    grads = opt._shard_grads()
    largest = math.isinf(p)
    # fused norms of pieces of each buffer: no gradient-sized temporaries (those on NVMe were
    # taken when they were written, the same way)
    if opt._grad_swap is not None:
        summed = opt._grad_swap.powers()
    else:  # (none at all: a norm of 0, as torch's clip returns it)
        summed = powers(grads, p)
    # The norm in FP32 at least, FP64 for a float64 model (whose norm can pass FP32's range, as
    # torch's): from the buckets, which every rank has (a rank may hold no gradient here).
    wide = any(b.flat.master_dtype == torch.float64 for b in opt._buckets)
    dtype = torch.float64 if wide else torch.float32
    # 1D FP64, this rank: the sum of p-th powers of its shard's elements, or their maximum and
    # whether one is NaN (a MAX reduction by gloo can drop another rank's NaN; torch's is NaN)
    total = torch.zeros(2 if largest else 1, dtype=torch.float64, device=opt.engine.mesh.device)
    summed = summed.to(total.device)
    if len(summed):
        if largest:
            total[0] = summed.nan_to_num(nan=0.0, posinf=math.inf).max()  # (inf stays inf)
            total[1] = summed.isnan().any()
        else:
            total += summed.sum()
    mesh = opt.engine.mesh
    if mesh.tp_size > 1 and not largest:
        # Tensor-parallel ranks hold different pieces of split parameters (summed over the
        # group below) and the same gradient of replicated ones (to be counted once).
        total -= _tp_replicated_power(opt, p) * (1 - 1 / mesh.tp_size)
    op = dist.ReduceOp.MAX if largest else dist.ReduceOp.SUM
    sharded = opt.engine.partition.optimizer_states and mesh.shard_size > 1
    # DDP's clip is local: a norm logged on rank 0 alone, from the first step on, is named here;
    # the first call only (a store's round trips every step would load it at scale).
    if (sharded or mesh.tp_size > 1) and not opt._norm_checked:
        every_rank_calls(
            "clip_grad_norm",
            "the gradients' norm",
            "each rank holds a shard of the gradients; take the norm on every rank and log it "
            "on one",
            mesh.group if mesh.tp_size == 1 else None,
        )
        opt._norm_checked = True  # (a call refused checks again)
    if sharded:
        # The shard group's ranks hold disjoint shards that together make every gradient;
        # with hybrid sharding the other groups hold the same ones: summing over them too
        # would count each element once per replica.
        C.all_reduce(
            total,
            group=mesh.shard_group,
            ledger=opt.engine.ledger,
            label="norm",
            op=op,
            async_op=False,
        )
    if mesh.tp_size > 1:
        C.all_reduce(
            total,
            scope=C.TENSOR,
            group=mesh.tp_group,
            ledger=opt.engine.ledger,
            label="norm",
            op=op,
            async_op=False,
        )
    if largest:
        norm = torch.where(total[1] > 0, torch.full_like(total[0], math.nan), total[0])
    else:
        norm = total.clamp(min=0).pow(1 / p)[0]
    norm = norm.to(dtype)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if opt._grad_swap is not None:
        opt._grad_swap.scale(coef)  # stored ones are multiplied when read back
    elif grads:
        torch._foreach_mul_(grads, coef)
        opt._show_shard_grads()
    return norm


def _tp_replicated_power(opt: ShardedOptimizer, p: float) -> torch.Tensor:
    """Sum of p-th powers (FP64, ``powers``) of this rank's shard gradients of the parameters
    that tensor parallelism replicates (not split: ``zeroshard.tensor_parallel``)."""
    if opt._grad_swap is not None:
        raise ValueError(
            "clip_grad_norm with tensor parallelism needs the gradients in memory; keep "
            "gradients on the device or CPU (offload gradients='cpu'), or do not clip"
        )
    own = {id(b): set(opt._slots[id(b)]) for b in opt._buckets}
    pieces = [
        b.shard_grad[piece]
        for b in opt._buckets
        if b.shard_grad is not None
        for i, (slot, piece) in enumerate(b.flat.pieces())
        if i in own[id(b)]
        and not getattr(slot.param, "_zeroshard_tp_split", False)
        and piece.stop > piece.start
    ]
    return powers(pieces, p).sum().to(opt.engine.mesh.device)
