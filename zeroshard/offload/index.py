"""The NVMe tier's index: which tensors a folder holds and the checksums that vouch for them.

``index.json`` maps each tensor name to its swap file, dtype, shape and the xxh3-64 of each of its
blocks, with the block size they were cut at. It is the only record a reopened store trusts: it
is written to a temporary file, fsynced, renamed over the old one (atomic: a reader sees the old
or the new index, never half of one) and the folder is fsynced so the rename itself survives a
crash. A swap file the index does not name was written after the last flush and is not trusted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .tiers import OffloadError, SwapIntegrityError, TensorMeta, dtype_from_str, dtype_to_str

__all__ = [
    "FORMAT",
    "INDEX_NAME",
    "IndexEntry",
    "index_block_bytes",
    "read_index",
    "write_index",
]

INDEX_NAME = "index.json"
FORMAT = "zeroshard.offload/1"


@dataclass(frozen=True)
class IndexEntry:
    """One tensor of the index: what it is, where its bytes are, and their checksums."""

    meta: TensorMeta
    file: str
    """The swap file's name inside the folder."""
    checksums: list[int]
    """xxh3-64 of each block (block i covers bytes [i * block_bytes, (i + 1) * block_bytes))."""


def index_block_bytes(folder: Path) -> int | None:
    """The block size recorded in a folder's index, or None if there is no readable index."""
    try:
        return int(json.loads((folder / INDEX_NAME).read_text())["block_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # read_index reports the precise problem


def write_index(
    folder: Path, *, block_bytes: int, created_folder: bool, entries: Iterable[IndexEntry]
) -> None:
    """Atomically replace ``folder``'s index with ``entries`` (the swap files must be durable
    already: fsync them first, or the index may vouch for bytes a crash lost)."""
    index = {
        "format": FORMAT,
        "block_bytes": block_bytes,
        "created_folder": created_folder,  # so a reopened store removes the folder too
        "tensors": {
            e.meta.name: {
                "file": e.file,
                "dtype": dtype_to_str(e.meta.dtype),
                "shape": list(e.meta.shape),
                "checksums": e.checksums,
            }
            for e in entries
        },
    }
    tmp = folder / (INDEX_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(index, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / INDEX_NAME)  # atomic: readers see the old or the new index
    dir_fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def read_index(folder: Path, *, block_bytes: int) -> tuple[bool, list[IndexEntry]]:
    """``(created_folder, entries)`` of ``folder``'s index, checked against ``block_bytes``.

    A missing index is an OffloadError (the run never flushed), unreadable JSON a
    SwapIntegrityError, another format an OffloadError and another block size a ValueError
    naming the ``OffloadConfig`` to reopen it with.
    """
    path = folder / INDEX_NAME
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise OffloadError(
            f"{folder} has no {INDEX_NAME}: nothing to resume (the run never flushed); "
            f"delete it with TensorStore.discard({str(folder)!r})"
        ) from None
    except json.JSONDecodeError as e:
        raise SwapIntegrityError(f"{path} is not valid JSON: {e}") from e
    if index.get("format") != FORMAT:
        raise OffloadError(f"{path} has format {index.get('format')!r}, expected {FORMAT!r}")
    if index["block_bytes"] != block_bytes:
        raise ValueError(
            f"{path} was written with block_bytes={index['block_bytes']}; reopen it with "
            f"OffloadConfig(block_bytes={index['block_bytes']})"
        )
    entries = [
        IndexEntry(
            meta=TensorMeta(name=name, dtype=dtype_from_str(t["dtype"]), shape=tuple(t["shape"])),
            file=t["file"],
            checksums=list(t["checksums"]),
        )
        for name, t in index["tensors"].items()
    ]
    return bool(index.get("created_folder", False)), entries
