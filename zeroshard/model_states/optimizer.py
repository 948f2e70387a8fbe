"""The sharded optimizer: any element-wise ``torch.optim`` class over this rank's FP32 master shard.

Each rank builds the user's optimizer over *pieces*: views into its ``master`` shard, one per run
of consecutive parameters that share a param group. Optimizer states are created lazily by torch
for those pieces only, so they are partitioned exactly as the master is (stage >= 1) or replicated
(stage 0). After the step, replicated parameters are refreshed from the updated shards.

Loss scaling lives here too (``zeroshard.precision``): ``backward`` multiplies the loss by the
scaler's scale; ``step`` unscales this rank's FP32 shard gradients and checks them for inf/NaN in
one fused pass, agrees on the outcome with one one-element all-reduce ("found_inf"), and either
steps or skips (master weights, optimizer states and step counters untouched).

Element-wise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, ...) give the same result as
unsharded training; optimizers with per-tensor statistics (LAMB, Adafactor) would not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard import collectives as C
from zeroshard.engine import Engine, engine_of
from zeroshard.model_states.flat_param import FlatParam
from zeroshard.precision import LossScaler, default_scaler


@dataclass
class _Piece:
    """A contiguous slice of one FlatParam's master and shard gradient given to the optimizer."""

    flat: FlatParam
    span: slice
    tensor: torch.Tensor  # 1D view of flat.master[span], this rank only


def _param_groups(model: nn.Module, params: Iterable[Any] | None) -> list[dict[str, Any]]:
    """Normalize ``params`` as torch.optim accepts it (tensors, or dicts with "params") ."""
    if params is None:
        return [{"params": list(model.parameters())}]
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g, params=list(g["params"])) for g in params]
    return [{"params": params}]


