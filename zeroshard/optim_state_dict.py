"""Optimizer state dicts of sharded optimizers, in the format FSDP2's optimizer gives.

``optimizer_state_dict(opt)`` / ``load_optimizer_state_dict(opt, sd)`` (what
``ShardedOptimizer.state_dict`` / ``load_state_dict`` call) use the format of
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` for an FSDP2 model:

    {"state": {fqn: {"step": tensor(3.),             # plain scalars as the optimizer holds them
                     "exp_avg": DTensor Shard(0),     # per-element states, like the parameter
                     "exp_avg_sq": DTensor Shard(0)}},
     "param_groups": [{"lr": ..., "betas": ..., ..., "params": [fqn, ...]}]}

A tied parameter's state is keyed by its first name in ``model.named_parameters()``. The loss
scaler is not part of it: ``opt.loss_scaler.state_dict()`` is saved apart. As in torch, a
parameter no optimizer step has reached holds no state and is left out. Before the first step
every parameter is first given states as torch's ``get_optimizer_state_dict`` does (a
zero-gradient step at learning rate 0: zeros), so that a fresh optimizer's dict is a complete
template for ``dcp.load``. Unlike torch's, those states are dropped again once the dict is made,
and their ``step`` reads 0, not 1: asking for the dict does not change training, and loading it
back leaves those parameters without state (either way a unit no backward has reached yet would
otherwise count its first real step as Adam's second).

``optimizer_state_dict(opt, local=True)`` gives each element-wise state as a ``FlatRange`` (this
rank's own state tensor, no collective) instead: what ``zeroshard.checkpoint`` saves and loads
into, in place.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from zeroshard.checkpoint_files import gather
from zeroshard.flat_range import FlatRange
from zeroshard.model_states.flat_param import FlatParam, Slot
from zeroshard.optim_state_checks import match_groups, warn_dropped
from zeroshard.state_dict_gather import (
    Wholes,
    batch_cap,
    flat_sources,
    holds_its_row_chunk,
    not_row_chunk,
)
from zeroshard.state_dict_layout import (
    all_names,
    as_sharded,
    device_mesh,
    first_names,
    refuse_split_pieces,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from zeroshard.model_states.grads import GradBucket
    from zeroshard.model_states.optimizer import ShardedOptimizer
    from zeroshard.model_states.subgroups import Piece, SubGroup

__all__ = [
    "called_by_torch",
    "keyed_by_position",
    "load_optimizer_state_dict",
    "local_state_entries",
    "optimizer_state_dict",
]

_TORCH_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def called_by_torch(function: str, *, depth: int = 4) -> bool:
    """Whether ``torch.distributed.checkpoint.state_dict``'s ``function`` is among the few
    callers above this method (torch wraps an optimizer's ``step`` once or twice): its
    ``get_state_dict`` / ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``, FSDP2's
    recipe, used on a zeroshard optimizer."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if (
            frame.f_code.co_name == function
            and frame.f_globals.get("__name__") == _TORCH_STATE_DICT
        ):
            return True
        frame = frame.f_back
    return False


