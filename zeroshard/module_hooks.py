"""Where the engine meets ``nn.Module``'s hooks: its hooks run eagerly under torch.compile
(``eager``), and its forward hooks that reshard a unit stay behind the user's (``keep_last``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["eager", "keep_last"]


def keep_last(module: nn.Module, handles: list[Any]) -> None:
    """Move the engine's forward hooks ``handles`` (the reshard, in order) behind the module's
    other forward hooks, before each call: a user's hook registered after ``shard()`` (one
    reading the unit's weights, for a norm or a penalty) runs while they are gathered, not on
    the placeholders (NaN) that the reshard leaves."""
    hooks = module._forward_hooks
    if hooks and next(reversed(hooks)) != handles[-1].id:
        for handle in handles:
            if handle.id in hooks:
                hooks.move_to_end(handle.id)


def eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as a module hook that torch.compile runs eagerly, never traces: the engine's
    hooks swap storages and parameter data. Disabled as a whole, at registration: a wrapper
    that graph-breaks only while compiling (FSDP2's way) made torch.compile of the whole model
    recompile its resume function per hook signature until dynamo's limit (8), losing the
    compiled graph. (This imports dynamo, which torch's optimizers import anyway.)"""
    return torch._dynamo.disable(hook, recursive=True)
