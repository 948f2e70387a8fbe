"""A unit: one wrapped module (a transformer block, or the root for what no block owns), the
flat storage of the parameters it owns (its ``FlatParam`` objects, one per dtype group) and
where it is in a training step (``TrainingState``, checked at every transition; ``Phase`` is
the whole model's), and its uses in a forward (``Use``: each backward reaching one). The engine
(``zeroshard.engine``) drives the units through forward and backward; a unit only gathers,
frees and reports."""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroshard.model_states.flat_param import FlatParam, ShardState
from zeroshard.model_states.grads import GradBucket
from zeroshard.precision import FP32, MixedPrecision
from zeroshard.trees import map_tensors

if TYPE_CHECKING:
    from zeroshard.engine import Engine
    from zeroshard.module_hooks import Lending

__all__ = ["Phase", "TrainingState", "Unit", "Use"]


class Phase(enum.Enum):
    """Where the whole model is in a training step (the engine's own state, beside
    each unit's ``TrainingState``)."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class TrainingState(enum.Enum):
    """Where one unit is in a training step; checked at every transition.

    What is alive in each state (partitioned parameters; replicated ones are always gathered):

        IDLE           gathered storage freed (the root may keep it until backward);
                       parameters are NaN placeholders of their own shape (``FlatParam``);
                       gradients, if any, are reduced shards (local ones inside ``no_sync``).
        FORWARD        gathered; parameters are views into it.
        PRE_BACKWARD   gathered; autograd is accumulating the unit's gradients (into the bucket's
                       ``full_grad`` views, or its own per-parameter tensors at stage 3).
        POST_BACKWARD  autograd is done with the unit for this backward: its gradient reduction
                       is issued (or finished), gathered storage freed.
    """

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


_TRANSITIONS: dict[TrainingState, set[TrainingState]] = {
    TrainingState.IDLE: {TrainingState.FORWARD, TrainingState.PRE_BACKWARD},
    TrainingState.FORWARD: {TrainingState.IDLE},
    TrainingState.PRE_BACKWARD: {TrainingState.POST_BACKWARD},
    TrainingState.POST_BACKWARD: {TrainingState.IDLE, TrainingState.PRE_BACKWARD},
}


class Unit:
    """One wrapped module, the flat storage of the parameters it owns and its training state."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        flat_params: list[FlatParam],
        buckets: list[GradBucket],
        is_root: bool,
        owners: list[nn.Module] | None = None,
        params: list[nn.Parameter] | None = None,
    ):
        self.name, self.module, self.flat_params, self.is_root = name, module, flat_params, is_root
        self.buckets = buckets
        self.param_ids = {id(p) for p in params or () if p.requires_grad}
        """The trainable parameters it owns (at stages 0-2 a FlatParam may hold other units')."""
        self.owners = owners or []
        """Submodules (other than ``module``) that register the unit's parameters."""
        self.precision: MixedPrecision = FP32
        """Its mixed-precision policy (``shard``'s ``mixed_precision``, or ``unit_precision``'s)."""
        self.lender: nn.Module | None = None  # the owner whose call is a use of the unit
        self.lent_gathered = False  # the unit was gathered already when lent: keep it so
        self.lending: Lending | None = None  # the owners' hooks for lends (``module_hooks``)
        self.state = TrainingState.IDLE
        self.pending_uses = 0
        """Forward uses (with grad) whose backward has not reached the unit's inputs yet."""
        self.generation = 0
        """Bumped whenever ``pending_uses`` is reset: older uses no longer count."""
        self.recompute_use = False  # the current recomputation is a use (reentrant checkpoint)
        self.edits: list[list] = []
        """Per call running now: what ``trees.map_tensors`` changed in the caller's containers
        of inputs (in place; undone when the call ends), the inputs as given to the module, and
        the ids of their tensors then (``Engine._side_outputs``)."""
        self.depth = 0  # calls of the module running now: > 1 when it calls itself (a tree net)
        """Counted down by a hook that runs also when the call raised an Exception
        (``Engine._leave``); from 1 when the unit is out of its forward (a Ctrl-C's leftover)."""
        self.recomputing = 0  # its recomputations running now (in a backward): not counted above
        self.pre_hook_id: int | None = None  # the engine's forward pre-hook on the module
        self.updates = 0
        """Steps of an optimizer holding all its trainable parameters: a graph whose forward
        came before one is stale (its backward would use the new weights; torch raises there).
        Not counted for a unit that two optimizers share: one's step may leave a graph of the
        other's parameters valid (a GAN's generator and discriminator in one unit)."""

    def to(self, state: TrainingState) -> None:
        assert state in _TRANSITIONS[self.state], (
            f"unit {self.name or '<root>'}: {self.state.value} -> {state.value}"
        )
        self.state = state

    def lend_again(self) -> None:
        """Out of all its calls (none running, none recomputing): a call of one of its owners
        is a lend again (``module_hooks.Lending``)."""
        if self.lending is not None and self.depth == 0 and self.recomputing == 0:
            self.lending.attach()

    def unshard(self, *, async_op: bool = True) -> None:
        for f in self.flat_params:
            f.unshard(async_op=async_op)

    def wait_unshard(self) -> None:
        for f in self.flat_params:
            f.wait_unshard()

    def reshard(self, *, adopt: bool = False) -> None:
        """Free the gathered parameters; with ``adopt``, writes made to them while gathered are
        copied into the masters first (``FlatParam.adopt_gathered_writes``)."""
        for f in self.flat_params:
            if adopt:
                f.adopt_gathered_writes()
            f.reshard()

    def unalias(self, output: Any) -> Any:
        """``output`` with the tensors that are this unit's gathered parameters, or views of
        them (a learned position table returned whole or sliced), cloned before the unit
        reshards: they pointed at the freed gather (a crash) or at the placeholder at rest
        (NaN). FSDP2 crashes."""
        gathered = {
            f.full.untyped_storage().data_ptr()
            for f in self.flat_params
            if f.partition.parameters and f.state is ShardState.UNSHARDED
        }
        if not gathered:
            return output
        return map_tensors(lambda t: t.clone() if _storage_ptr(t) in gathered else t, output)

    @property
    def is_sharded(self) -> bool:
        return any(f.state is ShardState.SHARDED for f in self.flat_params)

    @property
    def is_gathered(self) -> bool:
        """Partitioned parameters gathered or being gathered."""
        parts = [f for f in self.flat_params if f.partition.parameters]
        return any(f.state is ShardState.UNSHARDED or f.gathering for f in parts)


