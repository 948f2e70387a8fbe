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
from torch.utils._pytree import (
    SUPPORTED_NODES,
    is_namedtuple_instance,
    tree_flatten,
    tree_unflatten,
)


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
        elif _is_container_subclass(leaf):
            out += tensors_in(_items(leaf))
    return out


def _is_container_subclass(x: Any, kinds: tuple[type, ...] = (dict, list)) -> bool:
    """A dict or list (or ``kinds``) of a class of the user's own (``class Out(dict)``, an
    EasyDict), which pytree leaves whole."""
    return isinstance(x, kinds) and type(x) not in (dict, list, tuple) and not _in_pytree(x)


def _in_pytree(x: Any) -> bool:
    return type(x) in SUPPORTED_NODES or is_namedtuple_instance(x)


def _items(x: dict | list | tuple) -> list[Any]:
    return list(x.values()) if isinstance(x, dict) else list(x)


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
            elif _is_container_subclass(leaf, (dict, list, tuple)):  # (hooked, not rebuilt)
                seen.add(id(leaf))
                pending.append((_items(leaf), depth))
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


def map_tensors(
    fn: Callable[[torch.Tensor], torch.Tensor], tree: Any, edits: list | None = None
) -> Any:
    """``tree`` with each tensor ``x`` replaced by ``fn(x)``. Containers (and dataclasses,
    shallow-copied) are rebuilt only where ``fn`` changed something below them. With ``edits``
    (a unit's inputs), lists, dicts and dataclass instances are changed in place instead, each
    change recorded there for ``undo``: a list or dict that the caller passes down for the unit
    to append to (aux losses, a cache) stays the caller's object, and what the unit adds to it
    reaches the caller (a copy, made once it held a tensor needing grad, lost the appends)."""
    if torch.is_tensor(tree):
        return fn(tree)
    if isinstance(tree, (list, dict)) and (edits is not None or _is_container_subclass(tree)):
        mapped = _map_items(fn, tree, edits)
        if mapped is not None:
            return mapped
        if not _in_pytree(tree):
            return tree  # neither written nor copied: left as it is
    if edits is not None and _is_dataclass_instance(tree):
        for f in dataclasses.fields(tree):
            old = getattr(tree, f.name)
            new = map_tensors(fn, old, edits)
            if new is not old:
                object.__setattr__(tree, f.name, new)  # frozen dataclasses too
                edits.append((tree, f.name, old, new))
        return tree
    if type(tree) in (list, tuple):
        mapped = [map_tensors(fn, x, edits) for x in tree]
        if all(a is b for a, b in zip(mapped, tree)):
            return tree
        return type(tree)(mapped)
    if type(tree) is dict:
        mapped_items = {k: map_tensors(fn, v) for k, v in tree.items()}
        if all(mapped_items[k] is v for k, v in tree.items()):
            return tree
        return mapped_items
    leaves, spec = tree_flatten(tree)  # namedtuples, ModelOutput, ...: rebuilt whole

    def leaf(x: Any) -> Any:
        if torch.is_tensor(x):
            return fn(x)
        if _is_dataclass_instance(x):
            return _map_dataclass(fn, x) if edits is None else map_tensors(fn, x, edits)
        if _is_container_subclass(x):  # of the user's class (pytree left it whole)
            return map_tensors(fn, x, edits)
        return x

    new = [leaf(x) for x in leaves]
    if all(a is b for a, b in zip(new, leaves)):
        return tree
    return tree_unflatten(new, spec)


def _map_items(
    fn: Callable[[torch.Tensor], torch.Tensor], tree: Any, edits: list | None
) -> Any | None:
    """A list or dict's items mapped: in place when ``edits`` is given (each change recorded),
    else, or when its class refuses or converts what it is given (torch.fx's immutable_list, an
    EasyDict), in a shallow copy; None when that fails too (nothing is changed)."""
    keys = list(range(len(tree)) if isinstance(tree, list) else tree)
    changed = {}
    for key in keys:
        new = map_tensors(fn, tree[key], edits)
        if new is not tree[key]:
            changed[key] = new
    if not changed:
        return tree
    if edits is not None:
        done = []
        for key, new in changed.items():
            old = tree[key]
            done.append((key, old, new))
            if not _set(tree, key, new):
                base = dict if isinstance(tree, dict) else list  # (its own setter converts)
                for k, o, _ in reversed(done):  # back as it was: copied below instead
                    base.__setitem__(tree, k, o)
                break
        else:
            edits += [(tree, key, old, new) for key, old, new in done]
            return tree
    try:
        copied = copy.copy(tree)
    except Exception:
        return None
    if all(_set(copied, key, new) for key, new in changed.items()):
        return copied
    return None


def _set(container: Any, key: Any, value: Any) -> bool:
    """``container[key] = value``; whether it holds ``value`` itself afterwards."""
    try:
        container[key] = value
        return container[key] is value
    except Exception:
        return False


def undo(edits: list) -> None:
    """Put back what ``map_tensors(..., edits)`` replaced, where the replacement is still there
    (a list entry found by identity: the unit may have inserted before it)."""
    for container, key, old, new in reversed(edits):
        if isinstance(container, list):
            at = key if key < len(container) and container[key] is new else None
            if at is None:  # the unit inserted before it: found by identity
                at = next((i for i, x in enumerate(container) if x is new), None)
            if at is not None:
                container[at] = old
        elif isinstance(container, dict):
            if key in container and container[key] is new:
                container[key] = old
        elif getattr(container, key, None) is new:
            object.__setattr__(container, key, old)
    edits.clear()


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


def cast_floats(tree: Any, dtype: torch.dtype, edits: list | None = None) -> Any:
    """Cast the floating-point tensors in ``tree`` to ``dtype``; other leaves pass through
    (``edits``: as ``map_tensors``')."""
    return map_tensors(
        lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x, tree, edits
    )