def keyed_by_position(opt: ShardedOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (keyed by parameter name) keyed by each parameter's position in
    ``opt.param_groups``, as a torch optimizer's: what ``get_optimizer_state_dict`` expects
    from ``optimizer.state_dict()`` before it keys it by name again (it took the names for
    positions: the states came out keyed by integers, and no template could load them)."""
    first = first_names(opt.engine.model)
    params = [p for g in opt.param_groups for p in g["params"]]
    position = {first[id(p)]: i for i, p in enumerate(params)}
    groups = [
        dict(g, params=[position[n] for n in g["params"]]) for g in state_dict["param_groups"]
    ]
    for g in groups:
        g.pop("param_names", None)  # (torch's own come from the optimizer, if at all)
    state = {position[n]: st for n, st in state_dict["state"].items()}
    return {**state_dict, "state": state, "param_groups": groups}


_IMPL_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Param-group keys that say how this process computes a step, not where training is: kept from
the running optimizer when a state dict is loaded (the rest of a saved group is taken)."""


def _init_states(opt: ShardedOptimizer) -> list[torch.optim.Optimizer]:
    """Give every sub-optimizer without state one, as torch's ``_init_optim_state`` does for
    ``get_optimizer_state_dict``: a step with zero gradients at learning rate 0, after which
    the learning rates are restored. States then exist (zeros; ``step`` counts 1), so the state
    dict is a complete template, e.g. for ``dcp.load`` before training. Returns the
    sub-optimizers given one (``optimizer_state_dict`` takes it back from them)."""
    swap = opt.engine.param_swap  # offloaded masters: each in memory while its step runs
    fresh = []
    for sg in opt._subgroups:
        o = sg.optimizer
        if o.state:
            continue
        resident = swap.resident(sg.bucket.flat) if swap is not None else contextlib.nullcontext()
        with resident:
            _init_subgroup(o)
        fresh.append(o)
    return fresh


def _init_subgroup(o: torch.optim.Optimizer) -> None:
    """``_init_states`` of one sub-optimizer: a step on zero gradients at learning rate 0 and
    without weight decay (SGD's momentum buffer took ``weight_decay * p`` from it, and a
    template loaded back, with no ``step`` to tell it from a trained state, moved the next
    steps); the settings are put back after."""
    kept = [{k: g[k] for k in ("lr", "weight_decay") if k in g} for g in o.param_groups]
    for group, settings in zip(o.param_groups, kept):
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
        for k, v in settings.items():
            group[k] = torch.zeros_like(v) if torch.is_tensor(v) else 0.0
    o.step()
    for group, settings in zip(o.param_groups, kept):
        group.update(settings)
        for p in group["params"]:
            p.grad = None


def _subgroup_of(opt: ShardedOptimizer) -> dict[int, SubGroup]:
    """This rank's sub-group of each bucket (by ``id``); a rank holding none of a bucket's
    trainable elements has none."""
    return {id(sg.bucket): sg for sg in opt._subgroups}


def _is_elementwise_state(value: Any, piece: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.ndim >= 1 and value.shape == piece.shape


def _stepped(opt: ShardedOptimizer, first: dict[int, str]) -> dict[str, dict[str, Any]]:
    """The (first) names of the parameters whose piece on this rank holds optimizer state (the
    ones an optimizer step reached), each with its own values of the states that are not
    element-wise (``step``: a head switched on late has stepped fewer times than its unit's
    other parameters). A parameter no backward has reached yet has none, as in torch, and a
    state dict leaves it out (``optimizer_state_dict``), so that a resumed run gives its first
    real step Adam's first bias correction."""
    out: dict[str, dict[str, Any]] = {}
    for sg in opt._subgroups:
        flat = sg.bucket.flat
        for s, piece in zip(flat.slots, _slot_pieces(flat, sg)):
            st = sg.optimizer.state.get(piece.tensor) if piece is not None else None
            if st:
                out[first[id(s.param)]] = {
                    k: _host_copy(v)
                    for k, v in st.items()
                    if not _is_elementwise_state(v, piece.tensor)
                }
    return out


def _slot_pieces(flat: FlatParam, sg: SubGroup | None) -> list[Piece | None]:
    """This rank's piece of each slot of ``flat`` (by index; one piece per parameter), or None
    where it holds none of it."""
    by_start = {p.span.start: p for p in _pieces(sg)}
    out: list[Piece | None] = []
    for i, (_, span) in enumerate(flat.pieces()):
        start, stop = flat.piece_range(i)
        out.append(by_start.get(span.start) if stop > start else None)
    return out


def _host_copy(v: Any) -> Any:
    return v.detach().cpu().clone() if torch.is_tensor(v) else v


def _state_layout(
    opt: ShardedOptimizer, stepped: dict[str, dict[str, Any]] | None = None
) -> tuple[list[dict[int, dict[str, Any]]], dict[str, dict[str, Any]]]:
    """Per bucket (engine order) and user group: each state key, either ``("elementwise",
    dtype)`` (a tensor shaped like the piece) or ``("value", v)`` (anything else, e.g. a 0-dim
    ``step``), as the first rank holding a piece with state has it; and the union of every
    rank's ``stepped``. The same on every rank (one object all-gather)."""
    subgroups = _subgroup_of(opt)
    stepped = stepped or {}
    mine: list[dict[int, dict[str, Any]]] = []
    for bucket in opt.engine.buckets:
        entry: dict[int, dict[str, Any]] = {}
        sg = subgroups.get(id(bucket))
        for gi, pieces in zip(sg.groups, sg.pieces) if sg is not None else ():
            # the first piece with state: pieces no step reached yet have none
            with_state = ((p, st) for p in pieces if (st := sg.optimizer.state.get(p.tensor)))
            piece, st = next(with_state, (None, None))
            if piece is None:
                continue
            entry[gi] = {
                k: ("elementwise", v.dtype)
                if _is_elementwise_state(v, piece.tensor)
                else ("value", _host_copy(v))
                for k, v in st.items()
            }
        mine.append(entry)
    mesh = opt.engine.mesh
    if mesh.world_size == 1:
        return mine, dict(stepped)
    every: list[Any] = [None] * mesh.world_size
    sent = (
        [
            {
                gi: {k: (kind, _Scalar.of(v)) for k, (kind, v) in keys.items()}
                for gi, keys in entry.items()
            }
            for entry in mine
        ],
        {name: {k: _Scalar.of(v) for k, v in values.items()} for name, values in stepped.items()},
    )
    dist.all_gather_object(every, sent, group=mesh.group)
    merged: list[dict[int, dict[str, Any]]] = [{} for _ in opt.engine.buckets]
    union: dict[str, dict[str, Any]] = {}
    for rank_layout, names in every:
        for bi, entry in enumerate(rank_layout):
            for gi, keys in entry.items():
                if gi not in merged[bi]:
                    merged[bi][gi] = {k: (kind, _Scalar.back(v)) for k, (kind, v) in keys.items()}
        for name, values in names.items():
            if name not in union:
                union[name] = {k: _Scalar.back(v) for k, v in values.items()}
    return merged, union


class _Scalar(NamedTuple):
    """A 0-dim CPU tensor (Adam's ``step``) as ``all_gather_object`` sends it: a pickled tensor
    goes through ``torch.save``'s machinery, about 0.3 ms to load back; 400 units of 4
    parameters took 0.5 s."""

    dtype: torch.dtype
    value: bool | int | float | complex

    @staticmethod
    def of(v: Any) -> Any:
        if (
            torch.is_tensor(v)
            and v.ndim == 0
            and v.device.type == "cpu"
            and type(v) is torch.Tensor
        ):
            return _Scalar(v.dtype, v.item())
        return v

    @staticmethod
    def back(v: Any) -> Any:
        return torch.tensor(v.value, dtype=v.dtype) if isinstance(v, _Scalar) else v


def _copy_value(v: Any) -> Any:
    return v.clone() if torch.is_tensor(v) else v


@torch.no_grad()
def optimizer_state_dict(
    opt: ShardedOptimizer, *, local: bool = False, template: bool | None = None
) -> dict[str, Any]:
    """``opt``'s state in the format of ``get_optimizer_state_dict`` for an FSDP2 model (module
    docstring): per-parameter states keyed by name, element-wise states as ``(Shard(0),)``
    DTensors cut out of each sub-group's pieces, and the param groups with parameter names.
    With ``local``, element-wise states are ``FlatRange`` views of this rank's own state tensors
    instead (no collective for them; ``load_optimizer_state_dict`` takes them as read in place).

    Parameters no optimizer step has reached hold no state and are left out, as torch's
    optimizer leaves them, unless ``template``: then every trainable parameter gets one (for
    those without, ``_init_states``' zero-gradient step at learning rate 0: zeros, ``step`` 0),
    so that the dict is a complete template to load into. ``template=None`` (the default) is
    True while no parameter has state (torch's ``get_optimizer_state_dict`` does the same). A
    collective: every rank calls it (per state key, consecutive flat buffers within
    ``bucket_bytes`` are gathered together)."""
    _check_sharded(opt, "optimizer_state_dict")
    engine = opt.engine
    if not local:
        refuse_split_pieces(engine, "opt.state_dict()")
    model = engine.model
    mesh = device_mesh(engine)
    first = first_names(model)
    stepped = _stepped(opt, first)  # before _init_states gives the others states
    fresh = _init_states(opt)
    group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    layout, stepped = _state_layout(opt, stepped)
    if template is None:
        template = not stepped

    def kept(p: torch.Tensor) -> bool:
        return template or first[id(p)] in stepped

    subgroups = _subgroup_of(opt)
    buckets = engine.buckets
    keys_of = [_elementwise_keys(entry) for entry in layout]
    per_param: dict[int, dict[str, Any]] = {}
    # Consecutive buckets share one gather per key (``bucket_bytes`` of whole states).
    cap = 0 if local else batch_cap(engine)
    make = _local_entries if local else _gathered_entries
    start = 0
    while start < len(buckets):
        batch = range(start, _batch_end(buckets, keys_of, start, cap))
        for (k, dtype), indices in _by_key(batch, keys_of).items():
            entries = make(buckets, indices, k, dtype, subgroups, mesh)
            for bi in indices:
                for i, s in enumerate(buckets[bi].flat.slots):
                    gi = group_of.get(id(s.param))
                    if gi is not None and k in layout[bi].get(gi, {}) and kept(s.param):
                        per_param.setdefault(id(s.param), {})[k] = entries[bi](i)
            del entries  # a gathered buffer is freed before the next key's
        for bi in batch:
            for s in buckets[bi].flat.slots:
                gi = group_of.get(id(s.param)) if kept(s.param) else None
                own = stepped.get(first[id(s.param)])  # its own step count, where it has one
                for k, (kind, v) in layout[bi].get(gi, {}).items() if gi is not None else ():
                    if kind == "value":
                        v = own.get(k, v) if own is not None else _unstepped_value(k, v)
                        per_param.setdefault(id(s.param), {})[k] = _copy_value(v)
        start = batch.stop
    # Zero-element parameters are not in any FlatParam; FSDP2 gives them states of their shape
    # (never stepped: step 0).
    by_group: dict[int, dict[str, Any]] = {}
    for entry in layout:
        for gi, keys_ in entry.items():
            by_group.setdefault(gi, keys_)
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            if p.numel() or not p.requires_grad or id(p) in per_param or gi not in by_group:
                continue
            per_param[id(p)] = {
                k: as_sharded(torch.zeros(p.shape, dtype=v, device=p.device), mesh, v)
                if kind == "elementwise"
                else _copy_value(_unstepped_value(k, v))
                for k, (kind, v) in by_group[gi].items()
            }
    state: dict[str, dict[str, Any]] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) in per_param and first[id(p)] not in state:
                state[first[id(p)]] = per_param[id(p)]
    param_groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [first[id(p)] for p in g["params"]],
        }
        for g in opt.param_groups
    ]
    # Asking for the state must not change training: states made for the template are dropped
    # (the dict keeps its own references), or a unit's first real step would count as Adam's
    # second (bias correction).
    for o in fresh:
        o.state.clear()
    return {"state": state, "param_groups": param_groups}