class Use:
    """One forward use of a unit, as the hook on its inputs: called when backward reaches them.

    Counted in ``unit.pending_uses`` while alive; a use whose graph is freed without a backward
    (a forward with grad never backpropagated) uncounts itself, so that later backwards still
    finish the unit as soon as its last real use is done. It holds the engine and the unit
    weakly: a graph kept after its model is dropped (the last ``loss``) keeps neither alive."""

    __slots__ = ("_engine", "_unit", "generation", "fired", "counted")

    def __init__(self, engine: Engine, unit: Unit) -> None:
        self._engine, self._unit = weakref.ref(engine), weakref.ref(unit)
        self.generation = unit.generation
        self.fired, self.counted = False, False  # counted: once it hooks the use's inputs

    def __call__(self) -> None:
        self.fired = True
        engine, unit = self._engine(), self._unit()
        if engine is not None and unit is not None and self.generation == unit.generation:
            engine._post_backward(unit)

    def __del__(self) -> None:
        unit = self._unit()
        if (
            unit is not None
            and self.counted
            and not self.fired
            and self.generation == unit.generation
        ):
            unit.pending_uses -= 1


def _storage_ptr(t: torch.Tensor) -> int | None:
    """Where ``t``'s storage starts; None for a tensor with no storage of its own to read (a
    wrapper subclass: the async result of a functional collective, which a rowwise Linear of
    a tensor-parallel unit returns, raised "invalid python storage"), which no gather holds."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
