"""TensorStore: named flat tensors kept on a memory tier, swapped asynchronously.

    store = TensorStore(OffloadConfig(tier=Tier.NVME, folder="/nvme/run/rank0"))
    h = store.swap_out("layers.0.w", w)        # returns at once; do not modify w until h.wait()
    store.prefetch(["layers.0.w"])             # hint: read ahead into the buffer pool
    w2 = store.swap_in("layers.0.w", into=buf).wait()
    store.release("layers.0.w")
    store.close()                              # deletes the files (also at normal exit)

Host tensors made by `store.empty_host(shape, dtype)` are page-aligned (and pinned when an
accelerator is present): their full blocks are written and read by the disk in place, skipping
the staging copy.

Scheduling. Each operation is cut into blocks of `block_bytes` that the `num_io_threads` workers
run in parallel, so one large tensor keeps every worker and the disk's queue busy. Operations on
the same name run in call order (a swap_in after a swap_out reads the new bytes); operations on
different names overlap freely. Nothing blocks the caller except a free-space shortfall, which is
raised by swap_out itself before anything is written.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeroshard.accelerator import pin_host_memory

from .cpu import MemoryBackend, flat_bytes, ready_event
from .folder import ALIGN_BYTES, discard_folder
from .index import index_block_bytes
from .nvme import NvmeBackend
from .pool import BufferPool, aligned_empty
from .tiers import OffloadError, SwapHandle, TensorMeta, Tier

__all__ = ["OffloadConfig", "TensorStore"]

# one block of an operation: a backend method and its arguments, run by an I/O worker
_Part = tuple[Callable[..., None], tuple]

logger = logging.getLogger("zeroshard.offload")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """How a TensorStore keeps its tensors.

    The defaults were measured with bench/bench_offload.py on the team's 2-core VM (ext4 on a
    virtio disk, ~2.5 GiB/s): each thread alternates a system call (the disk works) with a hash
    and a copy (the CPU works), so several threads keep requests queued. For 4 MiB tensors 8
    threads with 16 buffers write best (~89% of raw); 3 to 8 threads with 3 to 16 buffers read
    alike (79-83% of a raw read into one buffer, which runs ~20% faster on that VM than reads
    cycling through 8-16 buffers). Rerun the benchmark on a new machine."""

    tier: Tier = Tier.NVME
    """Where the tensors live: Tier.DEVICE, Tier.CPU or Tier.NVME (or their names as strings)."""

    folder: str | os.PathLike | None = None
    """NVMe only: the directory of the swap files, on the fast disk, one per store (per rank).
    Created if missing and tested at construction."""

    block_bytes: int = 4 << 20
    """Bytes per I/O request and per pool buffer; a multiple of 4096. Tensors larger than this
    are split so they use every I/O thread."""

    num_buffers: int = 16
    """Number of pool buffers (NVMe staging memory = num_buffers * block_bytes). Bounds how many
    blocks are in flight or prefetched at once."""

    num_io_threads: int = 8
    """Worker threads issuing I/O and copies; requests in flight on the disk at once."""

    direct_io: bool | None = None
    """NVMe only: O_DIRECT. None tries it and falls back to buffered I/O with a warning, True
    makes its absence an error, False uses the page cache."""

    def __post_init__(self) -> None:
        if isinstance(self.tier, str):
            names = [t.value for t in Tier]
            if self.tier not in names:
                raise ValueError(f"tier={self.tier!r} is not one of {names}")
            object.__setattr__(self, "tier", Tier(self.tier))
        if not isinstance(self.tier, Tier):
            raise ValueError(f"tier={self.tier!r}: pass Tier.DEVICE, Tier.CPU or Tier.NVME")
        if self.tier is Tier.NVME and self.folder is None:
            raise ValueError("tier=NVME needs folder=, a directory on the disk for the swap files")
        if isinstance(self.folder, (str, os.PathLike)) and os.fspath(self.folder).startswith("~"):
            # (a literal "~" folder under the working directory otherwise, as checkpoints do)
            home = os.path.expanduser(self.folder)
            object.__setattr__(self, "folder", home if isinstance(self.folder, str) else Path(home))
        if self.tier is not Tier.NVME and self.folder is not None:
            raise ValueError("folder= is only used by Tier.NVME; drop it or set tier=Tier.NVME")
        if self.block_bytes < ALIGN_BYTES or self.block_bytes % ALIGN_BYTES:
            raise ValueError(
                f"block_bytes={self.block_bytes} must be a positive multiple of {ALIGN_BYTES} "
                "(O_DIRECT alignment), e.g. 4 << 20"
            )
        if self.num_buffers < 1:
            raise ValueError(f"num_buffers={self.num_buffers} must be >= 1 (2 or more overlap I/O)")
        if self.num_io_threads < 1:
            raise ValueError(f"num_io_threads={self.num_io_threads} must be >= 1")
        if self.direct_io is not None and self.tier is not Tier.NVME:
            raise ValueError("direct_io= is only used by Tier.NVME; leave it None")


def _warn_once(warned: set[str], key: str, message: str) -> None:
    """Log `message` the first time `key` is seen in `warned` (one set per store)."""
    if key not in warned:
        warned.add(key)
        logger.warning(message)


def _close_at_exit(backend: Any, executors: list[ThreadPoolExecutor | None], pid: int) -> None:
    """The finalizer of a store nobody closed: at interpreter exit or when garbage-collected.
    Not in a child made by ``os.fork`` (process ``pid`` made the store): its exit would delete
    the parent's swap files under it."""
    if os.getpid() != pid:
        return
    try:
        if executors[0] is not None:
            # No block is queued: queued blocks hold the store, which is unreachable now (or the
            # interpreter's exit already joined the workers). Do not join: this may be a worker.
            executors[0].shutdown(wait=False)
        backend.close(keep=False)
    except Exception as exc:  # at exit there is nobody left to raise to
        logger.warning("cleaning up an unclosed offload store failed: %s", exc)


