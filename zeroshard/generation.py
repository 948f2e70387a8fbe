"""Hugging Face ``generate()`` on a model whose parameters are sharded (stage 3): every rank runs
every forward, since each forward gathers with the other ranks.

transformers keeps ranks that finished early stepping (``synced_gpus``) for FSDP and DeepSpeed
ZeRO-3, which it recognizes by an attribute, ``_is_fsdp_managed_module``: ``mark`` sets it on
every module that generates (a model wrapped in one's own, peft's ``PeftModel``, calls the inner
one's ``generate()``); not on the others, since Dynamo takes modules so marked for FSDP1's and
runs them eagerly (``torch.compile`` of a block, or of a root without ``generate``, then compiled
nothing of it). ``summon_full_params`` lifts the mark while the model is whole, for a rank that
generates alone.

Some models' own ``generate`` (Whisper's, SeamlessM4T's) declares ``synced_gpus=False`` and passes
it on, so transformers never looks at the mark: at stage 3 a rank that stopped first left the
others waiting in a gather. Their ``generate`` is wrapped to default ``synced_gpus`` to the mark.

The speech encoders' LayerDrop (wav2vec2, HuBERT, WavLM, SpeechT5...: ``config.layerdrop``, 0.1 by
default) skips layers at random per rank in training, unless their encoder is marked: then every
layer runs on every rank, as under FSDP and ZeRO-3. Unmarked, the ranks ran different units at
stage 3 (an ``OrderMismatch``, or gloo's "Received data size doesn't match"). Those encoders are
marked too (their ``forward`` asks for it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

MARK = "_is_fsdp_managed_module"


def mark(model: nn.Module) -> None:
    """Mark ``model`` (stage 3) for transformers' ``generate()`` and LayerDrop: see the module
    docstring."""
    for module in model.modules():
        if _asks_for_the_mark(type(module)):
            setattr(module, MARK, True)
        generate = getattr(module, "generate", None)
        if not callable(generate):
            continue
        setattr(module, MARK, True)
        if _synced_off_by_default(generate):
            module.generate = _synced_as_marked(module, generate)


@functools.cache
def _asks_for_the_mark(cls: type) -> bool:
    """Whether transformers' ``cls.forward`` asks for the mark (``is_fsdp_managed_module``):
    the encoders that skip layers at random in training (LayerDrop) run them all under it."""
    if not cls.__module__.startswith("transformers."):
        return False
    try:
        return "is_fsdp_managed_module" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _synced_off_by_default(generate: Callable) -> bool:
    try:
        param = inspect.signature(generate).parameters.get("synced_gpus")
    except (TypeError, ValueError):
        return False
    return param is not None and param.default is False


def _synced_as_marked(module: nn.Module, generate: Callable) -> Callable:
    """``generate`` with ``synced_gpus`` defaulting to the mark when the caller gives none."""
    signature = inspect.signature(generate)

    @functools.wraps(generate)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "synced_gpus" not in signature.bind_partial(*args, **kwargs).arguments:
            import torch.distributed as dist

            many = dist.is_initialized() and dist.get_world_size() > 1
            kwargs["synced_gpus"] = bool(getattr(module, MARK, False)) and many
        return generate(*args, **kwargs)

    return wrapper
