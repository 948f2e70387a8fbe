"""What ``zeroshard.optimizer`` accepts: the optimizer class (element-wise ones only, or the
caller's word for it), the parameters in every form torch.optim takes them, and settings torch
itself accepts, each refused with a one-line error naming the fix; and the implementation it
picks when the caller picks none (fused Adam/AdamW where the device has it).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop",
        "Rprop", "ASGD",
    )
    if hasattr(torch.optim, name)
)  # fmt: skip
"""Optimizer classes whose update of an element depends on that element alone (and on scalar
hyperparameters), so that stepping each rank's shard equals stepping the whole tensor."""

_FUSED = ("Adam", "AdamW")
"""Classes whose fused implementation zeroshard turns on by default where the device has it."""


def param_groups(model: nn.Module, params: Iterable[Any] | None) -> list[dict[str, Any]]:
    """Normalize ``params`` as torch.optim accepts it: tensors, ``(name, tensor)`` pairs
    (``model.named_parameters()``), or dicts of either (or of one tensor) under "params"."""
    if params is None:
        return [{"params": list(model.parameters())}]
    if isinstance(params, (torch.Tensor, dict)):  # torch.optim's own checks, in its words
        fix = "wrap it in a list"
        if isinstance(params, dict):
            fix = "pass list(d.values()), or [d] for one group"
        raise TypeError(
            "params must be an iterable of tensors or of dicts (param groups), got a "
            f"{type(params).__name__}: {fix}"
        )
    params = list(params)
    if not params:
        raise ValueError("the optimizer got an empty parameter list")
    if isinstance(params[0], dict) and not all(isinstance(g, dict) for g in params):
        other = next(g for g in params if not isinstance(g, dict))
        raise TypeError(
            f"param groups mix dicts with a {type(other).__name__}: each group must be a dict "
            "(put it in one: {'params': [tensor]})"
        )
    groups = (
        [dict(g) for g in params]
        if params and isinstance(params[0], dict)
        else [{"params": params}]
    )
    for g in groups:
        if "params" not in g:
            raise ValueError(f"a param group needs a 'params' key; got keys {sorted(g)}")
        if isinstance(g["params"], torch.Tensor):  # {"params": model.head.weight}: one tensor
            g["params"] = [g["params"]]
        if isinstance(g["params"], (set, frozenset)):  # torch's refusal: its order differs
            raise TypeError(  # between processes, so would each rank's group
                "optimizer parameters need to be organized in ordered collections, but the "
                "ordering of tensors in sets will change between runs (and between ranks); "
                "pass a list, e.g. [p for p in model.parameters() if ...]"
            )
        g["params"] = [p[1] if isinstance(p, tuple) and len(p) == 2 else p for p in g["params"]]
        _check_listed_once(model, g["params"])
    return groups


def _check_listed_once(model: nn.Module, params: list[Any]) -> None:
    """A tensor twice in one group: torch warns (and means to refuse it); each listing would
    step its own piece of the same master here, the update applied twice."""
    seen: set[int] = set()
    for p in params:
        if isinstance(p, torch.Tensor) and id(p) in seen:
            names = {id(q): n for n, q in model.named_parameters()}
            raise ValueError(
                f"parameter {names.get(id(p), 'of shape ' + str(tuple(p.shape)))!r} is listed "
                "twice in one param group: list each parameter once (e.g. "
                "list(dict.fromkeys(params)))"
            )
        seen.add(id(p))


def check_elementwise(optimizer_cls: type, *, known: bool = False) -> None:
    """A TypeError for an optimizer instance; a ValueError for optimizer classes not known to be
    element-wise (unless ``known``: the caller says it is)."""
    if isinstance(optimizer_cls, torch.optim.Optimizer):
        raise TypeError(
            f"zeroshard.optimizer takes the optimizer class (torch.optim.AdamW) and its "
            f"settings, not a {type(optimizer_cls).__name__} built already: "
            "zeroshard.optimizer(model, torch.optim.AdamW, lr=...)"
        )
    if not callable(optimizer_cls):
        named = (
            getattr(torch.optim, optimizer_cls, None) if isinstance(optimizer_cls, str) else None
        )
        hint = f"torch.optim.{optimizer_cls}" if named is not None else "torch.optim.AdamW"
        raise TypeError(
            f"zeroshard.optimizer takes the optimizer class (or a function that builds one from "
            f"parameters and settings), not {optimizer_cls!r}: zeroshard.optimizer(model, "
            f"{hint}, lr=...)"
        )
    name = getattr(optimizer_cls, "__name__", repr(optimizer_cls))
    overrides = _overridden_step(optimizer_cls)
    if overrides and not known:
        raise ValueError(
            f"{name} overrides {overrides}: a sharded optimizer steps each rank's 1-D slice of "
            "a parameter on its own, so a step that reads whole tensors (a per-tensor norm, as "
            "LARS scales by) changes the result. If its step is element-wise, pass "
            "elementwise=True"
        )
    if known or (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, ELEMENTWISE)):
        return
    raise ValueError(
        f"{name} is not a known element-wise optimizer: a sharded optimizer steps each rank's "
        "slice of a parameter on its own, which changes the result of optimizers with "
        "per-tensor statistics or closures (LBFGS, Adafactor, LAMB, Muon). Known to be safe: "
        f"{', '.join(c.__name__ for c in ELEMENTWISE)}. If {name} is element-wise, pass "
        "elementwise=True"
    )


