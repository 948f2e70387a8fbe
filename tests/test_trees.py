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


class _Converting(dict):
    """Stores what it is given converted (an EasyDict turns dicts into its own class)."""

    def __setitem__(self, key, value):
        super().__setitem__(key, [value] if torch.is_tensor(value) else value)


def test_inputs_are_edited_in_place_and_put_back():
    """A unit's inputs (``edits``): the caller's list, dict and dataclass themselves, their
    tensors replaced while it runs and put back after; what the unit added stays."""
    from zeroshard.trees import undo

    x, y, z = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    aux, cache, out = [x], {"k": y, "n": 3}, Out(h=z, extra=[])
    edits: list = []
    tree = ((aux, cache), {"out": out})
    mapped = map_tensors(lambda t: t * 10, tree, edits)
    assert mapped[0][0] is aux and mapped[0][1] is cache and mapped[1]["out"] is out
    assert aux[0].item() == 10 and cache["k"].item() == 0 and out.h.item() == 20
    aux.insert(0, y)  # what a unit does with them
    cache["new"] = z
    undo(edits)
    assert aux == [y, x] and aux[1] is x and cache["k"] is y and cache["new"] is z
    assert out.h is z and edits == []


def test_containers_of_other_classes_are_searched_and_never_broken():
    """A dict or list of the user's own class (pytree leaves it whole) is searched and mapped;
    one that refuses writes (torch.fx's immutable_list: rebuilt by pytree) or converts them
    (left as it is) is never half-edited."""
    from torch.fx.immutable_collections import immutable_list

    class Out2(dict):
        pass

    x = torch.ones(1)
    assert tensors_in((Out2(h=x),)) == [x]
    for in_place in (False, True):
        doubled = map_tensors(lambda t: t * 2, Out2(h=x), [] if in_place else None)
        assert type(doubled) is Out2 and doubled["h"].item() == 2
        frozen, edits = immutable_list([x]), [] if in_place else None
        mapped = map_tensors(lambda t: t * 2, frozen, edits)
        assert frozen[0] is x and mapped[0].item() == 2 and type(mapped) is immutable_list
        converting, edits = _Converting(h=x), [] if in_place else None
        assert map_tensors(lambda t: t * 2, converting, edits) is converting
        assert dict.__getitem__(converting, "h") is x and not edits
