"""Auto-wrap policies: which submodules become units (the granularity of gather, free and reduce).

A policy is a pure function ``model -> list of submodule names`` (the root is always a unit and
never needs listing). ``units(model, policy)`` returns the ordered units with the parameters each
owns: a unit owns the parameters of its subtree that no inner unit owns, and a parameter registered
in several units (tied embeddings) is owned by their deepest common ancestor unit.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

WrapPolicy = Callable[[nn.Module], list[str]]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
"""Modules without a forward: never entered, so never a unit (by_size passes over them; a
ParameterDict made a unit never gathered at stage 3, its parameters NaN placeholders)."""
_SEVERAL = (list, tuple, set, frozenset)


def by_class(*classes: type[nn.Module] | str) -> WrapPolicy:
    """Every submodule that is an instance of one of ``classes`` (types or class names), like
    ``transformer_layer_cls={T5Block}``. Matching nothing is an error that lists the classes."""
    if not classes:
        raise ValueError("by_class needs at least one module class, e.g. by_class(Block)")
    # by_class((A, B)) and by_class({A}) as isinstance takes them: their classes
    classes = tuple(c for x in classes for c in (x if isinstance(x, _SEVERAL) else [x]))
    wrong = [c for c in classes if not _is_class_or_name(c)]
    if wrong:
        raise TypeError(
            f"by_class takes module classes or class names (by_class(Block), "
            f"by_class('T5Block')), got {wrong[0]!r}"
        )

    def matches(module: nn.Module) -> bool:
        return any(
            type(module).__name__ == c if isinstance(c, str) else isinstance(module, c)
            for c in classes
        )

    def policy(model: nn.Module) -> list[str]:
        names = [name for name, m in model.named_modules() if name and matches(m)]
        if not names:
            present = sorted({type(m).__name__ for name, m in model.named_modules() if name})
            wanted = ", ".join(c if isinstance(c, str) else c.__name__ for c in classes)
            root = (
                f" ({type(model).__name__} is the model itself, whose parameters no unit takes "
                "form the root unit anyway: name the classes of its blocks)"
                if matches(model)
                else ""
            )
            raise ValueError(
                f"wrap policy by_class({wanted}) matches no submodule of "
                f"{type(model).__name__}{root}; classes of its submodules: {', '.join(present)}"
            )
        return names

    return policy


def by_size(min_num_params: int) -> WrapPolicy:
    """Bottom-up: a submodule becomes a unit once its subtree holds at least ``min_num_params``
    parameter elements not already owned by a unit below it."""
    count = min_num_params  # 1e6 as FSDP's users write it, or a numpy int: a whole number
    whole = isinstance(count, numbers.Real) and math.isfinite(count) and count == int(count)
    if isinstance(count, bool) or not whole:
        raise TypeError(f"by_size takes a parameter count (a whole number), got {count!r}")
    min_num_params = int(count)
    if min_num_params <= 0:
        raise ValueError(f"by_size needs a positive parameter count, got {min_num_params}")

    def policy(model: nn.Module) -> list[str]:
        chosen: list[str] = []
        seen: set[int] = set()  # a tied parameter counts once, where it is first registered

        def visit(name: str, module: nn.Module) -> int:
            own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for p in own)
            remaining = sum(p.numel() for p in own)
            for child_name, child in module.named_children():
                remaining += visit(f"{name}.{child_name}" if name else child_name, child)
            # Containers have no forward of their own, so their hooks would never fire.
            if name and remaining >= min_num_params and not isinstance(module, _CONTAINERS):
                chosen.append(name)
                return 0
            return remaining

        visit("", model)
        if not chosen:
            _warn_one_unit(model, f"by_size({min_num_params:,})")
        return chosen

    policy.by_size = True  # type: ignore[attr-defined]  (a tied module it picks: said by no one)
    return policy


def by_predicate(predicate: Callable[[str, nn.Module], bool]) -> WrapPolicy:
    """Every submodule ``(name, module)`` for which ``predicate`` is true."""
    try:
        inspect.signature(predicate).bind("name", nn.Module())
    except TypeError:
        raise TypeError(
            f"by_predicate calls its predicate with (name, module), which {predicate!r} does "
            "not take: write it as lambda name, module: ... (FSDP1's lambda_auto_wrap_policy "
            "took the module alone)"
        ) from None
    except ValueError:  # a builtin without a signature: called as it is
        pass

    def policy(model: nn.Module) -> list[str]:
        names = [name for name, m in model.named_modules() if name and predicate(name, m)]
        if not names:
            _warn_one_unit(model, "by_predicate")
        return names

    return policy


def _warn_one_unit(model: nn.Module, policy: str) -> None:
    warnings.warn(
        f"wrap policy {policy} matches no submodule of {type(model).__name__}: the whole model "
        "is one unit (stage 3 then gathers every parameter at once); lower the size or use "
        "by_class(...)",
        stacklevel=3,
    )


def from_hf(model: nn.Module) -> WrapPolicy:
    """The blocks a Hugging Face model declares unsplittable (``model._no_split_modules``)."""
    names = getattr(model, "_no_split_modules", None)
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no _no_split_modules; use by_class(...) or by_size(...)"
            + _block_hint(model)
        )
    return by_class(*names)


def _block_hint(model: nn.Module) -> str:
    """The classes of the longest ``ModuleList``'s items (a model's layers), as a suggestion."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return ""
    name, layers = max(lists, key=lambda nm: len(nm[1]))
    classes = ", ".join(repr(c) for c in dict.fromkeys(type(m).__name__ for m in layers))
    return f", e.g. by_class({classes}) for the layers of its {name}"


