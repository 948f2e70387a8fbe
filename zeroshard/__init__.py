"""zeroshard: ZeRO / fully sharded data parallel training on top of torch.distributed.

model = zeroshard.shard(model, stage=3, wrap=zeroshard.wrap.by_class(Block))
optimizer = zeroshard.optimizer(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
loss = loss_fn(model(x), y)
optimizer.backward(loss); optimizer.clip_grad_norm(1.0); optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zeroshard.collectives import Ledger
    from zeroshard.loss_scaling import LossScaler
    from zeroshard.model_states.optimizer import ShardedOptimizer

__version__ = "0.1.0"

# Names are imported on first use (PEP 562), so that ``import zeroshard`` (and the command line,
# whose Ctrl-C handler runs only once its module is imported) does not wait for torch.
_SUBMODULES = ("checkpoint", "export", "models", "offload", "planner", "precision",
               "state_dict", "tensor_parallel", "wrap")  # fmt: skip
"""The public modules, listed by ``dir(zeroshard)``; every submodule is an attribute (imported
on first use, as ``zeroshard.export.export_safetensors`` in the README reads)."""
_EXPORTS = {
    "Ledger": "zeroshard.collectives",
    "ShardConfig": "zeroshard.engine",
    "engine_of": "zeroshard.engine",
    "Mesh": "zeroshard.mesh",
    "ShardedOptimizer": "zeroshard.model_states.optimizer",
    "Offload": "zeroshard.offload",
    "OffloadConfig": "zeroshard.offload",
    "TensorStore": "zeroshard.offload",
    "Tier": "zeroshard.offload",
    "load_optimizer_state_dict": "zeroshard.optim_state_dict",
    "optimizer_state_dict": "zeroshard.optim_state_dict",
    "DynamicLossScaler": "zeroshard.loss_scaling",
    "LossScaler": "zeroshard.loss_scaling",
    "MixedPrecision": "zeroshard.precision",
    "shard": "zeroshard.sharding",
    "STAGES": "zeroshard.stages",
    "Partition": "zeroshard.stages",
    "device_mesh": "zeroshard.state_dict",
    "full_state_dict": "zeroshard.state_dict",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        if name in _SUBMODULES or (
            name.isidentifier() and importlib.util.find_spec(f"zeroshard.{name}") is not None
        ):
            return importlib.import_module(f"zeroshard.{name}")
        raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES, *_EXPORTS})


def optimizer(
    model,
    optimizer_cls,
    params=None,
    *,
    loss_scaler: LossScaler | None = None,
    step_in_backward: bool = False,
    **defaults,
) -> ShardedOptimizer:
    """A sharded ``optimizer_cls`` (any element-wise torch.optim class) over a sharded model.

    ``params`` is what torch.optim takes (parameters or groups of them, e.g. no weight decay for
    biases); it defaults to ``model.parameters()``. ``defaults`` go to ``optimizer_cls``.
    ``loss_scaler`` defaults to ``DynamicLossScaler()`` when the model computes in FP16, else to
    ``LossScaler()`` (no scaling; steps with inf/NaN gradients are skipped).
    ``step_in_backward`` (stages 2-3): each unit steps as soon as its gradient shard is reduced,
    which lowers the peak by up to the rank's gradient shard; no gradient clipping, no FP16
    (``zeroshard.model_states.backward_step``).
    """
    from zeroshard.model_states.optimizer import ShardedOptimizer

    return ShardedOptimizer(
        model,
        optimizer_cls,
        params,
        loss_scaler=loss_scaler,
        step_in_backward=step_in_backward,
        **defaults,
    )


def ledger(model) -> Ledger:
    """The communication ledger of a sharded model (elements and bytes per collective)."""
    from zeroshard.engine import engine_of

    return engine_of(model).ledger


def summon_full_params(model, *, writeback: bool = True):
    """Context manager: every parameter of a sharded model gathered, as views of its own shape
    in the compute dtype. Forward (and backward) inside work; with ``writeback`` the values
    written inside reach the FP32 masters on exit (unchanged ones keep full precision)."""
    from zeroshard.engine import engine_of
    from zeroshard.summon import summon_full_params as summon

    return summon(engine_of(model), writeback=writeback)


def no_sync(model):
    """Context manager: backward passes inside accumulate gradients without communicating."""
    from zeroshard.engine import engine_of

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
