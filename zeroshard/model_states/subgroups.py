"""The sharded optimizer's sub-groups: this rank's part of each trainable FlatParam's master,
cut into one piece per parameter, stepped by a torch optimizer of the user's class of its own.
A sub-group is the unit of the optimizer step (bounded in size, fused where torch has it) and of
its swapping (``state_swap``: sub-group i + 1 read while i steps). ``States`` shows their states
as one mapping, as ``torch.optim.Optimizer.state`` is to tools that walk it."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.model_states.flat_param import FlatParam
from zeroshard.model_states.grads import GradBucket
from zeroshard.model_states.param_swap import ParamSwapper

__all__ = ["Piece", "States", "SubGroup", "build_subgroups"]


@dataclass
class Piece:
    """A contiguous slice of one FlatParam's master and shard gradient given to the optimizer."""

    span: slice
    tensor: torch.Tensor  # 1D view of flat.master[span], this rank only
    slot: int = 0  # the parameter's index among the engine's trainable slots


@dataclass
class SubGroup:
    """One trainable FlatParam's pieces and the torch optimizer that steps them."""

    bucket: GradBucket
    groups: list[int]  # index into the user's param groups, per torch param group below
    pieces: list[list[Piece]]  # per torch param group
    optimizer: torch.optim.Optimizer


class States(Mapping):
    """The sub-groups' optimizer states as one read-only mapping (piece tensor -> its state):
    what ``torch.optim.Optimizer.state`` is to tools that walk it (memory trackers). Read
    through the sub-optimizers each time: torch's ``load_state_dict`` replaces their dicts."""

    def __init__(self, subgroups: list[SubGroup]) -> None:
        self._subgroups = subgroups

    @property
    def _maps(self) -> list[dict]:
        return [sg.optimizer.state for sg in self._subgroups]

    def __getitem__(self, key: Any) -> Any:
        for m in self._maps:
            if key in m:  # never m[key]: torch's states are defaultdicts
                return m[key]
        if isinstance(key, torch.Tensor):
            raise KeyError(
                "opt.state is keyed by this rank's 1D pieces of the sharded parameters, not by "
                "the model's parameters: zeroshard.optimizer_state_dict(opt) gives each "
                "parameter's states by name (FSDP2's format; a collective)"
            )
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        for m in self._maps:
            yield from m

    def __delitem__(self, key: Any) -> None:
        """Forget one piece's states: its next step starts them afresh, as torch's would."""
        for m in self._maps:
            if key in m:
                m.get(key)  # an offloaded sub-group's states come back to memory first
                dict.__delitem__(m, key)
                return
        self[key]  # the KeyError that says what the keys are

    def clear(self) -> None:
        """Forget every state (torch's ``opt.state.clear()``, or ``opt.state =
        defaultdict(dict)`` to reset Adam's moments): the next step starts them afresh. A new
        dict per sub-optimizer, as torch's ``load_state_dict`` gives (the swapper adopts it)."""
        for sg in self._subgroups:
            sg.optimizer.state = defaultdict(dict)

    def __len__(self) -> int:
        return sum(len(m) for m in self._maps)


def build_subgroups(
    buckets: list[GradBucket],
    user_groups: list[dict[str, Any]],
    optimizer_cls: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
    param_swap: ParamSwapper | None = None,
) -> list[SubGroup]:
    """One torch optimizer per trainable FlatParam over the pieces of each user group in it
    (one piece per parameter: this rank's part of it). Offloaded masters (``param_swap``) are
    read in one at a time while their views are cut."""
    where: dict[int, tuple[GradBucket, slice, int]] = {}
    index = 0  # slots in the order of Engine.slots_touched
    for b in buckets:
        for slot, span in b.flat.pieces():
            where[id(slot.param)] = (b, span, index)
            index += 1
    spans: dict[GradBucket, list[tuple[int, slice, int]]] = {b: [] for b in buckets}
    for gi, group in enumerate(user_groups):
        for p in group["params"]:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param groups hold tensors, got {type(p).__name__}")
            if not p.requires_grad or p.numel() == 0 and id(p) not in where:
                continue  # nothing to update (zero-element parameters stay unsharded)
            if id(p) not in where:
                raise ValueError(
                    "a parameter given to the optimizer is not part of the sharded model: one "
                    "of another model, or one the model got after shard() (e.g. a new embedding "
                    "from resize_token_embeddings: change the model before sharding it); pass "
                    "model.parameters() (or groups of them) of the model given to shard()"
                )
            b, span, slot_index = where[id(p)]
            if span.start < span.stop:
                spans[b].append((gi, span, slot_index))
    out = []
    for b in buckets:
        flat: FlatParam = b.flat
        master = flat.master_view  # views of it stay valid while it is offloaded (param_swap)
        assert master is not None
        by_group: dict[int, list[Piece]] = {}
        for gi, span, slot_index in sorted(spans[b], key=lambda x: (x[0], x[1].start)):
            # One piece per parameter: a parameter no rank's backward reached is left out of
            # the step, exactly as torch leaves out a parameter whose .grad is None.
            by_group.setdefault(gi, []).append(Piece(span, torch.empty(0), slot_index))
        if not by_group:
            continue
        with param_swap.resident(flat) if param_swap is not None else contextlib.nullcontext():
            for pieces in by_group.values():
                for piece in pieces:
                    piece.tensor = master[piece.span]
        groups = sorted(by_group)
        torch_groups = [
            dict(
                {k: v for k, v in user_groups[gi].items() if k != "params"},
                params=[p.tensor for p in by_group[gi]],
            )
            for gi in groups
        ]
        opt = optimizer_cls(torch_groups, **defaults)
        out.append(SubGroup(b, groups, [by_group[gi] for gi in groups], opt))
    return out
