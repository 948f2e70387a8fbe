"""The order in which every rank issues its gradient reductions at stages 0-2 (DDP's rule).

A collective pairs whatever each rank issues next. Ranks whose backward reaches units in orders
of their own (a router's choice per rank, a unit that one rank's batch skips) would sum one
bucket's gradient with another's, silently when the sizes match, or abort inside the backend.
So every rank issues the reductions in one order, and a bucket ready before those ahead of it
waits for them.

The order starts as the reverse of the buckets' registration order (the backward order of a
model whose units run as registered, the root last). After the first backward that reduces, it
becomes rank 0's order of that backward, broadcast once (DDP's bucket rebuild): a model whose
blocks run in another order than they were registered in (a U-Net's middle block, registered
after its up blocks) would otherwise keep finished buckets waiting, their gradients alive and
none of their reductions overlapping the rest of backward.

Stage 3 reduces each bucket as soon as it is ready (``in_order=False``): there the units'
gathers already pair the ranks in each one's forward order, the step refuses ranks whose orders
differ (``zeroshard.model_states.agreement.agreed``), and a reduction waiting would keep a unit's
full gradient alive.
"""

from __future__ import annotations

import torch

from zeroshard import collectives as C
from zeroshard.mesh import Mesh
from zeroshard.model_states.grads import GradBucket


class ReductionOrder:
    """Which ready buckets may be reduced now; ``buckets`` are the engine's, the same list (by
    position) on every rank; ``in_order=False``: each at once (stage 3)."""

    def __init__(self, buckets: list[GradBucket], *, in_order: bool = True) -> None:
        self.buckets, self.in_order = buckets, in_order
        self.order = buckets[::-1]
        self.learned = False
        """The order is rank 0's of the first backward that reduced (``end_backward``)."""
        self._waiting: set[GradBucket] = set()  # ready, not yet reduced
        self._next = 0  # position in ``order`` of the next bucket to reduce
        self._seen: list[GradBucket] = []  # this backward's buckets, in the order they got ready

    def ready(self, buckets: list[GradBucket]) -> list[GradBucket]:
        """``buckets`` just became ready: those to reduce now, in order (any of them whose turn
        has come, and the waiting ones behind them)."""
        if not self.in_order:
            return buckets
        self._seen.extend(buckets)
        self._waiting.update(buckets)
        now = []
        while self._next < len(self.order) and self.order[self._next] in self._waiting:
            bucket = self.order[self._next]
            self._waiting.discard(bucket)
            now.append(bucket)
            self._next += 1
        return now

    def is_waiting(self, bucket: GradBucket) -> bool:
        """Ready and not yet reduced (gradients that reach it now are part of its reduction)."""
        return bucket in self._waiting

    def end_backward(self, mesh: Mesh) -> None:
        """After a backward in which every bucket was reduced (or none was): forget it, and take
        rank 0's order of it as the order from now on if none was taken yet (a collective:
        every rank calls it at the same backward)."""
        if not self.learned and self._seen:
            self._learn(mesh)
        self.forget()

    def forget(self) -> None:
        """Forget the current backward (it ended, or was interrupted by an exception)."""
        self._waiting.clear()
        self._next = 0
        self._seen.clear()

    def _learn(self, mesh: Mesh) -> None:
        position = {b: i for i, b in enumerate(self.buckets)}
        seen = [position[b] for b in dict.fromkeys(self._seen)]
        rest = sorted(set(range(len(self.buckets))) - set(seen), reverse=True)
        chosen = torch.tensor(seen + rest, dtype=torch.int64, device=mesh.device)
        if mesh.world_size * mesh.tp_size > 1:
            # Over the agreement's group: every rank that reduces with another (with tensor
            # parallelism, the whole job).
            C.broadcast(chosen, src=0, group=None if mesh.tp_size > 1 else mesh.group)
        self.order = [self.buckets[i] for i in chosen.tolist()]
        self.learned = True
