"""A faster DCP storage reader: files in threads, elements read straight into the destination.

DCP's ``FileSystemReader`` reads one file after another and every chunk through ``torch.load``
(the chunk's bytes into a buffer, then into a new tensor, then copied into the destination);
verifying the checksums beforehand read every file a second time. ``Reader`` reads ``threads``
files at once per rank (``os.preadv``, which releases the GIL, in reads of up to
``_CHUNK_BYTES``), finds each chunk's elements in its ``torch.save`` zip from the first
``_HEAD_BYTES`` (the zip's local headers and the tensor's pickle, unpickled without its storage)
and reads them into the destination tensor's own memory when it wants the whole chunk in the
saved dtype and is contiguous: no copy besides the kernel's. Other chunks (parts of a saved
chunk when resharding, another dtype, a layout not recognized) are read whole and copied out
(``torch.load`` for a layout not recognized). Bytes entries go to the planner as streams.

Checksums (``files``: ``zeroshard.json``'s ``{name: {"bytes", "xxh3_64"}}``; None: none checked).
The coordinator's global plan gives every listed file to one rank to verify: to the rank that
reads the most of it (at the same world size: each rank its own files), else to the rank with
the fewest bytes to verify so far. That rank reads the whole file in order, hashing every byte
as it lands (in the destination tensor or in a scratch buffer for the bytes it does not need):
each file is read once. A missing, short, resized or corrupted file raises ``CheckpointError``
naming it, on every rank (``read`` turns DCP's ``CheckpointException`` back into it). The
checksum is known once the file is read: a corrupted file fails the load after some of its
bytes reached the destination tensors (load a good checkpoint before training on).
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import math
import os
import pickle
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from zeroshard.checkpoint_files import (
    CheckpointError,
    check_file,
    corrupted,
    damaged_tensors,
    hash_file,
    missing,
)

_CHUNK_BYTES = 64 * 2**20  # one read (and hash update), in bytes
_HEAD_BYTES = 4096  # first read of a chunk: its zip headers and pickle, in bytes
_THREADS = 4  # files each rank reads at once (reads, xxhash and tensor copies release the GIL)


class Reader(FileSystemReader):
    """``FileSystemReader`` reading ``threads`` files at once, into the destination tensors,
    verifying the checksums of ``files`` from the bytes read (None: not verified)."""

    def __init__(
        self,
        path: str | os.PathLike,
        files: dict[str, dict[str, Any]] | None = None,
        *,
        threads: int = _THREADS,
    ) -> None:
        super().__init__(path)
        # The rank files are checked by the rank that reads each, before torch.load
        # (checkpoint_checks.rank_state): not hashed twice.
        self.files = files and {n: w for n, w in files.items() if not n.startswith("rank-")}
        self.threads = max(1, threads)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The global ``.metadata``, unpickled once (``load`` and DCP both ask for it)."""
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = self._checked_metadata()
        return self._metadata

    def _checked_metadata(self) -> Metadata:
        """The ``.metadata``, its checksum verified before it is unpickled (a damaged pickle
        fails in any odd way, or worse, reads as another checkpoint)."""
        folder, name = Path(self.path), ".metadata"
        if self.files is not None and name in self.files:
            problem = check_file(folder, name, self.files[name])
            if problem:
                raise CheckpointError(problem)
        try:
            return super().read_metadata()
        except FileNotFoundError:
            raise CheckpointError(missing(folder, name)) from None
        except Exception as exc:  # unpickling a damaged file raises anything
            raise CheckpointError(
                f"checkpoint file {folder / name} cannot be read ({type(exc).__name__}: {exc}); "
                "it is damaged: use another checkpoint"
            ) from None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._metadata = None

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Give every listed file to one rank to verify (see the module docstring)."""
        if self.files is None:
            return plans
        wanted: list[dict[str, int]] = []
        for plan in plans:
            per_file: dict[str, int] = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                per_file[info.relative_path] = per_file.get(info.relative_path, 0) + info.length
            wanted.append(per_file)
        load = [0] * len(plans)
        mine: list[list[str]] = [[] for _ in plans]
        for name in sorted(self.files):
            size = self.files[name]["bytes"]
            readers = [r for r in range(len(plans)) if wanted[r].get(name)]
            if readers:
                rank = max(readers, key=lambda r: (wanted[r][name], -load[r]))
            else:
                rank = min(range(len(plans)), key=lambda r: (load[r], r))
            load[rank] += size
            mine[rank].append(name)
        return [dataclasses.replace(p, storage_data=m) for p, m in zip(plans, mine, strict=True)]

    def read_data(self, plan: LoadPlan, planner) -> Any:
        """Read this rank's items and verify its files (``plan.storage_data``), ``threads``
        files at once, largest first; a completed future (the reads are done on return)."""
        folder = Path(self.path)
        if self.files is None:
            verify: list[str] = []
        elif plan.storage_data is not None:
            verify = list(plan.storage_data)
        else:  # no global plan seen (a rank-local load): this rank checks every file it reads
            verify = sorted({self.storage_data[i.storage_index].relative_path for i in plan.items})
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for name, want in (self.files or {}).items():  # before any read, on every rank alike:
            try:  # a cut-short file changed some tensors before it raised
                size = (folder / name).stat().st_size
            except FileNotFoundError:
                raise CheckpointError(missing(folder, name)) from None
            if size != want["bytes"]:
                cut = damaged_tensors(folder, name, want, self.storage_data, size)
                raise CheckpointError(corrupted(folder, name, size, want["bytes"], cut))
        names = sorted(set(per_file) | set(verify), key=lambda n: -self._size_of(folder, n))
        lock = threading.Lock()
        metadata = self.read_metadata()

        def one(name: str) -> None:
            _File(self, folder, name, per_file.get(name, []), name in verify).run(
                planner, lock, metadata
            )

        with ThreadPoolExecutor(max_workers=min(self.threads, max(1, len(names)))) as pool:
            for future in [pool.submit(one, n) for n in names]:
                future.result()
        return _done()

    def _size_of(self, folder: Path, name: str) -> int:
        if self.files is not None and name in self.files:
            return self.files[name]["bytes"]
        try:
            return (folder / name).stat().st_size
        except OSError:
            return 0


def _done() -> Any:
    from torch.futures import Future

    fut: Future = Future()
    fut.set_result(None)
    return fut


class _File:
    """One file's part of a rank's reads: walked whole and hashed (``verify``), or only the
    chunks this rank needs."""

    def __init__(self, reader: Reader, folder: Path, name: str, items: list, verify: bool):
        self.reader, self.folder, self.name = reader, folder, name
        self.items, self.verify = items, verify
        self.path = folder / name
        self.hasher = xxhash.xxh3_64() if verify else None
        self._want = reader.files[name] if verify else {}  # {"bytes", "xxh3_64"}

    def run(self, planner, lock: threading.Lock, metadata: Metadata) -> None:
        chunks: dict[int, tuple[Any, list[ReadItem]]] = {}
        for item in self.items:
            info = self.reader.storage_data[item.storage_index]
            chunks.setdefault(info.offset, (info, []))[1].append(item)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(missing(self.folder, self.name)) from None
        try:
            if hasattr(os, "posix_fadvise"):  # a large readahead window: reads of a chunk or
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # two go 5x faster cold
            size = os.fstat(fd).st_size  # (as recorded: ``read_data`` checked every file's)
            pos = 0
            for offset in sorted(chunks):
                info, items = chunks[offset]
                if self.hasher is not None and offset > pos:
                    self._skip(fd, pos, offset)
                try:
                    self._chunk(fd, info, items, planner, lock, metadata)
                except CheckpointError:
                    raise
                except Exception:  # a damaged chunk that does not parse: say so when it is
                    if self.verify and hash_file(self.path) != self._want["xxh3_64"]:
                        raise CheckpointError(self._corrupted()) from None
                    raise
                pos = max(pos, offset + info.length)
            if self.hasher is not None:
                self._skip(fd, pos, size)
                if self.hasher.hexdigest() != self._want["xxh3_64"]:
                    raise CheckpointError(self._corrupted())
        finally:
            os.close(fd)

    def _corrupted(self, size: int | None = None, want: int | None = None) -> str:
        """``corrupted``'s error for this file, naming the tensors the damage reaches: past
        ``size`` bytes, where the file is cut short there; else by the chunks' checksums."""
        tensors = damaged_tensors(
            self.folder, self.name, self._want, self.reader.storage_data, size
        )
        return corrupted(self.folder, self.name, size, want, tensors)

    def _read(self, fd: int, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the file's bytes from ``offset`` (in ``_CHUNK_BYTES`` reads),
        hashing them as they land; a short file raises."""
        pos, total = 0, len(view)
        while pos < total:
            part = view[pos : min(total, pos + _CHUNK_BYTES)]
            got = os.preadv(fd, [part], offset + pos)
            if got <= 0:
                size = os.fstat(fd).st_size
                raise CheckpointError(self._corrupted(size, offset + total))
            if self.hasher is not None:
                self.hasher.update(part[:got])
            pos += got

    def _skip(self, fd: int, lo: int, hi: int) -> None:
        """Read (and hash) bytes ``[lo, hi)`` that no chunk of this rank needs."""
        scratch = memoryview(bytearray(min(_CHUNK_BYTES, max(0, hi - lo))))
        while lo < hi:
            n = min(len(scratch), hi - lo)
            self._read(fd, scratch[:n], lo)
            lo += n

    def _chunk(self, fd: int, info, items: list, planner, lock, metadata) -> None:
        """One stored chunk (``torch.save``-d at ``info.offset``): its elements read straight
        into the destination when one item wants all of it in its dtype, else read whole and
        copied out for each item."""
        if info.transform_descriptors:
            raise CheckpointError(f"{self.path}: transformed checkpoint chunks are not supported")
        head = memoryview(bytearray(min(info.length, _HEAD_BYTES)))
        self._read(fd, head, info.offset)
        if len(items) == 1 and info.length > len(head):
            direct = self._direct(fd, info, items[0], head, planner, lock, metadata)
            if direct:
                return
        whole = bytearray(info.length)
        whole[: len(head)] = head
        rest = memoryview(whole)[len(head) :]
        if len(rest):
            self._read(fd, rest, info.offset + len(head))
        for item in items:
            _load_item(item, memoryview(whole), planner, lock, metadata, self.path)

    def _direct(self, fd, info, item, head: memoryview, planner, lock, metadata) -> bool:
        """Read the chunk's elements into the destination tensor itself (True), or nothing
        (False: not the plain layout, a part of the chunk, another dtype or a strided
        destination; ``head`` is then all that was read)."""
        if item.type == LoadItemType.BYTE_IO:
            return False
        layout = _layout(head, metadata, item)
        if layout is None:
            return False
        start, found = layout
        if any(item.storage_offsets) or tuple(item.lengths) != found.size:
            return False
        nbytes = math.prod(found.size) * found.dtype.itemsize
        if start + nbytes > info.length:
            return False
        with lock:
            target = planner.resolve_tensor(item).detach()
        if (
            target.dtype != found.dtype
            or tuple(target.size()) != found.size
            or target.device.type != "cpu"
            or not target.is_contiguous()
            or nbytes == 0
        ):
            return False
        done = len(head)  # the chunk's bytes [0, done) are read (and hashed)
        if start > done:
            self._read(fd, memoryview(bytearray(start - done)), info.offset + done)
            done = start
        memory = memoryview((ctypes.c_char * nbytes).from_address(target.data_ptr())).cast("B")
        have = max(0, min(nbytes, done - start))  # elements' bytes already in ``head``
        memory[:have] = head[start : start + have]
        if have < nbytes:
            self._read(fd, memory[have:], info.offset + start + have)
            done = start + nbytes
        if done < info.length:
            self._read(fd, memoryview(bytearray(info.length - done)), info.offset + done)
        with lock:
            planner.commit_tensor(item, target)
        return True


# --------------------------------------------------------------------- one chunk


def _load_item(item, view: memoryview, planner, lock, metadata, path: Path) -> None:
    """Hand one read item's bytes (``view``: the chunk as ``torch.save`` wrote it) to the
    planner: bytes as a stream, a tensor copied into the one the planner resolves."""
    if item.type == LoadItemType.BYTE_IO:
        with lock:
            planner.load_bytes(item, io.BytesIO(bytes(view)))
        return
    layout = _layout(view, metadata, item)
    if layout is not None:
        start, found = layout
        numel = math.prod(found.size)
        if start + numel * found.dtype.itemsize > len(view):
            raise CheckpointError(corrupted(path.parent, path.name))
        tensor = torch.empty(found.size, dtype=found.dtype)
        if numel:
            tensor = torch.frombuffer(view, dtype=found.dtype, count=numel, offset=start)
            tensor = tensor.view(found.size)
    else:  # not the plain layout: torch.load copes with any
        tensor = torch.load(io.BytesIO(view), map_location="cpu", weights_only=True)
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    with lock:
        target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise CheckpointError(
            f"checkpoint file {path}: chunk {item.storage_index.fqn} has size "
            f"{tuple(tensor.size())}, the destination {tuple(target.size())}"
        )
    target.copy_(tensor)
    with lock:
        planner.commit_tensor(item, target)


_LOCAL = b"PK\x03\x04"  # a zip local file header's signature


def _layout(view: memoryview, metadata: Metadata, item) -> tuple[int, _Found] | None:
    """Where the stored chunk's elements start in ``view`` (its ``torch.save`` zip, or its
    first bytes), and their dtype, size and stride; None when it is not the plain layout
    ``torch.save`` writes for a dense tensor. The zip's records come in order (``data.pkl``
    first, then the storages); their local headers give no sizes (torch writes them after the
    data), so the pickle is read up to its STOP and the storage's header searched for by name
    within the first ``_HEAD_BYTES``."""
    md = metadata.state_dict_metadata.get(item.storage_index.fqn)
    if not isinstance(md, TensorStorageMetadata) or len(view) < 30 or view[:4] != _LOCAL:
        return None
    head = bytes(view[:_HEAD_BYTES])
    name_len, extra_len = struct.unpack_from("<HH", head, 26)
    name = head[30 : 30 + name_len]
    if not name.endswith(b"data.pkl") or (len(name) > 8 and name[-9:-8] != b"/"):
        return None
    try:
        found = _Header(io.BytesIO(head[30 + name_len + extra_len :])).load()
    except Exception:
        return None
    if not isinstance(found, _Found) or found.dtype != md.properties.dtype:
        return None
    numel = math.prod(found.size)
    strides, step = [], 1
    for n in reversed(found.size):
        strides.append(step)
        step *= n
    if (numel > 1 and found.stride != tuple(reversed(strides))) or (
        found.storage_numel < found.offset + numel
    ):
        return None
    record = name[:-8] + f"data/{found.key}".encode()
    at = head.find(_LOCAL, 30)
    while at != -1 and at + 30 <= len(head):
        name_len, extra_len = struct.unpack_from("<HH", head, at + 26)
        if head[at + 30 : at + 30 + name_len] == record:
            start = at + 30 + name_len + extra_len
            return start + found.offset * found.dtype.itemsize, found
        at = head.find(_LOCAL, at + 4)
    return None


@dataclasses.dataclass
class _Found:
    key: str
    dtype: torch.dtype | None
    storage_numel: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage, offset, size, stride, *args) -> _Found:
    key, dtype, numel = storage
    return _Found(key, dtype, numel, int(offset), tuple(size), tuple(stride))


_STORAGE_DTYPES = {
    f"{name}Storage": dtype
    for name, dtype in [
        ("Float", torch.float32), ("Double", torch.float64), ("Half", torch.float16),
        ("BFloat16", torch.bfloat16), ("Long", torch.int64), ("Int", torch.int32),
        ("Short", torch.int16), ("Char", torch.int8), ("Byte", torch.uint8),
        ("Bool", torch.bool), ("ComplexFloat", torch.complex64),
        ("ComplexDouble", torch.complex128),
    ]
}  # fmt: skip
"""The dtype of each typed storage class ``torch.save`` pickles (others: ``torch.load``)."""


class _Header(pickle.Unpickler):
    """Unpickles a ``torch.save``-d tensor's ``data.pkl`` without its storage: the storage
    key, dtype, size in elements, and the tensor's offset, size and stride (anything else is
    refused: ``torch.load`` then)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            import collections

            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            return _STORAGE_DTYPES.get(name)  # not the class: its dtype warns (deprecated)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        # ('storage', storage type or dtype, key, location, size in elements)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("not a storage")
        dtype = pid[1] if isinstance(pid[1], torch.dtype) else None
        return (str(pid[2]), dtype, int(pid[4]))


# --------------------------------------------------------------------- load


def read(state: dict, reader: Reader, planner, group) -> None:
    """``dcp.load`` of ``state`` through ``reader``; a ``CheckpointError`` any rank raised is
    raised again, as itself, on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=reader, planner=planner, process_group=group)
    except CheckpointException as exc:
        errors = []
        for rank in sorted(exc.failures):
            error = exc.failures[rank]
            error = getattr(error, "exc", error[0] if isinstance(error, tuple) else error)
            if isinstance(error, CheckpointError):
                raise CheckpointError(str(error)) from None
            errors.append(error)
        # Another failure (an optimizer of another kind or param-group layout: "Missing key
        # in checkpoint state_dict: optim.state.w.momentum_buffer"): one line, the first rank's.
        first = str(errors[0]).strip().splitlines()[-1] if errors else str(exc)
        raise CheckpointError(
            f"checkpoint {reader.path} does not fit this model and optimizer ({first}); load it "
            "with the optimizer class and param groups it was saved with"
        ) from exc
