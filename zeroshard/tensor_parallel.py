"""Tensor (model) parallelism beside ZeRO: a 2-D mesh of data-parallel x tensor-parallel ranks.

The article's Nm. Inside a tensor-parallel group of ``tp`` ranks, each transformer block's
attention and MLP are split Megatron-style through ``torch.distributed.tensor.parallel``: the
first linear of each pair column-parallel (its output features split, ``ColwiseParallel``), the
second row-parallel (its input features split, one all-reduce of the output,
``RowwiseParallel``). The fused ``qkv`` projection is split by heads (``FusedColwiseParallel``):
rank r holds the q, k and v rows of heads ``[r * H/tp, (r+1) * H/tp)``. Everything else
(embeddings, layer norms, the head) is replicated in the group and gets the same gradient on
each of its ranks. Other models are split by the plan they declare (``plan_for``): a Hugging
Face config's ``base_model_tp_plan``, or a ``tp_plan`` attribute in the same format.

ZeRO shards over the data-parallel dimension only: ``zeroshard.shard(model, mesh=dp_mesh)`` with
the ``Mesh`` that ``mesh_2d`` returns. To let the engine flatten, gather and reduce them like any
other parameter, the split parameters are *local*: plain ``nn.Parameter`` tensors holding this
rank's piece (so ``model.state_dict()`` gives local pieces; ``gather_tensor_parallel`` rebuilds
the whole tensors). A forward pre-hook wraps them as ``DTensor`` views for the length of their
module's forward, so that DTensor's sharding rules run the math, including the all-reduce of
the input gradient in backward that a column-parallel layer needs.

Layout, for ``world = dp * tp`` ranks (``init_device_mesh(..., (dp, tp), ("dp", "tp"))``): ranks
``[d * tp, (d+1) * tp)`` form tensor-parallel group d; ranks with the same tp coordinate form a
data-parallel group (the ZeRO shard group). Every rank of a tensor-parallel group must see the
same batch: data is split by the data-parallel rank (``Mesh.rank``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard import tensor_parallel_checks
from zeroshard.tensor_parallel_plans import check_untied, given_plan, gpt_plan, plan_for

__all__ = ["gather_tensor_parallel", "gpt_plan", "mesh_2d", "parallelize", "plan_for"]
from zeroshard.flat_range import FlatRange, Split
from zeroshard.mesh import Mesh, cached_mesh
from zeroshard.watchdog import inherit_timeout

DIMS = ("dp", "tp")
"""Dim names of the 2-D ``DeviceMesh``: data-parallel x tensor-parallel."""

_MESHES: dict[tuple, tuple[object, object]] = {}
"""2-D meshes made by ``mesh_2d``, per (world size, tp, device type) in this process group:
models parallelized alike share process groups instead of creating new ones each time
(``zeroshard.mesh.cached_mesh``)."""

_SEQUENCE = "_zeroshard_sequence_parallel"
"""Attribute of a model whose sequences ``parallelize`` split."""

_LOCAL = "_zeroshard_tensor_parallel"
"""Attribute of a module whose parameters were localized: ``{name: _Split}``."""


@dataclass(frozen=True)
class _Split:
    """How one parameter is split across the tensor-parallel group."""

    dim: int | None
    """The dimension split in ``tp`` equal pieces (rank r holds piece r); None: replicated."""
    groups: int = 1
    """Fused projections (q, k, v): the dimension is ``groups`` blocks, each split separately,
    and rank r holds piece r of every block, concatenated."""
    placements: tuple = ()
    """The DTensor placements of the local piece (``Shard(dim)`` or ``Replicate()``)."""


def mesh_2d(tp: int, *, mesh: Mesh | None = None):
    """The (dp, tp) ``DeviceMesh`` of every rank, and the data-parallel ``Mesh`` ZeRO shards
    over (this rank's "dp" dim, with ``tp_group`` set). A collective: every rank calls it.

    A ValueError naming the fix when ``tp`` does not divide the world size."""
    from torch.distributed.device_mesh import init_device_mesh

    base = mesh or Mesh.current()
    world = dist.get_world_size()
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int (ranks per tensor-parallel group), got {tp!r}")
    if world % tp:
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise ValueError(
            f"tp={tp} does not divide the world size {world}; use one of {divisors} "
            "(or launch dp * tp ranks: --nproc)"
        )

    def make():
        made = init_device_mesh(base.device.type, (world // tp, tp), mesh_dim_names=DIMS)
        inherit_timeout(made.get_group("dp"), made.get_group("tp"))
        return made

    dm = cached_mesh(_MESHES, (world, tp, base.device.type), make)
    dp = Mesh.from_device_mesh(dm["dp"], device=base.device)
    dp = replace(dp, local_rank=base.local_rank, local_world_size=base.local_world_size)
    return dm, replace(dp, tp_group=dm.get_group("tp"))


def parallelize(
    model: nn.Module,
    device_mesh,
    plan: dict | None = None,
    *,
    sequence_parallel: bool = False,
    sync_module_states: bool = True,
) -> nn.Module:
    """Split ``model`` across the "tp" dim of ``device_mesh`` (from ``mesh_2d``) with ``plan``
    (module name -> ``ParallelStyle``; default ``plan_for(model, tp, sequence_parallel=...)``),
    in place, before ``zeroshard.shard``. Parameters must be materialized (not on the meta
    device). With ``sync_module_states`` every tensor-parallel rank first takes its group's
    first rank's parameters and buffers, so that the pieces are cut from one model and the
    replicated parameters are equal (``shard``'s own sync runs over the data-parallel ranks
    only). With ``sequence_parallel``, sequences must split evenly in tp (a ValueError says so
    at the forward)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from zeroshard.engine import _ATTR

    if getattr(model, _ATTR, None) is not None:
        raise ValueError(
            "parallelize() of a model zeroshard.shard() has sharded already: split it first, "
            "then shard it (parallelize(model, mesh); zeroshard.shard(model, ..., mesh=dp))"
        )
    if splits(model):
        raise ValueError(
            "parallelize() of a model it has split already (its split Linears hold 1/tp of "
            "their weights): call it once per model"
        )
    if not hasattr(device_mesh, "ndim"):  # (mesh_2d's second value, the data-parallel Mesh)
        raise TypeError(
            f"parallelize() takes the DeviceMesh mesh_2d returns first, got a "
            f"{type(device_mesh).__name__}: device_mesh, dp_mesh = mesh_2d(tp); "
            "parallelize(model, device_mesh); zeroshard.shard(model, ..., mesh=dp_mesh)"
        )
    names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
    if device_mesh.ndim > 1 and "tp" not in names:
        raise ValueError(
            f"parallelize() splits over a mesh dim named 'tp'; this mesh's dims are {names}: "
            "make it with zeroshard.tensor_parallel.mesh_2d(tp) (dims 'dp', 'tp'), or name "
            "yours so"
        )
    tp_mesh = device_mesh["tp"] if device_mesh.ndim > 1 else device_mesh
    tp = tp_mesh.size()
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "tensor parallelism needs materialized parameters: build the model on the CPU "
            "(or its device), then parallelize, then zeroshard.shard"
        )
    if plan is None:
        plan = plan_for(model, tp, sequence_parallel=sequence_parallel)
    else:
        plan = given_plan(model, plan, tp)
    check_untied(model, plan)
    if tp == 1:
        return model
    group = tp_mesh.get_group()
    if sync_module_states:
        _sync(model, group)
    tensor_parallel_checks.rng_at_first_forward(model, group)
    tensor_parallel_checks.unsplit_inside_pairs_at_first_forward(model, plan)
    styles = {name: style for name, style in plan.items()}
    parallelize_module(model, tp_mesh, styles)
    for name in styles:
        _localize(model.get_submodule(name), getattr(styles[name], "groups", 1))
    if sequence_parallel:
        model.register_forward_pre_hook(_even_sequences(tp), prepend=True, with_kwargs=True)
        setattr(model, _SEQUENCE, True)
    return model


