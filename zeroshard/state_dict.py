"""State dicts of sharded models and optimizers, in FSDP2's format.

``model.state_dict()`` of a model passed through ``zeroshard.shard`` (any stage) returns what
``torch.distributed.fsdp.fully_shard`` gives for the same model: every parameter name of the
original model (every name of a tied parameter too), each a ``DTensor`` placed ``(Shard(0),)``
on a 1-D ``DeviceMesh`` of the data-parallel group, with the parameter's global shape and, as
local tensor, rank r's row chunk ``torch.chunk(param, world_size, dim=0)[r]`` (empty, shape
``(0, *param.shape[1:])``, for ranks past the last chunk). Buffers are plain tensors, as in the
unsharded model. So ``torch.distributed.checkpoint`` (DCP) saves and reshards it like an FSDP2
checkpoint, and ``torch.save`` / ``torch.load`` (``weights_only`` included) round trip it.

Hybrid sharding (shard groups of k ranks, ``zeroshard.mesh``): as FSDP2's HSDP, each entry is a
DTensor placed ``(Replicate(), Shard(0))`` on the 2-D ("replicate", "shard") mesh, its local
tensor the row chunk ``torch.chunk(param, k, dim=0)[shard_rank]``: the ranks of a replicate group
hold the same chunk, and DCP writes it once. ``local_state_dict`` ranges likewise repeat across
replicas (the same fqn and offsets: DCP's save planner keeps one of each).

    values      the FP32 masters cast to each parameter's original dtype: a model trained in
                bf16 saves full-precision weights, not its bf16 compute copy.
    0-dim       parameters without rows (``torch.tensor(1.0)``): FSDP2 refuses them
                ("fully_shard doesn't support scalar parameters"); here they come back as plain
                (replicated) tensors.
    0 elements  parameters stay plain, unsharded parameters in the engine; their entry is a
                DTensor of their (empty) shape, as FSDP2's.

How it is made, a few ``FlatParam``s at a time (consecutive flats whose whole buffers fit in
``ShardConfig.bucket_bytes``, or one larger flat; ``zeroshard.state_dict_gather``): their
master shards are all-gathered in one collective into a temporary FP32 buffer (stage >= 1; at
stage 0 the master is already whole, and FP32 replicated buffers are read in place), each
parameter's row chunk is cut out and cloned, the buffer is freed. At stage >= 1 this is a
collective: every rank must call ``state_dict()`` (unlike FSDP2, whose shards are row-aligned
already).

``model.load_state_dict(sd)`` accepts that format (DTensors on any mesh, e.g. filled in by
``dcp.load``) or plain full tensors (an unsharded model's ``state_dict()``, a ``torch.load``-ed
file), for every stage and precision, ``strict`` as usual. Each parameter's value (DTensor row
chunks are made whole by all-gathers of several entries, up to ``bucket_bytes`` of them, taken
in the order the load reaches them) is written into this rank's FP32 master
range and into the compute copy where one is held (replicated stages, or a stage-3 unit gathered
right now), so the next forward and the next optimizer step both continue from it. Sharded
parameters are consumed by a pre-hook of the module called and taken off ``missing_keys`` by its
post-hook; ``assign=True`` does not replace sharded parameters (their storage is the engine's).

The hooks live on every module of the model passed to ``shard``: a submodule's own
``state_dict()`` / ``load_state_dict()`` give and take its entries in the same format (as
FSDP2's do), and the root may itself sit inside a larger module (prefixes are honoured). Each
acts for the call made, not for torch's recursion into submodules (read from the call stack).

``full_state_dict(model)`` gives plain full tensors instead (rank 0 only and on the CPU by
default): for export, and for a model's own ``save_pretrained`` (``zeroshard.save_pretrained``).

``local_state_dict(model)`` gives, for every sharded parameter, a ``FlatRange`` (this rank's own
master range as a view: no collective, no copy) instead of a DTensor: what ``zeroshard.checkpoint``
saves (DCP writes the range as chunks) and loads into in place; ``load_state_dict`` of such a dict
then refreshes the compute copies.

``keep_vars=True`` changes nothing here: entries are new DTensors, not the parameters.

``zeroshard.optimizer_state_dict`` (module ``zeroshard.optim_state_dict``) gives the optimizer's
states in the same format.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.state_dict_hooks import hooks_of, install_state_dict_hooks
from zeroshard.state_dict_layout import device_mesh, own_key, uncompiled

__all__ = [
    "device_mesh",
    "full_state_dict",
    "install_state_dict_hooks",
    "local_state_dict",
]


def local_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with a ``FlatRange`` (a view of this rank's master range, module
    ``zeroshard.flat_range``) instead of a DTensor for every sharded parameter: no collective,
    no copy. What ``zeroshard.checkpoint`` saves and loads into (in place, through DCP);
    ``model.load_state_dict`` of it then refreshes the compute copies."""
    model = uncompiled(model)
    hooks = hooks_of(model)
    hooks.local = True
    try:
        return model.state_dict()
    except (AttributeError, TypeError) as exc:
        if "FlatRange" not in str(exc):
            raise
        raise TypeError(
            f"a state_dict hook of this model computes on its entries ({exc}), which "
            "zeroshard.checkpoint takes as ranges of the masters, read and written in place "
            "(FlatRange): let the hook rename or drop keys only, or save with "
            "torch.distributed.checkpoint.save(model.state_dict(), ...)"
        ) from exc
    finally:
        hooks.local = False


def full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, torch.Tensor]:
    """The whole model as plain, full tensors (FP32 masters in each parameter's original dtype;
    every name, buffers included), gathered a few FlatParams (``bucket_bytes``) at a time.

    A collective at stage >= 1: every rank calls it. With ``rank0_only`` the other ranks get
    ``{}``; with ``cpu_offload`` the tensors are copied to the CPU as they are cut. A
    tensor-parallel model's split parameters are gathered whole over its tp group as each
    module's entries are made, before the user's state-dict hooks may rename them."""
    model = uncompiled(model)
    hooks = hooks_of(model)
    mesh = hooks.engine.mesh
    split = mesh.tp_size > 1  # every rank cuts its pieces on the device, then they are gathered
    hooks.full = (rank0_only and not split, cpu_offload and not split)
    try:
        sd = model.state_dict()
    finally:
        hooks.full = None
    if split and cpu_offload:  # (whole already: each module's entries gathered as made)
        sd = {k: v.cpu() for k, v in sd.items()}
    if rank0_only and not mesh.is_first:  # (not every tp rank of data-parallel rank 0)
        return {}
    # Blocks compiled inside the model: their wrappers' level left out (save_pretrained wrote
    # weights no model has, "blocks.0._orig_mod.fc.weight").
    return {own_key(k): v for k, v in sd.items()}