class ShardedOptimizer:
    """Wraps ``optimizer_cls`` so that it steps only this rank's shard of the master weights.

    Call ``backward(loss)``, optionally ``clip_grad_norm(max_norm)``, then ``step()`` and
    ``zero_grad()``. ``.optimizer`` is the inner torch optimizer (for LR schedulers).
    ``loss_scaler`` defaults to a ``DynamicLossScaler`` when gradients are computed in FP16 and
    to no scaling (steps with inf/NaN gradients skipped) otherwise.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_cls: type[torch.optim.Optimizer],
        params: Iterable[Any] | None = None,
        *,
        loss_scaler: LossScaler | None = None,
        **defaults: Any,
    ) -> None:
        self.engine: Engine = engine_of(model)
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise TypeError(
                "loss_scaler must be a zeroshard LossScaler or DynamicLossScaler, got "
                f"{type(loss_scaler).__name__}"
            )
        self._trainable = [f for f in self.engine.flat_params if f.requires_grad]
        self.loss_scaler = loss_scaler or default_scaler({f.param_dtype for f in self._trainable})
        self._found_inf: torch.Tensor | None = None  # (1,) FP32: set once gradients are unscaled
        where = {}  # id(original parameter) -> (flat, its slice of master)
        for flat in self._trainable:
            for slot, span in flat.pieces():
                where[id(slot.param)] = (flat, span)
        self._groups: list[list[_Piece]] = []
        torch_groups = []
        for group in _param_groups(model, params):
            pieces = self._pieces_for(group["params"], where)
            self._groups.append(pieces)
            torch_groups.append(dict(group, params=[p.tensor for p in pieces]))
        self.optimizer = optimizer_cls(torch_groups, **defaults)

    @staticmethod
    def _pieces_for(params: list[nn.Parameter], where: dict) -> list[_Piece]:
        """Merge consecutive slices of the same FlatParam into one piece (fewer, larger tensors
        make the optimizer's kernels faster)."""
        pieces: list[_Piece] = []
        spans = []
        for p in params:
            if not p.requires_grad or p.numel() == 0:
                continue  # nothing to update (zero-element parameters stay unsharded)
            if id(p) not in where:
                raise ValueError(
                    "a parameter given to the optimizer is not part of the sharded model; pass "
                    "model.parameters() (or groups of them) of the model given to shard()"
                )
            flat, span = where[id(p)]
            if span.start < span.stop:
                spans.append((flat, span))
        for flat, span in spans:
            last = pieces[-1] if pieces else None
            if last is not None and last.flat is flat and last.span.stop == span.start:
                last.span = slice(last.span.start, span.stop)
            else:
                pieces.append(_Piece(flat, span, torch.empty(0)))
        for piece in pieces:
            assert piece.flat.master is not None
            piece.tensor = piece.flat.master[piece.span]
        return pieces

    # ----------------------------------------------------------------- the step
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def _shard_grads(self) -> list[torch.Tensor]:
        """This rank's reduced FP32 gradients (1D, its optimizer range of each buffer)."""
        return [f.shard_grad for f in self._trainable if f.shard_grad is not None]

    def backward(self, loss: torch.Tensor, *, sync: bool = True) -> None:
        """``loss.backward()`` (times the loss scale); with ``sync=False`` gradients only
        accumulate locally (a gradient-accumulation micro-step), communicated by the next
        synchronized backward."""
        self._found_inf = None  # new gradients arrive scaled
        scale = self.loss_scaler.scale
        if scale != 1.0:
            loss = loss.float() * scale  # in FP32: an FP16 loss times 2**16 would overflow
        if sync:
            loss.backward()
        else:
            with self.engine.no_sync():
                loss.backward()

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so that their global norm (over every rank's shard) is at most
        ``max_norm``; returns the norm before clipping, as ``torch.nn.utils.clip_grad_norm_``."""
        if norm_type != 2.0:
            raise ValueError("clip_grad_norm supports the 2-norm (norm_type=2.0) only")
        self._unscale()  # clip the true gradient, not the scaled one
        grads = self._shard_grads()
        device = self.engine.mesh.device
        sq = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:  # one fused norm per buffer: no gradient-sized temporaries
            sq += torch.stack(torch._foreach_norm(grads)).pow(2).sum()
        if self.engine.partition.optimizer_states and self.engine.mesh.world_size > 1:
            C.all_reduce(
                sq,
                group=self.engine.mesh.group,
                ledger=self.engine.ledger,
                label="norm",
                async_op=False,
            )
        norm = sq.sqrt()[0]
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return norm

    def _unscale(self) -> None:
        """Divide this rank's shard gradients by the loss scale and look for inf/NaN, in one
        fused pass; idempotent until the next ``backward``."""
        if self._found_inf is not None:
            return
        device = self.engine.mesh.device
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        grads = self._shard_grads()
        scaler = self.loss_scaler
        if not grads or (scaler.scale == 1.0 and not scaler.checks):
            return
        inv_scale = torch.full((1,), 1.0 / scaler.scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found_inf, inv_scale)

    def _agree_found_inf(self) -> bool:
        """Whether any rank's shard gradients hold inf/NaN: one one-element all-reduce (MAX),
        so every rank skips or steps together (a shard's overflow is seen only by its owner)."""
        assert self._found_inf is not None
        if self.engine.mesh.world_size > 1:
            C.all_reduce(
                self._found_inf,
                group=self.engine.mesh.group,
                ledger=self.engine.ledger,
                label="found_inf",
                op=dist.ReduceOp.MAX,
                async_op=False,
            )
        return bool(self._found_inf.item())  # a host sync: the decision is made on the host

    def step(self) -> bool:
        """One optimizer step on this rank's shard, then refresh replicated parameters.

        Returns False when the step was skipped because some rank's gradients hold inf/NaN
        (the loss scaler then lowers its scale); master weights and optimizer states are left
        untouched. ``zero_grad`` as usual either way.
        """
        self._unscale()
        found_inf = self.loss_scaler.checks and self._agree_found_inf()
        self._found_inf = None
        self.loss_scaler.update(found_inf)
        if found_inf:
            self.engine.ledger.end_step()
            return False
        for pieces in self._groups:
            for piece in pieces:
                g = piece.flat.shard_grad
                piece.tensor.grad = None if g is None else g[piece.span]
        self.optimizer.step()
        handles = [f.sync_after_step() for f in self._trainable]
        for h in handles:
            if h is not None:
                h.wait()
        self.engine.ledger.end_step()
        return True

    def zero_grad(self) -> None:
        self._found_inf = None
        for f in self._trainable:
            f.zero_grad()
        for pieces in self._groups:
            for piece in pieces:
                piece.tensor.grad = None

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (as torch's ``state_dict``), plus the loss
        scaler's state under ``"loss_scaler"``."""
        return dict(self.optimizer.state_dict(), loss_scaler=self.loss_scaler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        scaler = state.pop("loss_scaler", None)
        self.optimizer.load_state_dict(state)
        if scaler is not None:
            self.loss_scaler.load_state_dict(scaler)
