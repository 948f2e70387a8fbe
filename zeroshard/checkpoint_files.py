"""The files of a checkpoint folder: checksums, fsync, atomic publishing, keeping the last K.

Every rank of a save or load takes part (the object collectives below run on the model's group);
see ``zeroshard.checkpoint`` for the folder's layout and the order in which it is written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash

META_FILE = "zeroshard.json"
TMP, OLD, GONE = ".tmp-", ".old-", ".gone-"
"""Suffixes of a save's folder before it is published, of the checkpoint it replaces while it
does, and of one being removed (``prune``): each renamed in one step, so a crash at any moment
leaves every complete checkpoint whole under a name that says what it is."""
STALE_TMP_S = 3600.0
"""Another run's ``.tmp-`` folder unchanged this long (seconds) is a save that died."""
LEGACY_RUN = "legacy"
"""The run of checkpoints saved before runs were recorded (``run_id``), and of runs resumed
from one."""
_CHUNK_BYTES = 8 * 2**20  # read size when hashing
_HASH_THREADS = 4  # files each rank hashes at once (xxhash and file reads release the GIL)
log = logging.getLogger(__name__)
NUMBERED = re.compile(r"^(?P<prefix>.*?)(?P<num>\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read as asked; the message says what to do."""


class NotACheckpoint(CheckpointError):
    """A folder passed as a checkpoint that is none (a run's folder of them, an export): the
    caller's mistake, not a damaged checkpoint."""


# --------------------------------------------------------------------- collectives on objects


def broadcast(obj: Any, group) -> Any:
    """Rank 0's ``obj`` on every rank of ``group``."""
    box = [obj]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]


def gather(obj: Any, group) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def agree(error: str | None, group) -> None:
    """Raise the first rank's error on every rank (no rank left waiting in a collective)."""
    errors = [e for e in gather(error, group) if e]
    if errors:
        raise CheckpointError(errors[0])


# --------------------------------------------------------------------- files


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fsync_file(path)  # a directory opened read-only can be fsynced on POSIX


def hash_file(path: Path) -> str:
    return hash_with_chunks(path, [])[0]


def hash_with_chunks(path: Path, bounds: list[tuple[int, int]]) -> tuple[str, list[str]]:
    """The xxh3_64 of the file at ``path`` and of each of its byte ranges ``bounds`` ((offset,
    length), sorted, not overlapping), in one pass over the file."""
    whole = xxhash.xxh3_64()
    parts = [xxhash.xxh3_64() for _ in bounds]
    pos, first = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK_BYTES):
            whole.update(block)
            end = pos + len(block)
            while first < len(bounds) and sum(bounds[first]) <= pos:
                first += 1  # (ranges wholly before this block are done)
            j = first
            while j < len(bounds) and bounds[j][0] < end:
                offset, length = bounds[j]
                lo, hi = max(offset, pos), min(offset + length, end)
                if lo < hi:
                    parts[j].update(memoryview(block)[lo - pos : hi - pos])
                j += 1
            pos = end
    return whole.hexdigest(), [h.hexdigest() for h in parts]


def chunk_bounds(storage_data: dict, name: str) -> list[tuple[int, int, tuple[str, ...]]]:
    """The chunks DCP stored in data file ``name``: (offset, length, the names of the tensors
    whose pieces they hold), by offset (``storage_data``: a DCP ``Metadata``'s)."""
    chunks: dict[tuple[int, int], list[str]] = {}
    for index, info in storage_data.items():
        if info.relative_path == name:
            chunks.setdefault((info.offset, info.length), []).append(index.fqn)
    return [(o, n, tuple(dict.fromkeys(fqns))) for (o, n), fqns in sorted(chunks.items())]


def damaged_tensors(
    folder: Path, name: str, want: dict[str, Any], storage_data: dict, size: int | None = None
) -> list[str]:
    """The tensors whose stored pieces in data file ``name`` are damaged: those past the end of
    a file cut short at ``size`` bytes; else those whose chunks' checksums differ from the ones
    recorded at save (``want["chunks"]``; none recorded: not known, empty)."""
    chunks = chunk_bounds(storage_data, name)
    if size is not None:
        return [fqn for o, n, fqns in chunks if o + n > size for fqn in fqns]
    recorded = want.get("chunks")
    if not isinstance(recorded, list) or len(recorded) != len(chunks):
        return []
    try:
        _, now = hash_with_chunks(folder / name, [(o, n) for o, n, _ in chunks])
    except OSError:
        return []
    return [fqn for (_, _, fqns), a, b in zip(chunks, now, recorded) if a != b for fqn in fqns]


def data_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != META_FILE)


