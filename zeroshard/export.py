"""Export a checkpoint's model weights to Hugging Face safetensors files.

    zeroshard.export.export_safetensors("out/ckpt/step-000100", "out/hf", dtype="bf16",
                                        config=model.config)
    transformers.AutoModelForCausalLM.from_pretrained("out/hf")

Single process, no process group: the checkpoint's DCP ``.metadata`` lists the ``model.*``
entries (global shapes and dtypes; the optimizer's entries are never read), the names are split
into output shards of at most ``max_shard_bytes`` (in key order, as ``transformers`` does; a
tensor larger than the limit gets a shard of its own), and each shard's tensors are read with
``torch.distributed.checkpoint.load(..., no_dist=True)`` into freshly allocated full tensors,
written and dropped before the next shard is read: at most one output shard's tensors are held.

Files, as ``save_pretrained`` writes them: ``model.safetensors`` when everything fits one shard,
else ``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``). Every file carries the
metadata ``{"format": "pt"}``. Names are the unsharded model's (the checkpoint already uses them).
Files are written under temporary names and renamed; the index is written last, and
``model*.safetensors`` files of an earlier export in ``out_dir`` that are not part of this one are
removed.

Tied weights. A zeroshard checkpoint stores tied parameters under every name (``lm_head.weight``
and ``transformer.wte.weight`` of GPT-2 hold equal values), and ``zeroshard.json`` records
which names were one tensor, parameter or buffer (``"tied"``, ``{alias: source}``;
checkpoints saved before it recorded none). A name is left out (stored once, under its
source's name) when it is tied:

* ``tied={"lm_head.weight": "transformer.wte.weight"}``: explicit ``{alias: source}`` pairs,
  and nothing else;
* otherwise, with ``config`` (a ``transformers`` config, or a folder / ``config.json`` holding
  one), the pairs of the model it describes: with ``tie_word_embeddings`` true, the
  ``_tied_weights_keys`` of the class its ``architectures`` names (``{alias: source}`` in
  transformers >= 5), and none when false (a tied checkpoint exported as an untied model
  stores both: its head was left out, and ``from_pretrained`` made one at random);
* otherwise the checkpoint's recorded pairs.

A declared pair is checked before anything is written: same shape and ``torch.equal`` values
(else a one-line ``ExportError``: dropping the alias would change the model); the check reads
the two tensors of each pair once more, on their own. ``from_pretrained``
re-ties the alias to its source. ``config`` is also written to ``out_dir`` (``config.json``, with
``architectures`` naming the model class the tensors fit when the config named none), and so is
a generation config (``generation_config.json``: the one beside a config given as a folder or
file, else the model class's defaults from the config, as ``save_pretrained`` writes them), so
the folder loads and generates with ``from_pretrained`` as it is.

``dtype`` casts floating-point tensors (integer and boolean ones are kept as they are).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from collections.abc import Mapping
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch

from zeroshard import checkpoint, precision
from zeroshard.save_pretrained import record_dtype, weights_dtype
from zeroshard.state_dict_layout import COMPILED

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD = "model-{:05d}-of-{:05d}.safetensors"
_OURS = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")
_PREFIX = "model."


class ExportError(ValueError):
    """A checkpoint that cannot be exported as asked; the message says what to do."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportResult:
    """What ``export_safetensors`` wrote."""

    out_dir: str
    files: list[str]
    """The safetensors files written, in order (names relative to ``out_dir``)."""
    index: str | None
    """The index file's name, or None for a single ``model.safetensors``."""
    weight_map: dict[str, str]
    """Every stored name and the file holding it."""
    total_size: int
    """Bytes of the stored tensors (as in the index's ``metadata.total_size``)."""
    tied: dict[str, str]
    """``{alias: source}`` names left out as tied to their source."""
    dtype: str | None
    """The dtype floating-point tensors were cast to (None: as saved)."""


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``dtype`` through the one table of dtype names (``zeroshard.precision.DTYPES``)."""
    try:
        return precision.dtype_of(dtype, what="export dtype")
    except ValueError as exc:
        raise ExportError(str(exc)) from None


def _shard_bytes(max_shard_bytes: int | str) -> int:
    if isinstance(max_shard_bytes, str):
        from zeroshard.planner.units import parse_bytes

        max_shard_bytes = parse_bytes(max_shard_bytes)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int):
        raise ExportError(
            f"max_shard_bytes must be an int or a size like '2GB', got {max_shard_bytes!r}"
        )
    if max_shard_bytes < 1:
        raise ExportError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    return max_shard_bytes


def _load_config(config: Any) -> Any:
    """A ``transformers`` config from a config object, a folder or a ``config.json`` file."""
    if config is None or not isinstance(config, str | os.PathLike):
        return config
    import transformers

    path = Path(config)
    if path.is_file():
        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise ExportError(f"{path} has no model_type; pass a transformers config.json")
        return transformers.AutoConfig.for_model(**data)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}; pass a transformers config or folder")
    return transformers.AutoConfig.from_pretrained(path)


def _write_config(out: Path, config: Any, source: Any, model_cls: type | None) -> None:
    """``config.json`` and ``generation_config.json`` into ``out`` (module docstring); the
    caller's config object is left as it was."""
    import transformers

    config = deepcopy(config)
    if not getattr(config, "architectures", None) and model_cls is not None:
        config.architectures = [model_cls.__name__]  # (serving stacks read it)
    config.save_pretrained(out)
    folder = None
    if isinstance(source, str | os.PathLike):
        folder = Path(source) if Path(source).is_dir() else Path(source).parent
    if folder is not None and (folder / "generation_config.json").is_file():
        transformers.GenerationConfig.from_pretrained(folder).save_pretrained(out)
    elif model_cls is not None and model_cls.can_generate():
        transformers.GenerationConfig.from_model_config(config).save_pretrained(out)