_stores: weakref.WeakSet[TensorStore] = weakref.WeakSet()
"""The stores of this process (``discard_unclosed``); a collected one has run its finalizer."""


def discard_unclosed() -> None:
    """Delete the swap files of every store this process has not closed, for an exit that runs
    no finalizer (``os._exit``, as a rank that cannot agree to stop in time leaves): a signal
    while a run set up its NVMe masters left gigabytes of them behind. Operations in flight on
    other threads may fail meanwhile: the caller is about to end the process."""
    for store in list(_stores):
        store._finalizer()  # (once: a closed store's is detached, and does nothing)


def _close_unused(store: TensorStore, pid: int) -> None:
    """``close_with``'s finalizer. Not in a child made by ``os.fork`` (its parent's store: it
    would wait for reads no thread of the child runs), nor on one of the store's own I/O
    threads, which the close would wait for (its own finalizer does it then)."""
    executor = store._executors[0]
    if os.getpid() != pid or store.closed:
        return
    if executor is not None and threading.current_thread() in getattr(executor, "_threads", ()):
        return
    try:
        store.close()
    except Exception as exc:  # (a finalizer has nobody to raise to)
        logger.warning("could not delete the swap files of a collected store: %s", exc)


_outside_inference = torch.inference_mode(False)
"""Store operations run outside inference mode: the views and buffers they make in the caller's
thread are written by the I/O workers, outside it, which torch refuses for a view or tensor made
in inference mode (a stage-3 forward under ``torch.inference_mode()`` with parameters on NVMe
failed every later read of those masters)."""


