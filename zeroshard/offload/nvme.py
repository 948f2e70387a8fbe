"""The NVMe tier: one swap file per tensor, aligned direct I/O, a checksum per block.

The folder (its layout, lock, probes and clean-up) is ``zeroshard.offload.folder``; the index
that records each tensor's file and checksums is ``zeroshard.offload.index``. This module moves
the bytes.

A block goes through a buffer of the pool: the tensor's bytes are copied in, hashed and written
with os.pwritev; a read is os.preadv into a buffer (in requests of READ_CHUNK_BYTES), a hash check
of the whole block, then a copy out. Full blocks of page-aligned host tensors
(TensorStore.empty_host) skip the copy: the disk uses their own pages.
os.preadv and os.pwritev release the GIL, so the store's threads keep several requests in flight
on the disk. With O_DIRECT the page cache is bypassed: bytes swapped out really leave RAM, and a
read really comes from the disk. A file that is missing, short, or whose bytes fail their checksum
is a SwapIntegrityError naming the file and the tensor; nothing unverified is copied out of the
pool (a block read in place is checked where it landed, and its swap_in fails).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from .cpu import copy_bytes
from .folder import (
    ALIGN_BYTES,
    LOCK_NAME,
    MEMORY_FILESYSTEMS,
    collect_if_held_here,
    discard_folder,
    file_name,
    filesystem_type,
    free_bytes,
    holds_swap_files,
    padded_bytes,
    prepare_folder,
    release_lock,
    remove_if_empty,
    still_at,
    swap_files,
    take_lock,
)
from .index import INDEX_NAME, IndexEntry, index_block_bytes, read_index, write_index
from .pool import BufferPool
from .tiers import OffloadError, SwapIntegrityError, SwapSpaceError, TensorMeta

__all__ = [
    "ALIGN_BYTES",
    "INDEX_NAME",
    "NvmeBackend",
    "discard_folder",
    "filesystem_type",
    "free_bytes",
    "index_block_bytes",
    "padded_bytes",
]

logger = logging.getLogger("zeroshard.offload")

# A block is read in requests of at most this many bytes (a multiple of ALIGN_BYTES), one after
# the other into its buffer. On the benchmark's virtio disk, 1 MiB requests from 8 threads read
# 4 MiB tensors at ~90% of a raw single-buffer read where whole 4 MiB requests got ~78%: a 1 MiB
# request always fits the queue's max_segments (254 runs of pages), a 4 MiB one into a pool buffer
# whose pages are scattered is split into uneven pieces. Writes keep one request per block.
READ_CHUNK_BYTES = 1 << 20


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _hash(view: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(view)


@dataclass
class _FileEntry:
    meta: TensorMeta
    path: Path
    file_bytes: int  # size of the file on disk, padded (0 before the first write)
    checksums: list[int] | None  # xxh3-64 per block; None while unwritten or after a failure
    error: BaseException | None = None  # why the last swap_out failed, if it did


@dataclass
class _WriteCtx:
    entry: _FileEntry
    fd: int
    checksums: list[int]


@dataclass
class _ReadCtx:
    entry: _FileEntry
    fd: int
    checksums: list[int]


class NvmeBackend:
    """Swap files in one folder, read and written block by block through a BufferPool."""

    def __init__(
        self,
        folder: Path,
        *,
        block_bytes: int,
        pool: BufferPool,
        direct_io: bool | None,
        warn_once: Callable[[str, str], None],
        resume: bool,
    ) -> None:
        self.folder = folder
        self.block_bytes = block_bytes
        self.pool = pool
        self.read_chunk_bytes = READ_CHUNK_BYTES
        self._warn_once = warn_once
        collect_if_held_here(folder)
        self.created_folder, self.direct_io = prepare_folder(folder, direct_io)
        self.filesystem = filesystem_type(folder)
        if self.filesystem in MEMORY_FILESYSTEMS:
            warn_once(
                "memory-fs",
                f"{folder} is on {self.filesystem}, which is RAM: the NVMe tier's files stay in "
                "memory; point folder= at a directory on a disk",
            )
        if not self.direct_io and direct_io is None:
            warn_once(
                "buffered",
                f"{folder} does not support O_DIRECT: falling back to buffered I/O, so swapped "
                "tensors also sit in the page cache (RAM) until the kernel evicts them",
            )
        self._lock_fd = take_lock(folder)
        self._folder_id = _identity(folder)  # (``close``: still this store's folder?)
        self._entries: dict[str, _FileEntry] = {}
        self._dirty: set[str] = set()  # written since the last flush: fsync before the index
        self._mutex = threading.Lock()  # guards _reserved_bytes and _dirty
        # promised to swap_outs that passed the free-space check but have not allocated yet
        self._reserved_bytes = 0
        if resume:
            self._load_index()
        elif holds_swap_files(folder):
            release_lock(self._lock_fd)
            raise OffloadError(
                f"{folder} holds swap files of an earlier run; resume them with "
                f"TensorStore.reopen({str(folder)!r}) or delete them with "
                f"TensorStore.discard({str(folder)!r})"
            )

    # -- the folder ------------------------------------------------------------------------------
    def _open_flags(self, write: bool) -> int:
        flags = os.O_CLOEXEC | (os.O_RDWR | os.O_CREAT if write else os.O_RDONLY)
        return flags | (os.O_DIRECT if self.direct_io else 0)

    def names(self) -> list[str]:
        return [n for n, e in list(self._entries.items()) if e.checksums is not None]

    def stored_bytes(self) -> int:
        return sum(e.file_bytes for e in list(self._entries.values()))  # list(): workers insert

    def entry(self, name: str) -> _FileEntry:
        return self._entries[name]

    # -- writes ----------------------------------------------------------------------------------
    def reserve(self, meta: TensorMeta) -> int:
        """Check the free space for the tensor's file and reserve it; return the bytes reserved.

        Runs in the caller's thread, so a shortfall is raised by swap_out itself. The reservation
        ends in begin_write once posix_fallocate has taken the blocks (then statvfs shows them).
        """
        old = self._entries.get(meta.name)
        need = padded_bytes(meta.nbytes) - (old.file_bytes if old else 0)
        if need <= 0:
            return 0
        with self._mutex:
            free = free_bytes(self.folder) - self._reserved_bytes
            if need <= free:
                self._reserved_bytes += need
                return need
        free = max(free, 0)
        raise SwapSpaceError(
            f"swap_out({meta.name!r}) needs {need} bytes ({_mib(need)}) more in {self.folder} "
            f"but only {free} bytes ({_mib(free)}) are free after pending writes; free disk "
            "space or point folder= at a bigger disk"
        )

    def begin_write(self, meta: TensorMeta, src: torch.Tensor, reserved_bytes: int) -> _WriteCtx:
        del src  # write_block reads it, block by block
        try:
            return self._open_for_write(meta)
        finally:
            with self._mutex:
                self._reserved_bytes -= reserved_bytes  # allocated now, or failed

    def _open_for_write(self, meta: TensorMeta) -> _WriteCtx:
        entry = self._entries.get(meta.name)
        if entry is None:
            entry = _FileEntry(meta, self.folder / file_name(meta.name), 0, None)
            self._entries[meta.name] = entry
        entry.meta, entry.checksums, entry.error = meta, None, None  # unreadable until complete
        self.pool.drop_cached(meta.name)
        size = padded_bytes(meta.nbytes)
        grow = max(size - entry.file_bytes, 0)
        try:
            fd = os.open(entry.path, self._open_flags(write=True), 0o600)
        except OSError as e:
            entry.error = self._os_error("open", entry, e)
            raise entry.error from e
        try:
            if size > entry.file_bytes:
                # reserve the blocks now: a full disk fails here, before any byte is written
                os.posix_fallocate(fd, 0, size)
            elif size < entry.file_bytes:
                os.ftruncate(fd, size)
        except OSError as e:
            os.close(fd)
            entry.error = self._os_error("allocate", entry, e, need=grow)
            raise entry.error from e
        entry.file_bytes = size
        num_blocks = -(-meta.nbytes // self.block_bytes)
        return _WriteCtx(entry, fd, [0] * num_blocks)

    def _direct_view(self, tensor: torch.Tensor) -> memoryview | None:
        """A 1D uint8 host tensor as an I/O buffer, if O_DIRECT can use it as it is.

        Tensors from TensorStore.empty_host are page-aligned, so their full blocks go between the
        disk and their own pages with no staging copy: the CPU only hashes them. Other tensors
        (torch aligns to 64 bytes) and partial last blocks go through the pool.
        """
        if tensor.device.type != "cpu" or tensor.data_ptr() % ALIGN_BYTES:
            return None
        if tensor.numel() % ALIGN_BYTES:
            return None
        # Not tensor.numpy(): it marks the storage not resizable for good, and swapped masters
        # are freed and refilled by resizing their storage (zeroshard.model_states.param_swap).
        # The caller keeps ``tensor`` alive while the view is used.
        raw = (ctypes.c_char * tensor.numel()).from_address(tensor.data_ptr())
        return memoryview(raw).cast("B")

    def _pwrite(self, ctx: _WriteCtx, view: memoryview, start: int) -> None:
        try:
            written = os.pwritev(ctx.fd, [view], start)
        except OSError as e:
            raise self._os_error("write", ctx.entry, e, need=len(view)) from e
        if written != len(view):
            raise OffloadError(
                f"short write to {ctx.entry.path} for tensor {ctx.entry.meta.name!r}: "
                f"{written} of {len(view)} bytes at offset {start}"
            )

    def write_block(self, ctx: _WriteCtx, start: int, src: torch.Tensor, ready) -> None:
        nbytes, block = src.numel(), start // self.block_bytes
        view = self._direct_view(src)
        if view is not None:
            ctx.checksums[block] = _hash(view)
            self._pwrite(ctx, view, start)
            return
        io_bytes = padded_bytes(nbytes)
        index = self.pool.acquire()
        try:
            buf = self.pool.view(index)
            copy_bytes(buf[:nbytes], src, ready)
            buf[nbytes:io_bytes].zero_()  # the padding of the last block: keep files reproducible
            view = self.pool.memoryview(index, io_bytes)
            ctx.checksums[block] = _hash(view[:nbytes])
            self._pwrite(ctx, view, start)
        finally:
            self.pool.release(index)

    def end_write(self, ctx: _WriteCtx, error: BaseException | None) -> BaseException | None:
        os.close(ctx.fd)
        with self._mutex:
            self._dirty.add(ctx.entry.meta.name)
        if error is None:
            ctx.entry.checksums = ctx.checksums  # only a complete, hashed file becomes readable
            return None
        ctx.entry.error = error
        if not isinstance(error, OffloadError):
            error = OffloadError(
                f"swap_out({ctx.entry.meta.name!r}) to {ctx.entry.path} failed: {error!r}"
            )
            error.__cause__ = ctx.entry.error
        return error

    def _os_error(
        self, what: str, entry: _FileEntry, e: OSError, need: int | None = None
    ) -> OffloadError:
        name = entry.meta.name
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return SwapSpaceError(
                f"no space left on the device to {what} swap file {entry.path} of tensor {name!r}"
                f" (needs {need} more bytes, {_mib(need or 0)}; {free_bytes(self.folder)} free): "
                "free disk space or point folder= at a bigger disk"
            )
        return OffloadError(f"cannot {what} swap file {entry.path} of tensor {name!r}: {e}")

    # -- reads -----------------------------------------------------------------------------------
    def begin_read(self, name: str) -> _ReadCtx:
        entry = self._entries.get(name)
        if entry is None:
            raise OffloadError(f"tensor {name!r} is not in the NVMe tier at {self.folder}")
        if entry.checksums is None:
            raise OffloadError(
                f"tensor {name!r} has no valid copy in {entry.path}: its last swap_out failed "
                f"({entry.error!r})"
            )
        try:
            fd = os.open(entry.path, self._open_flags(write=False))
        except FileNotFoundError as e:
            raise SwapIntegrityError(f"swap file {entry.path} of tensor {name!r} is missing") from e
        except OSError as e:
            raise self._os_error("open", entry, e) from e
        size = os.fstat(fd).st_size
        if size < padded_bytes(entry.meta.nbytes):
            os.close(fd)
            raise SwapIntegrityError(
                f"swap file {entry.path} of tensor {name!r} is truncated: {size} bytes on disk, "
                f"{padded_bytes(entry.meta.nbytes)} expected"
            )
        return _ReadCtx(entry, fd, entry.checksums)

    def _pread(self, ctx: _ReadCtx, view: memoryview, start: int) -> int:
        """Read into `view` from offset `start`, in requests of read_chunk_bytes; bytes read.

        Stops at the first short request (the end of the file): _verify reports the shortfall.
        """
        got, step = 0, self.read_chunk_bytes
        try:
            while got < len(view):
                chunk = view[got : got + step]
                n = os.preadv(ctx.fd, [chunk], start + got)
                got += n
                if n < len(chunk):
                    break
        except OSError as e:
            raise self._os_error("read", ctx.entry, e) from e
        return got

    def _read_into(self, ctx: _ReadCtx, start: int, nbytes: int, index: int) -> None:
        """Read and check one block into held buffer `index`; release it if that fails."""
        try:
            view = self.pool.memoryview(index, padded_bytes(nbytes))
            self._verify(ctx, start, nbytes, view, self._pread(ctx, view, start))
        except BaseException:
            self.pool.release(index)
            raise

    def _verify(self, ctx: _ReadCtx, start: int, nbytes: int, view: memoryview, got: int) -> None:
        entry, block = ctx.entry, start // self.block_bytes
        if got < nbytes:
            raise SwapIntegrityError(
                f"swap file {entry.path} of tensor {entry.meta.name!r} is truncated: block "
                f"{block} at offset {start} returned {got} of {nbytes} bytes"
            )
        if _hash(view[:nbytes]) != ctx.checksums[block]:
            raise SwapIntegrityError(
                f"checksum mismatch in swap file {entry.path} of tensor {entry.meta.name!r}, "
                f"block {block} (bytes {start}..{start + nbytes}): the file was corrupted or "
                "changed after it was written"
            )

    def read_block(self, ctx: _ReadCtx, start: int, dst: torch.Tensor, ready) -> None:
        nbytes = dst.numel()
        index = self.pool.take_cached(ctx.entry.meta.name, start // self.block_bytes)
        if index is None and (view := self._direct_view(dst)) is not None:
            # zero-copy: if the check fails, `into` holds unverified bytes and the handle raises
            self._verify(ctx, start, nbytes, view, self._pread(ctx, view, start))
            return
        if index is None:
            index = self.pool.acquire()
            self._read_into(ctx, start, nbytes, index)
        try:
            copy_bytes(dst, self.pool.view(index)[:nbytes], ready)
        finally:
            self.pool.release(index)

    def prefetch_block(self, ctx: _ReadCtx, start: int, nbytes: int) -> None:
        """Read a block into a free buffer and park it there; do nothing if none is free.

        A prefetch is a hint bounded by the pool: it never evicts and never waits, so prefetching
        more than the pool holds cannot stall the reads and writes that need buffers now.
        """
        index = self.pool.try_acquire()
        if index is None:
            return
        self._read_into(ctx, start, nbytes, index)
        self.pool.put_cached(ctx.entry.meta.name, start // self.block_bytes, index)

    def end_read(self, ctx: _ReadCtx) -> None:
        os.close(ctx.fd)

    # -- lifetime --------------------------------------------------------------------------------
    def release(self, name: str) -> None:
        self.pool.drop_cached(name)
        entry = self._entries.pop(name, None)
        if entry is not None:
            entry.path.unlink(missing_ok=True)
            with self._mutex:
                self._dirty.discard(name)

    def flush(self) -> None:
        """Make the files written so far durable, then atomically replace the index."""
        with self._mutex:
            dirty, self._dirty = self._dirty, set()
        for name in dirty:
            entry = self._entries.get(name)
            if entry is not None and entry.path.exists():
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        write_index(
            self.folder,
            block_bytes=self.block_bytes,
            created_folder=self.created_folder,
            entries=[
                IndexEntry(meta=e.meta, file=e.path.name, checksums=e.checksums)
                for e in list(self._entries.values())
                if e.checksums is not None
            ],
        )

    def _load_index(self) -> None:
        """Take the entries of the folder's index; delete swap files it does not vouch for."""
        self.created_folder, entries = read_index(self.folder, block_bytes=self.block_bytes)
        for e in entries:
            file = self.folder / e.file
            size = file.stat().st_size if file.exists() else 0
            self._entries[e.meta.name] = _FileEntry(e.meta, file, size, e.checksums)
        known = {e.path for e in self._entries.values()}
        for orphan in swap_files(self.folder):
            if orphan not in known:
                # written after the last flush, so no checksum vouches for it: it cannot be used
                logger.warning(
                    "deleting %s: not in %s, written after the last flush",
                    orphan,
                    self.folder / INDEX_NAME,
                )
                orphan.unlink()

    def close(self, keep: bool) -> None:
        """Flush the index and keep the files (to reopen later), or delete everything. Not
        in a folder that is no longer this store's (deleted, and another store made it again
        and locked it: its files carry the same names; a store collected late deleted them)."""
        lock = self.folder / LOCK_NAME
        ours = _identity(self.folder) == self._folder_id and (
            still_at(self._lock_fd, lock) or not lock.exists()  # (its lock deleted by hand)
        )
        if ours and keep:
            self.flush()
        elif ours:
            for entry in self._entries.values():
                entry.path.unlink(missing_ok=True)
            for name in (INDEX_NAME, INDEX_NAME + ".tmp"):
                (self.folder / name).unlink(missing_ok=True)
        self._entries.clear()
        self.pool.close()
        if ours:
            (self.folder / LOCK_NAME).unlink(missing_ok=True)
        release_lock(self._lock_fd)
        if ours and not keep and self.created_folder:
            remove_if_empty(self.folder)


def _identity(folder: Path) -> tuple[int, int] | None:
    """(device, inode) of ``folder``, None when it is gone."""
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return st.st_dev, st.st_ino
