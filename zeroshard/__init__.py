"""zeroshard: ZeRO / fully sharded data parallel training on top of torch.distributed.

model = zeroshard.shard(model, stage=3, wrap=zeroshard.wrap.by_class(Block))
optimizer = zeroshard.optimizer(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
loss = loss_fn(model(x), y)
optimizer.backward(loss); optimizer.clip_grad_norm(1.0); optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from zeroshard import checkpoint, offload, precision, wrap
from zeroshard.collectives import Ledger
from zeroshard.engine import ShardConfig, engine_of
from zeroshard.mesh import Mesh
from zeroshard.model_states.optimizer import ShardedOptimizer
from zeroshard.offload import Offload, OffloadConfig, TensorStore, Tier
from zeroshard.optimizer_state_dict import load_optimizer_state_dict, optimizer_state_dict
from zeroshard.precision import DynamicLossScaler, LossScaler, MixedPrecision
from zeroshard.sharding import shard
from zeroshard.stages import STAGES, Partition
from zeroshard.state_dict import device_mesh, full_state_dict

__version__ = "0.1.0"


def optimizer(
    model, optimizer_cls, params=None, *, loss_scaler: LossScaler | None = None, **defaults
) -> ShardedOptimizer:
    """A sharded ``optimizer_cls`` (any element-wise torch.optim class) over a sharded model.

    ``params`` is what torch.optim takes (parameters or groups of them, e.g. no weight decay for
    biases); it defaults to ``model.parameters()``. ``defaults`` go to ``optimizer_cls``.
    ``loss_scaler`` defaults to ``DynamicLossScaler()`` when the model computes in FP16, else to
    ``LossScaler()`` (no scaling; steps with inf/NaN gradients are skipped).
    """
    return ShardedOptimizer(model, optimizer_cls, params, loss_scaler=loss_scaler, **defaults)


def ledger(model) -> Ledger:
    """The communication ledger of a sharded model (elements and bytes per collective)."""
    return engine_of(model).ledger


def summon_full_params(model, *, writeback: bool = True):
    """Context manager: every parameter of a sharded model gathered, as views of its own shape
    in the compute dtype. Forward (and backward) inside work; with ``writeback`` the values
    written inside reach the FP32 masters on exit (unchanged ones keep full precision)."""
    return engine_of(model).summon_full_params(writeback=writeback)


def no_sync(model):
    """Context manager: backward passes inside accumulate gradients without communicating."""
    return engine_of(model).no_sync()


__all__ = [
    "checkpoint",
    "STAGES",
    "DynamicLossScaler",
    "Ledger",
    "LossScaler",
    "Mesh",
    "MixedPrecision",
    "Offload",
    "OffloadConfig",
    "Partition",
    "ShardConfig",
    "ShardedOptimizer",
    "TensorStore",
    "Tier",
    "device_mesh",
    "engine_of",
    "full_state_dict",
    "ledger",
    "load_optimizer_state_dict",
    "no_sync",
    "offload",
    "optimizer",
    "optimizer_state_dict",
    "precision",
    "shard",
    "summon_full_params",
    "wrap",
]
