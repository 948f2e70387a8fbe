"""What the planner needs to know about a model, from whatever the user has at hand: a parameter
count, a transformer shape, a zeroshard GPT preset, any ``nn.Module`` (counted on the meta device,
so nothing is allocated) or a Hugging Face config.

A built model (``from_module``, ``from_hf_config``) that takes token ids has its activations
measured: one forward and loss on the meta device per batch and sequence length planned
(``zeroshard.planner.saved``). Otherwise a transformer shape gives the reference GPT's
residual-state terms (activations, working memory, logits); a bare parameter count plans model
states and communication only.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zeroshard.models.gpt import GPTConfig, preset
from zeroshard.planner import hf
from zeroshard.planner.saved import ActivationProfile, Inputs, hf_inputs, profile
from zeroshard.planner.stepped import SteppedLayout


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

    @property
    def block_split_numel(self) -> int:
        """Of ``block_numel``, what tensor parallelism cuts into pieces: the four Linears'
        weights (12 hd^2) and the colwise ones' biases (3 hd + 4 hd); the layer norms and the
        rowwise biases (6 hd) stay whole on every rank."""
        return 12 * self.hidden_size**2 + 7 * self.hidden_size


@dataclass(frozen=True, kw_only=True)
class ModelDescription:
    """A model as the planner sees it."""

    num_params: int
    """Parameter count Psi (elements; shared parameters counted once)."""
    shape: TransformerShape | None = None
    """The transformer shape when known; ``None`` plans model states and communication only."""
    largest_unit_numel: int | None = None
    """Parameters of the largest wrap unit other than the root (a block); default: one block,
    or the embedding if larger, for a transformer."""
    block_unit_numels: tuple[int, ...] | None = None
    """Parameters each unit other than the root owns, in forward order, when the units were
    found on a built model (``from_module``); ``None``: one transformer block each."""
    root_unit_numel: int | None = None
    """Parameters the root unit owns (what no wrapped unit owns: embeddings, final norm, a head),
    when the units were found on a built model; default: what a shape leaves outside its blocks."""
    wrap_policy: str | None = None
    """How the units were found (``_no_split_modules (GPT2Block)``, ``--wrap Block``, a guess);
    ``None`` when they come from a shape or are unknown."""
    name: str = "model"
    """How tables and reports call it."""
    num_trainable_params: int | None = None
    """Parameters that train (``requires_grad``); only these have gradients and optimizer
    states. ``None``: every parameter (a count or a shape)."""
    stepped: SteppedLayout | None = None
    """A built model whose loss leaves some trainable parameters without a gradient (measured on
    meta): which ones, in the engine's flat buffers; only the others get optimizer states.
    ``None``: every trainable one gets them (a count, a shape, or a forward not run)."""
    activations: ActivationProfile | None = None
    """What autograd saves per unit, measured on the built model (meta device) at the batch and
    sequence length planned (``zeroshard.planner.saved``); ``None``: the reference GPT's
    formulas from ``shape`` (a shape, a preset, or a model that takes no token ids)."""
    buffer_bytes: int = 0
    """Bytes of the model's buffers (BatchNorm statistics, rotary tables), for a built model:
    whole on every rank at every stage (the engine shards parameters only)."""
    cast_buffer_numel: int = 0
    """Elements of its persistent floating buffers, among them: a mixed-precision preset keeps
    those in its 2-byte buffer dtype (``memory.buffer_bytes``)."""
    cast_buffer_bytes: int = 0
    """Their bytes as built."""
    tp_split_numel: int | None = None
    """Parameters the model's tensor-parallel plan cuts into pieces
    (``zeroshard.tensor_parallel_plans.split_params``), for a built model that declares one;
    ``None``: the blocks' Linears of a shape, else everything outside the root."""
    unit_split_numels: tuple[int, ...] | None = None
    """Of ``tp_split_numel``, each unit's: the root's, then ``block_unit_numels``' order (a
    unit of experts the plan leaves whole, an MoE layer's, is gathered almost whole at
    every tensor-parallel degree)."""

    def __post_init__(self) -> None:
        _positive_int("num_params", self.num_params)
        for field_name in ("largest_unit_numel", "root_unit_numel"):
            value = getattr(self, field_name)
            if value is None:
                continue
            if field_name == "largest_unit_numel":
                _positive_int(field_name, value)
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field_name} must be an int >= 0, got {value!r}")
            if value > self.num_params:
                raise ValueError(
                    f"{field_name}={value} exceeds num_params={self.num_params}; "
                    "a unit holds at most the whole model"
                )
        if self.block_unit_numels is not None:
            owned = sum(self.block_unit_numels) + (self.root_unit_numel or 0)
            if self.root_unit_numel is None or owned != self.num_params:
                raise ValueError(
                    f"block_unit_numels {self.block_unit_numels} and root_unit_numel="
                    f"{self.root_unit_numel} own {owned} parameters, not num_params="
                    f"{self.num_params}; give both, from the same wrapped model"
                )

    @property
    def unit_numel(self) -> int | None:
        """The largest unit stage 3 gathers at once, the root included when its size is known;
        else the transformer default; else ``None`` (unknown)."""
        if self.root_unit_numel is not None:
            return max(self.root_unit_numel, self.largest_unit_numel or 0)
        if self.largest_unit_numel is not None:
            return self.largest_unit_numel
        if self.shape is None:
            return None
        embedding_numel = self.shape.vocab_size * self.shape.hidden_size
        return min(self.num_params, max(self.shape.block_numel, embedding_numel))

    @property
    def block_unit_numel(self) -> int | None:
        """Parameters of the largest unit other than the root: ``largest_unit_numel`` when given
        (``None`` when a built model has no unit but the root), else one transformer block (a
        model wrapped per block), else ``None``."""
        if self.largest_unit_numel is not None or self.root_unit_numel is not None:
            return self.largest_unit_numel
        return None if self.shape is None else min(self.num_params, self.shape.block_numel)

    @property
    def root_numel(self) -> int | None:
        """Parameters the root unit owns: ``root_unit_numel``, else what a shape leaves outside
        its blocks (embeddings, final norm) for a model wrapped per block; ``None`` without
        either."""
        if self.root_unit_numel is not None:
            return self.root_unit_numel
        if self.shape is None:
            return None
        return max(0, self.num_params - self.shape.num_layers * self.shape.block_numel)

    def unit_rank_numels(self, num_mp_ranks: int) -> tuple[int, list[int]] | None:
        """(root, [each other unit]) parameters one tensor-parallel rank holds: a unit's split
        ones 1/Nm, the rest whole; ``None`` where the units' splits are not known."""
        if self.unit_split_numels is None or self.block_unit_numels is None:
            return None
        whole = (self.root_unit_numel or 0, *self.block_unit_numels)
        held = [
            n - cut + math.ceil(cut / num_mp_ranks)
            for n, cut in zip(whole, self.unit_split_numels, strict=True)
        ]
        return held[0], held[1:]

    @property
    def replicated_numel(self) -> int:
        """Parameters every tensor-parallel rank holds whole: all but ``tp_split_numel`` (the
        planned Linears of a built model), else a shape's all but its blocks' Linears, else the
        root unit's (embeddings, final norm, head). 0 when neither is known (the papers' Psi /
        Nm for everything)."""
        if self.tp_split_numel is not None:
            return self.num_params - self.tp_split_numel
        if self.shape is not None and self.root_unit_numel is None:
            split = self.shape.num_layers * self.shape.block_split_numel
            return max(self.root_numel or 0, self.num_params - split)
        return self.root_numel or 0

    def mp_numel(self, num_mp_ranks: int) -> int:
        """Parameters one tensor-parallel rank holds: the split ones' 1/Nm, the replicated whole."""
        replicated = self.replicated_numel
        return math.ceil((self.num_params - replicated) / num_mp_ranks) + replicated

    @property
    def kept_gathered_numel(self) -> int:
        """Stage 3: parameters gathered once per step and kept from forward to backward (the
        root unit, unless ``ShardConfig.reshard_root_after_forward``, off by default)."""
        return self.root_numel or 0


