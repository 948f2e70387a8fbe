"""Stage-3 parameter masters on NVMe (``Offload(parameters="nvme")``, ZeRO-Infinity).

At stage 3 the gather source of each ``FlatParam`` is its FP32 ``master`` shard (1D, this rank's
range, 4 bytes per element for float parameters). With parameters on NVMe every master lives as
one record in the rank's parameter ``TensorStore`` (``<folder>/rank00000-params``) and is in
memory only around its uses:

    forward / backward   the masters of the next ``num_prefetch + param_prefetch`` units along
                         the engine's order are read ahead (``read_ahead``); a unit's gather
                         waits for its own read (``fetch``), and the master is dropped again as
                         soon as the gather is done (``gathered``): the store's copy is current
    optimizer step       sub-group i's master is read with its optimizer states (i + 1 read
                         ahead), stepped, written back and dropped once written (at most
                         ``MAX_WRITES`` writes in flight: a few masters in memory at once)
    after the step       everything is dropped; the first units of the next forward are read
                         ahead (``Engine.params_changed``)

so outside the step at most the read-ahead window's masters (plus the gathers in flight) are in
memory, not all of them. A dropped master keeps its tensor object, shape and views (the
optimizer's pieces are views of it): only its storage is resized to 0 bytes and back, as
partitioned ``full`` buffers are.

Code that reads masters outside the engine and the step must go through this module: torch
refuses to cut a view of the empty storage, but reading a view cut earlier (the optimizer's
pieces) while dropped reads freed memory. ``ShardedOptimizer.master_pieces()`` (divergence
checks) and the optimizer state dict's template step read them in one sub-group at a time
(``resident``).

Reading a master any other way (``flat.master``: state dicts, ``load_state_dict``) makes it
resident and *held* until the next step or ``params_changed``; ``masters_in_memory()`` holds
every master at once (``zeroshard.checkpoint`` uses it around save and load) and writes back on
exit those that a load may have changed.

Every read is checksummed by the store; a failed or corrupted read stops training with an
``OffloadError`` naming the master (``master[i]:<unit>``), and every later use raises it again.
Nothing here is communicated except the space check at construction (an all-reduce).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zeroshard.model_states.swap_space import check_space
from zeroshard.model_states.swappers import StopsOnFailure, open_store, stopping_on_refusal
from zeroshard.offload import SwapHandle

if TYPE_CHECKING:
    from zeroshard.mesh import Mesh
    from zeroshard.model_states.flat_param import FlatParam
    from zeroshard.offload.placement import Offload

log = logging.getLogger(__name__)

MAX_WRITES = 2
"""Masters being written back at once during the step (each stays in memory until written)."""


@dataclass(eq=False)
class _Master:
    """The swap state of one FlatParam's master (this rank's shard)."""

    name: str  # the record's name in the store, e.g. "master[3]:blocks.0.attn"
    tensor: torch.Tensor  # the master itself: 1D range numel, FP32; storage empty when dropped
    nbytes: int
    resident: bool = True  # storage allocated (holding the values once no read is in flight)
    dirty: bool = True  # memory newer than the store: must be written before it is dropped
    held: bool = False  # read outside the schedule (a state dict): kept until the next step
    reading: SwapHandle | None = None
    writing: SwapHandle | None = None


class ParamSwapper(StopsOnFailure):
    """The FP32 masters of stage-3 FlatParams on NVMe (module docstring). Built by ``shard``
    when ``Offload.parameters`` is "nvme", the folder's space checked first (a collective); each
    FlatParam is handed over with ``adopt`` as it is made, and ``finish_adopting`` drops them
    all from memory."""

    def __init__(self, offload: Offload, mesh: Mesh, num_prefetch: int, need_bytes: int) -> None:
        """``need_bytes``: this rank's swap files of every master (``sharding._master_bytes``),
        checked against the folder's free space (a collective) before the first is written."""
        self.store = open_store(offload.param_store_config(mesh.global_rank), mesh, self)
        try:
            check_space(self.store, need_bytes, mesh)
        except BaseException:
            self.store.close()
            raise
        self.mesh = mesh
        self.window = num_prefetch + offload.param_prefetch
        """Units whose masters are read ahead of the current one along the engine's order."""
        self._masters: dict[FlatParam, _Master] = {}
        self._writing: deque[_Master] = deque()
        self._pins = 0  # depth of masters_in_memory
        self._changed_while_pinned = False
        self._in_step = False
        self._error: str | None = None
        self.total_bytes = 0  # every master of this rank
        self.resident_bytes = 0  # masters with storage now
        self.reset_stats()

    # ----------------------------------------------------------------- construction
    def adopt(self, flat: FlatParam) -> None:
        """Take over ``flat``'s master (just made, in memory): write it to the store."""
        master = flat.master_view
        if master is None or master.numel() == 0:
            return  # nothing to keep elsewhere
        nbytes = master.numel() * master.element_size()
        m = _Master(f"master[{len(self._masters)}]:{flat.name}", master, nbytes)
        self._masters[flat] = m
        self.total_bytes += nbytes
        self.resident_bytes += nbytes
        flat.master_swap = self
        self._write(m)
        while len(self._writing) > MAX_WRITES:  # memory at construction: a few masters too
            self._retire(self._writing[0])

    def finish_adopting(self) -> None:
        """Drop every master from memory once written."""
        self._settle()
        log.info(
            "parameters on NVMe (%s, rank %d): %d bytes of FP32 master shards in %d swap files; "
            "read ahead %d unit(s) along the engine's order",
            self.store.config.folder,
            self.mesh.rank,
            self.total_bytes,
            len(self._masters),
            self.window,
        )

    # ----------------------------------------------------------------- forward and backward
    def fetch(self, flat: FlatParam, *, hold: bool = False) -> None:
        """Make ``flat``'s master resident (waiting for its read); ``hold`` keeps it so until
        the next step or ``params_changed`` (a state dict reads or writes it meanwhile)."""
        m = self._masters.get(flat)
        if m is None:
            return
        self._check()
        self._start_read(m)
        if m.reading is not None:
            self._wait(m)
        if hold:
            m.held = True
            # the reader may write it (``load_state_dict``): written back before it is dropped;
            # inside masters_in_memory a load says so through params_changed instead
            m.dirty = m.dirty or not self._pins

    def read_ahead(self, flats: Iterable[FlatParam]) -> None:
        """Start reading the masters of ``flats`` that are not in memory (no waiting)."""
        self._check()
        for f in flats:
            m = self._masters.get(f)
            if m is not None:
                self._start_read(m)

    def gathered(self, flat: FlatParam) -> None:
        """``flat``'s gather finished: drop its master unless something still needs it."""
        m = self._masters.get(flat)
        if m is not None and not self._in_step and not self._pins:
            self._drop(m)

    def mark_dirty(self, flat: FlatParam) -> None:
        """``flat``'s master was written outside the step (``summon_full_params``)."""
        m = self._masters.get(flat)
        if m is not None:
            m.dirty = True

    @contextlib.contextmanager
    def resident(self, flat: FlatParam) -> Iterator[None]:
        """``flat``'s master in memory inside, dropped again on exit (views of it are made
        once, e.g. the optimizer's pieces: torch checks a view against its storage's size)."""
        self.fetch(flat)
        try:
            yield
        finally:
            m = self._masters.get(flat)
            if m is not None and not self._in_step:
                self._drop(m)

    # ----------------------------------------------------------------- the optimizer step
    def begin_step(self) -> None:
        self._check()
        self._in_step = True

    def before(self, flat: FlatParam, following: FlatParam | None) -> None:
        """Read the next sub-group's master ahead, make ``flat``'s resident and not being
        written (the step changes it in place)."""
        if following is not None:
            self.read_ahead([following])
        self.fetch(flat)
        m = self._masters.get(flat)
        if m is not None and m.writing is not None:
            self._wait(m)

    def after(self, flat: FlatParam) -> None:
        """``flat``'s master stepped: write it back (waiting for the oldest write beyond
        ``MAX_WRITES``)."""
        m = self._masters.get(flat)
        if m is None:
            return
        m.dirty = True
        self._write(m)
        while len(self._writing) > MAX_WRITES:
            self._retire(self._writing[0])

    def end_step(self) -> None:
        """Wait for the writes and drop every master (``params_changed`` then reads ahead)."""
        self._in_step = False
        for m in self._masters.values():
            m.held = False
        self._settle()

    def abort_step(self) -> None:
        self._in_step = False

    # ----------------------------------------------------------------- outside the schedule
    def params_changed(self) -> None:
        """The masters may have changed (a load, ``summon_full_params``' write-back): write the
        changed ones and drop the held ones (inside ``masters_in_memory``: at its exit)."""
        if self._pins:
            self._changed_while_pinned = True
            return
        self._check()
        for m in self._masters.values():
            m.held = False
        self._settle()

    @contextlib.contextmanager
    def masters_in_memory(self) -> Iterator[None]:
        """Every master resident inside (e.g. around a checkpoint's save or load); on exit the
        ones a load may have changed are written back, then all are dropped."""
        self._check()
        self._pins += 1
        try:
            for m in self._masters.values():
                self._start_read(m)
            for m in self._masters.values():
                if m.reading is not None:
                    self._wait(m)
            yield
        finally:
            self._pins -= 1
            if not self._pins and self._error is None:
                if self._changed_while_pinned:
                    for m in self._masters.values():
                        m.dirty = True
                self._changed_while_pinned = False
                for m in self._masters.values():
                    m.held = False
                self._settle()

    def close(self) -> None:
        """Wait for pending I/O and delete the swap files; the masters are gone afterwards."""
        if self._error is None:
            self._error = "the parameters' offloaded masters were closed"
        self.store.close()

    # ----------------------------------------------------------------- measurements
    def reset_stats(self) -> None:
        self.read_bytes = self.write_bytes = 0
        self.wait_s = 0.0  # the training thread blocked on a read or write
        self.max_resident_bytes = self.resident_bytes  # outside the step

    def stats(self) -> dict[str, float]:
        """Bytes read and written, the most master bytes resident outside the step, and the
        seconds the caller blocked on a swap, since ``reset_stats``."""
        return {
            "param_read_bytes": self.read_bytes,
            "param_write_bytes": self.write_bytes,
            "param_wait_s": self.wait_s,
            "param_resident_bytes": self.resident_bytes,
            "param_max_resident_bytes": self.max_resident_bytes,
            "param_total_bytes": self.total_bytes,
        }

    # ----------------------------------------------------------------- internals

    def _grow(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        if not self._in_step and not self._pins:
            self.max_resident_bytes = max(self.max_resident_bytes, self.resident_bytes)

    def _start_read(self, m: _Master) -> None:
        if m.resident:
            return  # in memory, or being read
        m.tensor.untyped_storage().resize_(m.nbytes)  # the same storage: views stay valid
        # Issued before it counts as resident: a Ctrl-C between the two left a resident master
        # never read (the next forward computed with uninitialized memory); now one that is
        # read and not resident, read again at the next use.
        m.reading = self.store.swap_in(m.name, into=m.tensor)
        m.resident = True
        self._grow(m.nbytes)
        self.read_bytes += m.nbytes

    def _write(self, m: _Master) -> None:
        assert m.resident and m.reading is None and m.writing is None
        self.write_bytes += m.nbytes
        what = f"parameter master {m.name!r} could not be written"
        try:
            with stopping_on_refusal(self.stop, what, "parameters"):
                m.writing = self.store.swap_out(m.name, m.tensor)
            self._writing.append(m)
        except BaseException:  # a Ctrl-C between the write and its note lost the next step
            if m.writing is not None and m not in self._writing:
                self._writing.append(m)
            raise

    def _wait(self, m: _Master) -> None:
        """Finish ``m``'s read or write in flight; a failure stops training (module docstring)."""
        handle = m.reading if m.reading is not None else m.writing
        assert handle is not None
        t0 = time.perf_counter()
        try:
            handle.wait()
        except Exception as e:
            what = "read back" if m.reading is not None else "written"
            raise self.stop(
                f"parameter master {m.name!r} could not be {what}", "parameters", e
            ) from e
        finally:
            self.wait_s += time.perf_counter() - t0
        if m.reading is not None:
            m.reading = None
            m.dirty = False
        else:
            m.writing = None
            m.dirty = False
            self._writing.remove(m)

    def _retire(self, m: _Master) -> None:
        """Finish ``m``'s write (a sub-group stepped before the current one, or one written at
        construction) and drop it unless something holds it."""
        self._wait(m)
        self._drop(m)

    def _drop(self, m: _Master) -> None:
        """Free ``m``'s storage if it is clean, idle and not held (else leave it)."""
        if not m.resident or m.dirty or m.held or m.reading or m.writing or self._pins:
            return
        m.tensor.untyped_storage().resize_(0)
        m.resident = False
        self.resident_bytes -= m.nbytes

    def _settle(self) -> None:
        """Write every dirty resident master, wait for every write, drop what nothing holds."""
        self._check()
        for m in self._masters.values():
            if m.reading is not None:
                self._wait(m)
            if m.resident and m.dirty and m.writing is None:
                self._write(m)
        while self._writing:
            self._wait(self._writing[0])
        for flat, m in self._masters.items():
            if not flat.gathering:  # an async gather in flight still reads it
                self._drop(m)