@dataclass
class UnitSpec:
    """One unit: its module and the parameters it owns, in registration order."""

    name: str
    """Module name in the model ("" for the root)."""
    module: nn.Module
    params: list[tuple[list[tuple[nn.Module, str]], nn.Parameter, str]] = field(
        default_factory=list
    )
    """(every (module, attribute) that registers it, the parameter, its first full name)."""


def _is_class_or_name(c: object) -> bool:
    return isinstance(c, (str, type))  # a module class, or a mixin its blocks share


_POLICIES = (
    "a policy from zeroshard.wrap (by_class(Block), by_size(n), by_predicate(fn), "
    "from_hf(model)), a module class or class name, or a list of them"
)


def as_policy(wrap: object) -> WrapPolicy | None:
    """What ``shard(wrap=...)`` takes: a policy; a module class, a class name or a collection of
    them (read as ``by_class``, like FSDP's ``transformer_layer_cls``); or None."""
    if isinstance(wrap, nn.Module):
        raise TypeError(
            f"wrap= got a {type(wrap).__name__} module, not its class: pass "
            f"zeroshard.wrap.by_class({type(wrap).__name__})"
        )
    if wrap is None or (callable(wrap) and not isinstance(wrap, type)):
        return wrap  # type: ignore[return-value]
    classes = list(wrap) if isinstance(wrap, _SEVERAL) else [wrap]
    if classes and all(_is_class_or_name(c) for c in classes):
        return by_class(*classes)
    raise TypeError(f"wrap= takes {_POLICIES}; got {wrap!r}")


def with_classes(policy: WrapPolicy | None, classes: tuple, why: str) -> WrapPolicy | None:
    """``policy``'s units and every submodule of ``classes`` (types or names) besides; ``why``
    (what asked for them) names the fix when one of them matches nothing (a misspelt name
    beside a class that matched was ignored)."""
    if not classes:
        return policy
    each = [by_class(cls) for cls in classes]

    def both(model: nn.Module) -> list[str]:
        try:
            more = {name for extra in each for name in extra(model)}
        except ValueError as exc:
            raise ValueError(f"{why}: {exc}") from None
        names = _names(policy, model) | more if policy is not None else more
        return [n for n, _ in model.named_modules() if n in names]

    both.by_size = getattr(policy, "by_size", False)  # type: ignore[attr-defined]
    return both