def trained_bytes(num_bytes: int, num_params: int, num_trainable: int | None) -> int:
    """``num_bytes`` of all ``num_params`` parameters scaled to the ``num_trainable`` ones
    (None: all train): frozen parameters have no gradient and no optimizer state."""
    return num_bytes if num_trainable is None else num_bytes * num_trainable // num_params


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


def from_module(
    module,
    *,
    wrap: str | Sequence[str] | None = None,
    shape: TransformerShape | None = None,
    name: str | None = None,
    inputs: Inputs | None = None,
) -> ModelDescription:
    """Any ``nn.Module``, or a zero-argument callable building one: the callable runs on the meta
    device, so no parameter memory is allocated. Shared parameters (tied embeddings) are counted
    once. The units are those the engine would make (``zeroshard.wrap.units``) with ``wrap``
    (class names, ``--wrap``), else the model's ``_no_split_modules`` (Hugging Face), else one
    unit, as ``shard`` makes it (a warning names the class of its longest run of repeated blocks).
    A model that takes token ids (a transformers model, ``model(x, y)`` returning the loss, or
    ``model(x)`` returning logits) gets its activations measured
    (``ModelDescription.activations``), and so does a model fed ``inputs`` (one sample's shape
    per input: an image model's, an audio model's; a transformers vision model's pixels are
    found in its config); if its forward fails on meta, a warning."""
    import torch
    from torch import nn

    if not isinstance(module, nn.Module):
        if not callable(module):  # (a TypeError was a traceback from zeroshard plan)
            raise ValueError(f"from_module takes an nn.Module or a callable, got {module!r}")
        try:
            with torch.device("meta"):
                module = module()
        except TypeError as exc:  # wants arguments: not a model factory
            raise ValueError(f"the factory could not be called with no arguments: {exc}") from None
        except Exception as exc:  # its own error, or one of building on the meta device
            raise ValueError(
                f"the factory failed when built on the meta device ({type(exc).__name__}: {exc})"
            ) from None
        if not isinstance(module, nn.Module):
            raise ValueError(f"the factory returned {type(module).__name__}, not an nn.Module")
    num_params = sum(p.numel() for p in module.parameters())  # parameters() deduplicates
    if num_params == 0:
        raise ValueError(f"{type(module).__name__} has no parameters; nothing to plan")
    policy, how = wrap_policy(module, wrap)
    from zeroshard.tensor_parallel_plans import split_params
    from zeroshard.wrap import units

    specs = units(module, policy)
    numels = [sum(p.numel() for _, p, _ in spec.params) for spec in specs]
    label = name or type(module).__name__
    _warn_nested(label, [s.name for s in specs[1:]], numels[1:])
    inputs = inputs or hf_inputs(module)  # (once: it may warn)
    try:
        activations = profile(module, tuple(s.name for s in specs[1:]), inputs)
        if activations is None:
            _warn_no_inputs(label)
    except ValueError as exc:  # what the model's forward raised, on every way of calling it
        warnings.warn(
            f"{label}: a forward on the meta device failed ({type(exc).__name__}: {exc}); "
            "activations follow the reference GPT's formulas (needs a shape) instead of being "
            "measured",
            stacklevel=2,
        )
        activations = None
    try:
        cut = split_params(module)
    except ValueError:  # no plan: zeroshard plan refuses --mp > 1 for it
        cut = None
    splits = None
    if cut is not None:
        splits = [sum(p.numel() for _, p, _ in spec.params if id(p) in cut) for spec in specs]
    order = _call_order(activations, len(specs) - 1)
    if order is not None:  # the engine's forward (gathers, spans) follows the calls
        activations = profile(module, tuple(specs[1 + i].name for i in order), inputs)
        numels = numels[:1] + [numels[1 + i] for i in order]
        if splits is not None:
            splits = splits[:1] + [splits[1 + i] for i in order]
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    reached = None if activations is None else activations.reached()
    cast = {  # persistent floating buffers, once each
        id(b): b
        for m in module.modules()
        for n, b in m._buffers.items()
        if b is not None and b.is_floating_point() and n not in m._non_persistent_buffers_set
    }.values()
    tp_split = None if cut is None else sum(p.numel() for p in module.parameters() if id(p) in cut)
    return ModelDescription(
        num_params=num_params,
        num_trainable_params=trainable if trainable < num_params else None,
        stepped=_stepped(module, specs, reached),
        shape=shape,
        largest_unit_numel=max(numels[1:], default=0) or None,
        block_unit_numels=tuple(numels[1:]),
        root_unit_numel=numels[0],
        wrap_policy=how,
        name=label,
        activations=activations,
        tp_split_numel=tp_split,
        unit_split_numels=None if splits is None else tuple(splits),
        buffer_bytes=sum(b.numel() * b.element_size() for b in module.buffers()),
        cast_buffer_numel=sum(b.numel() for b in cast),
        cast_buffer_bytes=sum(b.numel() * b.element_size() for b in cast),
    )


