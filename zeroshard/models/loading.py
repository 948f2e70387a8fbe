"""The model of a ``zeroshard train`` run: a built-in GPT preset, your own factory, or a Hugging
Face causal LM built from its config. Plain PyTorch (and transformers); it never imports zeroshard.

Your own model, ``--model package.module:factory``:

* ``factory()`` is called with no arguments on every rank, after ``torch.manual_seed(seed)``, and
  returns an ``nn.Module`` (on the CPU, or on the meta device; its buffers and parameters are
  then materialized by ``reset_parameters()`` unit by unit).
* ``module(idx_BT)`` takes int64 token ids of shape (B, T) and returns logits (B, T, V), or an
  output with a ``.logits`` attribute (as transformers models do); V must cover the data's
  vocabulary (256 for bytes). The loss is the mean cross-entropy against the next token.
* Units (what stage 3 gathers and frees together, and what gradients are reduced by): the class
  names in ``--wrap`` (comma-separated), else the model's ``_no_split_modules`` attribute (as
  transformers models declare), else the whole model is one unit (a warning says so).

``--hf config.json``: ``AutoModelForCausalLM.from_config`` of that config (FP32, randomly
initialized; nothing is downloaded), wrapped by its ``_no_split_modules``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeroshard.models.gpt import GPT, preset

# Config keys under which Hugging Face configs give the longest sequence (tokens).
_HF_CONTEXT_KEYS = (
    "max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_seq_len",
    "max_target_positions",  # (Whisper's decoder, which a causal LM trains)
)  # fmt: skip


def kv_heads(config: Any) -> tuple[str, int] | None:
    """The config's key/value head count for grouped-query attention, as (field, value):
    ``num_key_value_heads``, or Falcon's ``num_kv_heads`` where its new decoder architecture
    uses it; None when the config has none."""
    value = config.get("num_key_value_heads")
    if isinstance(value, int):
        return "num_key_value_heads", value
    value = config.get("num_kv_heads")
    if isinstance(value, int) and config.get("new_decoder_architecture"):
        return "num_kv_heads", value
    return None


@dataclass(frozen=True, eq=False)
class BuiltModel:
    """A model ready to shard, and how to cut it into units."""

    module: nn.Module
    unit_classes: tuple[str, ...]
    """Class names whose instances become units (empty: the whole model is one unit)."""
    name: str
    """What was built, for the summary (the preset, the factory, or the config's model type)."""
    param_init_fn: Callable[[nn.Module], None] | None = None
    """For a model on the meta device: initializes one module's own parameters."""


def import_factory(spec: str, *, named: str | None = None) -> Callable[[], nn.Module]:
    """The callable named by ``"package.module:attr"``; a ValueError with the fix otherwise,
    beginning with ``named`` (default ``model = 'spec'``, the setting that gave it)."""
    said = named or f"model = {spec!r}"
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"{said}: cannot import {module_name} ({exc}); put its folder on PYTHONPATH or pip "
            "install its package"
        ) from None
    except Exception as exc:  # its own code raised: a bug there (it was a launcher's traceback)
        raise ValueError(
            f"{said}: importing {module_name} raised {_where(exc)}; fix the module (`python -c "
            f"'import {module_name}'` shows the whole traceback)"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{said}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{said}: {attr} is a {type(obj).__name__}, not a callable")
    try:
        inspect.signature(obj).bind()
    except TypeError as exc:
        raise ValueError(
            f"{said}: the factory is called with no arguments, and {attr} needs some "
            f"({exc}); give them defaults, or name a wrapper that passes them"
        ) from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass
    return obj


def _where(exc: Exception) -> str:
    """``exc`` in one line, with the file and line that raised it."""
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} ({exc.filename}, line {exc.lineno})"
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{at}"


def _call_factory(spec: str) -> Any:
    """``factory()``; a factory that exits (``sys.exit``) is said so instead of passing its
    status for ours (3 would read as divergence), and the bad input it refuses with a
    ValueError is said as the setting's (it was the factory's message alone)."""
    factory = import_factory(spec)
    try:
        return factory()
    except ValueError as exc:
        raise ValueError(f"model = {spec!r}: {exc}") from exc
    except SystemExit as exc:
        raise ValueError(
            f"model = {spec!r}: the factory exited (sys.exit({exc.code!r})) instead of "
            "returning a module; raise an exception there to say why"
        ) from None