def _umask() -> int:
    """The process's file-creation mask (read by setting it: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _config_tied(config: Any, model_cls: type | None) -> dict[str, str]:
    """``{alias: source}`` that a transformers config declares tied (see the module docstring):
    the ``_tied_weights_keys`` of the config's architectures, else of ``model_cls`` (the class
    its model was built as, when the config names none)."""
    if config is None or not getattr(config, "tie_word_embeddings", False):
        return {}
    import transformers

    archs = [getattr(transformers, a, None) for a in getattr(config, "architectures", None) or []]
    pairs: dict[str, str] = {}
    for cls in [a for a in archs if a is not None] or [model_cls]:
        keys = getattr(cls, "_tied_weights_keys", None)
        if isinstance(keys, Mapping):
            pairs.update({str(k): str(v) for k, v in keys.items()})
    return pairs


def _check_config(config: Any, entries: dict[str, tuple[torch.Size, torch.dtype]]) -> type | None:
    """Raise when ``config``'s model does not hold the checkpoint's tensors (another model's
    config: ``from_pretrained`` would then initialize every weight at random, with a warning
    only). The model is built on the meta device, from a copy of the config (some models'
    constructors rewrite theirs: ``BartForCausalLM`` makes it a decoder), as the config's
    ``architectures`` names it, else as whichever of transformers' model kinds (causal LM,
    seq2seq LM, image classifier, ..., base model) holds most of the checkpoint's tensors with
    their shapes; returns the class of that model (None without a config)."""
    if config is None:
        return None
    best: dict[str, torch.Size] = {}
    best_cls, best_params = None, set()
    best_score = (-1, 0)
    for cls in _model_kinds(config):
        try:
            with torch.device("meta"):
                copy = deepcopy(config)
                model = cls.from_config(copy) if hasattr(cls, "from_config") else cls(copy)
        except Exception:  # this kind of model does not fit the config (ValueError, mostly)
            continue
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        fits = sum(tuple(shapes.get(n, ())) == tuple(e[0]) for n, e in entries.items())
        score = (fits, -len(set(shapes) - set(entries)))
        if score > best_score:
            best, best_cls, best_score = shapes, type(model), score
            best_params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        if fits == len(entries) and set(shapes) <= set(entries):
            break  # every tensor, with its shape, and nothing more: this is the model
    shared = [n for n in entries if n in best]
    misshaped = [n for n in shared if tuple(best[n]) != tuple(entries[n][0])]
    if len(shared) * 2 < len(entries) or misshaped:
        what = (
            f"{len(entries) - len(shared)} of its {len(entries)} tensors are not in it"
            if len(shared) * 2 < len(entries)
            else f"{misshaped[0]} is {tuple(entries[misshaped[0]][0])} in the checkpoint, "
            f"{tuple(best[misshaped[0]])} in the config's model"
        )
        example = next((n for n in entries if n not in best), misshaped[0] if misshaped else "")
        raise ExportError(
            f"--config describes another model than the checkpoint's: {what} (e.g. {example}); "
            "pass the config of the model that was trained, or none"
        )
    # The same body with another head (a classifier's config for a language model's
    # checkpoint): from_pretrained would drop the trained head and make one at random.
    dropped = [n for n in entries if n not in best]
    made = sorted(best_params - set(entries))
    if dropped or made:
        name = best_cls.__name__ if best_cls is not None else "the config's model"
        parts = []
        if dropped:
            parts.append(f"{len(dropped)} of the checkpoint's tensors are not in it ({dropped[0]})")
        if made:
            parts.append(f"it has {len(made)} parameters the checkpoint lacks ({made[0]})")
        raise ExportError(
            f"--config describes another model than the checkpoint's: as {name}, "
            f"{'; '.join(parts)}, which from_pretrained would drop or initialize at random; "
            "pass the config of the model that was trained (its architectures too), or none"
        )
    return best_cls


def _model_kinds(config: Any) -> list[type]:
    """The classes ``config``'s model may have been built as: those its ``architectures``
    names, else every ``transformers.AutoModelFor*`` (language models first) and ``AutoModel``."""
    import transformers

    names = [getattr(transformers, a, None) for a in getattr(config, "architectures", None) or []]
    if named := [c for c in names if c is not None]:
        return named
    first = ["AutoModelForCausalLM", "AutoModelForSeq2SeqLM"]
    rest = sorted(a for a in dir(transformers) if a.startswith("AutoModelFor") and a not in first)
    return [getattr(transformers, a) for a in [*first, *rest, "AutoModel"]]


def _tensor_entries(reader) -> dict[str, tuple[torch.Size, torch.dtype, str]]:
    """``{name: (global shape, dtype, saved name)}`` of the checkpoint's model tensors, in saved
    order. Names are the model's own: a compiled model's checkpoint of an earlier version saved
    them behind ``_orig_mod.`` (exported so, they loaded as no model's weights)."""
    entries = {}
    for key, md in reader.read_metadata().state_dict_metadata.items():
        if key.startswith(_PREFIX) and hasattr(md, "size") and hasattr(md, "properties"):
            name = key.removeprefix(_PREFIX)
            entries[name] = (torch.Size(md.size), md.properties.dtype, name)
    if entries and all(n.startswith(COMPILED) for n in entries):
        entries = {n.removeprefix(COMPILED): e for n, e in entries.items()}
    return entries


def _read(reader_path: Path, names: list[str], entries) -> dict[str, torch.Tensor]:
    """Full tensors of ``names`` read from the checkpoint (single process)."""
    import torch.distributed.checkpoint as dcp

    model = {entries[n][2]: torch.empty(entries[n][0], dtype=entries[n][1]) for n in names}
    if model:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            reader = dcp.FileSystemReader(reader_path)
            dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    return {n: model[entries[n][2]] for n in names}


def _check_tied(path: Path, pairs: dict[str, str], entries, *, explicit: bool) -> dict[str, str]:
    """The declared pairs present in the checkpoint, each checked equal to its source; pairs
    given ``explicit``-ly (``tied=``, ``--tie``) must name tensors it holds."""
    found = {}
    for alias, source in pairs.items():
        unknown = [n for n in (alias, source) if n not in entries]
        if explicit and unknown:
            raise ExportError(
                f"tied pair {alias}={source}: {unknown[0]} is not in {path} (names such as "
                f"{next(iter(entries))}); fix or drop that --tie"
            )
        if unknown or alias == source:
            continue
        if entries[alias][0] != entries[source][0]:
            raise ExportError(
                f"{alias} {tuple(entries[alias][0])} is declared tied to {source} "
                f"{tuple(entries[source][0])} but their shapes differ in {path}; do not tie them "
                "(drop --tie, or set tie_word_embeddings=False in the config)"
            )
        both = _read(path, [alias, source], entries)
        if not torch.equal(both[alias], both[source].to(both[alias].dtype)):
            raise ExportError(
                f"{alias} is declared tied to {source} but their values differ in {path}; "
                "storing one would change the model: do not tie them (drop --tie, or set "
                "tie_word_embeddings=False in the config)"
            )
        found[alias] = source
    return found


def _overflows(cast: torch.Tensor, saved: torch.Tensor) -> bool:
    """Whether casting made inf of finite values (fp16's range ends at 65504)."""
    return cast.is_floating_point() and bool((torch.isinf(cast) & torch.isfinite(saved)).any())


def _plan_shards(sizes: dict[str, int], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def export_safetensors(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int | str = 2 * 2**30,
    tied: Mapping[str, str] | None = None,
    config: Any = None,
) -> ExportResult:
    """Write the model weights of the checkpoint at ``checkpoint_dir`` as safetensors files in
    ``out_dir`` (see the module docstring). Not a collective: one process, no process group."""
    from safetensors.torch import save_file

    path = Path(checkpoint_dir).expanduser().absolute()
    out = Path(out_dir).expanduser().absolute()
    cast = _dtype(dtype)
    limit = _shard_bytes(max_shard_bytes)
    recorded = {  # (one-line errors, a bad folder)
        a.removeprefix(COMPILED): b.removeprefix(COMPILED)
        for a, b in checkpoint.read_meta(path).get("tied", {}).items()
    }
    if out.resolve() == path.resolve() or path.resolve() in out.resolve().parents:
        raise ExportError(  # (inside it, a later save fails on it, and pruning deletes it)
            f"export into {out} would write into the checkpoint {path}; pick an OUT outside it"
        )
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file, not a folder; pick another OUT")
    # Every file's size and checksum as recorded at save: never export damaged weights.
    problem = checkpoint.verify(path)
    if problem is not None:
        raise ExportError(f"checkpoint {path} is damaged ({problem}); export another one")
    if not (path / ".metadata").is_file():
        raise ExportError(f"{path} has no DCP .metadata file; it is damaged: use another one")
    import torch.distributed.checkpoint as dcp

    entries = _tensor_entries(dcp.FileSystemReader(path))
    if not entries:
        raise ExportError(f"checkpoint {path} holds no model tensors; nothing to export")
    source, config = config, _load_config(config)
    model_cls = _check_config(config, entries)
    # A config names the model exported: its own ties, not the trained model's (a tied
    # checkpoint given an untied config dropped the head, which from_pretrained made at random).
    if tied is not None:
        declared = dict(tied)
    elif config is not None:
        declared = _config_tied(config, model_cls)
    else:
        declared = recorded
    dropped = _check_tied(path, declared, entries, explicit=tied is not None)

    def out_dtype(saved: torch.dtype) -> torch.dtype:
        return cast if cast is not None and saved.is_floating_point else saved

    sizes = {
        name: shape.numel() * out_dtype(saved).itemsize
        for name, (shape, saved, _) in entries.items()
        if name not in dropped
    }
    shards = _plan_shards(sizes, limit)
    n = len(shards)
    files = [SINGLE_FILE] if n == 1 else [_SHARD.format(i + 1, n) for i in range(n)]
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    mode = 0o666 & ~_umask()  # what open() gives a new file
    for file, names in zip(files, shards, strict=True):
        tensors = _read(path, names, entries)
        for name in names:
            t = tensors[name]
            tensors[name] = t.to(out_dtype(t.dtype)).contiguous()
            if tensors[name].dtype != t.dtype and _overflows(tensors[name], t):
                for written in weight_map.values():
                    (out / written).unlink(missing_ok=True)
                raise ExportError(
                    f"{name} does not fit in {tensors[name].dtype}: values up to "
                    f"{t.abs().max().item():.3g} become inf; export with --dtype bf16 or as saved"
                )
        tmp = out / (file + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, mode)  # safetensors writes 0600: unreadable to a server
        os.replace(tmp, out / file)
        del tensors
        weight_map.update(dict.fromkeys(names, file))
    total = sum(sizes.values())
    index = None
    if n > 1:
        index = INDEX_FILE
        tmp = out / (INDEX_FILE + ".tmp")
        body = {"metadata": {"total_size": total}, "weight_map": weight_map}
        tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, out / INDEX_FILE)
    keep = set(files) | ({index} if index else set())
    for stale in out.iterdir():
        if stale.is_file() and _OURS.match(stale.name) and stale.name not in keep:
            stale.unlink()
    if config is not None:
        _write_config(out, config, source, model_cls)
        # The files' dtype, not the config's (from_pretrained reads it): that of most elements
        # (a bf16 model's masters are FP32 beside a bf16 buffer of its own).
        files_dtype = weights_dtype(
            torch.empty(shape, dtype=out_dtype(saved), device="meta")
            for name, (shape, saved, _) in entries.items()
            if name not in dropped
        )
        record_dtype(out, files_dtype, None)
    return ExportResult(
        out_dir=str(out),
        files=files,
        index=index,
        weight_map=weight_map,
        total_size=total,
        tied=dropped,
        dtype=None if cast is None else str(cast).removeprefix("torch."),
    )