def _stepped(module, specs: list, reached: frozenset[int] | None) -> SteppedLayout | None:
    """The layout of ``module``'s units when some trainable parameter is not in ``reached``
    (``id``s of the parameters the loss reaches; ``None``: not measured, all count as reached)."""
    if reached is None or all(id(p) in reached for p in module.parameters() if p.requires_grad):
        return None
    return SteppedLayout(specs, reached)


def _call_order(activations, num_units: int) -> list[int] | None:
    """The units (indices after the root) in the order the root's forward first calls them, as
    the engine records its forward; ``None`` when that is their registration order, or not
    measured. A unit the root does not call (one inside another unit, or one never run) stays
    after the unit registered before it (an inner unit after its outer one). The plan takes its
    units' order for the forward's: a model running its blocks in reverse was planned 52%
    high at ``--ci 1``."""
    if activations is None:
        return None
    called = activations.at(micro_batch_size=1, seq_len=8).called
    if list(called) == sorted(called):
        return None
    runs: dict[int, list[int]] = {i: [i] for i in called}
    leading: list[int] = []
    run = leading
    for i in range(num_units):
        if i in runs:
            run = runs[i]
        else:
            run.append(i)
    return leading + [j for i in called for j in runs[i]]


def _warn_no_inputs(label: str) -> None:
    """Warn that a model taking no token ids, fed no ``Inputs``, has its activations planned by
    the reference GPT's formulas (or not at all, without a shape): a ViT, a ResNet and a small
    CNN were planned at 0.48, 0.18 and 0.08 of their measured peak at stage 3."""
    warnings.warn(
        f"{label} takes no token ids (no nn.Embedding) and no input shape was given: its "
        "activations are not measured (the reference GPT's formulas with a shape, else none), "
        "so the plan can be several times below the real peak; give one sample's input shape: "
        "from_module(..., inputs=Inputs(((3, 224, 224),))), zeroshard plan --input-shape "
        "3x224x224",
        stacklevel=3,
    )