def _unstepped_value(key: str, value: Any) -> Any:
    """A template state's ``value`` of ``key``: ``step`` 0 (no real step reached it; a
    load leaves it without state, as a fresh optimizer), not the template step's 1."""
    if key != "step":
        return value
    return torch.zeros_like(value) if torch.is_tensor(value) else type(value)(0)


def _never_stepped(state: dict[str, Any]) -> bool:
    """Whether a saved parameter state is a template's (``step`` 0: no real step reached
    it): loaded as no state, or the first real step would count as Adam's second."""
    step = state.get("step")
    if torch.is_tensor(step):
        return step.numel() == 1 and step.item() == 0
    return isinstance(step, (int, float)) and step == 0


def _elementwise_keys(entry: dict[int, dict[str, Any]]) -> dict[str, torch.dtype]:
    """A bucket's element-wise state keys and their dtypes (``_state_layout``'s entry)."""
    keys: dict[str, torch.dtype] = {}
    for gi_keys in entry.values():
        for k, (kind, v) in gi_keys.items():
            if kind == "elementwise":
                keys.setdefault(k, v)
    return keys


def _batch_end(
    buckets: list[GradBucket], keys_of: list[dict[str, torch.dtype]], start: int, cap: int
) -> int:
    """The end of the run of buckets from ``start`` whose whole element-wise states of one key
    fit in ``cap`` bytes (at least one bucket)."""
    stop, total = start, 0
    while stop < len(buckets):
        itemsize = max((d.itemsize for d in keys_of[stop].values()), default=0)
        total += buckets[stop].flat.padded_numel * itemsize
        if stop > start and total > cap:
            break
        stop += 1
    return stop