def read_hf_config(path: str) -> dict:
    """The JSON of an ``--hf`` config file, checked to be one; a ValueError otherwise."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        config = json.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"hf = {path!r}: cannot read {p} ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"hf = {path!r}: {p} is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"hf = {path!r}: {p} has no model_type; pass a Hugging Face config.json")
    return config


def hf_context_len(config: dict) -> int | None:
    """The longest sequence (tokens) a Hugging Face config declares, if it declares one."""
    for key in _HF_CONTEXT_KEYS:
        if isinstance(config.get(key), int):
            return config[key]
    return None


def build_model(
    *,
    preset_name: str,
    model: str | None,
    hf: str | None,
    wrap: str | None,
    vocab_size: int,
    meta_init: bool = False,
) -> BuiltModel:
    """The run's model (see the module docstring); call after seeding torch. ``vocab_size`` is
    the data's: the GPT preset is built with it, an ``--hf`` config must cover it. With
    ``meta_init`` a preset or a factory is built under ``torch.device("meta")`` (no storage; the
    sharding materializes it unit by unit)."""
    building = torch.device("meta") if meta_init else contextlib.nullcontext()
    wrap_names = tuple(n.strip() for n in wrap.split(",") if n.strip()) if wrap else ()
    if wrap and not wrap_names:
        raise ValueError(f"wrap = {wrap!r} names no class; pass class names, e.g. --wrap Block")
    if hf:
        module, name = _build_hf(hf, vocab_size), read_hf_config(hf)["model_type"]
    elif model:
        with building:
            module, name = _call_factory(model), model
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"model = {model!r} returned a {type(module).__name__}, not an nn.Module"
            )
        _check_forward(module, model)
    else:
        with building:
            gpt = GPT(dataclasses.replace(preset(preset_name), vocab_size=vocab_size))
        check_wrap_names(gpt, wrap_names)
        return BuiltModel(gpt, wrap_names or ("Block",), preset_name, gpt.init_module)
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"{name} has no trainable parameter (every one has requires_grad=False, or it has "
            "none): there is nothing to train; leave some parameters trainable"
        )
    check_wrap_names(module, wrap_names)
    declared = getattr(module, "_no_split_modules", None) or ()
    declared = (declared,) if isinstance(declared, str) else tuple(sorted(declared))
    return BuiltModel(module, wrap_names or declared, name)


def _check_forward(module: nn.Module, spec: str) -> None:
    """The module's forward can be called as training calls it, ``module(idx_BT)`` (a forward
    needing more failed in the first step, a traceback from every rank), and a Hugging Face
    model it is one that next-token training means something for (``_hf_fits``)."""
    _hf_fits(module, spec)
    try:
        inspect.signature(module.forward).bind(None)
    except TypeError as exc:
        raise ValueError(
            f"model = {spec!r}: training calls {type(module).__name__}(idx) with one tensor of "
            f"token ids (B, T), and its forward cannot take that ({exc}); give its other "
            "arguments defaults, or return a wrapper module whose forward takes the ids only"
        ) from None
    except ValueError:  # no signature to read: calling it will tell
        pass


_SEES_ITS_TARGET = "so next-token training would let each position see the token it predicts"
"""Why a model that attends both ways is refused (``--hf`` and ``--model`` alike)."""


def _hf_fits(module: nn.Module, spec: str) -> None:
    """A ValueError when ``module`` is a transformers model (or a peft adapter around one) that
    next-token training does not fit, as ``--hf`` refuses them: an encoder-decoder (called with
    the ids alone, its decoder failed for want of its own: "You must specify exactly one of
    input_ids or inputs_embeds"), a masked LM or an encoder built without ``is_decoder`` (each
    position sees the token it predicts: trained without a word). A module of the user's
    around one, which takes the ids and returns logits, is the user's to vouch for."""
    get_base = getattr(module, "get_base_model", None)  # (peft's PeftModel)
    hf = get_base() if callable(get_base) else module
    if not type(hf).__module__.startswith("transformers."):
        return
    config, name = getattr(hf, "config", None), type(hf).__name__
    if getattr(config, "is_encoder_decoder", False) is True:
        raise ValueError(
            f"model = {spec!r}: {name} is an encoder-decoder (its config's is_encoder_decoder), "
            "whose decoder needs token ids of its own; training calls the model with one tensor "
            "of token ids (B, T): return a wrapper module whose forward takes them and returns "
            "logits (B, T, V), or train a decoder-only model"
        )
    try:
        from transformers.models.auto import modeling_auto as auto
    except ImportError:  # (a transformers model, and transformers does not import: it will say)
        return
    causal = set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if name in set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.values()) - causal:
        raise ValueError(
            f"model = {spec!r}: {name} is a masked language model, whose encoder attends both "
            f"ways, {_SEES_ITS_TARGET}; train a causal (decoder) model"
        )
    if config is not None and _attends_both_ways(config):
        raise ValueError(
            f"model = {spec!r}: {name} is a {config.model_type} encoder that attends both ways, "
            f"{_SEES_ITS_TARGET}; build it with is_decoder=True in its config (a causal "
            "decoder), or train a decoder model"
        )


def check_wrap_names(module: nn.Module, names: tuple[str, ...]) -> None:
    """Every class that --wrap names is the class of some submodule (one mistyped beside one
    that matches was ignored without a word)."""
    present = {type(m).__name__ for n, m in module.named_modules() if n}
    missing = [n for n in names if n not in present]
    if missing:
        raise ValueError(
            f"wrap = {','.join(names)!r}: no submodule of {type(module).__name__} is a "
            f"{', '.join(missing)}; classes of its submodules: {', '.join(sorted(present))}"
        )


