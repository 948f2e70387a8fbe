"""The collectives zeroshard uses, with async handles, profiler labels and a byte ledger.

Counting convention (elements per rank, as in the ZeRO paper): an all-gather or reduce-scatter of
an n-element (unsharded) buffer moves n elements; an all-reduce moves 2n (a reduce-scatter plus an
all-gather). So one step of plain data parallelism moves 2 Psi, stages 1-2 move 2 Psi and stage 3
moves 3 Psi, Psi being the (padded) parameter count.

Algorithms by backend: on gloo, all-gathers and reduce-scatters run as point-to-point sends and
receives between every pair of ranks, straight into and out of the caller's buffers. gloo's own
collectives are much slower (2 ranks, fp32, 100 MiB, one thread each: all-gather 85 ms wall and
66 ms CPU against 25 and 18 by sends; reduce-scatter 106 ms, all-reduce 64-76, 35 by sends; 4
ranks: all-reduce 155 ms, reduce-scatter by sends 75, all-gather by sends 50), and gloo's
all-gather also allocates a temporary as large as its output (+433 MiB for a 431 MiB unit). A
reduce-scatter by sends receives the first peer's part straight into its output and any other
(more ranks, or reducing in place) through one receive buffer of at most ``REDUCE_CHUNK_BYTES``;
the sum runs in a fixed order of source ranks (deterministic; with 2 ranks it is gloo's). Every
such collective takes tags of its own, counted per group (the ranks of a group issue its
collectives in one order), so two in flight never take each other's messages. All-reduces stay
gloo's: as a reduce-scatter and then an all-gather by sends, stage 0 at ``100m`` went from 1.02x
to 1.08x DDP's step time (the second half can start only when this rank waits for it,
where gloo runs a whole all-reduce on its own thread during backward). The ledger counts
the logical collective, the paper's volume above; NCCL and the other backends run the
collectives themselves.

Scopes (hybrid sharding, ``zeroshard.mesh``): every collective is also counted under the group it
ran on, ``SHARD`` (inside a shard group: every rank without hybrid sharding), ``REPLICATE``
(across shard groups, between the ranks holding the same shard) or ``WORLD`` (every rank: the
small agreement all-reduce), or ``TENSOR`` (inside a tensor-parallel group,
``zeroshard.tensor_parallel``: the gradient-norm sum and the all-gathers of partitioned activation
checkpoints, ``zeroshard.residual_states.partitioned``; the layers' own all-reduces run through
DTensor and are not counted here). With shard groups of k ranks inside a node, ``REPLICATE`` is the
inter-node traffic: per step, the all-reduce of this rank's 1/k gradient shard, 2 Psi / k.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
import zlib
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch.profiler import record_function

from zeroshard.signals import deferred
from zeroshard.watchdog import diagnosed

# torch 2.13 renamed the flat-tensor collectives; older releases only have the first names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Waitable(Protocol):
    """A collective in flight: a backend's ``dist.Work`` or one of the exchanges below."""

    def wait(self) -> object: ...


@dataclass
class LedgerEntry:
    calls: int = 0
    numel: int = 0
    bytes: int = 0


SHARD, REPLICATE, WORLD, TENSOR = "shard", "replicate", "world", "tensor"
"""Ledger scopes: the group a collective ran on (module docstring)."""

KEPT_STEPS = 1000
"""Closed steps a ``Ledger`` remembers (the oldest are dropped: a long run does not grow)."""

ORDER_MODULUS = 16_777_213
"""The largest prime below 2**24: an ``order`` digest is exact in FP32, so it can ride in the
step's agreement all-reduce (``zeroshard.model_states.agreement.agree``)."""


@functools.cache
def _unit_code(op: str, unit: str) -> int:
    # crc32, not hash(): Python salts str hashes per process, and ranks must agree.
    return zlib.crc32(f"{op}:{unit}".encode())