def _by_key(
    batch: range, keys_of: list[dict[str, torch.dtype]]
) -> dict[tuple[str, torch.dtype], list[int]]:
    """``(key, dtype) -> indices``: the buckets of ``batch`` holding each element-wise state."""
    out: dict[tuple[str, torch.dtype], list[int]] = {}
    for bi in batch:
        for k, dtype in keys_of[bi].items():
            out.setdefault((k, dtype), []).append(bi)
    return out


def _gathered_entries(
    buckets: list[GradBucket],
    indices: list[int],
    key: str,
    dtype: torch.dtype,
    subgroups: dict[int, SubGroup],
    mesh: DeviceMesh,
) -> dict[int, Callable[[int], torch.Tensor]]:
    """``bucket index -> entry(slot index)``: state ``key`` of each slot of the bucket's flat as
    a ``(Shard(0),)`` DTensor, cut from one buffer of every rank's pieces; the buckets'
    buffers are gathered together where the states are partitioned (one collective)."""
    flats = [buckets[bi].flat for bi in indices]
    ranges = [
        _state_range(buckets[bi], subgroups.get(id(buckets[bi])), key, dtype) for bi in indices
    ]
    wholes = flat_sources(flats, ranges)
    return {bi: _cutter(f, whole, mesh, dtype) for bi, f, whole in zip(indices, flats, wholes)}


