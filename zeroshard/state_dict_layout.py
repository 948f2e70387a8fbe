"""How the entries of sharded state dicts are laid out and named, for the model's
(``zeroshard.state_dict``) and the optimizer's (``zeroshard.optim_state_dict``): FSDP2's
DTensor row chunks on the data-parallel mesh (``device_mesh``, ``as_sharded``), and the names
parameters go under (tied ones, torch's ``checkpoint_wrapper`` and ``torch.compile`` levels).
The collectives that fill them are ``zeroshard.state_dict_gather``'s."""

from __future__ import annotations

import math
import re
import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:  # DTensor is imported when first used: it costs `import zeroshard` ~0.5 s
    from torch.distributed.device_mesh import DeviceMesh

    from zeroshard.engine import Engine

_MESH_ATTR = "_zeroshard_device_mesh"
COLLECTIVE = (
    "the state dict (a collective where masters are sharded: every rank calls state_dict(), "
    "load_state_dict() and opt.state_dict(), not rank 0 alone)"
)
"""How a timed-out state-dict gather is named (``zeroshard.watchdog``): the DDP habit of
saving under ``if rank == 0:`` leaves the other ranks out of it."""


# --------------------------------------------------------------------- mesh and layout


def device_mesh(engine: Engine | nn.Module) -> DeviceMesh:
    """The ``DeviceMesh`` of ``engine``'s state-dict DTensors (built once, cached): the 1-D mesh
    of its data-parallel group, or with hybrid sharding the 2-D ("replicate", "shard") mesh, as
    FSDP2's HSDP has it (entries ``(Replicate(), Shard(0))``: replicas hold the same rows).
    ``engine`` may be the sharded model."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(engine, nn.Module):
        from zeroshard.engine import engine_of

        engine = engine_of(uncompiled(engine))  # (an unsharded model: the error says so)

    mesh = getattr(engine, _MESH_ATTR, None)
    if mesh is None:
        if engine.mesh.hybrid is not None:
            mesh = engine.mesh.hybrid.device_mesh
        else:
            group = engine.mesh.group if engine.mesh.group is not None else dist.group.WORLD
            mesh = DeviceMesh.from_group(group, engine.mesh.device.type)
        setattr(engine, _MESH_ATTR, mesh)
    return mesh


def row_chunk(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``torch.chunk(t, world_size, dim=0)[rank]`` (empty past the last)."""
    size = math.ceil(num_rows / world_size)
    lo = min(rank * size, num_rows)
    return lo, min(lo + size, num_rows)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


_SPECS_ATTR = "_zeroshard_specs"


def _spec(mesh: DeviceMesh, shape: torch.Size, dtype: torch.dtype) -> Any:
    """The ``DTensorSpec`` of a row-chunked entry of ``shape`` and ``dtype`` on ``mesh`` (made
    once per mesh, shape and dtype, as FSDP2 keeps one per parameter), with this rank's place
    in the mesh's last dimension and its size: ``DTensor.from_local`` made a spec and ran an
    autograd function per entry, 0.2-0.4 ms, most of a small unit's state dict."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    specs = mesh.__dict__.setdefault(_SPECS_ATTR, {})
    spec = specs.get((shape, dtype))
    if spec is None:
        shard_dim = mesh.ndim - 1  # the last: "shard" of a hybrid mesh
        placements = (Replicate(),) * shard_dim + (Shard(0),)
        meta = TensorMeta(shape, _contiguous_stride(shape), dtype)
        where = (mesh.get_local_rank(shard_dim), mesh.size(shard_dim))
        spec = specs[(shape, dtype)] = (DTensorSpec(mesh, placements, tensor_meta=meta), where)
    return spec


def as_sharded(full: torch.Tensor, mesh: DeviceMesh, dtype: torch.dtype) -> torch.Tensor:
    """This rank's row chunk of ``full`` (a copy in ``dtype``) as a DTensor of ``full``'s shape,
    ``(Shard(0),)`` on a 1-D mesh, ``(Replicate(), Shard(0))`` on the 2-D hybrid one (the chunk
    of this rank's place in its shard group); a 0-dim ``full`` comes back as a plain copy (FSDP2
    has no scalar shards)."""
    from torch.distributed.tensor import DTensor

    if full.ndim == 0:
        return full.to(dtype, copy=True)
    spec, (rank, world) = _spec(mesh, full.shape, dtype)
    lo, hi = row_chunk(full.shape[0], rank, world)
    local = full[lo:hi].to(dtype, copy=True).contiguous()
    return DTensor(local, spec, requires_grad=False)  # (as FSDP2's _from_local_no_grad)


def is_dtensor(value: Any) -> bool:
    """Without importing DTensor: none exists before its module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