def _warn_nested(label: str, names: list[str], numels: list[int]) -> None:
    """Warn when a unit holds another (``--wrap GPT2MLP,GPT2Block``): the timeline runs units one
    after another, while the engine keeps an outer unit gathered through its inner units'."""
    outer = [
        (n, size) for n, size in zip(names, numels) if any(m.startswith(n + ".") for m in names)
    ]
    if outer:
        name, size = max(outer, key=lambda o: o[1])
        warnings.warn(
            f"{label}: units nest ({name} holds another unit); the plan runs units one after "
            "another, but an outer unit stays gathered while its inner units run: at stage 3 "
            f"the peak can be up to {size:,} more gathered elements (its own parameters) than "
            "planned; wrap one level (the blocks) for an exact plan",
            stacklevel=3,
        )


def wrap_policy(module, wrap: str | Sequence[str] | None):
    """The engine's wrap policy for ``module`` and how it was chosen (see ``from_module``)."""
    from torch import nn

    from zeroshard import wrap as policies

    if wrap:
        from zeroshard.models.loading import check_wrap_names

        names = (wrap,) if isinstance(wrap, str) else tuple(wrap)
        check_wrap_names(module, names)  # as zeroshard train: a typo beside a match is named
        return policies.by_class(*names), "--wrap " + ",".join(names)
    declared = getattr(module, "_no_split_modules", None)
    if declared:
        return policies.from_hf(module), f"_no_split_modules ({', '.join(sorted(declared))})"
    runs = [
        [type(c).__name__ for c in m.children()]
        for m in module.modules()
        if isinstance(m, (nn.ModuleList, nn.Sequential))
    ]
    runs = [r for r in runs if r and len(set(r)) == 1]
    # As ``zeroshard train`` and ``shard`` without a wrap do: the plan is of what will run.
    hint = f"--wrap {max(runs, key=len)[0]} (its repeated blocks)" if runs else "--wrap CLASS"
    warnings.warn(
        f"{type(module).__name__} names no wrap policy (_no_split_modules): planned as one unit, "
        f"as zeroshard train makes it (stage 3 gathers every parameter at once); pass {hint} "
        "to plan and train it unit by unit",
        stacklevel=2,
    )
    return None, "none: the whole model is one unit"


