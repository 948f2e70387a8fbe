"""Where the engine meets ``nn.Module``'s hooks: which hooks a unit gets (``install``), run
eagerly under torch.compile (``eager``), the forward hooks that reshard it kept behind the
user's (``keep_last``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from zeroshard.engine import Engine
    from zeroshard.unit import Unit

__all__ = ["Lending", "eager", "install", "keep_last", "ran_before"]


def install(engine: Engine, unit: Unit) -> list[Any]:
    """The engine's hooks on ``unit``'s module (gather before, reshard after its forward) and on
    the submodules that own its parameters (``unit.owners``); their handles."""

    def pre(m: nn.Module, args: tuple, kwargs: dict) -> Any:
        keep_last(m, last)
        return engine._pre_forward(unit, args, kwargs)

    module = unit.module
    handles = [module.register_forward_pre_hook(eager(pre), with_kwargs=True, prepend=True)]
    unit.pre_hook_id = handles[0].id
    if engine.checkpointing is not None and unit in engine._checkpointed:
        # Runs first, and also when the forward raised: the saved-tensor hooks must pop.
        stop = eager(lambda m, a, o: engine._stop_dropping(m))
        handles.append(module.register_forward_hook(stop, always_call=True))
    if unit.is_root:  # stays in front of the user's hooks (the forward over for them)
        end = eager(lambda m, args, output: engine._end_root_forward(output))
        handles.append(module.register_forward_hook(end))
    post = eager(lambda m, args, output: engine._post_forward(unit, output))
    last = [module.register_forward_hook(post)]
    if unit.is_root:  # runs after ``post``, and also when the forward raised
        raised = eager(lambda m, a, o: engine._forward_raised())
        last.append(module.register_forward_hook(raised, always_call=True))
    leave = eager(lambda m, a, o: engine._leave(unit))  # last, and also when it raised
    last.append(module.register_forward_hook(leave, always_call=True))
    handles += last
    # A submodule holding the unit's parameters called on its own (T5's encoder in generate(),
    # an embedding applied outside the forward) is a use of the unit: gathered for it, and the
    # unit's backward ends only once the call's gradient is in (else reduced too early).
    if unit.owners:
        unit.lending = Lending(engine, unit)
        handles.append(unit.lending)
    return handles


class Lending:
    """The hooks on ``unit.owners`` that make a call of one of them a use of the unit (a lend).
    Attached while the unit is outside its own calls (``detach`` as one starts, ``attach``
    once the last ends), the only time a lend can happen: inside, they would do nothing, and
    as eager hooks they were graph breaks around every layer of a compiled block (a graph per
    layer, nothing fused); without them torch.compile traces the block's body whole. Detached,
    they are removed from the modules, not skipped, so that Dynamo neither traces nor guards on
    them (hooks kept and skipped inside made it guard on each one's id: a recompile per unit).
    The root's stay attached (``Engine._pre_forward``): its own code compiles eagerly in most
    models anyway (a loop over blocks), and a Ctrl-C in a forward leaves them in place."""

    def __init__(self, engine: Engine, unit: Unit) -> None:
        self._hooks = [_LendHooks(engine, unit, owner) for owner in unit.owners]
        self.attached = False
        self.attach()

    def attach(self) -> None:
        if not self.attached:
            for hooks in self._hooks:
                hooks.register()
            self.attached = True

    def detach(self) -> None:
        # (Each owner's hooks register and remove once whatever the calls before: a Ctrl-C
        # partway through either loop leaves no hook twice, and the next call completes it.)
        if self.attached or any(h.any_registered for h in self._hooks):
            self.attached = False
            for hooks in self._hooks:
                hooks.remove()

    remove = detach  # (with the engine's other handles)


class _LendHooks:
    """One owner's lend hooks, made once, registered at each ``attach``."""

    def __init__(self, engine: Engine, unit: Unit, owner: nn.Module) -> None:
        self.owner, self.last = owner, []  # the forward hooks' handles (``keep_last``'s)
        self.pre_handle: Any = None

        def lend(m: nn.Module, args: tuple, kwargs: dict) -> Any:
            keep_last(m, self.last)
            return engine._pre_lend(unit, m, args, kwargs)

        def raised(m: nn.Module, args: tuple, output: Any) -> None:
            if unit.lender is m:  # still lent: give_back did not run, the owner's call raised
                engine._call_raised(unit, keep=unit.lent_gathered)

        self.lend, self.raised = eager(lend), eager(raised)
        self.give_back = eager(lambda m, args, output: engine._post_lend(unit, m, output))

    @property
    def any_registered(self) -> bool:
        return self.pre_handle is not None or bool(self.last)

    def register(self) -> None:
        """Each hook once: what a call cut short (a Ctrl-C) left out is added."""
        owner = self.owner
        if not self.last:  # after ``give_back``, and also when the owner's call raised
            self.last[:] = [
                owner.register_forward_hook(self.give_back),
                owner.register_forward_hook(self.raised, always_call=True),
            ]
        if self.pre_handle is None:  # first, as the unit's own gather: a pre-hook registered
            # before shard() (prune's) reads the weights, the placeholders (NaN) at stage 3
            self.pre_handle = owner.register_forward_pre_hook(
                self.lend, with_kwargs=True, prepend=True
            )

    def remove(self) -> None:
        for handle in self.last:
            handle.remove()
        self.last.clear()
        if self.pre_handle is not None:
            self.pre_handle.remove()
            self.pre_handle = None


def ran_before(unit: Unit) -> tuple[int, ...]:
    """The ids of the forward pre-hooks of ``unit``'s module that run ahead of the engine's
    (prepended after ``shard()``): the inputs the engine's hook gets are theirs, so a
    recomputation from those inputs skips them (they would apply twice)."""
    ids = []
    for hook_id in unit.module._forward_pre_hooks:
        if hook_id == unit.pre_hook_id:
            break
        ids.append(hook_id)
    return tuple(ids)


def keep_last(module: nn.Module, handles: list[Any]) -> None:
    """Move the engine's forward hooks ``handles`` (the reshard, in order) behind the module's
    other forward hooks, before each call: a user's hook registered after ``shard()`` (one
    reading the unit's weights, for a norm or a penalty) runs while they are gathered, not on
    the placeholders (NaN) that the reshard leaves."""
    hooks = module._forward_hooks
    if hooks and next(reversed(hooks)) != handles[-1].id:
        for handle in handles:
            if handle.id in hooks:
                hooks.move_to_end(handle.id)


def eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as a module hook that torch.compile runs eagerly, never traces: the engine's
    hooks swap storages and parameter data. Disabled as a whole, at registration: a wrapper
    that graph-breaks only while compiling (FSDP2's way) made torch.compile of the whole model
    recompile its resume function per hook signature until dynamo's limit (8), losing the
    compiled graph. (This imports dynamo, which torch's optimizers import anyway.)"""
    return torch._dynamo.disable(hook, recursive=True)
