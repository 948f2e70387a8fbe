"""``zero_grad`` of a sharded model and of its submodules: the gradients the engine holds (the
reduced shards are not ``.grad`` attributes) are dropped too, so that a loop calling it instead
of the optimizer's does not accumulate them across steps; a submodule's drops its parameters'
part only (a GAN's ``netD.zero_grad()`` inside one sharded model)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from zeroshard.engine import Engine

__all__ = ["install"]


def install(model: nn.Module, engine: Engine) -> None:
    """``model.zero_grad()`` drops the gradients the engine holds too (the reduced shards are
    not ``.grad`` attributes, and a loop that calls it instead of the optimizer's would
    otherwise accumulate them across steps): through the optimizers built on the model, which
    also reset their step's flags, else bucket by bucket."""
    engine.optimizers = weakref.WeakSet()  # each ShardedOptimizer adds itself
    module_zero_grad = model.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        engine.gradients_discarded()  # (what a backward that raised left: with the rest)
        for opt in list(engine.optimizers):
            opt.zero_grad(set_to_none)
        for b in engine.buckets:  # every gradient: buckets shared by optimizers freed too
            b.zero(keep_touched=not set_to_none)
        engine.scaling.reset()
        module_zero_grad(set_to_none)

    model.zero_grad = zero_grad
    for module in model.modules():
        if module is not model and any(True for _ in module.parameters()):
            module.zero_grad = functools.partial(_zero_part, module, engine, module.zero_grad)


def _zero_part(module: nn.Module, engine: Engine, own: Callable, set_to_none: bool = True) -> None:
    """``submodule.zero_grad()`` (a GAN's ``netD.zero_grad()`` inside one sharded model) drops
    the gradients the engine holds for that submodule's parameters only; they came back at the
    next step, added to the new ones."""
    params, whole = {id(p) for p in module.parameters()}, 0
    reached = [b for b in engine.buckets if any(id(s.param) in params for s in b.flat.slots)]
    for opt in list(engine.optimizers):  # (step_in_backward: the updates stay, as zero_grad's)
        opt.drop_applied(reached)
    for b in reached:
        slots = [i for i, s in enumerate(b.flat.slots) if id(s.param) in params]
        if len(slots) == len(b.flat.slots):  # all of it: its memory and inf/NaN flag go too
            b.zero(keep_touched=not set_to_none)
            whole += 1
        elif slots:
            b.zero_slots(slots, keep_touched=not set_to_none)
    if whole == len(engine.buckets):
        engine.scaling.reset()  # nothing left of an accumulation
    own(set_to_none)
