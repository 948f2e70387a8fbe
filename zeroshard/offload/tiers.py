"""Memory tiers, the errors a tier can raise, and the handle an asynchronous swap returns.

ZeRO-Infinity (DESIGN.md §6) treats device memory, CPU RAM and NVMe as one hierarchy: model
states live in a slower tier and are streamed into a faster one just before use. This module holds
the vocabulary shared by the store and its back-ends; it allocates nothing and starts no thread.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

_log = logging.getLogger(__name__)

__all__ = [
    "OffloadError",
    "SwapHandle",
    "SwapIntegrityError",
    "SwapSpaceError",
    "TensorMeta",
    "Tier",
]


class Tier(str, enum.Enum):
    """A level of the memory hierarchy, fastest first: where a store keeps its tensors and where
    the planner places a model state."""

    DEVICE = "device"  # a private copy on the tensor's own device (no transfer, no saving)
    CPU = "cpu"  # host RAM, pinned when an accelerator is present so device copies are DMA
    NVME = "nvme"  # files in a folder, written and read through the aligned buffer pool


class OffloadError(RuntimeError):
    """A swap could not be done; the message names the tensor and, for NVMe, the file."""


class SwapIntegrityError(OffloadError):
    """A swap file is missing, truncated or fails its checksum: its bytes are not trusted."""


class OffloadSetupError(OffloadError, ValueError):
    """A placement that cannot be set up as asked (a folder not usable, in use or too small;
    too little host memory): bad input, found before step 1 (the command line exits 2)."""


class SwapSpaceError(OffloadSetupError):
    """The swap folder has not enough free space; the message says how much is needed."""


# dtype <-> text for the on-disk index. Only dtypes whose bytes round-trip exactly are listed.
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


def dtype_to_str(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) is not dtype:
        raise TypeError(
            f"dtype {dtype} is not supported by the offload store; use one of {_DTYPES}"
        )
    return name


def dtype_from_str(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise OffloadError(f"unknown dtype {name!r} in a swap index (written by a newer version?)")
    return _DTYPES[name]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What the store remembers of a swapped tensor besides its bytes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @staticmethod
    def of(name: str, tensor: torch.Tensor) -> TensorMeta:
        dtype_to_str(tensor.dtype)  # raises TypeError on dtypes we cannot round-trip
        return TensorMeta(name=name, dtype=tensor.dtype, shape=tuple(tensor.shape))


class SwapHandle:
    """Completion of one asynchronous swap, made of `num_parts` parts run by the I/O workers.

    `wait()` blocks until every part is done and re-raises the first error, so a failed swap is
    never mistaken for a finished one. `swap_in` handles return the filled tensor from `wait()`.
    """

    def __init__(self, kind: str, name: str, result: torch.Tensor | None = None) -> None:
        self.kind = kind  # "swap_out", "swap_in", "prefetch", "release": for messages only
        self.name = name
        self._result = result
        # Re-entrant: a release chained onto this handle runs in a finalizer (an activation
        # checkpoint's), which the garbage collector may run on a thread holding this lock (an
        # allocation in ``_finish`` on an I/O thread); a plain lock blocked that thread for good.
        self._lock = threading.RLock()
        self._event = threading.Event()
        self._num_pending: int | None = None  # set by start(); None means not started yet
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[SwapHandle], None]] = []
        # runs once, after the last part and before waiters wake: closes files, publishes checksums
        self._finalize: Callable[[BaseException | None], BaseException | None] | None = None

    # -- producer side (the store) -------------------------------------------------------------
    def start(
        self,
        num_parts: int,
        finalize: Callable[[BaseException | None], BaseException | None] | None = None,
    ) -> None:
        """Declare how many parts must finish; zero parts completes at once.

        `finalize(first_error)` runs after the last part and returns the error to report.
        """
        with self._lock:
            assert self._num_pending is None, "a handle is started once"
            self._num_pending = num_parts
            self._finalize = finalize
        if num_parts == 0:
            self._finish()

    def part_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            assert self._num_pending, "more parts finished than were started"
            if error is not None and self._error is None:
                self._error = error
            self._num_pending -= 1
            last = self._num_pending == 0
        if last:
            self._finish()

    def fail(self, error: BaseException) -> None:
        """Fail a handle before any of its parts were started."""
        self.start(1)
        self.part_done(error)

    def add_done_callback(self, fn: Callable[[SwapHandle], None]) -> None:
        """Run `fn(self)` when done (at once if already done), in the finishing thread."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def failed(self) -> bool:
        """True once any part failed: the remaining parts may skip their work."""
        return self._error is not None

    def _finish(self) -> None:
        if self._finalize is not None:
            try:
                self._error = self._finalize(self._error)
            except BaseException as e:  # a failing cleanup must still wake the waiters
                self._error = self._error or e
        with self._lock:
            self._event.set()  # (first: a callback added in here from now on runs at once)
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # (one that raised stopped the rest: the store's own start of
                # the next operation on the name among them, which then never ran)
                _log.exception("a done-callback of %r raised", self)

    # -- consumer side ---------------------------------------------------------------------------
    def done(self) -> bool:
        return self._event.is_set()

    def error(self) -> BaseException | None:
        return self._error if self.done() else None

    def wait(self, timeout: float | None = None) -> torch.Tensor | None:
        """Block until done; raise the swap's error; return the filled tensor of a swap_in."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.kind}({self.name!r}) not done after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "pending"
        return f"SwapHandle({self.kind}, {self.name!r}, {state})"