# Hugging Face config attribute names, per family, for each shape term.
_HF_KEYS: Mapping[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "num_heads": (
        "num_attention_heads",
        "n_head",
        "num_heads",
        "n_heads",
        "encoder_attention_heads",
    ),
    "vocab_size": ("vocab_size",),
    "max_seq_len": ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"),
}
_HF_DECODER_LAYERS = ("num_decoder_layers", "decoder_layers")
"""An encoder-decoder's decoder blocks (T5, BART), counted with the encoder's as blocks."""


def from_hf_config(
    config, *, wrap: str | Sequence[str] | None = None, inputs: Inputs | None = None
) -> ModelDescription:
    """A Hugging Face model config: a ``PretrainedConfig``, its ``to_dict()``, a ``config.json``
    path, or (with ``transformers`` installed) a hub name in the local cache.

    With ``transformers`` the model is built on the meta device and counted exactly, with the
    engine's units (``from_module``: ``wrap``, else ``_no_split_modules``; ``inputs`` for a
    model that takes no token ids, where its config does not give them). Without it, or when
    building fails, the count is the GPT-shaped estimate (MLP width 4 hd, biases, learned
    positions), with a warning that gives the reason."""
    if isinstance(config, (str, os.PathLike)):
        config = hf.load_config(os.fspath(config))
    values = hf.config_values(config)
    name = str(values.get("_name_or_path") or values.get("model_type") or "HF model")
    try:
        module = hf.build(config)
    except Exception as exc:  # ImportError without transformers, or anything building raised
        why = f"{_build_problem(exc)}: {type(exc).__name__}: {' '.join(str(exc).split())}"
        warnings.warn(
            f"{name}: counting with the GPT-shaped formula, not the built model ({why}); the "
            "count and the units are estimates",
            stacklevel=2,
        )
        try:
            found = _hf_shape_terms(values, required=True)
        except ValueError as missing:  # (the warning above is lost with the error's exit)
            raise ValueError(f"{missing}; building the model failed too ({why})") from None
        return from_transformer(**found, name=name)
    found = _hf_shape_terms(module.config.to_dict(), required=False)
    shape = None
    if found is not None:
        found.pop("max_seq_len", None)
        with contextlib.suppress(ValueError):  # heads not dividing the width (Gemma's own
            # head_dim): transformers built it, so its measured activations stand alone
            shape = TransformerShape(**found, tied_embeddings=_tied(module))
    return from_module(module, wrap=wrap, shape=shape, name=name, inputs=inputs)


def _build_problem(exc: Exception) -> str:
    """What kept ``hf.build`` from building the model, in words."""
    if not isinstance(exc, ImportError):
        return "building"
    if (exc.name or "").split(".")[0] == "transformers":
        return "transformers is not installed"
    return "a package the model's class needs is not installed"


def _tied(module) -> bool:
    """Whether the output projection is the input embedding (one parameter)."""
    inputs = getattr(module, "get_input_embeddings", lambda: None)()
    outputs = getattr(module, "get_output_embeddings", lambda: None)()
    if inputs is None or outputs is None:
        return False
    return outputs.weight is inputs.weight


def _hf_shape_terms(values: Mapping, *, required: bool) -> dict[str, int] | None:
    """The shape terms a Hugging Face config gives (``_HF_KEYS``); when one is missing, a
    ``ValueError`` if ``required`` else ``None``."""
    found: dict[str, int] = {}
    for term, keys in _HF_KEYS.items():
        key = next((k for k in keys if values.get(k) is not None), None)
        if key is not None:
            found[term] = int(values[key])
        elif term != "max_seq_len":
            if not required:
                return None
            raise ValueError(
                f"the Hugging Face config has none of {', '.join(keys)}; describe the model "
                "with --layers/--hidden/--heads/--vocab instead"
            )
    if values.get("is_encoder_decoder"):
        key = next((k for k in _HF_DECODER_LAYERS if values.get(k) is not None), None)
        found["num_layers"] += int(values[key]) if key else found["num_layers"]
    return found