_WRAPPED = "_checkpoint_wrapped_module."
"""What torch's ``checkpoint_wrapper`` inserts into parameter names and its own state-dict hooks
take out of the keys (``get_state_dict`` does alike): names here are the keys' names."""


def key_of(name: str) -> str:
    """The state-dict key of a parameter or buffer named ``name`` in ``named_modules()``'s
    terms (torch's ``checkpoint_wrapper`` inserts a level that its keys leave out)."""
    return name.replace(_WRAPPED, "")


def all_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name each parameter is registered under (tied parameters have several), keyed by
    ``id``, in ``state_dict`` order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name.replace(_WRAPPED, ""))
    return names


def tied_names(model: nn.Module) -> dict[str, str]:
    """``{alias: source}``: each further name under which ``model`` registers a parameter or a
    buffer (tied weights, a module registered at two places), as its state dict's keys have
    them; ``source`` is the first name."""
    pairs: dict[str, str] = {}
    buffers: dict[int, str] = {}  # persistent ones: non-persistent buffers have no key
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                full = f"{prefix}.{name}".lstrip(".").replace(_WRAPPED, "")
                if buffers.setdefault(id(b), full) != full:
                    pairs[full] = buffers[id(b)]
    for names in all_names(model).values():
        pairs.update((alias, names[0]) for alias in names[1:])
    return pairs


def first_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's first name, as ``get_optimizer_state_dict`` keys optimizer states."""
    return {id(p): name.replace(_WRAPPED, "") for name, p in model.named_parameters()}


def refuse_split_pieces(engine: Engine, what: str) -> None:
    """A ValueError for a state dict of DTensors over the data-parallel mesh of a
    tensor-parallel model: each would hold a tp rank's piece with the piece's shape as the
    global one, and ``dcp.save`` would keep one tp rank's pieces for all, silently."""
    if engine.mesh.tp_size > 1:
        raise ValueError(
            f"{what} of a tensor-parallel model (tp={engine.mesh.tp_size}) would hold each tp "
            "rank's pieces as whole tensors: save with zeroshard.checkpoint.save (the unsplit "
            "model, loadable at any tp), or take plain whole tensors with "
            "zeroshard.full_state_dict(model)"
        )


# --------------------------------------------------------------------- compiled models

COMPILED = "_orig_mod."
"""What ``torch.compile``'s wrapper puts before every name in its ``state_dict``: checkpoints of a
compiled model that zeroshard saved before it used the model's own names carry it."""


_COMPILED_LEVEL = re.compile(r"(?:^|(?<=\.))" + re.escape(COMPILED))


def own_key(key: str) -> str:
    """``key`` without the levels that ``torch.compile``'s wrappers put in it (a block compiled
    by ``torch.compile(block)`` inside the model: ``blocks.0._orig_mod.fc.weight``), as
    torch's ``get_state_dict`` names it."""
    return _COMPILED_LEVEL.sub("", key)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile(model)`` wraps (its ``_orig_mod``), else ``model``: the names
    of the uncompiled model, as torch's ``get_state_dict`` gives them (the wrapper's
    ``state_dict`` prefixes every key with ``COMPILED``: a checkpoint of the compiled model
    was another model's to the uncompiled one, and its export loaded as random weights)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # (imported by torch.compile)
    while eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    return model
