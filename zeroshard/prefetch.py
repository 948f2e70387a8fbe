"""What is gathered ahead of its use and freed when it is not needed: the ``Engine``'s prefetch
of the next units (forward order, or backward's: the reverse), the reads ahead of offloaded
masters, and the frees of units gathered for nothing (a prefetch that a forward skipped, a
unit recomputed for a backward that comes later). Stage 3 only (partitioned parameters).

``Prefetching`` is the ``Engine``'s part that does it, on the engine's own attributes
(``units``, ``forward_order``, ``phase``, ``config``, ``partition``, ``summoned``,
``param_swap``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from itertools import islice

import torch

from zeroshard.unit import Phase, TrainingState, Unit


class Prefetching:
    """The ``Engine``'s methods that gather ahead and free early."""

    def _prefetch(self, order: list[Unit], current: Unit | None) -> None:
        """Start gathering the next ``num_prefetch`` sharded units after ``current`` in
        ``order`` (from the start when ``current`` is None)."""
        start = order.index(current) + 1 if current is not None and current in order else 0
        if self.param_swap is not None:
            self._read_masters_ahead(order[start:])
        for nxt in islice(self._upcoming(order[start:]), self.config.num_prefetch):
            if nxt.is_sharded:
                nxt.unshard(async_op=True)

    def _free_idle_buffers(self, backward_order: list[Unit]) -> None:
        """In backward, after its prefetch: free the gather buffers no gather left in this
        backward will take (each size's free ones beyond the units of that size still to be
        gathered). The last units' backward then holds none idle; the buffers their parameters
        and gradients give back afterwards stay for the next step's gathers."""
        if not self.partition.parameters or self.summoned:
            return
        for pool in self.buffer_pools():
            idle = pool.idle()
            if not idle:  # (mostly: then no walk over the units left, once per unit)
                continue
            upcoming: Counter[tuple[torch.device, int]] = Counter()
            for u in self._upcoming(backward_order):
                if u.is_sharded and not u.is_gathered:
                    keys = (f.buffer_key for f in u.flat_params if f.partition.parameters)
                    upcoming.update(k for k in keys if k in idle)
                    if all(upcoming[k] >= n for k, n in idle.items()):
                        break  # every idle buffer has a gather to come
            pool.trim(upcoming)

    def _upcoming(self, order: list[Unit], *, root: bool = False) -> Iterator[Unit]:
        """The units of ``order`` a gather may be needed for next: not the root (it stays
        gathered between forward and backward) unless ``root``, and in backward none that
        backward has reached already."""
        for nxt in order:
            reached = self.phase is Phase.BACKWARD and nxt.state is not TrainingState.IDLE
            if not reached and (root or not nxt.is_root):
                yield nxt

    def _read_masters_ahead(self, order: list[Unit], *, root: bool = False) -> None:
        """Start reading the offloaded masters of the next ``param_swap.window`` sharded units
        of ``order`` (those a gather will need soon); the root only when ``root``."""
        assert self.param_swap is not None
        window = islice(self._upcoming(order, root=root), self.param_swap.window)
        self.param_swap.read_ahead(
            [f for u in window if u.is_sharded and not u.is_gathered for f in u.flat_params]
        )

    def _free_after_recompute(self, unit: Unit) -> bool:
        """Whether ``unit``, just recomputed at stage 3, is freed until its backward gathers it
        again (a span of k units kept gathered was the whole model with k = nl). Kept: the unit
        whose backward runs (not idle) and the next ``num_prefetch`` that backward reaches."""
        if not self.partition.parameters or self.summoned or unit.is_root:
            return False
        if unit.state is TrainingState.POST_BACKWARD and unit.is_gathered:
            # Lent again after its backward (a hook calling one of its layers): without grad
            # no backward of it comes to free it; with grad, its backward follows (reversible
            # layers) and finishes it, as the end of the backward does at the latest
            # (``_units_to_idle``).
            return not torch.is_grad_enabled()
        if unit.state is not TrainingState.IDLE or not unit.is_gathered:
            return False
        # The unit whose backward runs is reached (a span's last, non-reentrant); with none
        # reached (a reentrant checkpoint recomputes before any unit's backward), the first
        # upcoming one computes next: kept with the prefetched ones.
        running = any(u.state is TrainingState.PRE_BACKWARD for u in self.units if not u.is_root)
        window = self.config.num_prefetch + (not running)
        return unit not in islice(self._upcoming(self.forward_order[::-1]), window)

    def _free_unused_prefetches(self) -> None:
        """Units prefetched from the last forward's order that this forward skipped (layer drop,
        early exit): wait for their gather and free them, not hold them until the backward."""
        if not self.partition.parameters or self.summoned:
            return
        used = set(self.forward_order)
        for u in self.units:
            skipped = not u.is_root and u not in used and u.state is TrainingState.IDLE
            if skipped and u.is_gathered:
                u.reshard()