@dataclass
class Ledger:
    """Elements and bytes moved per (collective, label) since the last ``reset``.

    ``label`` says what moved: ``"params"`` (all-gathers of parameters), ``"grads"`` (gradient
    reduction), ``"norm"`` or ``"found_inf"`` (the small scalar all-reduces), ``"activations"``
    (partitioned activation checkpoints gathered for a recomputation). ``entries`` and ``steps``
    are totals over every group; ``scoped`` and ``scoped_steps`` split the same counts by scope
    (``SHARD``, ``REPLICATE``, ``WORLD``, ``TENSOR``), keyed ``(scope, op, label)``.
    """

    entries: dict[tuple[str, str], LedgerEntry] = field(
        default_factory=lambda: defaultdict(LedgerEntry)
    )
    steps: deque[dict[tuple[str, str], LedgerEntry]] = field(
        default_factory=lambda: deque(maxlen=KEPT_STEPS)
    )
    scoped: dict[tuple[str, str, str], LedgerEntry] = field(
        default_factory=lambda: defaultdict(LedgerEntry)
    )
    scoped_steps: deque[dict[tuple[str, str, str], LedgerEntry]] = field(
        default_factory=lambda: deque(maxlen=KEPT_STEPS)
    )
    order: int = 0
    """A digest (below ``ORDER_MODULUS``) of the units whose collectives this rank issued since
    the last ``end_step``, in order: equal on every rank when the ranks gathered and reduced the
    same units in the same order, and (but for one chance in 2**24) different otherwise. Ranks
    that run units in orders of their own pair one unit's shards with another's in each
    collective, silently when the sizes match."""

    def record(
        self,
        op: str,
        label: str,
        numel: int,
        element_bytes: int,
        scope: str = SHARD,
        unit: str | None = None,
    ) -> None:
        for entry in (self.entries[(op, label)], self.scoped[(scope, op, label)]):
            entry.calls += 1
            entry.numel += numel
            entry.bytes += numel * element_bytes
        if unit is not None:
            self.order = (self.order * 31 + _unit_code(op, unit)) % ORDER_MODULUS

    def numel(
        self, *, labels: tuple[str, ...] = ("params", "grads"), scope: str | None = None
    ) -> int:
        """Elements moved since the last reset by collectives with one of ``labels`` (on
        ``scope``'s group only, when given)."""
        return sum(
            e.numel
            for (sc, _, label), e in self.scoped.items()
            if label in labels and scope in (None, sc)
        )

    def bytes(
        self, *, labels: tuple[str, ...] = ("params", "grads"), scope: str | None = None
    ) -> int:
        return sum(
            e.bytes
            for (sc, _, label), e in self.scoped.items()
            if label in labels and scope in (None, sc)
        )

    def by_scope(self, step: int | None = None) -> dict[str, dict[str, int]]:
        """Per scope, ``{"calls", "numel", "bytes"}`` summed over collectives and labels: of the
        closed step ``steps[step]``, or since the last ``end_step`` when ``step`` is None."""
        entries = self.scoped if step is None else self.scoped_steps[step]
        out: dict[str, dict[str, int]] = {}
        for (scope, _, _), e in sorted(entries.items()):
            total = out.setdefault(scope, {"calls": 0, "numel": 0, "bytes": 0})
            total["calls"] += e.calls
            total["numel"] += e.numel
            total["bytes"] += e.bytes
        return out

    def end_step(self) -> None:
        """Close the current step: its totals go to ``steps`` and the counters restart."""
        self.steps.append(dict(self.entries))
        self.scoped_steps.append(dict(self.scoped))
        self.entries = defaultdict(LedgerEntry)
        self.scoped = defaultdict(LedgerEntry)
        self.order = 0

    def reset(self) -> None:
        self.entries = defaultdict(LedgerEntry)
        self.scoped = defaultdict(LedgerEntry)
        self.order = 0
        self.steps.clear()
        self.scoped_steps.clear()

    def summary(self) -> dict[str, dict[str, int]]:
        return {
            f"{op}/{label}": {"calls": e.calls, "numel": e.numel, "bytes": e.bytes}
            for (op, label), e in sorted(self.entries.items())
        }


class Handle:
    """A collective in flight; ``wait()`` is idempotent and returns its output tensor.

    ``op``, ``label``, ``group`` and ``unit`` say which collective it is, for the error when it
    does not complete: ``wait()`` raises ``CollectiveTimeout`` naming them and the ranks that did
    not arrive (``zeroshard.watchdog``), never a bare backend timeout."""

    def __init__(
        self,
        work: _Waitable | None,
        output: torch.Tensor,
        *,
        op: str = "collective",
        label: str = "",
        group: dist.ProcessGroup | None = None,
        unit: str | None = None,
    ) -> None:
        self._work = work
        self.output = output
        self.op, self.label, self.group, self.unit = op, label, group, unit
        if isinstance(work, _Exchange):
            weakref.finalize(self, _orphan, work)

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            with diagnosed(self.op, self.label, self.group, unit=self.unit):
                self._work.wait()
            self._work = None
        return self.output


