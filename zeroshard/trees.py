"""The tensors in what a unit takes and returns: nested tuples, lists, dicts and whatever
``torch.utils._pytree`` knows (namedtuples, Hugging Face ``ModelOutput``), and also plain
``@dataclass`` instances, which pytree leaves whole (a unit returning ``Out(h=...)``: its
tensors would get no backward hook and no cast). FSDP2 looks into dataclasses too.
"""

from __future__ import annotations

import copy
import dataclasses
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


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with each tensor ``x`` replaced by ``fn(x)``. Containers (and dataclasses,
    shallow-copied) are rebuilt only where ``fn`` changed something: ``tree`` itself when
    nothing changed (a list the caller passes down for a unit to append to stays the caller's)."""
    leaves, spec = tree_flatten(tree)
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