class TensorStore:
    """Named flat tensors on one tier, with asynchronous swap_out / swap_in / prefetch / release.

    Tensors of any supported dtype and shape round-trip bit for bit. The caller must not modify a
    tensor being swapped out, nor read an `into` buffer being swapped in, before the handle's
    wait(). Thread safety: call the store from one thread (the training loop); its own workers
    are internal.
    """

    def __init__(self, config: OffloadConfig, *, _resume: bool = False) -> None:
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
        self.config = config
        # not a bound method: the backend must not keep the store alive (see the finalizer)
        self._warn_once = functools.partial(_warn_once, set())
        self.pool: BufferPool | None = None
        if config.tier is Tier.NVME:
            self.pool = BufferPool(
                num_buffers=config.num_buffers,
                buffer_bytes=config.block_bytes,
                align_bytes=ALIGN_BYTES,
                pin_memory=pin_host_memory(),
            )
            self._backend: Any = NvmeBackend(
                Path(config.folder),
                block_bytes=config.block_bytes,
                pool=self.pool,
                direct_io=config.direct_io,
                warn_once=self._warn_once,
                resume=_resume,
            )
        else:
            self._backend = MemoryBackend(config.tier)
        # what callers may ask for, updated in call order (operations themselves may lag behind)
        self._metas: dict[str, TensorMeta] = {}
        if _resume:
            self._metas = {n: self._backend.entry(n).meta for n in self._backend.names()}
        # Guards _tails and _pending (worker callbacks touch them). Re-entrant: ``release`` runs
        # in finalizers (an activation checkpoint's, ``partitioned``), which the garbage
        # collector may run on a thread inside one of these blocks (an allocation there while an
        # interrupted step's graph is cyclic garbage); a plain lock blocked it for good.
        self._lock = threading.RLock()
        self._tails: dict[str, SwapHandle] = {}  # the last operation issued per name
        self._pending: set[SwapHandle] = set()
        self._executors: list[ThreadPoolExecutor | None] = [None]  # created on first use
        self._closed = False
        self._finalizer = weakref.finalize(
            self, _close_at_exit, self._backend, self._executors, os.getpid()
        )
        _stores.add(self)

    @classmethod
    def reopen(cls, folder: str | os.PathLike, config: OffloadConfig | None = None) -> TensorStore:
        """Resume the tensors a crashed or closed(keep=True) run left in `folder`.

        The store comes back as of that run's last flush(): tensors written after it either
        fail their checksum on swap_in (SwapIntegrityError) or, if new, were never indexed.
        """
        if config is None:  # take the block size the files were written with
            block_bytes = index_block_bytes(Path(folder).expanduser()) or OffloadConfig.block_bytes
            config = OffloadConfig(tier=Tier.NVME, folder=folder, block_bytes=block_bytes)
        if config.tier is not Tier.NVME or Path(config.folder) != Path(folder).expanduser():
            raise ValueError("reopen needs an NVMe config whose folder= is the folder reopened")
        return cls(config, _resume=True)

    @staticmethod
    def discard(folder: str | os.PathLike) -> None:
        """Delete the swap files a crashed run left in `folder` (refused while a store holds it)."""
        discard_folder(Path(folder).expanduser())

    # -- public operations -----------------------------------------------------------------------
    @_outside_inference
    def swap_out(self, name: str, tensor: torch.Tensor) -> SwapHandle:
        """Start copying `tensor` into the tier under `name` (replacing any previous tensor)."""
        self._check_open()
        if not isinstance(name, str):
            raise TypeError(f"tensor names are str, got {type(name).__name__}")
        if not tensor.is_contiguous():
            self._warn_once(
                "contiguous",
                "swap_out got a non-contiguous tensor: it is copied to a contiguous one first, "
                "which costs memory of its size; swap out contiguous (flat) tensors",
            )
            tensor = tensor.contiguous()
        meta = TensorMeta.of(name, tensor)
        reserved_bytes = self._backend.reserve(meta)  # a disk shortfall raises here, at once
        src = flat_bytes(tensor)  # 1D uint8 [nbytes], shares the caller's storage
        ready = ready_event(tensor)
        self._metas[name] = meta
        handle = SwapHandle("swap_out", name)

        def start() -> list[_Part]:
            ctx = self._backend.begin_write(meta, src, reserved_bytes)
            handle.start(
                len(spans := self._spans(meta.nbytes)),
                lambda error: self._backend.end_write(ctx, error),
            )
            write = self._backend.write_block
            return [(write, (ctx, begin, src[begin : begin + n], ready)) for begin, n in spans]

        return self._chain(name, handle, start)

    @_outside_inference
    def swap_in(self, name: str, into: torch.Tensor | None = None) -> SwapHandle:
        """Start copying tensor `name` into `into` (a new CPU tensor if None); wait() returns it.

        `into` must be contiguous with the stored dtype and number of elements; it may live on
        any device (an accelerator `into` is filled from the pinned pool by DMA).
        """
        self._check_open()
        meta = self.meta(name)
        if into is None:
            into = torch.empty(meta.shape, dtype=meta.dtype)
        if into.dtype != meta.dtype or into.numel() != meta.numel or not into.is_contiguous():
            raise ValueError(
                f"swap_in({name!r}, into=...) needs a contiguous {meta.dtype} tensor of "
                f"{meta.numel} elements; got {into.dtype} {tuple(into.shape)}"
                f"{'' if into.is_contiguous() else ', not contiguous'}"
            )
        dst = flat_bytes(into)  # 1D uint8 [nbytes], shares into's storage
        ready = ready_event(into)
        handle = SwapHandle("swap_in", name, result=into)

        def start() -> list[_Part]:
            ctx = self._backend.begin_read(name)
            handle.start(len(spans := self._spans(meta.nbytes)), self._end_read(ctx))
            read = self._backend.read_block
            return [(read, (ctx, begin, dst[begin : begin + n], ready)) for begin, n in spans]

        return self._chain(name, handle, start)

    @_outside_inference
    def prefetch(self, names: Iterable[str]) -> list[SwapHandle]:
        """Read tensors ahead into free pool buffers, so a later swap_in only copies out.

        A hint: at most `num_buffers` blocks are held, a prefetch never waits for a buffer, and a
        block that found none is simply read by the swap_in. Memory tiers need no prefetch.
        """
        self._check_open()
        if isinstance(names, str):  # (read letter by letter: "no tensor 'l' in the store")
            raise TypeError(f"prefetch takes a list of names, got the one name {names!r}")
        handles = []
        for name in names:
            meta = self.meta(name)
            if not isinstance(self._backend, NvmeBackend):
                continue
            handle = SwapHandle("prefetch", name)

            def start(handle=handle, name=name, meta=meta) -> list[_Part]:
                ctx = self._backend.begin_read(name)
                handle.start(len(spans := self._spans(meta.nbytes)), self._end_read(ctx))
                fetch = self._backend.prefetch_block
                return [(fetch, (ctx, begin, n)) for begin, n in spans]

            handles.append(self._chain(name, handle, start))
        return handles

    def release(self, name: str) -> SwapHandle:
        """Forget tensor `name` and free its memory or file once earlier operations are done."""
        self._check_open()
        self.meta(name)
        del self._metas[name]
        handle = SwapHandle("release", name)

        def start() -> list[_Part]:
            self._backend.release(name)
            handle.start(0)
            return []

        return self._chain(name, handle, start)

    def synchronize(self) -> None:
        """Wait for every operation issued so far (their errors stay with their handles)."""
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return
            for handle in pending:
                handle._event.wait()

    def flush(self) -> None:
        """Wait for all operations, fsync the swap files and atomically rewrite the index.

        What reopen() resumes after a crash is the state of the last flush (NVMe only).
        """
        self._check_open()
        if not isinstance(self._backend, NvmeBackend):
            raise ValueError(f"flush() needs the NVMe tier; {self.config.tier.value} is volatile")
        self.synchronize()
        self._backend.flush()

    def close(self, keep: bool = False) -> None:
        """Finish pending operations, then delete the swap files, or keep them for reopen()."""
        if self._closed:
            return
        self.synchronize()
        self._closed = True
        self._finalizer.detach()
        if self._executors[0] is not None:
            self._executors[0].shutdown(wait=True)
        self._backend.close(keep)

    def close_with(self, owner: object) -> None:
        """Close this store when ``owner``, the swapper using it, is collected, waiting for what
        is in flight: its own finalizer waits until nothing refers to the store, which the
        reads ahead of the next step (issued as a step ends) do until they finish, on an I/O
        thread (the files outlived ``del model, opt; gc.collect()`` by up to 0.3 s)."""
        weakref.finalize(owner, _close_unused, self, os.getpid())

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @_outside_inference
    def empty_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor that swaps to and from NVMe without a staging copy.

        Page-aligned (and pinned when an accelerator is present): the full blocks of such a
        tensor are read and written by the disk in place, so the CPU only hashes them. Allocate
        the host copies of model states this way (e.g. CPU optimizer states swapped to NVMe).
        """
        return aligned_empty(
            tuple(shape), dtype, align_bytes=ALIGN_BYTES, pin_memory=pin_host_memory()
        )

    # -- inspection ------------------------------------------------------------------------------
    def meta(self, name: str) -> TensorMeta:
        """Dtype and shape of stored tensor `name`."""
        if name not in self._metas:
            raise KeyError(f"no tensor {name!r} in the store; swap_out it first")
        return self._metas[name]

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (every later operation raises)."""
        return self._closed

    def names(self) -> list[str]:
        return list(self._metas)

    def __contains__(self, name: object) -> bool:
        return name in self._metas

    def stats(self) -> dict[str, Any]:
        """Byte counts and pool usage, for logs, tests and tuning."""
        out: dict[str, Any] = {
            "tier": self.config.tier.value,
            "num_tensors": len(self._metas),
            "stored_bytes": self._backend.stored_bytes(),
        }
        if self.pool is not None:
            out |= {
                "filesystem": self._backend.filesystem,
                "direct_io": self._backend.direct_io,
                "pool_bytes": self.pool.allocated_bytes,
                "max_buffers_in_use": self.pool.max_in_use,
                "num_prefetch_evictions": self.pool.num_evictions,
            }
        return out

    # -- scheduling ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("the store is closed")

    def _spans(self, nbytes: int) -> list[tuple[int, int]]:
        """(offset, length) of each block of a tensor of `nbytes` bytes."""
        step = self.config.block_bytes
        return [(begin, min(step, nbytes - begin)) for begin in range(0, nbytes, step)]

    def _end_read(self, ctx: Any) -> Callable[[BaseException | None], BaseException | None]:
        def finalize(error: BaseException | None) -> BaseException | None:
            self._backend.end_read(ctx)
            return error

        return finalize

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executors[0] is None:
                self._executors[0] = ThreadPoolExecutor(
                    self.config.num_io_threads, thread_name_prefix="zeroshard-io"
                )
            return self._executors[0]

    def _submit(self, handle: SwapHandle, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._executor().submit(self._run_part, handle, fn, args)
        except RuntimeError as e:  # the interpreter is shutting down: the part fails, visibly
            handle.part_done(e)

    @staticmethod
    def _run_part(handle: SwapHandle, fn: Callable[..., None], args: tuple) -> None:
        if handle.failed():
            handle.part_done()  # a sibling block failed: the operation is lost anyway
            return
        try:
            with torch.profiler.record_function(f"zeroshard::offload::{handle.kind}"):
                fn(*args)
        except BaseException as e:  # reported through the handle, never swallowed
            handle.part_done(e)
        else:
            handle.part_done()

    def _chain(self, name: str, handle: SwapHandle, start: Callable[[], list[_Part]]) -> SwapHandle:
        """Run `start` on a worker once the previous operation on `name` is done; track the handle.

        `start` opens the file and returns the operation's blocks. The worker that ran it submits
        all blocks but the first and runs the first itself: a one-block tensor costs one job, not
        a job to open the file followed by a job queued behind every other operation's opening.
        """

        once = threading.Lock()  # (a Ctrl-C's clean-up below may submit it twice: run once)

        def run() -> None:
            if not once.acquire(blocking=False):
                return
            try:
                parts = start()
            except BaseException as e:  # start raises only before handle.start()
                handle.fail(e)
                return
            for fn, args in parts[1:]:
                self._submit(handle, fn, *args)
            if parts:
                self._run_part(handle, *parts[0])

        def submit_run(_previous: SwapHandle | None = None) -> None:
            # always on a worker: opening and allocating the file (posix_fallocate writes zeros on
            # filesystems without native support) and the first block must not stall the caller,
            # who reaches here directly when the previous operation is already done
            try:
                self._executor().submit(run)
            except RuntimeError as e:  # the interpreter is shutting down
                handle.fail(e)

        def forget(_: SwapHandle) -> None:
            with self._lock:
                self._pending.discard(handle)
                if self._tails.get(name) is handle:
                    del self._tails[name]

        previous = None
        try:
            with self._lock:
                previous = self._tails.get(name)
                self._tails[name] = handle
                self._pending.add(handle)
            self._start_after(handle, previous, forget, submit_run)
        except BaseException:
            # A Ctrl-C between the handle's registration and its start left it pending for
            # good (every later operation on the name, and close(), hung): started all the
            # same (again if it was: ``run`` runs once, ``forget`` is idempotent).
            if handle in self._pending:
                self._start_after(handle, previous, forget, submit_run)
            raise
        return handle

    @staticmethod
    def _start_after(handle: SwapHandle, previous: SwapHandle | None, forget, submit_run) -> None:
        """Forget ``handle`` when done; start it now, or when ``previous`` is done."""
        handle.add_done_callback(forget)
        if previous is None:
            submit_run()
        else:
            previous.add_done_callback(submit_run)  # runs at once if it is already done