def file_record(folder: Path, name: str, storage_data: dict) -> dict[str, Any]:
    """``zeroshard.json``'s record of file ``name``: ``{"bytes", "xxh3_64"}``, and ``"chunks"``,
    the xxh3_64 of each chunk by offset, where ``storage_data`` (DCP's
    ``Metadata.storage_data``) places chunks in it."""
    bounds = [(o, n) for o, n, _ in chunk_bounds(storage_data, name)]
    whole, chunks = hash_with_chunks(folder / name, bounds)
    out = {"bytes": (folder / name).stat().st_size, "xxh3_64": whole}
    return out | {"chunks": chunks} if chunks else out


def hash_share(
    folder: Path, names: list[str], group, storage_data: dict
) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes", "xxh3_64"}}`` of ``names``, plus ``"chunks"`` for the data files
    ``storage_data`` (DCP's ``Metadata.storage_data``) places chunks in: each chunk's xxh3_64
    by offset, so that a damaged file names the tensors it reaches (``damaged_tensors``). Each
    rank hashes every world_size-th file (each was fsynced by its writer: DCP with
    ``sync_files``, ``_write_bytes``), the results are gathered on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    def entry(name: str) -> dict[str, Any]:
        return file_record(folder, name, storage_data)

    share = names[rank::world]
    with ThreadPoolExecutor(max_workers=max(1, min(_HASH_THREADS, len(share)))) as pool:
        mine = dict(zip(share, pool.map(entry, share), strict=True))
    merged: dict[str, dict[str, Any]] = {}
    for part in gather(mine, group):
        merged.update(part)
    return {name: merged[name] for name in names}


def _use_another(folder: Path) -> str:
    """How to go on without a damaged checkpoint: a training run refuses to resume from an
    earlier one while this one lies beside it (a roll-back), so it must leave the folder."""
    return (
        f"use another checkpoint: move {folder.name} out of {folder.parent} (e.g. to "
        f"{folder.name}-damaged), then use the one before it (training: --resume auto)"
    )


def missing(folder: Path, name: str) -> str:
    """The error for a file a checkpoint lists but lacks."""
    return f"checkpoint {folder} lacks its file {name}; it is damaged: {_use_another(folder)}"


def corrupted(
    folder: Path,
    name: str,
    size: int | None = None,
    want: int | None = None,
    tensors: Sequence[str] = (),
) -> str:
    """The error for a file whose checksum is not the one recorded at save, or whose ``size``
    (bytes) is not ``want`` (the recorded size, or at least the end of a tensor it holds);
    ``tensors``: those the damage reaches (``damaged_tensors``), named."""
    why = (
        "its xxh3_64 checksum differs from the one recorded at save"
        if size is None
        else f"it is {size:,} bytes, {want:,} expected: cut short or appended to"
    )
    if tensors:
        more = f" and {len(tensors) - 3} more" if len(tensors) > 3 else ""
        named = ", ".join(repr(t) for t in tensors[:3])
        why += f"; damaged: {'tensor' if len(tensors) == 1 else 'tensors'} {named}{more}"
    return f"checkpoint file {folder / name} is corrupted ({why}); {_use_another(folder)}"


def check_file(
    folder: Path, name: str, want: dict[str, Any], storage_data: dict | None = None
) -> str | None:
    """Why the file ``name`` of ``folder`` is not as recorded at save (None when it is); with
    ``storage_data`` (DCP's ``Metadata.storage_data``), naming the tensors a damage reaches."""
    path, storage_data = folder / name, storage_data or {}
    if not path.is_file():
        return missing(folder, name)
    size = path.stat().st_size
    if size != want["bytes"]:
        cut = damaged_tensors(folder, name, want, storage_data, size)
        return corrupted(folder, name, size, want["bytes"], cut)
    if hash_file(path) != want["xxh3_64"]:
        return corrupted(folder, name, tensors=damaged_tensors(folder, name, want, storage_data))
    return None


CHECKPOINT_FILE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp|rank-\d+\.pt|zeroshard\.json)$")


def replace_problem(path: Path) -> str | None:
    """Why a save may not replace what is at ``path`` (None when it may): only a checkpoint
    (complete or not: every file one of a checkpoint's), an empty folder or nothing; anything
    else is the user's, and the save is refused before it writes."""
    if path.is_symlink():
        return (
            f"{path} is a symbolic link: a save replaces the folder at its path, not what it "
            "points to; save to the target folder itself"
        )
    if CHECKPOINT_FILE.match(path.name):
        return (
            f"{path} names one of a checkpoint's files; a checkpoint is a folder: save to "
            f"{path.parent}"
        )
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return (
            f"{blocker} is a file, and the checkpoint {path} would be a folder inside it; save "
            "to a path under a folder, or move the file away"
        )
    if not path.exists():
        return None
    if not path.is_dir() or not all(CHECKPOINT_FILE.match(f.name) for f in path.iterdir()):
        return (
            f"{path} exists and is not a zeroshard checkpoint: a save there would replace it and "
            "everything in it; save to another path (e.g. a subfolder), or remove it first"
        )
    return None


