"""``zeroshard.trees``: tensors found and replaced in what units take and return."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch

from zeroshard.trees import map_tensors, tensors_in

Pair = namedtuple("Pair", "a b")


@dataclass
class Out:
    h: torch.Tensor
    extra: list


def test_containers_are_rebuilt_only_above_a_changed_tensor():
    """A list or dict passed beside a tensor, for a unit to append to, stays the caller's (all
    were rebuilt once any tensor changed, and the unit's appends were lost)."""
    x, y = torch.ones(2), torch.zeros(2)
    sink, cache = [], {"n": 0}
    tree = ((x, sink, cache), {"k": [y], "pair": Pair(x, 3)})
    mapped = map_tensors(lambda t: t + 1 if t is x else t, tree)
    args, kwargs = mapped
    assert args[1] is sink and args[2] is cache
    assert kwargs["k"] is tree[1]["k"]  # nothing below it changed
    assert torch.equal(args[0], x + 1) and torch.equal(kwargs["pair"].a, x + 1)
    assert isinstance(kwargs["pair"], Pair) and kwargs["pair"].b == 3
    assert map_tensors(lambda t: t, tree) is tree


def test_dataclasses_are_searched_and_copied_when_changed():
    out = Out(h=torch.ones(1), extra=[torch.zeros(1)])
    assert [t.sum().item() for t in tensors_in(out)] == [1.0, 0.0]
    doubled = map_tensors(lambda t: t * 2, out)
    assert doubled is not out and torch.equal(doubled.h, torch.full((1,), 2.0))
    assert torch.equal(out.h, torch.ones(1))  # the original is left alone


def test_tensors_reached_looks_into_plain_objects_once_and_not_too_deep():
    import types

    from zeroshard.trees import MAX_OBJECT_DEPTH, tensors_reached

    loc, scale, deep = torch.zeros(2), torch.ones(2), torch.full((1,), 7.0)
    out = types.SimpleNamespace(policy=torch.distributions.Normal(loc, scale), logits=loc)
    out.me = out  # a cycle: searched once
    assert {id(t) for t in tensors_reached(out)} == {id(loc), id(scale)}
    assert tensors_in(out) == []  # pytree leaves such an object whole
    nest = deep
    for _ in range(MAX_OBJECT_DEPTH + 1):
        nest = types.SimpleNamespace(inner=nest)
    assert tensors_reached(nest) == []  # deeper than the limit: a config, a dataset, ...
    assert tensors_reached(nest.inner) == [deep]