def _orphan(exchange: _Exchange) -> None:
    """A handle died: its exchange, if still unwaited, is finished at the next one's start
    (``_wait_orphans`` takes only those still in flight). A weakref finalizer, so it takes no
    lock: the garbage collector may run it on a thread that holds ``_IN_FLIGHT_LOCK`` (an
    allocation inside ``_wait_orphans``, after a Ctrl-C left a handle in a reference cycle),
    and taking it there blocked that rank for good, its peers timing out in the next
    collective."""
    exchange.orphaned = True


def _alone(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> bool:
    """A group of one rank on the CPU: an all-gather or a reduce-scatter is a copy (none in
    place), where gloo's own staged a copy of its input besides. (On an accelerator the
    backend's stays: its work orders the side stream it runs on before the compute stream.)"""
    return tensor.device.type == "cpu" and dist.get_world_size(group) == 1


def _copy(output: torch.Tensor, source: torch.Tensor) -> None:
    _check_buffers(source, output, 1)  # (one rank: the shard is the whole)
    if output.data_ptr() != source.data_ptr():
        output.copy_(source)


def _check_buffers(shard: torch.Tensor, full: torch.Tensor, world: int) -> None:
    """A gather's or a reduce-scatter's buffers (``shard``: 1/N of ``full``) must match: a
    mismatch would otherwise hang, or cast silently."""
    for t in (shard, full):
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"collective buffers must be 1D and contiguous, got {tuple(t.shape)}")
    if shard.dtype != full.dtype or full.numel() != world * shard.numel():
        raise ValueError(
            f"collective buffers do not match: {full.numel()} {full.dtype} elements for {world} "
            f"shards of {shard.numel()} {shard.dtype} ones"
        )