def publish(tmp: Path, path: Path) -> None:
    """Rank 0: rename ``tmp`` to ``path``; an existing ``path`` is moved aside, then removed (put
    back if the rename fails)."""
    old = None
    if path.exists():
        old = path.with_name(path.name + OLD + tmp.name.rsplit(TMP, 1)[1])
        os.replace(path, old)
        fsync_dir(path.parent)
    try:
        os.replace(tmp, path)
    except OSError:  # (a rename that failed, not a process that died: that one stays aside)
        if old is not None:  # the previous checkpoint back under its name
            os.replace(old, path)
            fsync_dir(path.parent)
        raise
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)  # (another run's prune may have removed it)


def prune(path: Path, keep: int, run_id: str) -> None:
    """Remove complete numbered siblings of ``path`` saved by run ``run_id`` beyond the newest
    ``keep`` (never ``path``; another run's, e.g. ``seed1`` beside ``seed2``, are kept), and
    what earlier saves of the same prefix left when they stopped: ``.tmp-`` folders of this
    run's saves that died before their rename (named ``.tmp-<run_id[:8]>...``; a killed rank:
    a run's saves go one at a time, so none is in flight once ``path`` is in place) and other
    runs' untouched for ``STALE_TMP_S`` (one written now is a save in flight), ``.gone-``
    folders of removals cut short, and the ``.old-`` folder of a replaced checkpoint whose
    replacement is in place."""
    match = NUMBERED.match(path.name)
    if match is None:
        return
    numbered, others = [], []
    for sibling in path.parent.iterdir():
        stem, suffix = split_suffix(sibling.name)
        m = NUMBERED.match(stem)
        if m is None or m["prefix"] != match["prefix"]:
            continue
        replaced = suffix == OLD and (sibling.with_name(stem) / META_FILE).is_file()
        left = suffix == TMP and (sibling.name.rsplit(TMP, 1)[1].startswith(run_id[:8])
                                  or _untouched(sibling, STALE_TMP_S))  # fmt: skip
        if left or suffix == GONE or replaced:
            shutil.rmtree(sibling, ignore_errors=True)
        elif suffix in ("", OLD) and (sibling / META_FILE).is_file():
            if run_of(sibling) != run_id:
                others.append(sibling.name)
                continue
            numbered.append((int(m["num"]), sibling))  # a replaced one whose save stopped, too
    if others:
        log.info("keep=%d counts this run's checkpoints only: %d of other runs kept (%s)",
                 keep, len(others), ", ".join(sorted(others)[:3]))  # fmt: skip
    numbered.sort()
    # Only complete checkpoints count: a damaged one (a file cut short, which ``latest`` passes
    # over) took a place for good, and each later save removed a good one to make room. One
    # older than every kept checkpoint goes with the rest; a newer one is left (a save of its
    # step replaces it).
    from zeroshard.checkpoint_info import info  # (it reads this module's names)

    whole = [(n, s) for n, s in numbered if s == path or info(s).complete]
    oldest_kept = whole[-keep][0] if len(whole) >= keep else -1
    for num, sibling in numbered:
        if num < oldest_kept and sibling != path:
            log.info("removing checkpoint %s: keep=%d keeps the newest of %s*", sibling, keep,
                     match["prefix"])  # fmt: skip
            # Renamed first: a removal cut short leaves no half checkpoint under its own name.
            gone = sibling.with_name(sibling.name + GONE + os.urandom(4).hex())
            os.replace(sibling, gone)
            shutil.rmtree(gone, ignore_errors=True)  # (another run's prune may race it)


def _untouched(folder: Path, seconds: float) -> bool:
    """Whether nothing in ``folder`` (nor the folder) changed in the last ``seconds``."""
    try:
        newest = max([folder.stat().st_mtime, *(f.stat().st_mtime for f in folder.iterdir())])
    except OSError:  # removed meanwhile
        return False
    return newest < time.time() - seconds


def run_of(checkpoint: Path) -> str | None:
    """The ``run_id`` in a checkpoint's metadata (``LEGACY_RUN`` when saved before runs were
    recorded; None when unreadable)."""
    try:
        return json.loads((checkpoint / META_FILE).read_text()).get("run_id") or LEGACY_RUN
    except (OSError, ValueError, AttributeError):
        return None


def split_suffix(name: str) -> tuple[str, str]:
    """``step-000010.tmp-ab12`` -> (``step-000010``, ``.tmp-``); ("name", "") without one. The
    last suffix says what the folder is now (``step-000010.old-ab.gone-cd``: being removed)."""
    found = [(name.rfind(s), s) for s in (TMP, OLD, GONE) if s in name]
    if not found:
        return name, ""
    first = min(i for i, _ in found)
    return name[:first], max(found)[1]


@contextlib.contextmanager
def without_zip_crc32() -> Iterator[None]:
    """``torch.save`` (DCP writes every tensor with it) skips its zip CRC-32 inside: it costs a
    third of the serialization here, and every file gets an xxh3 checksum of its own anyway.
    The switch is process-wide (a ``torch.save`` in another thread meanwhile skips it too: its
    files load all the same); it is restored on exit."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)
