"""What a user changed on a sharded model's parameters since ``shard()``, found before the
engine uses them: writes inside ``summon_full_params(writeback=False)`` undone
(``discarding_writes``), data replaced in place of the engine's memory adopted across every
flat at once (``check_views``), ``requires_grad`` flipped (``check_requires_grad``), and
registrations changed (``check_registered``: weights tied, replaced or removed, parameters
moved to another device, prunings made at rest at stage 3)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Collection, Iterator

import torch
from torch import nn

from zeroshard import call_frames, module_buffers
from zeroshard.model_states.flat_param import FlatParam, ShardState, moved_message

__all__ = ["check_registered", "check_requires_grad", "check_views", "discarding_writes"]


@contextlib.contextmanager
def discarding_writes(
    flats: list[FlatParam], *, discard: bool = True, nested: bool = False
) -> Iterator[None]:
    """With ``discard``, writes to replicated parameters inside are undone on exit
    (``summon_full_params(..., writeback=False)``): their ``full`` is the live buffer (the
    master itself in FP32), so it is copied on entry and put back. Partitioned ones need
    nothing, their gathered ``full`` being dropped at the reshard, unless ``nested`` in an
    outer summon, which keeps them gathered and may write them back."""
    kept = [
        (f, f.full.clone())
        for f in flats
        if discard and (nested or not f.partition.parameters) and f.full.numel()
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for f, copy in kept:
                f.full.copy_(copy)
                f.use_full_views()  # data replaced inside (p.data = t, p.set_) undone too


def check_views(
    flats: Collection[FlatParam], everything: Collection[FlatParam] | None = None
) -> ValueError | None:
    """``FlatParam.check_views`` of every flat in ``flats``, each replacement read before any is
    copied in: one may be another flat's memory (``a.data, b.data = b.data, a.data`` across
    units: the first copy overwrote what the second parameter pointed at). When ``flats`` are
    part of ``everything`` (the model's: a unit called on its own) and hold a replacement,
    every flat is checked instead: the others' parameters may point at what it overwrites. A
    flat that raises adopts nothing, its views restored; the first such error is returned,
    once the others have adopted theirs."""
    storages = {f.full.untyped_storage().data_ptr() for f in flats if f.full.numel()}
    problem, read = None, []
    for f in flats:
        try:
            read.append((f, f.read_replacements(storages)))
        except ValueError as exc:
            problem = problem or exc
    if any(adopted for _, adopted in read) and everything and len(everything) > len(flats):
        return check_views(everything) or problem  # (nothing copied in yet)
    for f, adopted in read:
        f.copy_in(adopted)
    return problem


def check_requires_grad(flats: list[FlatParam]) -> None:
    """Raise if a parameter's ``requires_grad`` changed since it was flattened: which parameters
    train is fixed by ``shard`` (they were grouped by it, and frozen ones have no master or
    optimizer state), and a change would otherwise be ignored without a word."""
    changed = [
        (s.names[0], f.requires_grad)
        for f in flats
        for s in f.slots
        if s.param.requires_grad != f.requires_grad
    ]
    if changed:
        names = ", ".join(f"{n} ({was} -> {not was})" for n, was in changed[:3])
        more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
        raise ValueError(
            f"requires_grad changed after zeroshard.shard(): {names}{more}; which parameters "
            "train is fixed when the model is sharded: set requires_grad before shard() (to "
            "unfreeze progressively, shard a fresh model with the new setting, e.g. from a "
            "checkpoint). A forward that needs no gradient for them (a reference model's "
            "log-probabilities under peft's disable_adapter(), a GAN's set_requires_grad(netD, "
            "False) around the generator's step) needs no change: run it under "
            "torch.no_grad(), or drop the change and call each optimizer's zero_grad() before "
            "its backward"
        )


def check_registered(model: nn.Module, flats: list[FlatParam]) -> None:
    """Raise if a module holds another parameter than the one ``shard`` flattened under that
    name: a weight tied or replaced after ``shard()`` (``model.head.weight = model.emb.weight``,
    a module replaced) is read where the engine does not gather it (stage 3: NaN placeholders
    of another unit), and is not saved. Modules are looked up by path at each call (a module
    replaced after the first forward too), once per path; a parameter the model registers
    under another name (a parametrization removed: the same object moved) is still its own.
    Also raised, the change undone first: parameters moved to another device (``model.to``),
    and prunings made at rest (``_pruned_at_rest``)."""
    found: dict[str, nn.Module | None] = {}
    registered: set[int] | None = None  # every parameter's id, when first needed
    undone: list[str] = []  # prunings at rest, every one undone before one error
    for f in flats:
        for s in f.slots:
            for name in s.names:
                path, _, attr = name.rpartition(".")
                if path not in found:
                    found[path] = _module_at(model, path)
                now = getattr(found[path], "_parameters", {}).get(attr)
                # A plain tensor there is torch.func.functional_call's, for the call's length; a
                # parameter moved elsewhere, the same object (remove_parametrizations), is fine.
                if now is s.param or (now is not None and not isinstance(now, nn.Parameter)):
                    continue
                moved = now is not None and now.device != s.param.device  # model.to("meta")
                if moved and not call_frames.in_functional_call():
                    _put_back(model, flats)
                    said = moved_message(name, now.device, s.param.device)
                    lost = module_buffers.put_back(model, s.param.device)
                    raise ValueError(
                        f"{said}; {module_buffers.lost_message(lost)}" if lost else said
                    )
                at_rest = now is None and found[path] is not None and f.state is ShardState.SHARDED
                if at_rest and (what := _pruned_at_rest(found[path], name)) is not None:
                    undone.append(what)
                    continue
                if registered is None:
                    entries = [v for m in model.modules() for v in m._parameters.values()]
                    if call_frames.in_functional_call() or any(
                        v is not None and not isinstance(v, nn.Parameter) for v in entries
                    ):
                        return  # inside functional_call: parameters stand aside for its length
                    registered = {id(v) for v in entries}
                if id(s.param) not in registered and now is None:
                    raise ValueError(
                        f"{name} was removed from the model after zeroshard.shard() (del, "
                        "peft's delete_adapter / merge_and_unload / unload): the engine holds "
                        "it still, and the model no longer is the one sharded. Change the model "
                        "before shard(), or shard a fresh model; to merge adapters, merge them "
                        "inside zeroshard.summon_full_params(model) (peft's merge_adapter) and "
                        "save with zeroshard.full_state_dict(model)"
                    )
                # (a tied weight replaced under one of its names stays registered under the
                # other: only its own name tells, GPT-2's new head beside its embedding)
                if id(s.param) not in registered or now is not None:
                    raise ValueError(
                        f"{name} is not the parameter zeroshard.shard() flattened there: a "
                        "weight tied or replaced after shard() (model.head.weight = "
                        "model.emb.weight, a module replaced, a parametrization removed) is not "
                        "gathered where it is read, nor saved. Change the model before shard() "
                        "(tied weights stay one parameter), or shard a fresh model"
                    )
    if undone:
        raise _pruning_refused(undone)


_PRUNINGS_SEEN: weakref.WeakSet = weakref.WeakSet()
"""``torch.nn.utils.prune`` methods (forward pre-hooks) read by ``_pruned_at_rest``."""


def _pruned_at_rest(module: nn.Module, name: str) -> str | None:
    """Undo a pruning by ``torch.nn.utils.prune`` of parameter ``name`` of ``module`` made
    while it was at rest (stage 3) by a method that ranks values (L1, Ln): its mask ranked the
    NaN placeholders, an arbitrary choice, which prune's own product ``weight = weight_orig *
    mask``, NaN everywhere, tells. Returns what was undone (a container's earlier prunings go
    with it: its mask is their product), or None. Masks that read no values (``random_*``,
    ``identity``) are right at rest; ``custom_from_mask`` is what ``global_unstructured`` applies
    its ranking with, so it is undone too. Each pruning is read once (inside
    ``summon_full_params`` it is right)."""
    attr = name.rpartition(".")[2]
    keys = [k for k, h in module._forward_pre_hooks.items() if _prunes(h, attr)]
    hooks = [module._forward_pre_hooks[k] for k in keys]
    if not hooks or all(h in _PRUNINGS_SEEN for h in hooks):
        return None
    _PRUNINGS_SEEN.update(hooks)
    product = module.__dict__.get(attr)
    if not isinstance(product, torch.Tensor) or not product.is_floating_point():
        return None
    methods = getattr(hooks[-1], "_pruning_methods", (hooks[-1],))  # (a container's, in order)
    if not product.numel() or not bool(product.isnan().all()) or not _ranks_values(methods[-1]):
        return None
    for k in keys:
        del module._forward_pre_hooks[k]
    del module.__dict__[attr]
    module._buffers.pop(f"{attr}_mask", None)
    module._parameters[attr] = module._parameters.pop(f"{attr}_orig")
    return name if len(methods) == 1 else f"{name} (and its {len(methods) - 1} earlier pruning(s))"


def _ranks_values(method: object) -> bool:
    """Whether pruning ``method`` computed its mask from the parameter's values."""
    from torch.nn.utils import prune

    # (custom_from_mask's CustomFromMask is what global_unstructured applies its ranking with)
    free = (prune.Identity, prune.RandomUnstructured, prune.RandomStructured)
    return not isinstance(method, free)


def _pruning_refused(undone: list[str]) -> ValueError:
    return ValueError(
        f"{undone[0]} was pruned (torch.nn.utils.prune) while at rest"
        + (f", and {len(undone) - 1} more" if len(undone) > 1 else "")
        + ": stage 3 keeps no values of a parameter between uses, and a mask ranking them "
        "ranked NaN placeholders (an arbitrary choice). The pruning was undone: prune inside "
        "`with zeroshard.summon_full_params(model):`, or before zeroshard.shard()"
    )


def _prunes(hook: object, attr: str) -> bool:
    """Whether ``hook`` is ``torch.nn.utils.prune``'s for parameter ``attr``."""
    from torch.nn.utils import prune

    return isinstance(hook, prune.BasePruningMethod) and hook._tensor_name == attr


def _put_back(model: nn.Module, flats: list[FlatParam]) -> None:
    """Every flattened parameter registered again under its names where a parameter on another
    device took its place (``model.to(device)`` made new ones)."""
    for f in flats:
        for s in f.slots:
            for name in s.names:
                path, _, attr = name.rpartition(".")
                module = _module_at(model, path)
                now = getattr(module, "_parameters", {}).get(attr)
                if isinstance(now, nn.Parameter) and now.device != s.param.device:
                    module._parameters[attr] = s.param


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at ``path``; None when it is gone."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None