def _sync(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Every parameter and buffer of ``model`` as the first rank of ``group`` has it, whatever
    its dtype or layout (``shard``'s buffer sync, over the tensor-parallel group)."""
    from zeroshard import collectives as C

    with torch.no_grad():
        for p in model.parameters():
            C.broadcast_any(p.data, group=group)
        done: dict[int, torch.Tensor] = {}
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    if id(buf) not in done:
                        done[id(buf)] = C.broadcast_any(buf, group=group)
                    module._buffers[name] = done[id(buf)]


def is_sequence_parallel(model: nn.Module) -> bool:
    """Whether ``parallelize`` split ``model``'s sequences (its residual stream differs per
    tensor-parallel rank: Pa, which rebuilds checkpoints from pieces of a replicated tensor,
    cannot apply)."""
    return getattr(model, _SEQUENCE, False)


def _even_sequences(tp: int):
    """A forward pre-hook: the first input's dim 1 (the sequence) splits evenly in ``tp``
    (DTensor's sequence shards must be equal; a mismatch would fail inside a collective). The
    first input is the first positional one, else the first tensor passed by keyword."""

    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        given = [*args, *kwargs.values()]
        x = next((a for a in given if torch.is_tensor(a)), None)
        if x is not None and x.dim() > 1 and x.shape[1] % tp:
            raise ValueError(
                f"sequence parallelism splits each sequence evenly over tp={tp} ranks: a length "
                f"of {x.shape[1]} does not split; use lengths divisible by {tp}"
            )

    return check


def _localize(module: nn.Module, groups: int) -> None:
    """Replace ``module``'s DTensor parameters with plain ones holding the local piece; wrap
    them back as DTensors around its forward (module docstring)."""
    from torch.distributed.tensor import DTensor, Shard

    splits: dict[str, _Split] = {}
    locals_: dict[str, nn.Parameter] = {}
    mesh = None
    for name, p in list(module.named_parameters(recurse=False)):
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        shard = next((pl.dim for pl in p.placements if isinstance(pl, Shard)), None)
        splits[name] = _Split(
            dim=shard,
            groups=groups if shard == 0 else 1,
            placements=tuple(p.placements),
        )
        local = nn.Parameter(p.to_local().detach().clone(), requires_grad=p.requires_grad)
        local._zeroshard_tp_split = shard is not None  # read by the gradient-norm sum
        module._parameters[name] = local
        locals_[name] = local
    if not splits:
        return
    setattr(module, _LOCAL, splits)

    def wrap(mod: nn.Module, args: tuple) -> None:
        for name, split in splits.items():
            local = locals_[name]
            mod._parameters[name] = DTensor.from_local(  # type: ignore[assignment]
                local, mesh, split.placements, run_check=False
            )

    def unwrap(mod: nn.Module, args: tuple, output):
        for name in splits:
            mod._parameters[name] = locals_[name]
        return output

    module.register_forward_pre_hook(wrap)
    module.register_forward_hook(unwrap, always_call=True)


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether ``parallelize`` split some of ``model``'s parameters."""
    return any(hasattr(m, _LOCAL) for m in model.modules())


def splits(model: nn.Module) -> dict[str, _Split]:
    """``{parameter name: how it is split}`` for every split parameter of ``model``."""
    out = {}
    for mname, m in model.named_modules():
        for pname, split in getattr(m, _LOCAL, {}).items():
            out[f"{mname}.{pname}" if mname else pname] = split
    return out


def place_pieces(model: nn.Module, optim: dict[str, Any], tp_rank: int, tp_size: int) -> None:
    """A checkpoint's optimizer state of ``model`` (``FlatRange`` entries of
    ``zeroshard.checkpoint``), in place: split parameters' element-wise states placed as parts
    of the whole tensors (``Split``), so that the files hold the unsplit model and load at any
    tensor-parallel degree.
    (The model's own entries are placed as its state dict is made, under whatever names the
    user's state-dict hooks give them: ``zeroshard.state_dict``.)"""
    from zeroshard.checkpoint_files import CheckpointError

    for name, split in splits(model).items():
        if split.dim is None:
            continue
        where = placed(split, tp_rank, tp_size)
        states = optim["state"].get(name, {})
        # Element-wise states, not scalars such as Adam's step (the same on every rank).
        for key, value in states.items():
            if not _is_elementwise(value):
                continue
            if not isinstance(value, FlatRange):  # the same name, another piece per rank
                raise CheckpointError(
                    f"{name} is split tensor-parallel but its state {key!r} is a "
                    f"{type(value).__name__}, not this rank's range; checkpoints of it need "
                    "a model sharded by zeroshard.shard"
                )
            states[key] = value.placed(where)


def _is_elementwise(value: Any) -> bool:
    return isinstance(value, FlatRange) or (torch.is_tensor(value) and value.dim() > 0)


def whole_numel(model: nn.Module, tp_size: int) -> int:
    """Parameters of the unsplit model: split pieces counted whole."""
    split = {n for n, s in splits(model).items() if s.dim is not None}
    return sum(p.numel() * (tp_size if n in split else 1) for n, p in model.named_parameters())


def gather_tensor_parallel(
    model: nn.Module, state: dict[str, torch.Tensor], group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """``state`` (a state dict of ``model`` on this rank: local pieces) with every tensor whole:
    split ones all-gathered over the tensor-parallel ``group``, in the unsplit model's layout,
    and DTensors over the data-parallel ranks made full. A collective over every rank."""
    # DTensors over the data-parallel ranks (a sharded model's state dict): whole on this rank.
    out = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    for name, split in splits(model).items():
        if name not in out or split.dim is None:
            continue
        if out[name].shape != model.get_parameter(name).shape:
            continue  # whole already (zeroshard.full_state_dict gathers them)
        out[name] = whole_tensor(out[name], split, group)
    return out


def split_of(module: nn.Module, name: str) -> _Split | None:
    """How ``module``'s own parameter ``name`` is split across its tensor-parallel group; None
    where every rank holds it whole."""
    split = getattr(module, _LOCAL, {}).get(name)
    return split if split is not None and split.dim is not None else None


def whole_tensor(
    local: torch.Tensor, split: _Split, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The unsplit tensor of which ``local`` is this rank's piece (``split``), in the unsplit
    model's layout: all-gathered over the tensor-parallel ``group`` (every rank of it calls)."""
    local = local.contiguous()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local, group=group)
    if split.groups > 1:
        blocks = [p.chunk(split.groups, dim=split.dim) for p in pieces]
        return torch.cat([b[g] for g in range(split.groups) for b in blocks], dim=split.dim)
    return torch.cat(pieces, dim=split.dim)


def placed(split: _Split, tp_rank: int, tp_size: int) -> Split:
    """Where tensor-parallel rank ``tp_rank``'s piece of a ``split`` parameter lies in the whole
    tensor, as a checkpoint saves it."""
    return Split(split.dim, tp_rank, tp_size, split.groups)
