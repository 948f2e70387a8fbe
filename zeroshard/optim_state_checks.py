"""What a load of an optimizer state dict checks against the running optimizer before it loads
(``zeroshard.optim_state_dict.load_optimizer_state_dict``): which saved param group each of its
groups takes its hyperparameters from (a layout that cannot match is refused, as torch refuses
another number of groups), and which saved states it leaves out (parameters frozen since the
save), said in a warning."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zeroshard.model_states.optimizer import ShardedOptimizer


def match_groups(opt: ShardedOptimizer, saved: list[dict[str, Any]], first: dict[int, str]):
    """For each of ``opt``'s param groups, the saved group holding its parameters (by name,
    else by position)."""
    where = {name: j for j, g in enumerate(saved) for name in g.get("params", [])}
    out = []
    for i, g in enumerate(opt.param_groups):
        hits = sorted({where[first[id(p)]] for p in g["params"] if first.get(id(p)) in where})
        if len(hits) > 1:  # the hyperparameters would be one saved group's for all of them
            raise ValueError(
                f"param group {i} of the optimizer holds parameters of saved param groups "
                f"{', '.join(map(str, hits))}: the checkpoint has another group layout "
                f"({len(saved)} saved, {len(opt.param_groups)} here); build the optimizer with "
                "the saved run's param groups (e.g. weight decay off for biases and norms)"
            )
        taken = [j for j, g in enumerate(out) if hits and g is saved[hits[0]]]
        if taken:  # (one saved group split in two: its hyperparameters would go to both)
            raise ValueError(
                f"param groups {taken[0]} and {i} of the optimizer hold parameters of saved param "
                f"group {hits[0]}: the checkpoint has another group layout ({len(saved)} saved, "
                f"{len(opt.param_groups)} here; torch refuses it too); build the optimizer with "
                "the saved run's param groups, or load the model alone and start the optimizer "
                "fresh"
            )
        if hits:
            out.append(saved[hits[0]])
        elif len(saved) == len(opt.param_groups):
            out.append(saved[i])
        else:
            raise ValueError(
                f"cannot match param group {i} of the optimizer to the saved param groups: "
                f"none of its parameters is named in them and the group counts differ "
                f"({len(opt.param_groups)} here, {len(saved)} saved)"
            )
    return out


def warn_dropped(dropped: list[str]) -> None:
    """``dropped``: names of saved states of parameters the optimizer does not train (frozen
    since the save). They are not loaded, and a save from here on has none, so a layer frozen
    for a while and then trained again starts Adam afresh (torch's optimizer keeps them): said,
    not silent."""
    if dropped:
        warnings.warn(
            f"the optimizer state of {len(dropped)} parameter(s) this optimizer does not train "
            f"(frozen, e.g. {dropped[0]!r}) is not loaded, and a checkpoint saved from here on "
            "has none for them: trained again later, they start afresh (Adam's step 1). To "
            "keep it through a frozen phase, keep requires_grad=True and stop their gradient "
            "in the forward (torch.no_grad() or .detach()): a parameter without a gradient is "
            "skipped as torch skips it",
            stacklevel=4,
        )
