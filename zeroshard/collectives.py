"""The collectives zeroshard uses, with async handles, profiler labels and a byte ledger.

Counting convention (elements per rank, as in the ZeRO paper): an all-gather or reduce-scatter of
an n-element (unsharded) buffer moves n elements; an all-reduce moves 2n (a reduce-scatter plus an
all-gather). So one step of plain data parallelism moves 2 Psi, stages 1-2 move 2 Psi and stage 3
moves 3 Psi, Psi being the (padded) parameter count.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import record_function

# torch 2.13 renamed the flat-tensor collectives; older releases only have the first names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class LedgerEntry:
    calls: int = 0
    numel: int = 0
    bytes: int = 0


@dataclass
class Ledger:
    """Elements and bytes moved per (collective, label) since the last ``reset``.

    ``label`` says what moved: ``"params"`` (all-gathers of parameters), ``"grads"`` (gradient
    reduction), ``"norm"`` or ``"found_inf"`` (the small scalar all-reduces).
    """

    entries: dict[tuple[str, str], LedgerEntry] = field(
        default_factory=lambda: defaultdict(LedgerEntry)
    )
    steps: list[dict[tuple[str, str], LedgerEntry]] = field(default_factory=list)

    def record(self, op: str, label: str, numel: int, element_bytes: int) -> None:
        entry = self.entries[(op, label)]
        entry.calls += 1
        entry.numel += numel
        entry.bytes += numel * element_bytes

    def numel(self, *, labels: tuple[str, ...] = ("params", "grads")) -> int:
        """Elements moved since the last reset by collectives with one of ``labels``."""
        return sum(e.numel for (_, label), e in self.entries.items() if label in labels)

    def bytes(self, *, labels: tuple[str, ...] = ("params", "grads")) -> int:
        return sum(e.bytes for (_, label), e in self.entries.items() if label in labels)

    def end_step(self) -> None:
        """Close the current step: its totals go to ``steps`` and the counters restart."""
        self.steps.append(dict(self.entries))
        self.entries = defaultdict(LedgerEntry)

    def reset(self) -> None:
        self.entries = defaultdict(LedgerEntry)
        self.steps.clear()

    def summary(self) -> dict[str, dict[str, int]]:
        return {
            f"{op}/{label}": {"calls": e.calls, "numel": e.numel, "bytes": e.bytes}
            for (op, label), e in sorted(self.entries.items())
        }


class Handle:
    """A collective in flight; ``wait()`` is idempotent and returns its output tensor."""

    def __init__(self, work: dist.Work | None, output: torch.Tensor) -> None:
        self._work = work
        self.output = output

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self.output


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    ledger: Ledger,
    label: str = "params",
    async_op: bool = True,
) -> Handle:
    """Gather every rank's ``shard`` (1D, n/N elements) into ``output`` (1D, n, all ranks)."""
    ledger.record("all_gather", label, output.numel(), output.element_size())
    with record_function("zeroshard::all_gather"):
        work = _all_gather_flat(output, shard, group=group, async_op=async_op)
    return Handle(work, output)


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    ledger: Ledger,
    label: str = "grads",
    async_op: bool = True,
) -> Handle:
    """Sum ``full`` (1D, n, every rank's own) over ranks; rank r receives slice r in ``output``."""
    ledger.record("reduce_scatter", label, full.numel(), full.element_size())
    with record_function("zeroshard::reduce_scatter"):
        work = _reduce_scatter_flat(output, full, group=group, async_op=async_op)
    return Handle(work, output)


def all_reduce(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    ledger: Ledger,
    label: str,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = True,
) -> Handle:
    """Reduce ``tensor`` in place across ranks (sum by default)."""
    ledger.record("all_reduce", label, 2 * tensor.numel(), tensor.element_size())
    with record_function("zeroshard::all_reduce"):
        work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return Handle(work, tensor)


def broadcast(tensor: torch.Tensor, *, src: int = 0, group: dist.ProcessGroup | None) -> None:
    """Overwrite ``tensor`` with rank ``src``'s copy (model-state sync at shard time)."""
    with record_function("zeroshard::broadcast"):
        dist.broadcast(tensor, src=src, group=group)
