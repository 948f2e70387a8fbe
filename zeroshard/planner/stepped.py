"""Optimizer states of a model some of whose parameters never get a gradient.

torch's optimizers make a parameter's states at its first gradient, so a trainable parameter the
loss never reaches (BART's cross-attention in a decoder built as a causal LM, a head the loss
skips) has none. The engine partitions optimizer states by ranges of each flat buffer
(``zeroshard.model_states.partition``): the ranks whose ranges hold the reached parameters hold
more than a 1/Nd share of their states, the others less. The busiest rank is the one that runs
out of memory, so the plan charges every rank with its states (``busiest_rank_numel``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroshard.model_states.partition import intersect, layout, padded_numel, shard_range
from zeroshard.stages import partition


@dataclass(frozen=True, eq=False)
class SteppedLayout:
    """The engine's units of a built model (``zeroshard.wrap.units``, on meta) and which of
    their parameters the loss reaches (``zeroshard.planner.saved``)."""

    specs: list = field(repr=False)
    """``UnitSpec``s, the root first, as ``shard`` makes them."""
    reached: frozenset[int] = field(repr=False)
    """``id`` of every parameter the loss's graph reaches."""
    _cache: dict = field(default_factory=dict, repr=False)

    def busiest_rank_numel(
        self, *, stage: int, num_shard_ranks: int, bucket_bytes: int, param_bytes: int
    ) -> int:
        """Elements of reached parameters in the optimizer ranges of the rank holding the most:
        the engine's flat buffers (one per unit and (requires_grad, dtype) group at stage 3,
        else units filled into buckets of ``bucket_bytes`` in ``param_bytes``-byte working
        copies), each cut into ``num_shard_ranks`` ranges from stage 1 (whole at stage 0)."""
        key = (stage, num_shard_ranks, bucket_bytes, param_bytes)
        if key not in self._cache:
            part = partition(stage)  # (as ``shard`` makes the buffers and cuts their states)
            ranges = num_shard_ranks if part.optimizer_states else 1
            per_rank = [0] * ranges
            for params in self._flats(0 if part.parameters else bucket_bytes, param_bytes):
                offsets, numel = layout([p.numel() for p in params], params[0].element_size())
                padded = padded_numel(numel, num_shard_ranks)
                for rank in range(ranges):
                    shard = shard_range(rank, padded, ranges)
                    for p, start in zip(params, offsets):
                        if id(p) in self.reached:
                            lo, hi = intersect(shard, (start, start + p.numel()))
                            per_rank[rank] += hi - lo
            self._cache[key] = max(per_rank)
        return self._cache[key]

    def _flats(self, bucket_bytes: int, param_bytes: int) -> list[list]:
        """The trainable parameters of each flat buffer, in its order (``sharding._flat_params``
        with a policy whose floating working copies have ``param_bytes`` bytes)."""
        import torch

        from zeroshard.planner.saved import DTYPES
        from zeroshard.precision import MixedPrecision
        from zeroshard.sharding import _flat_params

        policy = MixedPrecision(param_dtype=getattr(torch, DTYPES[param_bytes]))
        found: list[list] = []

        def make(params: list[tuple], dtype, policy) -> object:
            if params[0][0].requires_grad:
                found.append([p for p, _ in params])
            return None

        _flat_params(self.specs, bucket_bytes, make, [policy] * len(self.specs))
        return found