def _point_to_point(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> bool:
    """Whether all-gathers and reduce-scatters run as sends and receives: on gloo (module
    docstring)."""
    return (
        tensor.device.type == "cpu"
        and dist.get_backend(group) == "gloo"
        and dist.get_world_size(group) > 1
    )


_TAGS: weakref.WeakKeyDictionary[dist.ProcessGroup, itertools.count] = weakref.WeakKeyDictionary()
_TAG_BASE, _TAG_SPAN, _MAX_CHUNKS = 1 << 24, 1 << 19, 1 << 10
_KINDS = ("all_gather", "reduce_scatter")
"""Tags of the point-to-point collectives: a block of ``_MAX_CHUNKS`` per collective (one per
message of a reduce-scatter's slice), counted per group from ``_TAG_BASE`` (above the small
tags a user's own sends take), wrapping after ``_TAG_SPAN`` collectives, one block per count
for each of ``_KINDS`` (the tags stay below 2**31)."""

REDUCE_CHUNK_BYTES = 4 << 20
"""A reduce-scatter sends each slice in messages of at most this many bytes (more when a slice
would need over ``_MAX_CHUNKS``): its receive buffer is one message, not a shard."""


def _next_tag(group: dist.ProcessGroup | None, what: str) -> int:
    """The first tag of the next point-to-point collective on ``group``: the same on every rank,
    since the ranks of a group issue its collectives in one order (as gloo's own collectives
    need). Tags of their own keep two collectives in flight apart whatever order their receives
    are posted in. ``what`` the collective is (one of ``_KINDS``) picks one tag of its count:
    ranks that issue a gather and a reduce-scatter at one count (a rank with a batch fewer
    evaluating while the other is in its backward) then wait for each other's messages until
    ``CollectiveTimeout``, where the same tag paired one rank's gather with the other's
    reduce-scatter of the same size, and the first computed with gradients as weights without
    a word (explorer). Gathers of different units of one size still pair: the step's agreement
    compares the order of the units' collectives and refuses the step
    (``agreement.OrderMismatch``), after which training goes on (a unit in the tag made that a
    timeout)."""
    counter = _TAGS.setdefault(group if group is not None else dist.group.WORLD, itertools.count())
    kind = _KINDS.index(what)
    return _TAG_BASE + ((next(counter) % _TAG_SPAN) * len(_KINDS) + kind) * _MAX_CHUNKS


def _chunks(n: int, element_size: int) -> list[tuple[int, int]]:
    """The messages ``[lo, hi)`` of an n-element slice, the same on the sending and the
    receiving rank."""
    per = max(REDUCE_CHUNK_BYTES // element_size, -(-n // _MAX_CHUNKS), 1)
    return [(lo, min(lo + per, n)) for lo in range(0, n, per)]


class _Exchange:
    """A point-to-point collective in flight: its sends and receives, waited together.

    gloo's sends and receives report completion only to ``wait`` (``is_completed`` stays False
    until then), and a send completes once its peer has posted the matching receive. Exchanges
    keep themselves alive until waited (``_IN_FLIGHT``): a handle dropped unwaited (a model freed
    with a refresh in flight) must not free a buffer that a peer's message is still on its way
    to, which leaves the connection between the two ranks unusable for every later collective.
    Such an orphan is waited for at the start of the next exchange (``_wait_orphans``)."""

    def __init__(self, sends: list[dist.Work], receives: list[dist.Work]) -> None:
        self._sends, self._receives = sends, receives
        self._done: dict[int, dist.Work] = {}
        """The works waited, by id: held here, so that no later work takes a freed one's id
        (a reduce-scatter drops each receive once added, and posts the next)."""
        self.orphaned = False
        """Its handle was dropped before ``wait``: finished by ``_wait_orphans``."""
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.add(self)

    def _wait_once(self, work: dist.Work) -> None:
        """Wait for ``work`` unless it was: gloo's sends and receives never return from a
        second wait. A Ctrl-C that came while blocked in one is raised as it returns, the work
        done: the exchange waited again (the next forward's, ``zero_grad``'s) hung for good."""
        if id(work) in self._done:
            return
        try:
            work.wait()
        except Exception:  # the backend's failure: a later wait raises it again
            raise
        except BaseException:  # a signal's, raised as the wait returned
            if work.is_completed():
                self._done[id(work)] = work
            raise
        self._done[id(work)] = work

    def _receive(self) -> None:
        for work in self._receives:
            self._wait_once(work)

    def wait(self) -> None:
        self._receive()
        for work in self._sends:
            self._wait_once(work)
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.discard(self)


_IN_FLIGHT: set[_Exchange] = set()
"""Exchanges started and not yet waited."""
_IN_FLIGHT_LOCK = threading.Lock()


def _wait_orphans() -> None:
    """Wait for the exchanges whose handles were dropped unwaited. Every rank started them in
    the same order, and their receives were posted then (an all-gather's all of them; a
    reduce-scatter's next ones are posted as each arrives, on every rank that waits for it)."""
    with _IN_FLIGHT_LOCK:
        orphans = [e for e in _IN_FLIGHT if e.orphaned]
    for exchange in orphans:
        exchange.wait()


class _ReduceExchange(_Exchange):
    """A reduce-scatter: every other rank's part of this rank's shard, in messages of at most
    ``REDUCE_CHUNK_BYTES``, added into ``output`` in a fixed order of sources (r - 1, r - 2,
    ...), so the sum is deterministic. When ``output`` is not the input's own slice, the first
    source's messages land in it directly, all receives posted at the start (``own`` is added to
    each at ``wait``); every other message, or all of them when reducing in place, goes through
    one message-sized receive buffer: the first receive is posted at the start, each next one
    when the last has been added, at ``wait``."""

    def __init__(
        self,
        sends: list[dist.Work],
        own: torch.Tensor,
        output: torch.Tensor,
        sources: list[int],
        *,
        group: dist.ProcessGroup | None,
        tag: int,
    ) -> None:
        self._own, self._output, self._group, self._tag = own, output, group, tag
        chunks = _chunks(own.numel(), own.element_size())
        direct = not _same_memory(own, output)
        self._direct = [  # (receive, lo, hi) straight into output, all posted now
            (self._recv(output[lo:hi], sources[0], c), lo, hi)
            for c, (lo, hi) in enumerate(chunks)
            if direct
        ]
        self._queue = deque(  # (source, chunk, lo, hi) through the buffer
            (src, c, lo, hi) for src in sources[direct:] for c, (lo, hi) in enumerate(chunks)
        )
        size = max((hi - lo for _, _, lo, hi in self._queue), default=0)
        self._inbox = own.new_empty(size)
        self._current = self._post_next()
        super().__init__(sends, [])

    def _recv(self, into: torch.Tensor, source: int, chunk: int) -> dist.Work:
        return dist.irecv(into, group_src=source, group=self._group, tag=self._tag + chunk)

    def _post_next(self) -> tuple[dist.Work, int, int] | None:
        if not self._queue:
            return None
        source, c, lo, hi = self._queue.popleft()
        return self._recv(self._inbox[: hi - lo], source, c), lo, hi

    def _receive(self) -> None:
        # One message at a time: a wait interrupted is taken up where it was. A message's
        # addition and its bookkeeping run as one (``deferred``): a Ctrl-C that came during the
        # addition was raised right after it, and the message was added again when taken up.
        while self._direct:
            work, lo, hi = self._direct[0]
            self._wait_once(work)
            with deferred():
                self._output[lo:hi].add_(self._own[lo:hi])
                self._direct.pop(0)
        while self._current is not None:
            work, lo, hi = self._current
            self._wait_once(work)
            with deferred():
                self._output[lo:hi].add_(self._inbox[: hi - lo])
                self._current = self._post_next()


def _peers(group: dist.ProcessGroup | None) -> tuple[int, list[int], list[int]]:
    """This rank in ``group``, the ranks it sends to (r + 1, r + 2, ...) and the ranks it
    receives from (r - 1, r - 2, ...), all as ranks of the group."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return (
        rank,
        [(rank + k) % world for k in range(1, world)],
        [(rank - k) % world for k in range(1, world)],
    )


def _gather_exchange(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, what: str
) -> _Exchange:
    """All-gather by sends and receives straight into ``output``: no temporary, no arithmetic.
    ``what``: the collective's operation, for its tag (``_next_tag``)."""
    rank, targets, sources = _peers(group)
    n, tag = shard.numel(), _next_tag(group, what)
    own = output[rank * n : (rank + 1) * n]
    if not _same_memory(own, shard):
        own.copy_(shard)
    sends = [dist.isend(own, group_dst=d, group=group, tag=tag) for d in targets]
    receives = [
        dist.irecv(output[s * n : (s + 1) * n], group_src=s, group=group, tag=tag) for s in sources
    ]
    return _Exchange(sends, receives)


def _reduce_exchange(
    output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None, what: str
) -> _ReduceExchange:
    """Reduce-scatter by sending every other rank its slice of ``full`` and summing the slices
    received with this rank's own into ``output`` (which may be that slice itself). ``what``:
    the collective's operation, for its tag (``_next_tag``)."""
    rank, targets, sources = _peers(group)
    n, tag = full.numel() // dist.get_world_size(group), _next_tag(group, what)
    sends = [
        dist.isend(full[d * n + lo : d * n + hi], group_dst=d, group=group, tag=tag + c)
        for d in targets
        for c, (lo, hi) in enumerate(_chunks(n, full.element_size()))
    ]
    own = full[rank * n : (rank + 1) * n]
    return _ReduceExchange(sends, own, output, sources, group=group, tag=tag)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def _exchanged(
    shard: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup | None,
    start: Callable[[], _Exchange],
    async_op: bool,
) -> _Exchange | None:
    """Check a gather's or a reduce-scatter's buffers (``_check_buffers``), finish the orphaned
    exchanges, then ``start()`` this one: a ``Handle``'s work, or finished here when the caller
    is synchronous."""
    _check_buffers(shard, full, dist.get_world_size(group))
    _wait_orphans()
    exchange = start()
    if async_op:
        return exchange
    try:
        exchange.wait()
    except Exception:  # the backend failed: the group is broken, nothing is waited again
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.discard(exchange)
        raise
    except BaseException:
        # A Ctrl-C: its receives stay posted, into buffers it holds: finished at the next
        # exchange's start, as a dropped handle's are, rather than never.
        exchange.orphaned = True
        raise
    return None


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    ledger: Ledger,
    label: str = "params",
    async_op: bool = True,
    unit: str | None = None,
    scope: str = SHARD,
) -> Handle:
    """Gather every rank's ``shard`` (1D, n/N elements) into ``output`` (1D, n, all ranks).
    ``unit`` names the wrapped module for ``CollectiveTimeout`` (as do the functions below)."""
    ledger.record("all_gather", label, output.numel(), output.element_size(), scope, unit)
    with record_function("zeroshard::all_gather"), diagnosed("all_gather", label, group, unit=unit):
        if _alone(group, output):
            work = _copy(output, shard)
        elif _point_to_point(group, output):
            what = "all_gather"
            start = functools.partial(_gather_exchange, output, shard, group, what)
            work = _exchanged(shard, output, group, start, async_op)
        else:
            work = _all_gather_flat(output, shard, group=group, async_op=async_op)
    return Handle(work, output, op="all_gather", label=label, group=group, unit=unit)


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    ledger: Ledger,
    label: str = "grads",
    async_op: bool = True,
    unit: str | None = None,
) -> Handle:
    """Sum ``full`` (1D, n, every rank's own) over ranks; rank r receives slice r in ``output``.
    ``output`` may be ``full``'s slice r (in place); ``full`` is scratch until ``wait``."""
    ledger.record("reduce_scatter", label, full.numel(), full.element_size(), unit=unit)
    with (
        record_function("zeroshard::reduce_scatter"),
        diagnosed("reduce_scatter", label, group, unit=unit),
    ):
        if _alone(group, full):
            work = _copy(output, full)
        elif _point_to_point(group, full):
            what = "reduce_scatter"
            start = functools.partial(_reduce_exchange, output, full, group, what)
            work = _exchanged(output, full, group, start, async_op)
        else:
            work = _reduce_scatter_flat(output, full, group=group, async_op=async_op)
    return Handle(work, output, op="reduce_scatter", label=label, group=group, unit=unit)


