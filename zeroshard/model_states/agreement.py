"""The step's agreement: one small all-reduce after backward in which every rank learns whether
any rank saw inf/NaN, whether the ranks ran their units in the same order, and which parameters
some rank's backward reached. Started by ``agree`` (overlapping what follows), read by
``agreed``; the optimizer's ``step`` and the step in backward decide from it alike on every
rank."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zeroshard import collectives as C
from zeroshard.mesh import Mesh
from zeroshard.model_states.optimizer_args import rank_neutral
from zeroshard.watchdog import diagnosed


def agree(
    found_inf: torch.Tensor, touched: torch.Tensor, mesh: Mesh, ledger: C.Ledger, *, async_op: bool
) -> C.Handle:
    """Start the agreement of every rank on [inf/NaN seen (``found_inf``: (1,) FP32, > 0 when
    this rank saw one), the order of the units' collectives, one flag per parameter that
    backward reached] (``touched``: 1D FP32, this rank's flags), MAX
    over every rank, also with hybrid sharding ("touched" depends on each rank's data): a shard's
    overflow is seen only by its owner, and a parameter is left out of the step only when no
    rank reached it. The order rides as ``[d, -d]`` (``Ledger.order``): MAX of both gives the
    largest and the smallest digest. Read the handle's output with ``agreed``."""
    order = torch.tensor([ledger.order, -ledger.order], dtype=torch.float32, device=touched.device)
    flags = torch.cat([found_inf, order, touched])
    if mesh.world_size * mesh.tp_size == 1:
        return C.Handle(None, flags)
    whole = mesh.hybrid is not None or mesh.tp_size > 1
    return C.all_reduce(
        flags,
        scope=C.WORLD if whole else C.SHARD,
        # Tensor-parallel ranks too: each sees only its pieces of split parameters.
        group=None if mesh.tp_size > 1 else mesh.group,
        ledger=ledger,
        label="found_inf",
        op=dist.ReduceOp.MAX,
        async_op=async_op,
    )


class OrderMismatch(RuntimeError):
    """The ranks ran their units in different orders since the last step (``agreed``)."""


def agreed(
    flags: torch.Tensor, forget_order: Callable[[], None], *, stepped: int = 0
) -> tuple[bool, list[bool]]:
    """(inf/NaN seen on some rank, per parameter: reached on some rank) from ``agree``'s output
    (a host sync). Raises ``OrderMismatch`` on every rank alike when the ranks' collectives
    paired different units: the gradients are of mixed-up parameters, and no step may use them
    (``stepped``: units that ``step_in_backward`` updated earlier in this backward, whose
    collectives still matched). ``forget_order`` (the engine's) runs first: the digest restarts
    and no prefetch follows the rank's own last order."""
    values = flags.tolist()
    if values[1] != -values[2]:
        forget_order()
        kept = (
            f"{stepped} unit(s) updated earlier in this backward (step_in_backward) keep it, "
            "the others are untouched"
            if stepped
            else "master weights are untouched"
        )
        raise OrderMismatch(
            "the ranks ran the wrapped units in different orders since the last step, so each "
            "collective paired one unit's shards on one rank with another unit's on another "
            f"(the gradients are of mixed-up parameters, and the step is refused; {kept}). "
            "Causes: a unit called on some ranks only or a different number of times; and, with "
            "sharded parameters (stage 3), a unit whose output reaches the loss on some ranks "
            "only, or that runs under torch.no_grad() on some ranks only, so that its backward "
            "runs there alone. Call the same units in the same order on every rank (branch on "
            "values all ranks share; an output a rank does not use can join its loss times 0), "
            "and restart from the last checkpoint: ranks that issued different numbers of "
            "collectives are out of step"
        )
    return values[0] > 0, [v > 0 for v in values[3:]]


def reduced_again_anywhere(flags: list[bool], mesh: Mesh) -> list[bool]:
    """Per bucket, whether some rank got gradients after its reduction in this backward (a unit
    reached again, a weight read outside its unit: ``flags``, this rank's), by one small
    all-reduce (MAX), so that every rank reduces the same buckets again (a rank alone in it
    hung the others)."""
    if mesh.world_size * mesh.tp_size == 1 or not flags:
        return flags
    agreed = torch.tensor([float(f) for f in flags], device=mesh.device)
    group = None if mesh.tp_size > 1 else mesh.group  # (as ``agree``)
    with diagnosed("all_reduce", "gradients after their reduction", group):
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return [f > 0 for f in agreed.tolist()]


def _compared_settings(group: dict[str, Any]) -> dict[str, str]:
    """A param group's settings as ranks compare them at construction (``rank_neutral``: the
    ``repr`` without memory addresses), but for ``params`` and values holding tensors, whose
    ``repr`` would read the device (``_tensor_settings``)."""
    return {
        k: rank_neutral(v)
        for k, v in group.items()
        if k not in ("params", "param_names") and not _holds_tensor(v)
    }


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    return torch.is_tensor(value)


def _tensor_settings(group: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """A param group's tensor settings (a tensor ``lr`` for fused or capturable optimizers),
    by key."""
    return sorted((k, v) for k, v in group.items() if torch.is_tensor(v) and k != "params")


def settings_digests(param_groups: Sequence[dict[str, Any]], device: torch.device) -> torch.Tensor:
    """``(4 * len(param_groups),)`` FP32, for ``agree``'s MAX: per group ``[d, -d, t, -t]``,
    ``d`` a 24-bit digest of its other settings (``_compared_settings``; exact in FP32), ``t``
    a weighted sum of its tensor settings' values, read on the device (no host sync). Ranks
    whose settings differ (a scheduler stepped on a rank's own metric) get ``max(x) !=
    -max(-x)`` for one of them."""
    plain, tensors = [], []
    zero = torch.zeros((), dtype=torch.float32, device=device)
    for g in param_groups:
        plain.append(
            float(zlib.crc32(repr(sorted(_compared_settings(g).items())).encode()) & 0xFFFFFF)
        )
        weighted = [
            (i + 1) * v.detach().to(device=device, dtype=torch.float32).sum()
            for i, (_, v) in enumerate(_tensor_settings(g))
        ]
        tensors.append(torch.stack(weighted).sum() if weighted else zero)
    d = torch.tensor(plain, dtype=torch.float32, device=device)
    t = torch.stack(tensors) if tensors else torch.zeros_like(d)
    return torch.stack([d, -d, t, -t], dim=1).reshape(-1)


def _shown_settings(group: dict[str, Any]) -> dict[str, Any]:
    """What an error shows of a group's settings: the compared ones and the tensors' values."""
    tensors = {
        k: str(v.detach().cpu().tolist()) for k, v in _tensor_settings(group) if v.numel() <= 8
    }
    return {**_compared_settings(group), **tensors}


def settings_apart(
    param_groups: Sequence[dict[str, Any]], reduced: list[float], group: Any
) -> str | None:
    """The error when ``reduced`` (``settings_digests`` after ``agree``) says the ranks' param
    groups differ, naming each setting and its value per rank (an object all-gather, on every
    rank alike: they all see the same ``reduced``); None when they agree."""
    apart = [
        i
        for i in range(len(param_groups))
        if reduced[4 * i] != -reduced[4 * i + 1] or reduced[4 * i + 2] != -reduced[4 * i + 3]
    ]
    if not apart:
        return None
    mine = [_shown_settings(param_groups[i]) for i in apart]
    every: list[Any] = [None] * dist.get_world_size(group)
    with diagnosed("all_gather_object", "the param groups' settings", group):
        dist.all_gather_object(every, mine, group=group)
    said = []
    for j, gi in enumerate(apart):
        for k in sorted({k for settings in every for k in settings[j]}):
            values = [settings[j].get(k, "(unset)") for settings in every]
            if len(set(values)) > 1:
                per_rank = ", ".join(f"{v} on rank {r}" for r, v in enumerate(values))
                said.append(f"param group {gi}'s {k!r} is {per_rank}")
    return (
        "optimizer.step(): the ranks' optimizer settings differ ("
        + ("; ".join(said) or "param groups " + ", ".join(map(str, apart)))
        + "): each rank would step its own shard with its own settings, and the model would mix "
        "them. Set them alike on every rank: a scheduler stepped with a rank's own metric "
        "(ReduceLROnPlateau) takes the metric all-reduced first. Nothing was stepped"
    )