def _build_hf(path: str, vocab_size: int) -> nn.Module:
    config = read_hf_config(path)
    if config.get("vocab_size", vocab_size) < vocab_size:
        raise ValueError(
            f"hf = {path!r}: vocab_size {config['vocab_size']} is smaller than the data's "
            f"{vocab_size}; raise vocab_size in the config or pass a matching --tokenizer"
        )
    from zeroshard.planner.hf import check_sizes  # (the planner builds on this module)

    check_sizes(config, f"hf = {path!r}")  # (before transformers: its model fails later)
    config = hf_config(path)  # (first: it says when transformers is missing)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (AssertionError, KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        # (a field its config takes and its model cannot build with; not memory running out)
        said = " ".join(line.strip() for line in str(exc).splitlines())
        if isinstance(exc, RuntimeError) and "alloc" in said:
            raise
        if isinstance(exc, ValueError) and "Unrecognized configuration class" in said:
            raise ValueError(
                f"hf = {path!r}: model_type {config.model_type!r} is not a causal (decoder-only) "
                "language model, which --hf builds (AutoModelForCausalLM has no class for it, as "
                "for encoder-decoders such as T5, encoders such as BERT, vision and speech "
                "models); use a decoder-only config (GPT-2, Llama, Qwen2, ...) or "
                "--model pkg.mod:factory for a model of your own"
            ) from None
        raise ValueError(
            f"hf = {path!r}: transformers cannot build a {config.model_type} model from this "
            f"config ({type(exc).__name__}: {said or 'no message'}); fix the field it names"
        ) from None
    named = list(getattr(config, "architectures", None) or [])
    base = type(getattr(model, "base_model", model)).__name__  # ("LlamaModel": its backbone)
    if named and type(model).__name__ not in named and base not in named:
        # it would train one model and its checkpoints and exports would name another
        raise ValueError(
            f"hf = {path!r}: its architectures name {', '.join(named)}, but --hf trains the "
            f"causal language model {type(model).__name__} (AutoModelForCausalLM); set "
            f'"architectures": ["{type(model).__name__}"] in the config (or drop it), or '
            "train a model of your own with --model pkg.mod:factory"
        )
    return model


_ENCODERS = ("bert", "roberta", "xlm-roberta", "electra", "camembert", "ernie", "rembert")
"""Encoder families whose causal-LM class attends both ways unless ``is_decoder`` is set (where
its source cannot be read; ``_attends_both_ways`` reads it)."""


def _attends_both_ways(config: Any) -> bool:
    """Whether the causal-LM class transformers builds for ``config`` is an encoder's that
    attends both ways without ``is_decoder``: its constructor consults the flag (BERT's family
    warns "add is_decoder=True" there, Reformer asserts it; BART's decoder sets it itself)."""
    if getattr(config, "is_decoder", False):
        return False
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        source = inspect.getsource(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__init__)
    except (ImportError, KeyError, OSError, TypeError, RuntimeError):  # (its import failed)
        return config.model_type in _ENCODERS
    return "is_decoder" in source and "is_decoder = True" not in source


def hf_config(path: str) -> Any:
    """The ``transformers`` config of an ``--hf`` file, validated by transformers; a ValueError
    naming the problem when it refuses it, or when it would build a model that sees the next
    token (an encoder without ``is_decoder``: next-token training would be no such thing)."""
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise ValueError(f"--hf needs transformers ({exc}); pip install transformers") from None
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers' validators raise classes of their own
        said = " ".join(line.strip() for line in str(exc).splitlines()) or type(exc).__name__
        raise ValueError(f"hf = {path!r}: transformers refuses this config: {said}") from None
    if _attends_both_ways(config):
        raise ValueError(
            f"hf = {path!r}: a {config.model_type} config builds an encoder that attends both "
            f'ways, {_SEES_ITS_TARGET}; set "is_decoder": true in the config (a causal '
            "decoder), or train a decoder model"
        )
    return config


def logits_of(output: Any, idx_BT: torch.Tensor) -> torch.Tensor:
    """The logits (B, T, V) of a model's output for the token ids ``idx_BT``: the tensor itself
    or its ``.logits``; a ValueError naming the shape when it is not that (logits with swapped
    axes, or one position short, were read as a small vocabulary or a batch-size mismatch)."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3:
        got = type(output).__name__
        if isinstance(logits, torch.Tensor):
            got = f"a tensor of shape {tuple(logits.shape)}"
        raise ValueError(
            f"the model returned {got}; a --model must return logits (B, T, V) or an output "
            "with .logits"
        )
    if logits.shape[:2] != idx_BT.shape:
        raise ValueError(
            f"the model returned logits of shape {tuple(logits.shape)} for token ids of shape "
            f"{tuple(idx_BT.shape)}; a --model must return logits (B, T, V): batch, then one "
            "row per input position, then the vocabulary"
        )
    return logits