def all_reduce(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    ledger: Ledger,
    label: str,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = True,
    unit: str | None = None,
    scope: str = SHARD,
) -> Handle:
    """Reduce ``tensor`` in place across ranks (sum by default), counted in the ledger under
    ``scope`` (``REPLICATE``: across shard groups; ``WORLD``: every rank; ``SHARD`` otherwise)."""
    ledger.record("all_reduce", label, 2 * tensor.numel(), tensor.element_size(), scope, unit)
    if scope != SHARD:
        label = f"{label} ({scope} group)"
    name = "zeroshard::all_reduce" + ("" if scope == SHARD else f"_{scope}")
    with record_function(name), diagnosed("all_reduce", label, group, unit=unit):
        work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return Handle(work, tensor, op="all_reduce", label=label, group=group, unit=unit)


def broadcast(tensor: torch.Tensor, *, src: int = 0, group: dist.ProcessGroup | None) -> None:
    """Overwrite ``tensor`` with the copy of rank ``src`` of ``group`` (its rank in the group,
    not the global one; model-state sync at shard time)."""
    with record_function("zeroshard::broadcast"), diagnosed("broadcast", "model states", group):
        dist.broadcast(tensor, group_src=src, group=group)


_BROADCAST_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                     torch.int32, torch.int8, torch.uint8, torch.bool}  # fmt: skip
"""What every backend broadcasts as it is (gloo lacks int16, the unsigned ints but uint8, and
the float8s: "Invalid scalar type")."""


def broadcast_any(t: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The value of ``t`` on rank 0 of ``group``, on every rank of it, whatever its dtype or
    layout: in place where the backends take its dtype and it is contiguous, else through a
    contiguous copy of its bytes (a strided view: a slice of another tensor, an ``expand``-ed
    one, whose memory is written back, its other elements untouched); a sparse one (a
    graph's adjacency), whose size differs between ranks, as an object (a new tensor, on
    ``t``'s device)."""
    if t.layout is not torch.strided:
        box = [t.cpu() if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(box, group_src=0, group=group)
        return box[0].to(t.device)
    own = t  # without expand's broadcast dimensions (stride 0): the same memory, all synced
    for dim in range(t.dim()):
        if own.stride(dim) == 0 and own.size(dim) > 1:
            own = own.narrow(dim, 0, 1)
    if own.dtype in _BROADCAST_DTYPES and own.is_contiguous():
        broadcast(own, src=0, group=group)  # (the backends move numel() elements from data_ptr)
        return t
    data = own.detach().contiguous().reshape(-1).view(torch.uint8)
    broadcast(data, src=0, group=group)
    own.copy_(data.view(t.dtype).view(own.shape))
    return t
