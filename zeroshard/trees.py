"""The tensors in what a unit takes and returns: nested tuples, lists, dicts and whatever
``torch.utils._pytree`` knows (namedtuples, Hugging Face ``ModelOutput``), and also plain
``@dataclass`` instances, which pytree leaves whole (a unit returning ``Out(h=...)``: its
tensors would get no backward hook and no cast). FSDP2 looks into dataclasses too.

A unit's outputs are searched further, for its backward hook only (``tensors_reached``): the
attributes of plain objects (``types.SimpleNamespace(logits=...)``, a class of the user's own, a
``torch.distributions.Normal``), which pytree leaves whole too. Missed, the unit's backward was
never seen: its gradients went to ``.grad`` and the step failed on "set by hand".
"""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree``, depth first, in a fixed order (the same tree gives the same
    list on every rank)."""
    out: list[torch.Tensor] = []
    for leaf in tree_flatten(tree)[0]:
        if torch.is_tensor(leaf):
            out.append(leaf)
        elif _is_dataclass_instance(leaf):
            for f in dataclasses.fields(leaf):
                out += tensors_in(getattr(leaf, f.name))
    return out


def tensors_reached(tree: Any) -> list[torch.Tensor]:
    """``tensors_in(tree)`` and the tensors held by attributes of the plain objects in it
    (objects with a ``__dict__``; not modules, classes or functions), each object once."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    # A loop, not a recursive closure: that is a reference cycle, which kept the outputs (and
    # a discarded forward's graph, its gathered parameters) alive until the garbage collector.
    # Plain objects deeper than MAX_OBJECT_DEPTH are not searched: an output holding a config,
    # a tokenizer or a dataset would have its whole object graph walked at every forward.
    pending = [(tree, 0)]
    while pending:
        node, depth = pending.pop()
        for leaf in tree_flatten(node)[0]:
            if torch.is_tensor(leaf):
                out.append(leaf)
            elif id(leaf) in seen:
                continue
            elif _is_dataclass_instance(leaf):  # as tensors_in, at any depth
                seen.add(id(leaf))
                pending.append(([getattr(leaf, f.name) for f in dataclasses.fields(leaf)], depth))
            elif _is_plain_object(leaf) and depth < MAX_OBJECT_DEPTH:
                seen.add(id(leaf))
                pending.append((list(vars(leaf).values()), depth + 1))
    return out


MAX_OBJECT_DEPTH = 3
"""Plain objects searched inside one another (a namespace holding a distribution: 2)."""


def _is_plain_object(x: Any) -> bool:
    return hasattr(x, "__dict__") and not isinstance(
        x, type | torch.nn.Module | types.FunctionType | types.MethodType | types.ModuleType
    )


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with each tensor ``x`` replaced by ``fn(x)``. Containers (and dataclasses,
    shallow-copied) are rebuilt only where ``fn`` changed something below them: a list or dict
    the caller passes down beside a tensor, for a unit to append to (aux losses, a cache), stays
    the caller's when its own contents are unchanged."""
    if torch.is_tensor(tree):
        return fn(tree)
    if type(tree) in (list, tuple):
        mapped = [map_tensors(fn, x) for x in tree]
        if all(a is b for a, b in zip(mapped, tree)):
            return tree
        return type(tree)(mapped)
    if type(tree) is dict:
        mapped_items = {k: map_tensors(fn, v) for k, v in tree.items()}
        if all(mapped_items[k] is v for k, v in tree.items()):
            return tree
        return mapped_items
    leaves, spec = tree_flatten(tree)  # namedtuples, ModelOutput, ...: rebuilt whole
    new = [
        fn(x) if torch.is_tensor(x) else _map_dataclass(fn, x) if _is_dataclass_instance(x) else x
        for x in leaves
    ]
    if all(a is b for a, b in zip(new, leaves)):
        return tree
    return tree_unflatten(new, spec)


def _map_dataclass(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    changed = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        mapped = map_tensors(fn, value)
        if mapped is not value:
            changed[f.name] = mapped
    if not changed:
        return obj
    new = copy.copy(obj)  # not dataclasses.replace: fields with init=False keep their values
    for name, value in changed.items():
        object.__setattr__(new, name, value)  # frozen dataclasses too
    return new


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors in ``tree`` to ``dtype``; other leaves pass through.
    ``tree`` itself when nothing needs a cast: its containers are rebuilt only then (a list
    that the caller passes down for a unit to append to, aux losses, stays the caller's)."""
    return map_tensors(
        lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x, tree
    )