def _state_range(
    bucket: GradBucket, sg: SubGroup | None, key: str, dtype: torch.dtype
) -> torch.Tensor:
    """1D, this rank's optimizer range of the bucket's flat: state ``key`` of each piece it
    holds (zeros where a piece has none)."""
    flat = bucket.flat
    assert flat.master_view is not None
    local = torch.zeros(flat.master_view.numel(), dtype=dtype, device=flat.mesh.device)
    for piece in _pieces(sg):
        v = sg.optimizer.state.get(piece.tensor, {}).get(key)
        if v is not None:
            local[piece.span].copy_(v)
    return local


def _cutter(
    flat: FlatParam, whole: torch.Tensor, mesh: DeviceMesh, dtype: torch.dtype
) -> Callable[[int], torch.Tensor]:
    def entry(index: int) -> torch.Tensor:
        s = flat.slots[index]
        return as_sharded(whole[s.offset : s.offset + s.numel].view(s.shape), mesh, dtype)

    return entry


def _local_entries(
    buckets: list[GradBucket],
    indices: list[int],
    key: str,
    dtype: torch.dtype,
    subgroups: dict[int, SubGroup],
    mesh: DeviceMesh,
) -> dict[int, Callable[[int], FlatRange]]:
    """As ``_gathered_entries``, each entry a ``FlatRange`` of this rank's own (``_local_entry``):
    no collective."""
    return {
        bi: _local_entry(buckets[bi].flat, subgroups.get(id(buckets[bi])), key, dtype)
        for bi in indices
    }


def _local_entry(
    flat: FlatParam, sg: SubGroup | None, key: str, dtype: torch.dtype
) -> Callable[[int], FlatRange]:
    """State ``key`` of each slot of ``flat`` (by index) as this rank holds it: the state
    tensor of the slot's piece (one piece per parameter), or an empty range where it holds
    none. A piece without state (a parameter no backward has reached yet, beside others that
    stepped) is zeros, as ``_gathered_entries`` gives it; a load into it gives it that state.
    No collective."""
    pieces = _slot_pieces(flat, sg)

    def entry(index: int) -> FlatRange:
        s, piece = flat.slots[index], pieces[index]
        if piece is None:
            empty = torch.empty(0, dtype=dtype, device=flat.mesh.device)
            return FlatRange(s.shape, dtype, 0, empty)
        value = sg.optimizer.state.get(piece.tensor, {}).get(key)
        if value is None:
            value = torch.zeros(piece.tensor.numel(), dtype=dtype, device=flat.mesh.device)
        return FlatRange(s.shape, dtype, flat.piece_range(index)[0], value)

    return entry


def local_state_entries(opt: ShardedOptimizer) -> Callable[[str, str, torch.dtype], Any]:
    """``entry(name, key, dtype)``: element-wise state ``key`` of the parameter ``name`` (its
    first name) as ``optimizer_state_dict(opt, local=True)`` gives it, zeros where ``opt``
    keeps none of it yet: what a load reads a state saved with other hyperparameters into
    (this rank's ``FlatRange``; None where ``opt`` does not step ``name``). No collective."""
    engine = opt.engine
    first = first_names(engine.model)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    subgroups = _subgroup_of(opt)
    where = {
        first[id(s.param)]: (bucket, i)
        for bucket in engine.buckets
        for i, s in enumerate(bucket.flat.slots)
        if id(s.param) in held and id(s.param) in first
    }

    def entry(name: str, key: str, dtype: torch.dtype) -> Any:
        if name not in where:
            return None
        bucket, index = where[name]
        return _local_entry(bucket.flat, subgroups.get(id(bucket)), key, dtype)(index)

    return entry


