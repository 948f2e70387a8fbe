"""Where the engine meets autograd: knowing when backward reaches a unit's outputs (its backward
begins: gather again) and its inputs (its backward for that use is done: reduce, free), and
whether a forward runs inside a backward (a recomputation, not a new use).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from zeroshard.trees import map_tensors, tensors_in, tensors_reached


class BackwardHook(torch.autograd.Function):
    """Identity whose backward calls ``hook``: on a unit's inputs, it fires once the unit's
    backward for that use is done (reduce, free). (Its outputs are views: an in-place op on a
    unit's input inside the unit's own forward is refused by autograd.)"""

    @staticmethod
    def forward(ctx, hook, *tensors):  # type: ignore[override]
        ctx.hook = hook
        return tensors

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.hook()
        return (None, *grads)

    @staticmethod
    def jvp(ctx, _hook_tangent, *tangents):  # type: ignore[override]
        # Forward-mode AD (dual tensors) through a unit: the identity's tangents pass through
        # (without it torch refused every dual forward of a sharded model with grad enabled).
        return tuple(t if t is None else t.view_as(t) for t in tangents)  # (views, as forward's)


def weakly(method: Callable[..., Any], *args: Any, gone: str | None = None) -> Callable[..., Any]:
    """``method(*args, *more)`` (a bound method; ``more``: what the hook is called with) as a
    hook that keeps neither its object nor ``args`` alive (plain values such as ints are held
    as they are): a graph or a parameter outliving its model (the last ``loss`` kept by the
    caller) must not keep the model's memory and swap files. Once one is gone it does
    nothing, or raises ``RuntimeError(gone)`` when given (what is gone was needed)."""
    owner, func = weakref.ref(method.__self__), method.__func__
    refs = [_ref(a) for a in args]

    def call(*more: Any) -> Any:
        live = [owner(), *(r() for r in refs)]
        if all(x is not None for x in live):
            return func(*live, *more)
        if gone is not None:
            raise RuntimeError(gone)
        return None

    return call


def _ref(value: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(value)
    except TypeError:  # not weakly referenceable (an int): it keeps nothing alive anyway
        return lambda: value


def when_backward_reaches(hook: Callable[[bool], None], tree: Any) -> None:
    """Call ``hook(graph)`` when backward first reaches one of ``tree``'s tensors that require
    grad: on a unit's outputs, as the unit's backward begins (gather again). A hook, not a
    wrapping Function, so the outputs stay what the unit returned (in-place ops on them are
    fine). ``graph``: whether the hooked tensors have a graph of their own.

    Outputs with a graph are hooked, and their hook dies with it. Leaves (a parameter returned
    as it is: a CLIP model's temperature beside its features) are hooked only when there is
    nothing else, once: a hook on a leaf outlives the graph, so each forward added one for good,
    and beside a graph's outputs it fired in the next step's backward as if that graph were
    used again (a false "stale graph" error)."""
    tensors = [x for x in tensors_reached(tree) if x.requires_grad]
    with_graph = [x for x in tensors if x.grad_fn is not None]
    if with_graph:
        torch.autograd.graph.register_multi_grad_hook(with_graph, lambda _: hook(True), mode="any")
    elif tensors:
        handle = None

        def once(_: Any) -> None:
            handle.remove()
            hook(False)

        handle = torch.autograd.graph.register_multi_grad_hook(tensors, once, mode="any")


def on_backward(hook, tree: Any, edits: list | None = None) -> tuple[Any, bool]:
    """``tree`` with its tensors that require grad passed through one ``BackwardHook(hook)``,
    and whether there was any (if not, ``hook`` will never fire); ``edits``: as
    ``trees.map_tensors``'."""
    hooked = {id(x): x for x in tensors_in(tree) if x.requires_grad}  # each tensor once
    if not hooked:
        return tree, False
    outs = dict(zip(hooked, BackwardHook.apply(hook, *hooked.values())))
    return map_tensors(lambda x: outs.get(id(x), x), tree, edits), True


def in_backward() -> bool:
    """Whether autograd is executing a backward on this thread: a forward then is a
    recomputation (activation checkpointing), not a new use."""
    return torch._C._current_graph_task_id() != -1


def stale_graph(unit: str) -> RuntimeError:
    """The error for a backward through a unit's forward made before an optimizer step (or a
    ``load_state_dict``) changed its parameters (``backward(retain_graph=True)``, ``step()``,
    then a backward again)."""
    return RuntimeError(
        f"backward through a forward of unit {unit or '<root>'} made before an optimizer step "
        "or a load changed its parameters (backward(retain_graph=True), step(), then backward "
        "again; or load_state_dict between the forward and its backward): its gradients would "
        "mix old activations with new weights, and torch raises here too (modified by an "
        "inplace operation); run the forward again after the step or load"
    )


def warn_graph_of_backward(partitioned: bool) -> None:
    """Warn when the backward running builds a graph of itself (``create_graph=True``: a
    gradient penalty, double backward) and the parameters are ``partitioned``. Autograd then
    runs with grad enabled; a later backward through that graph would need the gathered
    parameters that partitioned units free once their backward is done, and fails deep inside
    autograd (FSDP2 alike). A warning, not an error: without that later backward (gradients
    accumulated out of place) it trains correctly."""
    if partitioned and torch.is_grad_enabled():
        warnings.warn(
            "backward with create_graph=True of a model whose parameters are partitioned "
            "(stage 3): a backward through the graph it builds (higher-order gradients) would "
            "use parameters freed after each unit's backward and fail ('setStorage ... out of "
            "bounds'); run such a step inside zeroshard.summon_full_params(model), or shard at "
            "stage 0-2",
            stacklevel=2,
        )
