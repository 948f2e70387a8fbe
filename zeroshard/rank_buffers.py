"""Buffers whose values differ between ranks, kept per rank in a checkpoint.

A module's buffers are not sharded: every rank holds a whole copy. Most stay equal on every
rank, but some are updated from each rank's own batches (BatchNorm's running mean and variance),
so the ranks' copies drift apart, as they do under FSDP2. A checkpoint's model state holds one
copy of each (FSDP2's format); each rank's file also keeps this rank's copy of every buffer that
is not the same on all ranks, so that a resume at the same world size gives every rank back its
own values and continues bit for bit. At another world size the model state's copy is used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch
from torch import nn

from zeroshard.checkpoint_files import gather
from zeroshard.state_dict_layout import key_of


def each_persistent_buffer(model: nn.Module) -> Iterator[tuple[str, nn.Module, torch.Tensor]]:
    """(name as in ``model.state_dict()``, its module, the buffer) for the buffers a state
    dict holds."""
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield key_of(f"{prefix}.{name}" if prefix else name), module, buf


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name (as in ``model.state_dict()``) -> buffer, for the buffers a state dict holds."""
    return {key: buf for key, _, buf in each_persistent_buffer(model)}


def _digest(tensor: torch.Tensor) -> str:
    if tensor.layout is not torch.strided:  # (a graph's sparse adjacency)
        tensor = tensor.to_dense()
    data = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


def differing(model: nn.Module, group) -> dict[str, torch.Tensor]:
    """This rank's copies (on CPU) of the buffers whose values are not the same on every rank
    of ``group``. A collective: one exchange of a digest per buffer (16 bytes each)."""
    buffers = persistent_buffers(model)
    mine = {name: _digest(buf) for name, buf in buffers.items()}
    every = gather(mine, group)
    return {
        name: buf.detach().cpu().clone()
        for name, buf in buffers.items()
        if any(theirs.get(name) != mine[name] for theirs in every)
    }


def restore(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy ``saved`` (from ``differing`` on this rank, in an earlier process) into the model."""
    buffers = persistent_buffers(model)
    with torch.no_grad():
        for name, value in saved.items():
            if name in buffers and buffers[name].shape == value.shape:
                buffers[name].copy_(value)