def _names(policy: WrapPolicy, model: nn.Module) -> set[str]:
    """The submodule names ``policy`` picks, checked to be names (FSDP1's ``lambda_fn(module)
    -> bool`` passed as a policy returned a bool)."""
    names = policy(model)
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        hint = (
            "; for a predicate on modules use zeroshard.wrap.by_predicate(lambda name, module: ...)"
            if isinstance(names, bool)
            else ""
        )
        raise TypeError(
            f"the wrap policy returned {names!r}, not a list of submodule names; wrap= takes "
            f"{_POLICIES}{hint}"
        )
    names = list(names)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"the wrap policy returned {names!r}: submodule names are strings")
    return set(names)


def units(
    model: nn.Module,
    policy: WrapPolicy | None,
    keep: Callable[[nn.Module], bool] | None = None,
) -> list[UnitSpec]:
    """The root unit first, then the policy's units in module (pre-)order, with their params.
    A unit left without parameters is dropped, unless ``keep(module)`` (a policy of its own to
    compute in: ``unit_precision`` on a GELU or a norm without affine parameters)."""
    wanted = _names(policy, model) if policy is not None else set()
    modules = dict(model.named_modules(remove_duplicate=False))
    missing = wanted - modules.keys()
    if missing:
        raise ValueError(f"wrap policy named modules that do not exist: {sorted(missing)}")
    wanted -= _read_by_their_parent(modules)
    containers = sorted(n for n in wanted if isinstance(modules[n], _CONTAINERS))
    if containers:
        raise ValueError(
            f"cannot wrap containers {containers}: a ModuleList/ModuleDict/ParameterList/"
            "ParameterDict has no forward; wrap the modules inside it, or the module that "
            "reads its parameters, instead"
        )
    specs = [UnitSpec("", model)]
    specs += [UnitSpec(n, m) for n, m in model.named_modules() if n in wanted]
    index = {id(s.module): i for i, s in enumerate(specs)}

    def unit_path(module_name: str) -> list[int]:
        """Indices of the units enclosing ``module_name``, outermost (root) first."""
        path, prefix = [0], ""
        for part in module_name.split(".") if module_name else []:
            prefix = f"{prefix}.{part}" if prefix else part
            i = index.get(id(modules[prefix]))
            if i is not None and i != path[-1]:
                path.append(i)
        return path

    registrations: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False):
            _, regs, names = registrations.setdefault(id(p), (p, [], []))
            if (module, attr) not in [(m, a) for m, a in regs]:
                regs.append((module, attr))
                names.append(f"{mod_name}.{attr}" if mod_name else attr)
    module_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    for p, regs, names in registrations.values():
        paths = [unit_path(module_names[id(m)]) for m, _ in regs]
        owner = _common_prefix(paths)[-1]
        specs[owner].params.append((regs, p, names[0]))
    # A unit left with no parameters (none, or all shared upward) would only add hook overhead,
    # unless it has a policy of its own: its inputs are cast to it (FSDP2 does so too).
    owner = _owners(specs)
    kept, tied = specs[:1], []
    for s in specs[1:]:
        if s.params:
            kept.append(s)
            continue
        wanted_alone, outside = keep is not None and keep(s.module), _held_outside(s, owner)
        if wanted_alone and not outside:
            kept.append(s)
        elif outside and not wanted_alone:
            tied.append(s.name)  # (those ``keep`` picks: its caller refuses them, naming why)
    if tied and not getattr(policy, "by_size", False):  # (named, and silently not made: a
        # class that matched nothing is an error; by_size picks such a module by its count)
        warnings.warn(
            f"wrap: {', '.join(tied)} make(s) no unit: its parameters are shared with a module "
            "outside it (tied), so the unit around both holds them (or units inside it hold "
            "the rest); wrap a module around every use, or untie",
            stacklevel=3,
        )
    return kept


