"""Hugging Face models for the planner: read a config, build the model it describes on the meta
device (no parameter memory, no download), and find its units as the engine would.

``transformers`` is optional: ``build`` raises ``ImportError`` without it, and
``zeroshard.planner.describe.from_hf_config`` then falls back to the shape formula with a warning.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping

from zeroshard.models.loading import kv_heads

# Model heads tried in order when the config names no ``architectures``: a causal LM is what
# ``zeroshard train --hf`` trains; encoder-decoders (T5) and encoders (BERT) have their own.
AUTO_CLASSES = (
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForMaskedLM",
    "AutoModel",
)


def load_config(path: str) -> dict:
    """The dict of a ``config.json`` file, a folder holding one, or (with ``transformers``) a hub
    name already in the local cache."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if os.path.isfile(file):
        try:
            with open(file, encoding="utf-8") as f:
                found = json.load(f)
        except ValueError as exc:  # not JSON (UnicodeDecodeError is a ValueError too)
            raise ValueError(f"{file} is not a JSON config: {exc}") from None
        if not isinstance(found, dict):
            raise ValueError(f"{file} holds a JSON {type(found).__name__}, not a config object")
        check_sizes(found, file)
        return found
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(
            f"{path!r} is not a config.json file or folder, and reading a hub name needs "
            "transformers: pip install 'zeroshard[hf]'"
        ) from None
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True).to_dict()
    except (OSError, ValueError) as exc:  # not a file, folder or cached hub name
        raise ValueError(
            f"{path!r} is not a config.json file, a folder holding one, or a hub name in the "
            f"local cache ({type(exc).__name__}); pass the path of the model's config.json"
        ) from None


SIZE_KEYS = (
    "n_layer", "num_hidden_layers", "num_layers", "vocab_size", "n_embd", "hidden_size",
    "d_model", "n_head", "num_attention_heads", "num_heads", "n_positions",
    "max_position_embeddings", "intermediate_size", "d_ff", "n_inner", "num_key_value_heads",
    "num_kv_heads", "encoder_layers", "decoder_layers", "ffn_dim", "encoder_ffn_dim",
    "decoder_ffn_dim", "num_local_experts", "max_target_positions",
)  # fmt: skip
"""Config fields that count something (layers, tokens, features, heads): positive when set."""


def check_sizes(config: dict, file: str) -> None:
    """A size field of 0 or less, or given as text, is named with its value (it was planned as
    given, or failed later on a symptom: a wrap class matching nothing for 0 layers, "invalid
    literal for int()" naming no field); so are grouped-query heads that do not group.
    ``file``: how the messages name the config (``zeroshard train`` checks it too)."""
    for key in SIZE_KEYS:
        value = config.get(key)
        if isinstance(value, str):
            raise ValueError(f"{file}: {key} = {value!r}; it counts something: write a number")
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            raise ValueError(f"{file}: {key} = {value}; it counts something: set it to 1 or more")
    heads, (key, groups) = config.get("num_attention_heads"), kv_heads(config) or ("", 0)
    if isinstance(heads, int) and groups >= 1 and heads % groups:
        raise ValueError(
            f"{file}: num_attention_heads = {heads} is not a multiple of {key} = {groups}; "
            "grouped-query attention shares each key/value head among a whole number of query "
            "heads: use a divisor of num_attention_heads"
        )


def config_values(config) -> Mapping:
    """The key/value view of a config dict, a ``PretrainedConfig`` or any object with attributes."""
    if isinstance(config, Mapping):
        return config
    return config.to_dict() if hasattr(config, "to_dict") else vars(config)


@contextlib.contextmanager
def quiet_transformers():
    """transformers logs config advice (token ids, ``is_decoder``, ``loss_type``) while building
    and running a model; the planner has nothing to do with it. The verbosity is restored on the
    way out; without transformers nothing is done."""
    try:
        from transformers.utils import logging
    except ImportError:
        yield
        return
    before = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(before)


def build(config, *, device: str = "meta"):
    """The model ``config`` describes, built on ``device`` (meta: no memory): the class its
    ``architectures`` names, else the first of ``AUTO_CLASSES`` that accepts it. ``config`` is a
    ``PretrainedConfig`` or a config dict with ``model_type``. Raises ``ImportError`` without
    transformers, ``ValueError`` when no class takes the config."""
    import torch
    import transformers

    with quiet_transformers():
        if not isinstance(config, transformers.PretrainedConfig):
            values = dict(config_values(config))
            model_type = values.get("model_type")
            if not model_type:
                raise ValueError("the config has no model_type, so transformers cannot read it")
            from transformers import CONFIG_MAPPING

            if model_type not in CONFIG_MAPPING:
                raise ValueError(f"transformers {transformers.__version__} has no {model_type!r}")
            config = CONFIG_MAPPING[model_type].from_dict(values)
        names = list(getattr(config, "architectures", None) or [])
        unknown = [n for n in names if not hasattr(transformers, n)]
        if unknown:  # (the Auto classes instead built another model without a word)
            raise ValueError(
                f"the config's architectures names {unknown[0]!r}, which transformers "
                f"{transformers.__version__} does not have; correct it or remove architectures"
            )
        classes = [getattr(transformers, n) for n in names]
        problems = []
        for cls in classes or [getattr(transformers, n) for n in AUTO_CLASSES]:
            make = cls.from_config if cls.__name__.startswith("Auto") else cls
            try:
                with torch.device(device):
                    return make(config)
            except ValueError as exc:  # an Auto class that does not take this config
                problems.append(f"{cls.__name__}: {str(exc).splitlines()[0]}")
    raise ValueError("no model class takes the config: " + "; ".join(problems))
