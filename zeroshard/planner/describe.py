"""What the planner needs to know about a model, from whatever the user has at hand: a parameter
count, a transformer shape, a zeroshard GPT preset, any ``nn.Module`` (counted on the meta device,
so nothing is allocated) or a Hugging Face config.

Only a transformer shape gives the residual-state terms (activations, working memory, logits); a
bare parameter count plans model states and communication only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from zeroshard.models.gpt import GPTConfig, preset


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The shape terms of the ZeRO papers' transformer (nl, hd, heads, vocabulary)."""

    num_layers: int
    """Transformer blocks (nl)."""
    hidden_size: int
    """Hidden width (hd)."""
    num_heads: int
    """Attention heads; must divide ``hidden_size``."""
    vocab_size: int
    """Vocabulary size: the width of the logits."""
    tied_embeddings: bool = True
    """The output projection is the token embedding (GPT-2, the zeroshard GPT): its gradient from
    the logits waits in autograd until the embedding's own gradient joins it."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size"):
            _positive_int(f"TransformerShape.{name}", getattr(self, name))
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"num_heads={self.num_heads} does not divide hidden_size={self.hidden_size}; "
                "pick a head count that divides the hidden size"
            )

    @property
    def block_numel(self) -> int:
        """Parameters of one block with biases: 12 hd^2 + 13 hd (the papers round to 12 hd^2)."""
        return 12 * self.hidden_size**2 + 13 * self.hidden_size


@dataclass(frozen=True, kw_only=True)
class ModelDescription:
    """A model as the planner sees it."""

    num_params: int
    """Parameter count Psi (elements; shared parameters counted once)."""
    shape: TransformerShape | None = None
    """The transformer shape when known; ``None`` plans model states and communication only."""
    largest_unit_numel: int | None = None
    """Parameters of the largest wrap unit (what stage 3 gathers at once); default: one block,
    or the embedding if larger, for a transformer."""
    name: str = "model"
    """How tables and reports call it."""

    def __post_init__(self) -> None:
        _positive_int("num_params", self.num_params)
        if self.largest_unit_numel is not None:
            _positive_int("largest_unit_numel", self.largest_unit_numel)
            if self.largest_unit_numel > self.num_params:
                raise ValueError(
                    f"largest_unit_numel={self.largest_unit_numel} exceeds num_params="
                    f"{self.num_params}; a unit holds at most the whole model"
                )

    @property
    def unit_numel(self) -> int | None:
        """``largest_unit_numel``, else the transformer default, else ``None`` (unknown)."""
        if self.largest_unit_numel is not None:
            return self.largest_unit_numel
        if self.shape is None:
            return None
        embedding_numel = self.shape.vocab_size * self.shape.hidden_size
        return min(self.num_params, max(self.shape.block_numel, embedding_numel))

    @property
    def block_unit_numel(self) -> int | None:
        """Parameters of the largest unit other than the root: ``largest_unit_numel`` when given,
        else one transformer block (a model wrapped per block), else ``None``."""
        if self.largest_unit_numel is not None:
            return self.largest_unit_numel
        return None if self.shape is None else min(self.num_params, self.shape.block_numel)

    @property
    def root_numel(self) -> int | None:
        """Parameters outside the transformer blocks (embeddings, final norm): what the root unit
        owns when the model is wrapped per block; ``None`` without a shape."""
        if self.shape is None:
            return None
        return max(0, self.num_params - self.shape.num_layers * self.shape.block_numel)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def from_params(num_params: int, *, name: str | None = None) -> ModelDescription:
    """A model known only by its parameter count (model states and communication only)."""
    if isinstance(num_params, float) and num_params.is_integer():
        num_params = int(num_params)
    return ModelDescription(num_params=num_params, name=name or "model")


def from_transformer(
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    vocab_size: int,
    max_seq_len: int = 0,
    num_params: int | None = None,
    name: str | None = None,
) -> ModelDescription:
    """A GPT-like transformer. Without ``num_params`` the count is the zeroshard GPT's (biases,
    learned positions over ``max_seq_len`` tokens, tied embeddings)."""
    shape = TransformerShape(
        num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, vocab_size=vocab_size
    )
    if num_params is None:
        hd = hidden_size
        num_params = num_layers * shape.block_numel + (vocab_size + max_seq_len + 2) * hd
    label = name or f"transformer nl={num_layers} hd={hidden_size} heads={num_heads}"
    return ModelDescription(num_params=num_params, shape=shape, name=label)


def from_gpt(config: GPTConfig | str) -> ModelDescription:
    """A zeroshard GPT, by config or preset name (``"1b"``); counts as ``GPTConfig.num_params``."""
    cfg = preset(config) if isinstance(config, str) else config
    return from_transformer(
        num_layers=cfg.n_layer,
        hidden_size=cfg.n_embd,
        num_heads=cfg.n_head,
        vocab_size=cfg.vocab_size,
        num_params=cfg.num_params(),
        name=f"GPT {config}" if isinstance(config, str) else "GPT",
    )


def from_module(module, *, name: str | None = None) -> ModelDescription:
    """Any ``nn.Module``, or a zero-argument callable building one: the callable runs on the meta
    device, so no parameter memory is allocated. Shared parameters are counted once. The largest
    unit is a guess: the largest child, looking inside ModuleList/ModuleDict/Sequential (pass
    ``largest_unit_numel`` to ``ModelDescription`` when the wrap policy is known)."""
    import torch
    from torch import nn

    if not isinstance(module, nn.Module):
        if not callable(module):
            raise TypeError(f"from_module takes an nn.Module or a callable, got {module!r}")
        with torch.device("meta"):
            module = module()
        if not isinstance(module, nn.Module):
            raise TypeError(f"the factory returned {type(module).__name__}, not an nn.Module")
    num_params = sum(p.numel() for p in module.parameters())  # parameters() deduplicates
    if num_params == 0:
        raise ValueError(f"{type(module).__name__} has no parameters; nothing to plan")
    # Candidate units: the children, with containers (ModuleList, ModuleDict, Sequential) opened.
    units, todo = [], list(module.children())
    while todo:
        child = todo.pop()
        if isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            todo.extend(child.children())
        else:
            units.append(child)
    unit = max((sum(p.numel() for p in u.parameters()) for u in units), default=0)
    return ModelDescription(
        num_params=num_params,
        largest_unit_numel=unit or None,
        name=name or type(module).__name__,
    )


# Hugging Face config attribute names, per family, for each shape term.
_HF_KEYS: Mapping[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "vocab_size": ("vocab_size",),
    "max_seq_len": ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"),
}


def from_hf_config(config) -> ModelDescription:
    """A Hugging Face model config: a ``PretrainedConfig``, its ``to_dict()``, a ``config.json``
    path, or (with ``transformers`` installed) a hub name. The count is the GPT-shaped estimate
    (MLP width 4 hd); for exact counts build the model with ``from_module`` on meta."""
    if isinstance(config, (str, os.PathLike)):
        config = _load_hf_config(os.fspath(config))
    if isinstance(config, Mapping):
        values = config
    else:  # a PretrainedConfig (to_dict) or any object with the attributes
        values = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    found: dict[str, int] = {}
    for term, keys in _HF_KEYS.items():
        key = next((k for k in keys if values.get(k) is not None), None)
        if key is not None:
            found[term] = int(values[key])
        elif term != "max_seq_len":
            raise ValueError(
                f"the Hugging Face config has none of {', '.join(keys)}; describe the model "
                "with --layers/--hidden/--heads/--vocab instead"
            )
    name = values.get("_name_or_path") or values.get("model_type") or "HF model"
    return from_transformer(**found, name=str(name))


def _load_hf_config(path: str) -> dict:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(
            f"{path!r} is not a config.json file or folder, and reading a hub name needs "
            "transformers: pip install 'zeroshard[hf]'"
        ) from None
    return AutoConfig.from_pretrained(path).to_dict()