@torch.no_grad()
def _check_sharded(opt: Any, what: str) -> None:
    from zeroshard.model_states.optimizer import ShardedOptimizer

    if not isinstance(opt, ShardedOptimizer):
        raise TypeError(
            f"{what} takes the optimizer zeroshard.optimizer(model, ...) returned, got "
            f"{type(opt).__name__}: a torch optimizer's own state_dict() is its format"
        )


def load_optimizer_state_dict(opt: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    """Load what ``optimizer_state_dict`` returns (per parameter name: DTensors of any mesh, e.g.
    resharded by ``dcp.load``, or plain full tensors) into ``opt``'s sub-groups, at any world
    size or stage. Param-group hyperparameters are taken from the saved group holding the same
    parameters (by name, else by position), except the implementation choices ``foreach``,
    ``fused``, ``capturable``, ``differentiable`` (kept). A collective (DTensors are gathered
    in batches of consecutive entries, ``zeroshard.state_dict_gather.Wholes``)."""
    _check_sharded(opt, "load_optimizer_state_dict")
    if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
        keys = list(state_dict)[:3] if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(
            f"not an optimizer state dict (no 'param_groups'; it holds {keys}): load what "
            "opt.state_dict() returned; a model's state dict goes to model.load_state_dict()"
        )
    engine = opt.engine
    model = engine.model
    first = first_names(model)
    every_name = all_names(model)
    saved_state: dict[str, dict[str, Any]] = state_dict.get("state", {})
    known = {n for names in every_name.values() for n in names}
    unknown = [k for k in saved_state if k not in known]
    if unknown and all(isinstance(k, int) for k in unknown):
        raise ValueError(
            f"the optimizer state dict is keyed by position ({unknown[0]!r}, ...), as a plain "
            "torch optimizer's is; a zeroshard optimizer's is keyed by parameter name. Convert "
            "it on the unsharded model: torch.distributed.checkpoint.state_dict."
            "get_optimizer_state_dict(model, torch_optimizer) keys it by name"
        )
    if unknown:  # else nothing would be loaded for them, without a word
        raise ValueError(
            f"the optimizer state dict names {len(unknown)} parameter(s) the model does not "
            f"have, e.g. {unknown[0]!r} (keys are the model's parameter names, as "
            "opt.state_dict(), zeroshard.optimizer_state_dict and torch's "
            "get_optimizer_state_dict(model, opt) give)"
        )
    groups_before = [dict(g) for g in opt.param_groups]
    for g, saved in zip(opt.param_groups, match_groups(opt, state_dict["param_groups"], first)):
        for k, v in saved.items():
            if k not in ("params", "param_names") and k not in _IMPL_KEYS:
                g[k] = v
    # Which keys are element-wise, per bucket and group: from the running optimizer's own
    # states (a 0-dim parameter's ``exp_avg`` has the shape of ``step``), made if none yet.
    fresh = _init_states(opt)
    layout, _ = _state_layout(opt)
    group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    subgroups = _subgroup_of(opt)
    saved_keys = {k for st in saved_state.values() if not _never_stepped(st) for k in st}
    plan = [
        (
            bucket,
            subgroups.get(id(bucket)),
            _slot_loads(bucket, layout[bi], group_of, subgroups, saved_state, every_name),
        )
        for bi, bucket in enumerate(engine.buckets)
    ]
    # Checked whole, from shapes alone, before anything is loaded (the states are then written
    # in place), and agreed: the rank whose piece holds a bad entry raised alone, and the
    # others waited in the next gather.
    problem = None
    for _, sg, slots in plan:
        for sl in slots:
            problem = problem or _entry_problem(sl, saved_keys, sg)
    mesh = engine.mesh
    if mesh.world_size * mesh.tp_size > 1:
        group = None if mesh.tp_size > 1 else mesh.group
        problem = next((p for p in gather(problem, group) if p), None)
    if problem is not None:
        for g, before in zip(opt.param_groups, groups_before):
            g.clear()  # (without the saved groups' keys it lacked: initial_lr)
            g.update(before)
        for o in fresh:  # (a fresh optimizer stays fresh: Adam's template says step 1)
            o.state.clear()
        raise ValueError(f"{problem}: nothing was loaded")
    # Entries made whole in the order taken below, gathered ahead in batches (a collective).
    order = [(sl.names[0], k) for _, _, slots in plan for sl in slots for k in sorted(sl.state)]
    wholes = Wholes(order, lambda nk: saved_state[nk[0]][nk[1]], batch_cap(engine))
    for bucket, sg, slots in plan:
        flat: FlatParam = bucket.flat
        # Per piece of the sub-group (torch's parameter order): key -> state being assembled.
        pieces = _pieces(sg)
        assembled: list[dict[str, Any]] = [{} for _ in pieces]
        for sl in slots:
            for k in sorted(sl.state):
                v = wholes.whole((sl.names[0], k), sl.state[k])  # every rank alike: a collective
                if sl.owner is None:
                    continue
                piece, into = pieces[sl.owner], assembled[sl.owner]
                if isinstance(v, FlatRange):  # read in place (checkpoint.load): the state itself
                    into[k] = v.data
                elif _elementwise(k, v, sl.slot, sl.kinds):
                    buf = into.get(k)
                    if buf is None:
                        buf = into[k] = _state_buffer(sg.optimizer, piece.tensor, k, v)
                    a, b = flat.piece_range(sl.index)
                    lo = sl.span.start - piece.span.start
                    buf[lo : lo + (b - a)].copy_(v.reshape(-1)[a:b])
                else:
                    into.setdefault(k, _copy_value(v))
        if sg is None:
            continue
        packed = sg.optimizer.state_dict()
        groups = packed["param_groups"]
        for tg, gi in zip(groups, sg.groups):
            tg.update({k: v for k, v in opt.param_groups[gi].items() if k != "params"})
        packed["state"] = {j: st for j, st in enumerate(assembled) if st}
        sg.optimizer.load_state_dict(packed)
    # (the states of parameters another optimizer of the model trains are its own: a
    # checkpoint of two optimizers gives each the states of both)
    trained = {
        n
        for o in {opt, *engine.optimizers}
        for g in o.param_groups
        for p in g["params"]
        if p.requires_grad
        for n in every_name.get(id(p), ())
    }
    warn_dropped(
        [k for k, st in saved_state.items() if k not in trained and not _never_stepped(st)]
    )


class _SlotLoad(NamedTuple):
    """A slot of a bucket whose saved state a load takes (``_saved_slots``), with what the
    running optimizer keeps for it (``kinds``, ``_state_layout``'s) and this rank's piece of
    it among the sub-group's (``owner``, an index of ``_pieces``; None where it holds none)."""

    index: int
    slot: Slot
    span: range
    names: list[str]
    state: dict[str, Any]
    kinds: dict[str, Any]
    owner: int | None


def _pieces(sg: SubGroup | None) -> list[Piece]:
    """The sub-group's pieces, in torch's parameter order (none without a sub-group)."""
    return [p for ps in sg.pieces for p in ps] if sg is not None else []


def _slot_loads(
    bucket: GradBucket,
    kinds_by_group: dict[int, dict[str, Any]],
    group_of: dict[int, int],
    subgroups: dict[int, SubGroup],
    saved_state: dict[str, dict[str, Any]],
    every_name: dict[int, list[str]],
) -> list[_SlotLoad]:
    """The ``_SlotLoad`` of each slot of ``bucket`` whose saved state a load takes."""
    pieces = _pieces(subgroups.get(id(bucket)))
    spans = sorted((p.span.start, p.span.stop, j) for j, p in enumerate(pieces))
    return [
        _SlotLoad(
            i,
            s,
            span,
            names,
            st,
            kinds_by_group.get(group_of.get(id(s.param), -1), {}),
            _owner(span, spans),
        )  # fmt: skip
        for i, s, span, names, st in _saved_slots(bucket.flat, saved_state, every_name)
    ]


def _elementwise(key: str, value: Any, slot: Slot, kinds: dict[str, Any]) -> bool:
    """Whether saved state ``key`` of ``slot`` (``value``: the entry, or its whole tensor) is
    element-wise: as the running optimizer keeps it (``kinds``, ``_state_layout``'s), else by
    its shape."""
    if key in kinds:
        return kinds[key][0] == "elementwise"
    return torch.is_tensor(value) and value.ndim >= 1 and value.shape == slot.shape


def _entry_problem(load: _SlotLoad, saved_keys: set[str], sg: SubGroup | None) -> str | None:
    """What stops ``load``'s saved state from being loaded on this rank, from shapes alone (no
    collective), or None. ``saved_keys``: every key the saved states hold."""
    name, slot, state, kinds, owner = load.names[0], load.slot, load.state, load.kinds, load.owner
    for k, v in sorted(state.items()):
        if not holds_its_row_chunk(v):  # (its gather would fail on every rank, mid-load)
            return not_row_chunk(v)
        if owner is None or isinstance(v, FlatRange) or not _elementwise(k, v, slot, kinds):
            continue
        if not torch.is_tensor(v) or v.is_meta:  # (its copy would fail on this rank alone)
            what = "a tensor on the meta device" if torch.is_tensor(v) else type(v).__name__
            return f"optimizer state {k!r} of {name} is {what}, not values of the parameter's shape"
        if v.numel() != slot.numel:
            return (
                f"optimizer state {k!r} of {name} has shape {tuple(v.shape)}, the parameter "
                f"{tuple(slot.shape)}"
            )
    if owner is None or not kinds:
        return None
    assert sg is not None
    if not set(kinds) & set(state):
        return (
            f"optimizer state of {name} holds {', '.join(map(repr, sorted(state)))}, none of "
            f"what the running {type(sg.optimizer).__name__} keeps "
            f"({', '.join(map(repr, sorted(kinds)))}): a state dict of another optimizer "
            "class; load one of the same class (or start its states fresh)"
        )
    # A state that the others have and this one lacks (a toggled option, such as amsgrad,
    # drops a key from all of them): else the step of this rank alone fails.
    lacking = sorted((set(kinds) & saved_keys) - set(state))
    if lacking:
        return (
            f"optimizer state of {name} lacks {', '.join(map(repr, lacking))} (it has "
            f"{', '.join(map(repr, sorted(state)))}; the running optimizer keeps "
            f"{', '.join(map(repr, sorted(kinds)))})"
        )
    return None


def _state_buffer(
    optimizer: torch.optim.Optimizer, piece: torch.Tensor, key: str, like: torch.Tensor
) -> torch.Tensor:
    """1D zeros to assemble element-wise state ``key`` of ``piece`` in: the state the optimizer
    holds already where it has the dtype and device torch's load would give it (the piece's),
    else a new tensor of ``like``'s dtype (torch's load casts it). In place, a load holds no
    second copy of the rank's optimizer states (FSDP2's holds none either)."""
    held = optimizer.state.get(piece, {}).get(key)  # (NVMe-offloaded states: read in first)
    if (
        torch.is_tensor(held)
        and held.numel() == piece.numel()
        and held.dtype == piece.dtype
        and held.device == piece.device
        and held.is_contiguous()
        and not held.is_inference()
        and held.untyped_storage().data_ptr() != like.untyped_storage().data_ptr()
    ):
        return held.view(-1).zero_()
    return torch.zeros(piece.numel(), dtype=like.dtype, device=piece.device)


def _saved_slots(
    flat: FlatParam, saved_state: dict[str, dict[str, Any]], every_name: dict[int, list[str]]
) -> Iterator[tuple[int, Slot, range, list[str], dict[str, Any]]]:
    """``(index, slot, span, names, saved state)`` of each slot of ``flat`` whose parameter the
    saved state names (under any of its names, the first found kept) with a state some real
    step made (not a template's)."""
    for i, (s, span) in enumerate(flat.pieces()):
        names = [n for n in every_name.get(id(s.param), []) if n in saved_state]
        if names and not _never_stepped(saved_state[names[0]]):
            yield i, s, span, names, saved_state[names[0]]


def _owner(span: range, spans: list[tuple[int, int, int]]) -> int | None:
    """The piece holding all of ``span`` (a range of the flat buffer) among the sub-group's
    pieces, ``spans`` sorted (start, stop, index); ``None`` when none does or ``span`` is empty.
    The pieces do not overlap, so only the last one starting at or before ``span`` can: a
    bisection, where a scan per parameter was quadratic (1.3 s for 3,000 parameters in one
    unit, 5.2 s for 6,000, explorer)."""
    if span.stop <= span.start:
        return None
    k = bisect.bisect_right(spans, (span.start, math.inf, math.inf)) - 1
    return spans[k][2] if k >= 0 and span.stop <= spans[k][1] else None
