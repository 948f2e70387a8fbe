"""The collectives zeroshard uses, with async handles, profiler labels and a byte ledger.

Counting convention (elements per rank, as in the ZeRO paper): an all-gather or reduce-scatter of
an n-element (unsharded) buffer moves n elements; an all-reduce moves 2n (a reduce-scatter plus an
all-gather). So one step of plain data parallelism moves 2 Psi, stages 1-2 move 2 Psi and stage 3
moves 3 Psi, Psi being the (padded) parameter count.

Algorithms by backend: gloo's flat reduce-scatter costs about 1.8x its all-reduce of the same
buffer (measured here, 2 ranks, fp32: all-reduce 56 ms per 100 MiB, reduce-scatter 106), so on
gloo a reduce-scatter runs as an in-place all-reduce of the send buffer, its slice copied out at
``wait`` (100m stage 3: backward 8% faster). All-gathers stay gloo's own below
``GATHER_BY_ALL_REDUCE_BYTES`` (64 MiB): as an all-reduce of the output's bytes (other slots
zeroed) it was faster alone (68 against 82 ms per 100 MiB) but slower in training, where its extra
reduction work competes with compute on the same cores (100m stage 3, 27 MiB units: step 1.36 s
against 1.27 s). From 64 MiB on they run as that all-reduce: gloo's own gather allocates a
temporary as large as its output (measured: +433 MiB for a 431 MiB unit), the in-place all-reduce
nothing. Those all-reduces run on twins of the group (same ranks, one per collective they stand
in for, made once by ``prepare``): gloo cannot tell two all-reduces apart, so a rank in one of
them and another rank in a plain all-reduce of another size would abort the process; on separate
groups they wait and the watchdog names both collectives. The ledger still counts the logical
collective, the paper's volume above; NCCL and the other backends run the collectives themselves.

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

import weakref
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import record_function

from zeroshard.watchdog import diagnosed, inherit_timeout

# torch 2.13 renamed the flat-tensor collectives; older releases only have the first names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class LedgerEntry:
    calls: int = 0
    numel: int = 0
    bytes: int = 0


SHARD, REPLICATE, WORLD, TENSOR = "shard", "replicate", "world", "tensor"

KEPT_STEPS = 1000
"""Closed steps a ``Ledger`` remembers (the oldest are dropped: a long run does not grow)."""
"""Ledger scopes: the group a collective ran on (module docstring)."""


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

    def record(
        self, op: str, label: str, numel: int, element_bytes: int, scope: str = SHARD
    ) -> None:
        for entry in (self.entries[(op, label)], self.scoped[(scope, op, label)]):
            entry.calls += 1
            entry.numel += numel
            entry.bytes += numel * element_bytes

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

    def reset(self) -> None:
        self.entries = defaultdict(LedgerEntry)
        self.scoped = defaultdict(LedgerEntry)
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
        work: dist.Work | None,
        output: torch.Tensor,
        *,
        op: str = "collective",
        label: str = "",
        group: dist.ProcessGroup | None = None,
        unit: str | None = None,
        then: Callable[[], None] | None = None,
    ) -> None:
        self._work = work
        self.output = output
        self.op, self.label, self.group, self.unit = op, label, group, unit
        self._then = then  # run once the work is complete (a slice copied out)
        if work is None:
            self._finish()

    def _finish(self) -> None:
        if self._then is not None:
            self._then()
            self._then = None

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            with diagnosed(self.op, self.label, self.group, unit=self.unit):
                self._work.wait()
            self._work = None
        self._finish()
        return self.output


def _by_all_reduce(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> bool:
    """Whether a reduce-scatter runs as an all-reduce: on gloo (module docstring)."""
    return tensor.device.type == "cpu" and dist.get_backend(group) == "gloo"


_TWINS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, dist.ProcessGroup]] = (
    weakref.WeakKeyDictionary()
)
_PURPOSES = ("reduce_scatter", "all_gather")
"""The collectives that run as all-reduces on gloo, each on a twin of its own."""


def _twin(group: dist.ProcessGroup | None, purpose: str) -> dist.ProcessGroup:
    """The group's twin for all-reduces that stand in for ``purpose`` (module docstring). Made
    by the group's ranks only, at their first such collective on it (the same one on each: they
    run the same schedule), with the job's timeout."""
    key = group if group is not None else dist.group.WORLD
    twins = _TWINS.setdefault(key, {})
    twin = twins.get(purpose)
    if twin is None:
        ranks = dist.get_process_group_ranks(key)
        twin = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        inherit_timeout(twin)
        twins[purpose] = twin
    return twin


def prepare(*groups: dist.ProcessGroup | None) -> None:
    """Make the twins the collectives below use on ``groups`` now, at a point every rank of
    each reaches (``shard``), rather than at a first collective that a rank may never join."""
    for group in groups:
        if dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1:
            for purpose in _PURPOSES:
                _twin(group, purpose)


def _slot(output: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's slot of a flat buffer split evenly over ``group``."""
    n = output.numel() // dist.get_world_size(group)
    r = dist.get_rank(group)
    return output[r * n : (r + 1) * n]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


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
    ledger.record("all_gather", label, output.numel(), output.element_size(), scope)
    with record_function("zeroshard::all_gather"), diagnosed("all_gather", label, group, unit=unit):
        if _gathers_by_all_reduce(group, output):
            own = _slot(output, group)
            if not _same_memory(own, shard):
                own.copy_(shard)
            n, r = own.numel(), dist.get_rank(group)
            output[: r * n].zero_()  # every other slot: zeros, which the sum leaves exact
            output[(r + 1) * n :].zero_()
            twin = _twin(group, "all_gather")
            work = dist.all_reduce(output, group=twin, async_op=async_op)
        else:
            work = _all_gather_flat(output, shard, group=group, async_op=async_op)
    return Handle(work, output, op="all_gather", label=label, group=group, unit=unit)


GATHER_BY_ALL_REDUCE_BYTES = 64 << 20
"""On gloo, all-gathers of this many bytes or more run as in-place all-reduces (module
docstring): gloo's own gathers into a temporary as large as the output."""


def _gathers_by_all_reduce(group: dist.ProcessGroup | None, output: torch.Tensor) -> bool:
    big = output.numel() * output.element_size() >= GATHER_BY_ALL_REDUCE_BYTES
    return big and _by_all_reduce(group, output) and dist.get_world_size(group) > 1


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
    ``full`` is scratch: on gloo it holds the whole sum afterwards (module docstring)."""
    ledger.record("reduce_scatter", label, full.numel(), full.element_size())
    with (
        record_function("zeroshard::reduce_scatter"),
        diagnosed("reduce_scatter", label, group, unit=unit),
    ):
        if _by_all_reduce(group, full):
            # ``full`` is the caller's send buffer, consumed here: reduced in place.
            own = _slot(full, group)
            work = dist.all_reduce(full, group=_twin(group, "reduce_scatter"), async_op=async_op)
            then = None if _same_memory(own, output) else (lambda: output.copy_(own))
            return Handle(
                work, output, op="reduce_scatter", label=label, group=group, unit=unit, then=then
            )
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
    ledger.record("all_reduce", label, 2 * tensor.numel(), tensor.element_size(), scope)
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
