"""Activation checkpointing every ``k`` units (the article's ``ci``): ZeRO-R's first lever.

Consecutive units form a *span* of up to ``k`` units while each one's first positional input is
the previous one's first output (the usual ``for block in blocks: x = block(x, ...)`` chain).
Inside a span nothing is saved for backward but the span's inputs: every tensor autograd would
save is dropped and recomputed in backward by replaying the span's units in order from its
inputs, each unit with the RNG state and autocast it had in the forward. That is
``ceil(nl / k)`` saved inputs instead of every block's activations, for one extra forward of
each span. Where the saved inputs
are kept (whole, 1/Nm per tensor-parallel rank, on the CPU or NVMe) is the ``CheckpointKeeper``'s
business (``zeroshard.residual_states.partitioned``).

The mechanism is PyTorch's non-reentrant checkpoint (``torch.utils.checkpoint``): one checkpoint
frame per span, its saved-tensor hooks entered around each unit's forward only, so that code the
model runs between units (not replayed) saves its tensors normally. A chain that breaks (a unit
fed something else, or its input written in place since the previous unit returned it, a
unit used twice) closes the span; the next unit opens a new one. A unit called under torch's
``functional_call`` (tensors of the caller's standing in for its parameters) is not
checkpointed: its replay would use the module's own parameters. Units
nested inside another unit are not checkpointed on their own (the outer one covers them), nor
are units that run inside a checkpoint already (the model's own ``torch.utils.checkpoint``, or
a unit of the open span calling them): that checkpoint recomputes them.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint as ckpt
from torch import nn

from zeroshard import call_frames
from zeroshard.residual_states.partitioned import CheckpointKeeper, check_version, version_of
from zeroshard.trees import map_tensors, tensors_in


def _checkpointing_layer(module: nn.Module) -> bool:
    """transformers' ``GradientCheckpointingLayer`` with its checkpointing on, training: its
    forward checkpoints itself (known before its first forward, unlike ``_own``)."""
    return (
        module.training
        and getattr(module, "gradient_checkpointing", False) is True
        and any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)
    )


def _from_reentrant_checkpoint(out: torch.Tensor | None) -> bool:
    """Whether ``out`` is the output of ``torch.utils.checkpoint(..., use_reentrant=True)``."""
    grad_fn = out.grad_fn if out is not None else None
    return type(grad_fn).__name__ == "CheckpointFunctionBackward"


def _storage(t: torch.Tensor) -> tuple:
    """What tells a tensor saved for backward apart from others: its memory and layout (an
    input seen through a hook's alias is the input)."""
    try:
        return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
    except RuntimeError:  # (no storage to point at: sparse, nested)
        return (id(t),)


def _storages(tree: Any) -> set[tuple]:
    return {_storage(t) for t in tensors_in(tree)}


class _Saves:
    """What a unit saved for backward while it computed: whether anything, and whether its
    ``inputs`` (``_storages``) alone. Held by a pack hook, it holds no tensor (a hook closing
    over the span kept its last output alive: saved tensors hold their pack hook)."""

    def __init__(self, inputs: set[tuple]) -> None:
        self.inputs, self.any, self.only_inputs = inputs, False, True

    def recording(self, pack: Any) -> Any:
        """``pack`` (a saved-tensor pack hook) noting each tensor it packs."""

        def pack_hook(x: torch.Tensor) -> Any:
            self.any = True
            if self.only_inputs and _storage(x) not in self.inputs:
                self.only_inputs = False  # (no more looks: it is decided)
            return pack(x)

        return pack_hook

    @property
    def inputs_alone(self) -> bool:
        return self.any and self.only_inputs


def _first_tensor(tree: Any) -> torch.Tensor | None:
    tensors = tensors_in(tree)
    return tensors[0] if tensors else None


@dataclass
class _Call:
    """One unit's forward in a span, with what its recomputation needs to run it the same way:
    the RNG state, autocast and train/eval modes at its start (the model may draw random
    numbers or switch autocast between units: LayerDrop, stochastic depth; ``model.eval()``
    may come before the backward: dropout then recomputed nothing, and torch's checkpoint
    failed on a different number of saved tensors)."""

    module: nn.Module
    rest: tuple
    """Positional args after the first (the first is the span's input or the previous output);
    none for a span's first call, whose frame saves them all. Here and in ``kwargs``, a tensor
    that was one of the positional ones is a stand-in (``aliases``)."""
    kwargs: dict
    cpu_rng: torch.Tensor
    devices: list[int]
    """The accelerator devices of the call's tensors (none on the CPU)..."""
    device_states: list[torch.Tensor]
    """... and their RNG states."""
    autocast: tuple[dict, dict]
    """``torch.utils.checkpoint``'s (device, cpu) autocast kwargs."""
    modes: list[bool]
    """``training`` of ``module.modules()``, in order."""
    versions: list[tuple[weakref.ref, int | None]]
    """Each tensor in ``rest`` and ``kwargs`` at the call (weakly) and its version: written in
    place since, the recomputation would run on other values."""
    ran_before: tuple[int, ...] = ()
    """The module's forward pre-hooks that had run on the arguments kept (``enter``)."""
    aliases: dict[int, tuple[int, bool, torch.Tensor]] = field(default_factory=dict)
    """Stand-ins in ``rest`` and ``kwargs`` (empty tensors, by id) for tensors that were one of
    the call's positional arguments (``attn(h, h, h)``, ``u(h, [h, h])``, ``attn(h, key=h)``):
    (its position, whether the forward got that very tensor or another one on its memory). The
    replay gives them that argument as recomputed: identity decides code paths
    (``nn.MultiheadAttention`` projects q, k, v in one matmul when they are one tensor, and
    saved other tensors than the forward's when replayed with three), and the forward's
    tensors are not kept (a chained unit's are activations the span does not keep)."""

    def arguments(self, positional: tuple) -> tuple[tuple, dict]:
        """The call's positional and keyword arguments for its replay, the first ones
        ``positional`` (the span's inputs from its frame, or the previous output and ``rest``),
        the stand-ins replaced."""
        if not self.aliases:
            return positional, self.kwargs

        views: dict[int, torch.Tensor] = {}  # one other tensor per position (key is value)

        def fill(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in self.aliases:
                return t
            j, same, _ = self.aliases[id(t)]
            if same:
                return positional[j]
            if j not in views:
                views[j] = positional[j].view_as(positional[j])
            return views[j]

        return map_tensors(fill, positional), map_tensors(fill, self.kwargs)

    def check_unchanged(self) -> None:
        """Before the recomputation: autograd's error if a tensor of the call was written in
        place since the forward (as for a tensor autograd saved)."""
        name = type(self.module).__name__
        for ref, version in self.versions:
            t = ref()
            if t is not None:
                check_version(t, version, f"a tensor given to {name} beside its input")


@dataclass
class _Span:
    frame: Any  # torch.utils.checkpoint._CheckpointFrame
    calls: list[_Call] = field(default_factory=list)
    last_output: torch.Tensor | None = None
    last_version: int = 0
    """``last_output._version`` when the unit returned it: written in place since, it is not
    what the unit returned, and the chain breaks (a recomputation would skip the write)."""
    hooks: Any = None  # the saved-tensor hooks while a unit of the span computes
    saved: _Saves | None = None
    """What the computing unit saved."""


class SpanCheckpointing:
    """Checkpoints spans of up to ``every`` chained units (module docstring)."""

    def __init__(self, every: int, device: torch.device, keeper: CheckpointKeeper) -> None:
        if every < 1:
            raise ValueError(f"checkpoint_every must be >= 1 (blocks per span), got {every}")
        self.every, self.device = every, device
        self.keeper = keeper
        """Keeps each span's inputs: whole, partitioned (Pa) or offloaded, and counts them."""
        self._span: _Span | None = None
        self._own: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        """Units whose forward saved nothing but their inputs in a span (``note_output``): their
        forward checkpoints itself (a reentrant ``torch.utils.checkpoint`` inside it, as
        transformers' ``GradientCheckpointingLayer`` runs one), so that a span's recomputation
        would replay it only for its inputs, before its own replays it again."""
        self._watched: tuple[nn.Module, Any, _Saves] | None = None
        """Such a unit computing outside any span, and what it saved (``_watch``)."""
        self._warned_keyword = False
        self.num_spans = 0
        """Spans opened since construction (for tests and the planner's ``nl / ci``)."""

    # ----------------------------------------------------------------- forward
    def enter(
        self,
        module: nn.Module,
        args: tuple,
        kwargs: dict,
        ran_before: tuple[int, ...] = (),
        given: Any = None,
    ) -> None:
        """Before a unit's forward (grad enabled, not a recomputation): join or open a span and
        start dropping what autograd saves. ``args`` and ``kwargs`` are what the module's
        forward pre-hooks ``ran_before`` (their ids) made of the call's: its recomputation
        skips those. A unit that runs inside a checkpoint already (a
        ``torch.utils.checkpoint`` of the model's own, or a unit of an open span calling it) is
        left to it: that checkpoint drops and recomputes what the unit saves, and hooks of ours
        stacked on its own would take those tensors from its count (its recomputation would
        then find them out of order). So is a unit whose forward checkpoints itself
        (``_own``); ``given`` is what its forward gets (cast, hooked), beside ``args``."""
        if call_frames.in_functional_call():
            # Its tensors stand in for the module's own for this call only (MAML's fast weights,
            # a hypernetwork's generated ones): a replay in backward would compute with the
            # module's own. Saved as without checkpointing; the chain breaks here.
            self.close()
            return
        outer = self._checkpoint_running()
        span = self._span
        if outer == "theirs" and (span is None or span.hooks is None):
            self.close()  # code not ours ran between units: the chain breaks here
        if outer:  # (inside a span's unit, torch's hooks on top of ours: left as they are)
            return
        inputs = _storages((args, kwargs, given))
        if module in self._own or _checkpointing_layer(module):
            self.close()
            self._watch(module, inputs)
            return
        first = args[0] if args else None
        keyword = first is None and any(map(torch.is_tensor, kwargs.values()))
        if keyword and not self._warned_keyword:
            self._warned_keyword = True
            warnings.warn(
                f"{type(module).__name__} gets its input by keyword: activation checkpointing "
                "keeps such an input whole on the device (not partitioned or offloaded) and "
                "starts a span at each such unit; pass the input positionally (block(x, ...))",
                stacklevel=2,
            )
        joins = (
            span is not None
            and len(span.calls) < self.every
            and first is not None
            and first is span.last_output
            and first._version == span.last_version
            and all(c.module is not module for c in span.calls)
        )
        call = self._call(module, args, kwargs, given)
        call.ran_before = ran_before
        if not joins:
            self.close()
            # positional ones are the frame's saved inputs (copies with Pa/offload; checked
            # at their unpack when kept whole), which its recomputation takes: not kept here
            # too (offloaded, a bias given beside the input stayed on the device as well);
            # containers among them as ``_Call.rest`` holds them (stand-ins for its tensors)
            saved = (a if isinstance(a, torch.Tensor) else r for a, r in zip(args[1:], call.rest))
            span = self._span = self._open((*args[:1], *saved), call.devices)
            call.versions = [(weakref.ref(t), version_of(t)) for t in tensors_in(kwargs)]
            call.rest = ()
        assert span is not None
        span.calls.append(call)
        span.hooks = ckpt._checkpoint_hook(span.frame)
        span.saved = _Saves(inputs)
        span.hooks.pack_hook = span.saved.recording(span.hooks.pack_hook)
        span.hooks.__enter__()

    def _watch(self, module: nn.Module, inputs: set) -> None:
        """Save ``module``'s tensors through the keeper (its inputs, as a span's: offloaded or
        1/Nm per rank as configured, whole ones version-checked at unpack), noting whether any
        is not one of its ``inputs``: its forward no longer checkpoints itself
        (``gradient_checkpointing_disable()``), and its next forward joins a span again."""
        saves, keeper = _Saves(inputs), self.keeper.hooks()
        hooks = torch.autograd.graph.saved_tensors_hooks(
            saves.recording(keeper.pack_hook), keeper.unpack_hook
        )
        hooks.__enter__()
        self._watched = (module, hooks, saves)

    def exit(self, module: nn.Module | None = None) -> None:
        """After a unit's forward (also when it raised): stop dropping saved tensors, if
        ``module`` is the unit that started (None: whichever did)."""
        watched = self._watched
        if watched is not None and module in (None, watched[0]):
            self._watched = None
            watched[1].__exit__(None, None, None)
            if not watched[2].only_inputs:
                self._own.discard(watched[0])
            return
        span = self._span
        if module is not None and not self._started(module):
            return
        if span is not None and span.hooks is not None:
            hooks, span.hooks = span.hooks, None
            hooks.__exit__(None, None, None)
            call = span.calls[-1]  # written from here on (after the unit ran): the error
            call.versions = [(r, version_of(t)) for r, _ in call.versions if (t := r()) is not None]

    def note_output(self, module: nn.Module, output: Any) -> None:
        """The unit's output as the model receives it: the next unit continues the chain if its
        first input is this tensor (only for a unit that joined the span, not one left to an
        outer checkpoint)."""
        span = self._span
        if span is not None and self._started(module):
            out = span.last_output = _first_tensor(output)
            span.last_version = out._version if out is not None else 0
            # Left to itself from its next forward: a unit whose forward checkpoints itself.
            # In a span of several, only one that returns a re-entrant checkpoint's output (a
            # unit saving its input alone, x * x, is cheap to replay, and saves memory there).
            mine = span.saved is not None and span.saved.inputs_alone
            if mine and (self.every == 1 or _from_reentrant_checkpoint(out)):
                self._own.add(module)

    def _checkpoint_running(self) -> str | None:
        """Whose checkpoint's saved-tensor hooks are on top now: "ours" (a unit of the open
        span is running), "theirs" (the model's own ``torch.utils.checkpoint``, in its forward
        or recomputation), or None (none, or other hooks such as ``save_on_cpu``: a span's own
        hooks go over those)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            return None
        span = self._span
        if span is not None and span.hooks is not None and top[0] is span.hooks.pack_hook:
            return "ours"
        name = getattr(top[0], "__qualname__", "")
        return "theirs" if name.startswith(("_checkpoint_hook.", "_recomputation_hook.")) else None

    def _started(self, module: nn.Module) -> bool:
        span = self._span
        return span is not None and bool(span.calls) and span.calls[-1].module is module

    def close(self) -> None:
        """End the open span (end of forward, or a broken chain)."""
        if self._span is not None:
            self.exit()
            self._span.frame.forward_completed = True
            self._span = None

    # ----------------------------------------------------------------- recomputation
    def _call(self, module: nn.Module, args: tuple, kwargs: dict, given: Any = None) -> _Call:
        """``module``'s call as it starts: its arguments (the first is not kept: the frame
        keeps the span's input, a chained unit gets the previous output), which of them were
        one tensor when its forward got them (``given``: after the engine's casts and backward
        hook; the replay runs the casts again, not the hook, which passes the positional
        tensors alone, each once: ``_stand_ins``), and its RNG and autocast state."""
        device_type = self.device.type
        device_module = getattr(torch, device_type, None)
        devices: list[int] = []
        states: list[torch.Tensor] = []
        if device_type != "cpu" and getattr(device_module, "_initialized", False):
            devices, states = ckpt.get_device_states(*args)
        rest, kept_kwargs, aliases = _stand_ins(args, kwargs, given)
        return _Call(
            module,
            rest,
            kept_kwargs,
            torch.get_rng_state(),
            devices,
            states,
            ckpt._get_autocast_kwargs(device_type=device_type),
            [m.training for m in module.modules()],
            [(weakref.ref(t), version_of(t)) for t in tensors_in((args[1:], kwargs))],
            aliases=aliases,
        )

    def _open(self, args: tuple, devices: list[int]) -> _Span:
        """A checkpoint frame whose recomputation replays the span's units in order (their RNG
        forked on ``devices``, the span's first call's)."""
        calls: list[_Call] = []
        device_type = self.device.type
        # One tensor given in several positions is saved once (once offloaded or split), and
        # replayed as one tensor (``_Call.aliases``).
        distinct: list[Any] = []
        order = [_index(distinct, a) for a in args]

        def recompute(*saved: Any) -> None:
            inputs = tuple(saved[j] for j in order)
            for call in calls:
                call.check_unchanged()
            with torch.random.fork_rng(devices=devices, device_type=device_type):
                out: Any = None
                for i, call in enumerate(calls):
                    torch.set_rng_state(call.cpu_rng)
                    if devices:
                        ckpt.set_device_states(devices, call.device_states, device_type=device_type)
                    device_autocast, cpu_autocast = call.autocast
                    autocast = (
                        torch.amp.autocast(device_type=device_type, **device_autocast)
                        if device_type != "cpu" and torch.amp.is_autocast_available(device_type)
                        else contextlib.nullcontext()
                    )
                    modes = [m.training for m in call.module.modules()]
                    _set_modes(call.module, call.modes)
                    try:
                        with (
                            autocast,
                            torch.amp.autocast("cpu", **cpu_autocast),
                            _without_pre_hooks(call.module, call.ran_before),
                        ):
                            given = inputs if i == 0 else (_first_tensor(out), *call.rest)
                            call_args, call_kwargs = call.arguments(given)
                            out = call.module(*call_args, **call_kwargs)
                    finally:
                        _set_modes(call.module, modes)

        early_stop = ckpt._enable_checkpoint_early_stop
        frame = ckpt._CheckpointFrame(
            recompute,
            True if early_stop is None else early_stop,
            None,
            ckpt._allowed_determinism_checks_to_fns[ckpt._DEFAULT_DETERMINISM_MODE],
        )
        with self.keeper.hooks():
            frame.save_inputs(*distinct)
        self.num_spans += 1
        return _Span(frame, calls)


def _stand_ins(args: tuple, kwargs: dict, given: Any) -> tuple[tuple, dict, dict]:
    """``args[1:]`` and ``kwargs`` of a call with the tensors that are one of its positional
    arguments replaced by stand-ins (``_Call.aliases``, returned third). Positional arguments,
    nested ones too, are one tensor as given (the engine's backward hook passes each of them
    once); a keyword one is the positional tensor itself, or another on its memory, as the
    forward got it (``given``: the call's arguments after the engine's hook, which passes the
    positional ones alone when one needs grad: ``attn(h, key=h)`` got a hooked query and the
    original key)."""
    raw_kw = tensors_in(kwargs)
    g_args, seen_kw = args, raw_kw
    like = isinstance(given, tuple) and len(given) == 2 and len(given[0]) == len(args)
    if like and given[1].keys() == kwargs.keys():  # (the engine's casts and hook keep shapes)
        given_kw = tensors_in(given[1])
        if len(given_kw) == len(raw_kw):
            g_args, seen_kw = given[0], given_kw
    first = _first_positions(args)
    # A list or dict among the arguments holds what the hook made of its tensors (changed in
    # place, the caller's own object: ``trees.map_tensors``'s edits, undone after the forward)
    given_first = _first_positions(g_args)
    aliases: dict[int, tuple[int, bool, torch.Tensor]] = {}

    def stand_in(j: int, same: bool) -> torch.Tensor:
        placeholder = torch.empty(0)
        aliases[id(placeholder)] = (j, same, placeholder)  # (kept: its id stays its own)
        return placeholder

    def nested(t: torch.Tensor) -> torch.Tensor:
        j = first.get(id(t), given_first.get(id(t)))
        return t if j is None else stand_in(j, True)

    rest = tuple(
        (stand_in(first[id(a)], True) if first[id(a)] < i else a)
        if isinstance(a, torch.Tensor)
        else map_tensors(nested, a)
        for i, a in enumerate(args)
        if i > 0
    )
    keyword: dict[int, tuple[int, bool]] = {}
    for r, g in zip(raw_kw, seen_kw, strict=True):
        j = first.get(id(r), given_first.get(id(r)))
        if j is not None:
            keyword[id(r)] = (j, g is g_args[j])
    kept = map_tensors(lambda t: stand_in(*keyword[id(t)]) if id(t) in keyword else t, kwargs)
    return rest, kept, aliases


def _first_positions(args: tuple) -> dict[int, int]:
    """``{id(tensor): its first position}`` of the tensors among ``args`` (top level)."""
    first: dict[int, int] = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            first.setdefault(id(a), i)
    return first


def _index(distinct: list[Any], arg: Any) -> int:
    """``arg``'s position in ``distinct``, appended if it is not there (a tensor: that very
    object; anything else: always appended)."""
    if isinstance(arg, torch.Tensor):
        for j, d in enumerate(distinct):
            if d is arg:
                return j
    distinct.append(arg)
    return len(distinct) - 1


@contextlib.contextmanager
def _without_pre_hooks(module: nn.Module, ids: tuple[int, ...]) -> Iterator[None]:
    """``module``'s forward pre-hooks ``ids`` (at the front) taken out for the block, then put
    back in front, in order."""
    hooks = module._forward_pre_hooks
    taken = [(i, hooks.pop(i)) for i in ids if i in hooks]
    try:
        yield
    finally:
        for hook_id, hook in reversed(taken):
            hooks[hook_id] = hook
            hooks.move_to_end(hook_id, last=False)


def _set_modes(module: nn.Module, modes: list[bool]) -> None:
    for m, training in zip(module.modules(), modes):
        m.training = training


def train_without_caches(model: nn.Module) -> list[Any]:
    """Hooks that make Hugging Face models train without their key/value cache: a decoder fills
    one as its layers run (``use_cache``, on by default in T5's config), so a checkpointed
    span's recomputation would find the cache its forward filled and compute something else
    (torch's checkpoint then fails on a different number of saved tensors). As transformers does
    under its own gradient checkpointing, a forward with grad enabled (in eval mode too: the
    engine checkpoints every forward that builds a graph) gets ``use_cache=False``, for every
    module with a ``config`` whose forward takes ``use_cache`` (a warning, once, when the
    caller asked for True). Returns the hooks' handles."""
    warned = False

    def no_cache(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        nonlocal warned
        if not torch.is_grad_enabled() or kwargs.get("use_cache") is False:
            return None
        if kwargs.get("use_cache") and not warned:
            warned = True
            warnings.warn(
                f"use_cache=True with activation checkpointing: {type(module).__name__} trains "
                "with use_cache=False (a recomputation would find the cache filled)",
                stacklevel=2,
            )
        return args, {**kwargs, "use_cache": False}

    handles = []
    for module in model.modules():
        forward = getattr(module, "forward", None)
        if getattr(module, "config", None) is None or forward is None:
            continue
        try:
            takes = "use_cache" in inspect.signature(forward).parameters
        except (TypeError, ValueError):  # no signature to read: a builtin, a C extension
            takes = False
        if takes:
            handles.append(module.register_forward_pre_hook(no_cache, with_kwargs=True))
    return handles
