"""A checkpoint folder read without loading it: its metadata (``zeroshard.json``), whether it is
complete, its files' checksums, and the newest complete one of a run. No process group needed.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from pathlib import Path
from typing import Any

from zeroshard.checkpoint_files import (
    CHECKPOINT_FILE,
    META_FILE,
    NUMBERED,
    OLD,
    TMP,
    CheckpointError,
    NotACheckpoint,
    check_file,
    split_suffix,
)

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """What ``info(path)`` reads from a checkpoint folder without loading it."""

    path: str
    complete: bool
    """``zeroshard.json`` present and every file it lists present with its recorded size."""
    problem: str | None = None
    """Why it is not complete (None when it is)."""
    step: int | None = None
    world_size: int | None = None
    tensor_parallel: int = 1
    """Ranks each split layer was split over (the job's world size counts them all)."""
    stage: int | None = None
    param_dtype: str | None = None
    """Compute dtype(s) of the parameters, e.g. ``bfloat16`` (masters are always FP32)."""
    reduce_dtype: str | None = None
    num_params: int | None = None
    zeroshard_version: str | None = None
    optimizers: list[str] | None = None
    """Each optimizer's class (``torch.optim.adamw.AdamW``), in the order saved (None: a
    checkpoint of an earlier version, or one FSDP2 wrote)."""
    size_bytes: int = 0
    """Bytes of every file in the folder."""


def read_meta(path: Path) -> dict[str, Any]:
    """The metadata of a complete checkpoint; a one-line error for anything else."""
    if TMP in path.name:
        raise CheckpointError(
            f"{path} is an incomplete save (a temporary folder never published: the job stopped "
            "while saving); load an earlier checkpoint and delete this folder"
        )
    if not path.exists():
        _check_aside(path)
        raise FileNotFoundError(
            f"no checkpoint at {path}; pass a folder written by zeroshard.checkpoint.save "
            "(zeroshard checkpoint info PATH checks one)"
        )
    if path.is_file():
        folder = path.parent if (path.parent / META_FILE).is_file() else "its folder"
        raise CheckpointError(f"{path} is a file; a checkpoint is a folder: pass {folder}")
    if not (path / META_FILE).is_file():
        for folder in (path / "ckpt", path):  # a run's output folder, or its folder of them
            newest = latest(folder)
            if newest is not None:
                raise NotACheckpoint(
                    f"{path} holds checkpoints but is not one: pass one of them, e.g. the newest, "
                    f"{newest}"
                )
        if path.is_dir() and not any(CHECKPOINT_FILE.match(f.name) for f in path.iterdir()):
            raise NotACheckpoint(
                f"{path} is not a zeroshard checkpoint (none of a checkpoint's files); pass a "
                "folder written by zeroshard.checkpoint.save"
            )
        if (path / ".metadata").is_file() and TMP not in path.name:  # (ours are published
            raise CheckpointError(  # with their META_FILE): FSDP2's, or META_FILE removed
                f"{path} has no {META_FILE}: a torch.distributed.checkpoint folder that "
                "zeroshard.checkpoint.save did not write (FSDP2's dcp.save writes these), or its "
                f"{META_FILE} was removed. Read it with dcp.load({{'model': model.state_dict(), "
                "'optim': opt.state_dict()}, checkpoint_id=PATH) under the keys it was saved "
                "with, then model.load_state_dict and opt.load_state_dict; save it with zeroshard "
                "to export it"
            )
        raise CheckpointError(
            f"{path} is incomplete (no {META_FILE}: the save did not finish, or it is not a "
            "zeroshard checkpoint); load an earlier checkpoint"
        )
    try:
        meta = json.loads((path / META_FILE).read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
            raise ValueError("no list of files")
    except ValueError as exc:  # a torn or hand-edited file (UnicodeDecodeError is one too)
        raise _damaged(path, exc) from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {meta.get('format_version')}, this zeroshard reads "
            f"{FORMAT_VERSION}; load it with the zeroshard version that wrote it "
            f"({meta.get('zeroshard_version')})"
        )
    for name, want in meta["files"].items():  # (read as {"bytes": int, "xxh3_64": str})
        if not _file_entry(want):
            raise _damaged(path, f"the entry of {name} has no size and checksum")
    return meta


def _damaged(path: Path, why: object) -> CheckpointError:
    return CheckpointError(f"{path / META_FILE} is damaged ({why}); load another checkpoint")


def _check_aside(path: Path) -> None:
    """For a missing ``path``: a ``FileNotFoundError`` saying so when a save that stopped while
    replacing it left it under its ``.old-`` name."""
    aside = sorted(path.parent.glob(path.name + OLD + "*")) if path.parent.is_dir() else []
    if aside:
        raise FileNotFoundError(
            f"no checkpoint at {path}, but {aside[0].name} holds the one a save was replacing "
            f"when it stopped; rename it back to {path.name}"
        )


def _file_entry(want: object) -> bool:
    """Whether ``want`` is a data file's record: ``{"bytes": int, "xxh3_64": str}``."""
    if not isinstance(want, dict):
        return False
    size = want.get("bytes")
    return type(size) is int and size >= 0 and isinstance(want.get("xxh3_64"), str)


def verify(path: str | os.PathLike) -> str | None:
    """In one process, no process group: why ``path``'s files are not as recorded at save (a
    file missing, resized or with another checksum), or None when every one matches."""
    folder = Path(path).expanduser()
    files = read_meta(folder)["files"]
    storage_data = _storage_data(folder, files)
    return next(
        (p for n in sorted(files) if (p := check_file(folder, n, files[n], storage_data))), None
    )


def _storage_data(folder: Path, files: dict) -> dict:
    """Where DCP placed each tensor's chunks (its ``.metadata``, read once its own checksum is
    verified); empty when that file is damaged or missing (``verify`` says so)."""
    from zeroshard.checkpoint_reader import Reader

    try:
        return Reader(folder, files).read_metadata().storage_data
    except (CheckpointError, OSError):
        return {}


def info(path: str | os.PathLike) -> CheckpointInfo:
    """What a checkpoint folder holds and whether it is complete (file sizes; no checksums).
    Not a collective. ``FileNotFoundError`` when ``path`` does not exist."""
    path = Path(path).expanduser()
    if not path.is_dir():
        if not path.exists():
            _check_aside(path)
        raise FileNotFoundError(f"no checkpoint folder at {path}; pass a checkpoint folder")
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    try:
        meta = read_meta(path)
    except CheckpointError as exc:
        return CheckpointInfo(path=str(path), complete=False, problem=str(exc), size_bytes=size)
    problem = None
    for name, want in meta["files"].items():
        file = path / name
        if not file.is_file() or file.stat().st_size != want["bytes"]:
            problem = f"file {name} is missing or has the wrong size"
            break
    # What the metadata says of the save, each of its type (a zeroshard.json made by hand or
    # another tool may lack one, give null or a string): the rest unknown, None.
    said = {
        k: v
        for k, v in meta.items()
        if k in _SAID and isinstance(v, _SAID[k]) and not isinstance(v, bool)
    }
    return CheckpointInfo(
        **said, path=str(path), complete=problem is None, problem=problem, size_bytes=size
    )


_SAID = {
    "step": int, "world_size": int, "tensor_parallel": int, "stage": int, "param_dtype": str,
    "reduce_dtype": str, "num_params": int, "zeroshard_version": str, "optimizers": list,
}  # fmt: skip
"""The fields of ``CheckpointInfo`` that ``zeroshard.json`` gives, and their types."""


def step_path(folder: str | os.PathLike, step: int) -> Path:
    """Where a run keeps the checkpoint of ``step``: ``folder/step-000100``."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step is a step count, an int >= 0; got {step!r}")
    return Path(folder).expanduser() / f"step-{step:06d}"


def latest(folder: str | os.PathLike) -> Path | None:
    """The complete numbered checkpoint (``step-*``) with the highest number in ``folder``
    (``info(...).complete``: one with a file missing or cut short is passed over). A checkpoint
    that a save stopped while replacing counts under its ``.old-`` name, the one it has then."""
    for child in _numbered(Path(folder).expanduser()):
        try:
            if info(child).complete:
                return child
        except FileNotFoundError:
            continue  # pruned since it was listed (a running job saves into the folder)
    return None


def passed_over(folder: str | os.PathLike) -> list[CheckpointInfo]:
    """The numbered checkpoints of ``folder`` newer than ``latest(folder)``, which it passed
    over as incomplete (each with its ``problem``), newest first."""
    out = []
    for child in _numbered(Path(folder).expanduser()):
        try:
            found = info(child)
        except FileNotFoundError:
            continue
        if found.complete:
            break
        out.append(found)
    return out


def _numbered(folder: Path) -> list[Path]:
    """The numbered checkpoints (``step-*``) of ``folder``, newest first; one that a save
    stopped while replacing under its ``.old-`` name. Those without metadata are listed too
    (``info`` says why they are incomplete): one that lost its ``zeroshard.json`` (a copy cut
    short) was passed over by ``--resume auto`` without a word."""
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        stem, suffix = split_suffix(child.name)
        m = NUMBERED.match(stem)
        if not m or m["prefix"] != "step-" or suffix not in ("", OLD):
            continue
        if not child.is_dir():
            continue
        if suffix == OLD and (folder / stem / META_FILE).is_file():
            continue  # the replacement is in place: this is only left to remove
        found.append((int(m["num"]), child))
    return [child for _, child in sorted(found, reverse=True)]
