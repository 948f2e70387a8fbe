"""``zeroshard export CHECKPOINT OUT``: a checkpoint's model weights as Hugging Face safetensors.

    zeroshard export out/ckpt/step-000100 out/hf --dtype bf16 --max-shard-size 5GB \\
        --config path/to/hf_model_folder

Writes ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` and
``model.safetensors.index.json`` when the weights exceed ``--max-shard-size``), one output
shard in memory at a time, in one process with no process group. Tied weights are stored once:
those ``--tie ALIAS=SOURCE`` names (repeatable; then no others), else those the checkpoint
recorded as one parameter and those the ``--config`` (a folder with a ``config.json``, or the
file) declares through ``tie_word_embeddings`` and its architecture's tied weights;
``--config`` is copied to OUT too, so OUT loads with ``from_pretrained``. Without ``--config``
(and ``--tie``), a checkpoint of a ``zeroshard train --hf CONFIG`` run uses the copy of
CONFIG it keeps (the config as that run built it, not a file edited since), and says so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from zeroshard import export


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export",
        help="write a checkpoint's model weights as Hugging Face safetensors",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", type=Path, help="a folder written by zeroshard.checkpoint.save")
    p.add_argument("out", type=Path, help="the output folder (created if missing)")
    p.add_argument("--format", choices=["safetensors"], default="safetensors")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating tensors")
    p.add_argument(
        "--max-shard-size", default="2GiB", help="largest output file, e.g. 2GB, 500MiB (2GiB)"
    )
    p.add_argument("--config", type=Path, help="a transformers config.json or its folder")
    p.add_argument(
        "--tie",
        action="append",
        default=None,
        metavar="ALIAS=SOURCE",
        help="store ALIAS only as SOURCE (equal tied weights); repeatable",
    )
    return p


def _ties(values: list[str] | None) -> dict[str, str] | None:
    if values is None:
        return None
    pairs = {}
    for value in values:
        alias, sep, source = value.partition("=")
        if not sep or not alias or not source:
            raise ValueError(
                f"--tie {value!r} must be ALIAS=SOURCE, e.g. lm_head.weight=wte.weight"
            )
        pairs[alias] = source
    return pairs


def _run_s_hf_config(checkpoint: Path) -> Path | None:
    """The ``--hf`` config that ``zeroshard train`` recorded for the run whose checkpoint this
    is: the settings the checkpoint holds, else (older versions) ``OUT_DIR/config.json`` beside
    ``OUT_DIR/ckpt/step-N``, which a later run into that folder may have rewritten (a relative
    path, as earlier versions recorded it, is looked for from here and from the run's folder).
    One that no longer exists is said on stderr: the export then has no config.json, which
    ``from_pretrained`` needs."""
    from zeroshard.cli.resume import config_changes, saved_extra, saved_settings

    recorded = checkpoint.absolute().parent.parent / "config.json"
    settings = saved_settings(recorded, str(checkpoint), quiet=True)
    hf = settings.get("hf") if isinstance(settings, dict) else None
    if not isinstance(hf, str):
        return None
    found = next((p for p in (Path(hf), recorded.parent / hf) if p.exists()), None)
    kept = saved_extra(str(checkpoint)).get("hf_config")
    if isinstance(kept, str):  # the config as the run built it, whatever the file says now
        edited = config_changes(kept, _read(found)) if found is not None else "gone"
        if edited:
            print(f"note: --hf {hf} differs from the config the run trained with ({edited}); "
                  "the checkpoint's own copy is exported", file=sys.stderr)  # fmt: skip
        copy = Path(tempfile.mkdtemp(prefix=_KEPT)) / "config.json"  # (removed by ``run``)
        copy.write_text(kept)
        _MADE.add(copy)
        return copy
    if found is None:
        print(
            f"warning: the run that saved {checkpoint} was trained with --hf {hf}, which is not "
            f"found from here or from {recorded.parent}: no config.json is written; pass "
            "--config PATH (the model's config.json)",
            file=sys.stderr,
        )
    return found


_KEPT = "zeroshard-export-config-"
_MADE: set[Path] = set()  # the checkpoint's config copies this process wrote, to remove


def _read(hf: Path) -> str:
    """An ``--hf`` config (a file or its folder) as JSON text; "" when it is no longer one."""
    from zeroshard.models.loading import read_hf_config

    try:
        return json.dumps(read_hf_config(str(hf)))
    except ValueError:
        return ""


def run(args: argparse.Namespace) -> int:
    config = args.config
    if config is None and args.tie is None and (config := _run_s_hf_config(args.checkpoint)):
        if config in _MADE:
            print("--config: the checkpoint's copy of the --hf config of the run that saved it")
        else:
            print(f"--config {config}: the --hf config of the run that saved it")
    try:
        result = export.export_safetensors(
            args.checkpoint,
            args.out,
            dtype=args.dtype,
            max_shard_bytes=args.max_shard_size,
            tied=_ties(args.tie),
            config=config,
        )
    finally:
        if config in _MADE:
            _MADE.discard(config)
            shutil.rmtree(config.parent, ignore_errors=True)
    what = f"{len(result.weight_map)} tensors, {result.total_size:,} bytes"
    if result.dtype:
        what += f" as {result.dtype}"
    files = result.files if result.index is None else [*result.files, result.index]
    print(f"{result.out_dir}: {what} in {', '.join(files)}")
    for alias, source in result.tied.items():
        print(f"  {alias}: tied to {source}, not stored")
    return 0
