"""The optimizer step with offloaded model states: what streams around it, sub-group by sub-group.

With ``Offload(optimizer="nvme")`` each sub-group's optimizer states live in swap files
(``state_swap``): sub-group ``i + 1``'s are read while ``i`` steps and ``i - 1``'s are written.
With ``gradients="nvme"`` its reduced gradient shard is read back beside them (``grad_swap``),
and with ``parameters="nvme"`` (stage 3) its FP32 master too (``param_swap``, the engine's),
written back after its step. ``Offload(optimizer="cpu")`` moves nothing on a CPU run: the states
are in host memory already. Every rank builds the same swappers (a collective).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from zeroshard.model_states.grad_swap import GradSwapper
from zeroshard.model_states.state_swap import StateSwapper, record_bytes, state_bytes_per_group
from zeroshard.offload.folder import padded_bytes

if TYPE_CHECKING:
    import torch

    from zeroshard.model_states.optimizer import ShardedOptimizer

log = logging.getLogger(__name__)


def swappers(
    opt: ShardedOptimizer, optimizer_cls: type[torch.optim.Optimizer], defaults: dict[str, Any]
) -> tuple[StateSwapper | None, GradSwapper | None]:
    """The swappers of ``opt``'s states and reduced gradients that the engine's ``Offload``
    places on NVMe (None where they stay in memory)."""
    engine = opt.engine
    offload = getattr(engine, "offload", None)
    if offload is not None and offload.optimizer == "cpu":
        per_group = state_bytes_per_group(optimizer_cls, defaults, opt._subgroups)
        log.info(
            "optimizer states on the CPU tier: %d bytes (training runs on the CPU: they are "
            "in host memory already, nothing moves)",
            sum(map(record_bytes, opt._subgroups, per_group)),
        )
    if offload is None or offload.optimizer != "nvme":
        return None, None
    if offload.gradients == "nvme" and any(
        o._param_ids != opt._param_ids for o in engine.optimizers
    ):
        raise ValueError(
            "a second optimizer over other parameters of a model whose gradients are "
            "on NVMe: each reduced gradient goes to one optimizer's swap files. Keep "
            "gradients in memory (Offload(gradients='cpu' or None)), or use one "
            "optimizer with param groups"
        )
    grad_bytes = 0
    if offload.gradients == "nvme":
        masters = [b.flat.master_view for b in engine.buckets if b.flat.master_view is not None]
        grad_bytes = sum(padded_bytes(m.numel() * m.element_size()) for m in masters)
    # Another live optimizer of the model (a GAN's) keeps its store: the lowest free one.
    taken = {o._swap.index for o in engine.optimizers if o._swap is not None}
    swap = StateSwapper(
        opt._subgroups,
        offload,
        engine.mesh,
        optimizer_cls,
        defaults,
        grad_bytes=grad_bytes,
        index=min(set(range(len(taken) + 1)) - taken),
    )
    grads = None
    if offload.gradients == "nvme":
        grads = GradSwapper(swap.store, list(engine.buckets), swap.timed, swap.stop)
    return swap, grads


def step_in_memory(opt: ShardedOptimizer, unused: set[int]) -> None:
    """Every sub-group in turn; with offloaded masters (``param_swap``) sub-group
    ``i + 1``'s is read while ``i`` steps, and each is written back after its step."""
    masters, subgroups = opt.engine.param_swap, opt._subgroups
    if masters is None:
        for sg in subgroups:
            opt._step_subgroup(sg, unused)
        return
    masters.begin_step()
    try:
        for i, sg in enumerate(subgroups):
            following = subgroups[i + 1].bucket.flat if i + 1 < len(subgroups) else None
            masters.before(sg.bucket.flat, following)
            opt._step_subgroup(sg, unused)
            masters.after(sg.bucket.flat)
    except BaseException:
        masters.abort_step()
        raise
    masters.end_step()


def step_swapped(opt: ShardedOptimizer, swap: StateSwapper, unused: set[int]) -> None:
    """Sub-group ``i + 1``'s states (and offloaded master) are read while ``i`` steps and
    ``i - 1`` is written."""
    swap.begin_step()
    grads, subgroups = opt._grad_swap, opt._subgroups
    masters = opt.engine.param_swap
    if masters is not None:
        masters.begin_step()
    try:
        for i, sg in enumerate(subgroups):
            swap.before(i)
            if masters is not None:
                following = subgroups[i + 1].bucket.flat if i + 1 < len(subgroups) else None
                masters.before(sg.bucket.flat, following)
            if grads is not None:
                if i + 1 < len(subgroups):
                    grads.prefetch(subgroups[i + 1].bucket)
                grads.restore(sg.bucket)
            opt._step_subgroup(sg, unused)
            if grads is not None:
                grads.consume(sg.bucket)
            swap.after(i)
            if masters is not None:
                masters.after(sg.bucket.flat)
    except BaseException:
        try:
            swap.abort_step()
        finally:  # (also when a second Ctrl-C lands in the first's cleanup)
            if masters is not None:
                masters.abort_step()
        raise
    swap.end_step()
    if masters is not None:
        masters.end_step()
