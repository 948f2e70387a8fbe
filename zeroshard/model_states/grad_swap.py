"""Reduced gradient shards on NVMe (``Offload(gradients="nvme")``, ZeRO-Infinity).

With partitioned gradients (stages 2-3) each bucket's reduced FP32 shard (``shard_grad``, 1D,
this rank's range, 4 bytes per owned element) leaves memory as soon as its reduction finishes
(``GradBucket.handoff``): it is written to the rank's ``TensorStore`` and dropped once written, so
backward holds the shards of the reductions in flight only. At the step, the optimizer reads the
shard of sub-group ``i + 1`` ahead while ``i`` steps, and drops the copy read after its
sub-group's step. The file stays the gradient until ``zero_grad``, as torch keeps ``.grad``: a
second step, a norm after the step or another backward read it again.

Clipping needs every shard's norm: each is taken at the hand-off (``clipping.powers``, as
``clip_grad_norm`` takes those in memory, so the global norm has the same bits), and each
clipping factor is kept per stored shard and applied, in order, whenever it is read back (the
same element-wise multiplies); a norm asked for after a clip reads the shard back to take it.
A reduction onto a stored shard (another backward before ``zero_grad``) reads it back, clipped
as it stands, and adds the new one (addition commutes exactly).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable

import torch

from zeroshard.model_states import clipping
from zeroshard.model_states.grads import GradBucket
from zeroshard.model_states.swappers import stopping_on_refusal
from zeroshard.offload import OffloadError, SwapHandle, TensorStore


class GradSwapper:
    """The reduced gradient shards of ``buckets`` on the NVMe tier of ``store`` (module
    docstring). ``timed`` wraps every swap handle (the state swapper's I/O accounting)."""

    def __init__(
        self,
        store: TensorStore,
        buckets: list[GradBucket],
        timed: Callable[[SwapHandle], SwapHandle],
        stop: Callable[[str, str, BaseException], OffloadError],
    ) -> None:
        """``stop``: the state swapper's (``StopsOnFailure.stop``): a gradient that cannot be
        written stops training for good, the store being shared."""
        self.store, self._buckets, self._timed, self._stop = store, buckets, timed, stop
        self._index = {id(b): i for i, b in enumerate(buckets)}
        self._lock = threading.Lock()  # _writing is also updated by I/O threads when done
        self._writing: dict[int, tuple[SwapHandle, torch.Tensor]] = {}  # keeps the source alive
        self._reading: dict[int, SwapHandle] = {}
        self._stored: set[int] = set()  # buckets whose gradient since zero_grad is in the store
        self._powers: dict[int, torch.Tensor] = {}  # 0-dim FP64 sum of squares of each file
        self._coefs: dict[int, list[torch.Tensor]] = {}  # clip factors since stored, in order
        self._mirrored: set[int] = set()  # stored, and read back in shard_grad (clipped alike)
        self.reset_stats()
        self._error: str | None = None
        self._deferred: OffloadError | None = None  # (``_handoff``)
        ref = weakref.ref(self)  # the engine's buckets must not keep the store alive

        def handoff(bucket: GradBucket) -> None:
            swapper = ref()
            if swapper is not None:
                swapper._handoff(bucket)

        def on_zero(bucket: GradBucket, slots: list[int] | None) -> None:
            swapper = ref()
            if swapper is not None:
                swapper._zeroed(bucket, slots)

        for b in buckets:
            b.handoff, b.on_zero = handoff, on_zero

    @property
    def failed(self) -> str | None:
        """A gradient write that failed in an I/O thread, worded "training stopped: ..." (what
        ``StopsOnFailure.failed`` is for the others; a write refused before it began stops the
        state swapper, whose store this shares)."""
        return None if self._error is None else f"training stopped: {self._error}"

    def stats(self) -> dict[str, float]:
        """Bytes of gradient shards written and read back, and the seconds the optimizer
        blocked on a read-back, since ``reset_stats``."""
        return {
            "grad_read_bytes": self.read_bytes,
            "grad_write_bytes": self.write_bytes,
            "grad_wait_s": self.wait_s,
        }

    def reset_stats(self) -> None:
        self.read_bytes = self.write_bytes = 0
        self.wait_s = 0.0

    def _name(self, i: int) -> str:
        return f"grad_shard[{i}]:{self._buckets[i].flat.name or '<root>'}"

    def _handoff(self, bucket: GradBucket) -> None:
        g = bucket.shard_grad  # 1D FP32, this rank's reduced shard
        if g is None or g.numel() == 0:
            return
        i = self._index[id(bucket)]
        try:
            if i in self._stored and i not in self._mirrored:
                g.add_(self._read(i))  # reduced again since zero_grad: onto the stored one
            self._mirrored.discard(i)  # (a read-back copy was in shard_grad: the sum holds it)
            self._store(i, g)
        except OffloadError as e:
            # Raised here, mid-backward, it left the reductions this rank had not started to
            # the other ranks, waiting in them (each rank's disk fills at its own unit): the
            # backward runs on, the gradient dropped (training has stopped), and
            # ``raise_deferred`` raises the first failure once it is over.
            if self._deferred is None:
                self._deferred = e
        bucket.shard_grad = None  # in the store now (``g`` lives until written), or dropped

    def raise_deferred(self) -> None:
        """After a backward: the first gradient that could not be stored in it, if any."""
        error, self._deferred = self._deferred, None
        if error is not None:
            raise error

    def _store(self, i: int, g: torch.Tensor) -> None:
        self._powers[i], self._coefs[i] = clipping.powers([g], 2.0)[0], []
        what = f"the gradient {self._name(i)} could not be written"
        with stopping_on_refusal(self._stop, what, "gradients"):
            handle = self._timed(self.store.swap_out(self._name(i), g))
        self.write_bytes += g.numel() * g.element_size()
        with self._lock:
            self._writing[i] = (handle, g)
        handle.add_done_callback(lambda h: self._written(i, h))
        self._stored.add(i)

    def _zeroed(self, bucket: GradBucket, slots: list[int] | None) -> None:
        """A submodule's ``zero_grad`` (``bucket.zero`` / ``zero_slots``): its stored shard is
        forgotten, or stored again with those ``slots`` zeroed (the bucket zeroed them in a
        read-back copy; the file still held them, and the next backward added onto it)."""
        i = self._index[id(bucket)]
        if i not in self._stored:
            return
        if slots is None:
            self._drop(i)
            return
        if i in self._mirrored:  # zeroed in memory by the bucket
            g, bucket.shard_grad = bucket.shard_grad, None
            self._mirrored.discard(i)
        else:
            g = self._read(i)
            pieces = bucket.flat.pieces()
            for slot in slots:
                g[pieces[slot][1]].zero_()
        self._store(i, g)

    def _drop(self, i: int) -> None:
        handle = self._reading.pop(i, None)
        if handle is not None:  # never leave a read running into memory we drop
            with contextlib.suppress(Exception):
                handle.wait()
        if i in self._mirrored:
            self._buckets[i].shard_grad = None
        for kept in (self._stored, self._mirrored):
            kept.discard(i)
        self._powers.pop(i, None)
        self._coefs.pop(i, None)

    def _written(self, i: int, handle: SwapHandle) -> None:
        """In an I/O thread: drop the source tensor of a finished write (frees its memory)."""
        with self._lock:
            if handle.error() is not None and self._error is None:
                self._error = f"{self._name(i)} could not be written ({handle.error()})"
            if self._writing.get(i, (None,))[0] is handle:
                del self._writing[i]

    def _start_read(self, i: int) -> None:
        if i in self._stored and i not in self._reading:
            # (a store closed by a failure of the states sharing it: that failure is the news)
            what = f"the gradient {self._name(i)} could not be read back"
            with stopping_on_refusal(self._stop, what, "gradients"):
                meta = self.store.meta(self._name(i))
                into = self.store.empty_host((meta.numel,), meta.dtype)  # the master's dtype
                self._reading[i] = self._timed(self.store.swap_in(self._name(i), into=into))
            self.read_bytes += meta.numel * into.element_size()

    def _read(self, i: int) -> torch.Tensor:
        """Stored shard ``i`` as it stands: read back (waiting), clipped as asked since."""
        self._start_read(i)
        t0 = time.perf_counter()
        try:
            g = self._reading.pop(i).wait()
        except Exception as e:
            what = f"the gradient {self._name(i)} could not be read back"
            raise self._stop(what, "gradients", e) from e
        finally:
            self.wait_s += time.perf_counter() - t0
        if self.failed is not None:
            raise OffloadError(self.failed)
        assert g is not None
        for coef in self._coefs[i]:
            g.mul_(coef)  # what clip_grad_norm's _foreach_mul_ did to resident ones
        return g

    # ----------------------------------------------------------------- the optimizer's side
    def prefetch(self, bucket: GradBucket) -> None:
        """Start reading ``bucket``'s stored shard (the next sub-group's)."""
        i = self._index[id(bucket)]
        if i not in self._mirrored:
            self._start_read(i)

    def restore(self, bucket: GradBucket) -> None:
        """Put ``bucket``'s stored shard, as it stands, back in ``shard_grad``."""
        i = self._index[id(bucket)]
        if i in self._stored and i not in self._mirrored:
            bucket.shard_grad = self._read(i)
            self._mirrored.add(i)

    def consume(self, bucket: GradBucket) -> None:
        """``bucket``'s sub-group has stepped: drop its read-back copy (the file stays)."""
        i = self._index[id(bucket)]
        if i in self._mirrored:
            bucket.shard_grad = None
            self._mirrored.discard(i)

    def powers(self) -> torch.Tensor:
        """1-D FP64, per bucket with a gradient, in engine order: the sum of squares of its
        shard as it stands (``clipping.powers``; taken at the hand-off for stored ones not
        clipped since; else of the shard in memory, read back first if need be)."""
        out = []
        for i, b in enumerate(self._buckets):
            if i in self._stored and not self._coefs[i]:
                out.append(self._powers[i])
                continue
            self.restore(b)
            if b.shard_grad is not None:
                out.append(clipping.powers([b.shard_grad], 2.0)[0])
        return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)

    def scale(self, coef: torch.Tensor) -> None:
        """Clip: multiply the shards in memory now, stored ones whenever read back."""
        resident = [b.shard_grad for b in self._buckets if b.shard_grad is not None]
        if resident:
            torch._foreach_mul_(resident, coef)
        for i in self._stored:
            self._coefs[i].append(coef)

    def zero(self) -> None:
        """``zero_grad``: forget the stored shards (their files are overwritten next time)."""
        for i in {*self._stored, *self._reading}:
            self._drop(i)