def _overridden_step(optimizer_cls: object) -> str | None:
    """``"step() of Base"`` when a subclass of a known element-wise optimizer redefines how it
    steps (``step``, ``_init_group``); None otherwise, or for other classes. torch's profiling
    wrapper, which its first instance writes into the class (``_patch_step_function``), is not
    a redefinition."""
    if not isinstance(optimizer_cls, type) or not issubclass(optimizer_cls, ELEMENTWISE):
        return None
    mro = optimizer_cls.__mro__
    for i, cls in enumerate(mro):
        if cls in ELEMENTWISE:
            return None
        for method in ("step", "_init_group"):
            if method not in vars(cls):
                continue
            inherited = next(vars(c)[method] for c in mro[i + 1 :] if method in vars(c))
            if _unhooked(vars(cls)[method]) is not _unhooked(inherited):
                return f"{method}() of {next(c for c in mro if c in ELEMENTWISE).__name__}"
    return None


def _unhooked(fn: Any) -> Any:
    """``fn`` without torch's profiling wrappers (``Optimizer.profile_hook_step``)."""
    while getattr(fn, "hooked", False) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def step_inner(optimizer: torch.optim.Optimizer) -> None:
    """Step one of a sharded optimizer's torch optimizers (a sub-group's) with its own step
    hooks but not torch's global ones (``register_optimizer_step_pre_hook``): those run once
    per step, around the user's optimizer's ``step``, not once per sub-group on 1-D pieces."""
    args: tuple = (optimizer,)
    with torch.autograd.profiler.record_function(f"{type(optimizer).__name__}.step (zeroshard)"):
        for hook in optimizer._optimizer_step_pre_hooks.values():
            hook(optimizer, args, {})
        _unhooked(type(optimizer).step)(optimizer)
        for hook in optimizer._optimizer_step_post_hooks.values():
            hook(optimizer, args, {})


def rank_neutral(value: Any) -> str:
    """``repr(value)`` without memory addresses (``<function f at 0x7f...>``), which differ
    between ranks for the same program: what ranks compare to agree on settings."""
    return _ADDRESS.sub("", repr(value))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def with_default_impl(
    optimizer_cls: type,
    defaults: dict[str, Any],
    device: torch.device,
    groups: Iterable[dict[str, Any]] = (),
) -> dict[str, Any]:
    """``defaults`` with ``fused=True`` for Adam/AdamW where the device has fused kernels and the
    caller chose no implementation, in its settings or in a param group's (measured on CPU:
    several times the for-loop path)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    chosen = ("fused", "foreach", "capturable", "differentiable")
    if any(k in d for d in (defaults, *groups) for k in chosen):
        return defaults
    if not isinstance(optimizer_cls, type) or optimizer_cls.__name__ not in _FUSED:
        return defaults
    if device.type not in _get_fused_kernels_supported_devices():
        return defaults
    return dict(defaults, fused=True)


_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by the caller point at the first frame
    outside zeroshard and torch (the user's ``opt.step()``, not torch's step wrappers)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def probe(
    optimizer_cls: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
    given: dict[str, Any],
    groups: list[dict[str, Any]],
    device: torch.device,
    *,
    known: bool = False,
) -> dict[str, Any]:
    """The class's defaults with ``defaults``, from one-element optimizers on ``device``, one per
    group with its own settings: torch's refusal of any of them becomes an error naming the
    class and the settings given (``given``: the caller's own; ``lr="3e-3"`` surfaced as a bare
    "'<=' not supported between instances of 'float' and 'str'", in a group's only at the
    first step). Keys of a group that the class does not take (``"name"``, a scheduler's
    ``"lr_scale"``) are kept in the group, as torch keeps them, and not probed. A class whose
    ``__init__`` registers step hooks is refused unless ``known`` element-wise: they run on each
    rank's 1-D slices (a per-tensor gradient centralization or trust ratio would be wrong)."""
    out: dict[str, Any] = {}
    for group in [{}, *groups]:
        own = {k: v for k, v in group.items() if k != "params" and (not group or k in out)}
        try:
            one = torch.zeros(1, device=device, requires_grad=True)
            made = optimizer_cls([one], **{**defaults, **own})
            out = made.defaults if not group else out  # the caller's settings alone
        except (TypeError, ValueError) as exc:
            settings = ", ".join(f"{k}={v!r}" for k, v in {**given, **own}.items())
            hint = (
                "; numbers are given as numbers (lr=3e-3, not '3e-3')"
                if any(isinstance(v, str) for v in {**given, **own}.values())
                else ""
            )
            where = " in a param group" if group else ""
            name = getattr(optimizer_cls, "__name__", repr(optimizer_cls))
            raise type(exc)(f"{name}({settings}){where} refused its settings: {exc}{hint}") from exc
        hooks = [
            *made._optimizer_step_pre_hooks.values(),
            *made._optimizer_step_post_hooks.values(),
        ]
        if hooks and not known:
            raise ValueError(
                f"{getattr(optimizer_cls, '__name__', optimizer_cls)} registers step hooks in its "
                f"__init__ ({', '.join(getattr(h, '__qualname__', repr(h)) for h in hooks)}): a "
                "sharded optimizer steps each rank's 1-D slice of a parameter, and they would run "
                "on those slices (a per-tensor norm would be wrong); if they are element-wise, "
                "pass elementwise=True"
            )
    return out