def _owners(specs: list[UnitSpec]) -> dict[int, str]:
    """The name of the unit holding each parameter, by ``id``."""
    return {id(p): s.name for s in specs for _, p, _ in s.params}


def _held_outside(spec: UnitSpec, owner: dict[int, str]) -> list[tuple[str, str]]:
    """``(parameter name, unit)`` of the unit's module parameters that a unit outside it holds:
    shared with (tied to) a module outside, so the enclosing unit took them."""
    mine = spec.name
    return [
        (name, owner[id(p)])
        for name, p in spec.module.named_parameters()
        if mine and owner[id(p)] != mine and not owner[id(p)].startswith(f"{mine}.")
    ]


def without_a_unit(
    model: nn.Module, specs: list[UnitSpec], wanted: Callable[[nn.Module], bool]
) -> list[str]:
    """Why each module that ``wanted`` picks cannot compute in a policy of its own (empty: each
    can): its parent reads its parameters (``_read_by_their_parent``), or some are shared with
    a module outside it (tied), so an enclosing unit holds them, gathered in that unit's
    policy (no unit of its own, or one whose other parameters and inputs are in its policy:
    "mat1 and mat2 must have the same dtype")."""
    units_by_module = {id(s.module): s for s in specs}
    modules = dict(model.named_modules(remove_duplicate=False))
    read = _read_by_their_parent(modules)
    owner = _owners(specs)
    said = []
    for name, module in model.named_modules():
        if not name or not wanted(module):
            continue
        what = f"{name} ({type(module).__name__})"
        if name in read and id(module) not in units_by_module:
            parent = _reader(name, read)
            cls = type(modules[parent])
            said.append(
                f"{what} is computed by {parent or 'the root'} ({cls.__module__}."
                f"{cls.__qualname__}), which reads its weights"
            )
            continue
        outside = _held_outside(units_by_module.get(id(module), UnitSpec(name, module)), owner)
        if outside:
            param, unit = outside[0]
            held = f"unit {unit}" if unit else "the root unit"
            said.append(
                f"{what}: its {param} is shared with a module outside it (tied), so {held} "
                "holds it, in its own policy"
            )
    return said


def _reader(name: str, read: set[str]) -> str:
    """The outermost module around ``name`` that ``_read_by_their_parent`` left it inside (a
    MultiheadAttention, a peft adapter layer): the nearest enclosing name not itself read."""
    parent = name
    while parent in read:
        parent = parent.rpartition(".")[0]
    return parent


def _read_by_their_parent(modules: dict[str, nn.Module]) -> set[str]:
    """Submodules whose parent reads their parameters without calling them, so that a unit of
    their own would never be entered: ``nn.MultiheadAttention.out_proj`` (a ``Linear``, matched
    by ``by_class(nn.Linear)``; at stage 3 its weight stayed a NaN placeholder, the outputs
    were NaN and every step was skipped), and every module inside a peft adapter layer
    (``BaseTunerLayer``: LoRA's ``base_layer``, ``lora_A``, ``lora_B``, whose weights DoRA
    reads, as OFT and BOFT read their base layer's). They stay in their parent's unit."""
    inside = set()
    for name, module in modules.items():
        if isinstance(module, nn.MultiheadAttention):
            inside.add(f"{name}.out_proj" if name else "out_proj")
        elif any(c.__name__ == "BaseTunerLayer" for c in type(module).__mro__):
            inside |= {n for n in modules if n != name and n.startswith(f"{name}." if name else "")}
    return inside


def _common_prefix(paths: Iterable[list[int]]) -> list[int]:
    paths = list(paths)
    prefix = paths[0]
    for path in paths[1:]:
        n = 0
        while n < min(len(prefix), len(path)) and prefix[n] == path[n]:
            n += 1
        prefix = prefix[:n]
    return prefix
