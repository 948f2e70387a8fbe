"""The state-dict hooks on every module of a sharded model (``install_state_dict_hooks``,
called by ``zeroshard.shard``): its ``state_dict()`` and ``load_state_dict()``, and each
submodule's own, give and take entries in the format ``zeroshard.state_dict`` describes. Each
module fills its own parameters' entries at its turn (flats gathered a batch at a time) and consumes
them on load; a hook acts for the call made, not for torch's recursion into submodules (read
from the call stack), and for one call per thread."""

from __future__ import annotations

import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroshard import module_buffers
from zeroshard.flat_range import FlatRange
from zeroshard.model_states.flat_param import FlatParam, ShardState
from zeroshard.state_dict_gather import Wholes, batch_cap, flat_batch, flat_sources
from zeroshard.state_dict_layout import (
    COLLECTIVE,
    all_names,
    as_sharded,
    device_mesh,
    is_dtensor,
    key_of,
    refuse_split_pieces,
)
from zeroshard.watchdog import diagnosed

if TYPE_CHECKING:
    from zeroshard.engine import Engine

__all__ = ["hooks_of", "install_state_dict_hooks"]

_HOOKS_ATTR = "_zeroshard_state_dict_hooks"

_TORCH_LOAD = next(
    c
    for c in nn.Module.load_state_dict.__code__.co_consts
    if isinstance(c, types.CodeType) and c.co_name == "load"
)
"""The code of ``Module.load_state_dict``'s inner ``load(module, ...)``: it, not
``load_state_dict``, runs for each submodule (and for the sharded model, when the call is made
on a module around it)."""

# --------------------------------------------------------------------- model hooks


class _Save:
    """One ``state_dict()`` of the model under way: how its entries are made, and the values
    cut so far. Each module fills its own parameters' entries at its turn, so that hooks of
    submodules see and edit real values; a flat is gathered once, at the first entry of it that
    is reached (with the flats after it that one gather takes along), and every slot of it is
    cut then (tied names share one tensor, as torch's)."""

    def __init__(
        self,
        root: nn.Module,
        prefix: str,
        convert: Callable,
        keep: bool,
        frame: Any,
        *,
        full: tuple[bool, bool] | None,
        local: bool,
    ) -> None:
        self.root, self.prefix, self.convert, self.keep = root, prefix, convert, keep
        self.full, self.local = full, local
        """The kind of call (``_Hooks.full``, ``.local``): a call made inside one of its hooks
        (a submodule's own ``state_dict()``) is a plain one."""
        self.frame, self.thread = frame, threading.current_thread()
        """The root's own frame of the call (a call that raised midway is no longer on the
        stack: dropped at the next)."""
        self.values: dict[tuple[int, int], Any] = {}
        """(id(flat), slot) -> the entry cut."""
        self.cut: set[int] = set()
        """ids of the flats cut (gathered) already."""
        self.params = {id(p) for p in root.parameters()}
        """The call's parameters (a submodule's call cuts its own slots of a unit only)."""


class _Load:
    """One ``load_state_dict()`` of the model under way."""

    def __init__(self, root: nn.Module, prefix: str, frame: Any) -> None:
        self.root, self.prefix, self.frame = root, prefix, frame
        self.thread = threading.current_thread()
        self.consumed: set[str] = set()
        """Keys taken (not missing, whatever the default says)."""
        self.ranges_loaded = False
        """Whether values were read into the masters in place (FlatRange)."""
        self.deferred: list[tuple[dict, int, Any]] = []
        """The user's pre-hooks on ``root`` registered after ``shard()``, run before the
        engine's take there: (hooks, key, hook) to put back."""
        self.assign = False
        """``load_state_dict(..., assign=True)``: the entries' tensors replace the buffers."""
        self.wholes: Wholes | None = None
        """The parameters' DTensor entries made whole, gathered ahead in batches."""


class _Hooks:
    """The state-dict hooks of one sharded model (registered on each of its modules)."""

    def __init__(self, model: nn.Module, engine: Engine) -> None:
        self.engine = engine
        self.full: tuple[bool, bool] | None = None
        """(rank0_only, cpu_offload) for the call ``full_state_dict`` makes; None: sharded
        entries. Taken by that call as it begins (``_Save.full``)."""
        self.local = False
        """Whether the call ``local_state_dict`` makes is one: ``FlatRange`` entries, nothing
        gathered. Taken by that call as it begins (``_Save.local``)."""
        self.saves: list[_Save] = []
        self.loads: list[_Load] = []
        """The calls under way, innermost last (a hook may call a submodule's own)."""
        self.slot_of = {
            id(s.param): (f, i) for f in engine.flat_params for i, s in enumerate(f.slots)
        }
        self._load_ids: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
        # On every module of the model: a submodule's own state_dict() (a head's, a block's) is
        # in the same format, and each module's entries are made (saving) and taken (loading)
        # at its own turn, between the hooks of the user's that run before and after torch's
        # own work there (a checkpoint-upgrade hook renaming or converting its keys).
        self.hooked: weakref.WeakSet[nn.Module] = weakref.WeakSet(model.modules())
        for m in model.modules():
            m.register_state_dict_pre_hook(self._state_dict_pre_hook_of_each)
            first = m.register_state_dict_post_hook(self._function(self._fill_own))
            m._state_dict_hooks.move_to_end(first.id, last=False)  # before the user's own
            m.register_state_dict_post_hook(self._function(self._finish_saving))
            self._load_ids[m] = m.register_load_state_dict_pre_hook(self._load_pre_hook_of_each).id
            first = m.register_load_state_dict_post_hook(self._load_post_hook_of_each)
            m._load_state_dict_post_hooks.move_to_end(first.id, last=False)

    @staticmethod
    def _function(method: Callable) -> Callable:
        """``method`` as a function (torch marks a state-dict post-hook with an attribute);
        returns None, as torch wants of hooks."""

        def run(*args: Any) -> None:
            method(*args)

        return run

    def _live(self, calls: list) -> bool:
        """Drop the calls on top of ``calls`` that raised midway (their frames are gone from
        their thread's stack, or the thread ended; a load's hooks set aside go back): whether
        one of this thread is left. A call of another thread under way is a RuntimeError (one
        model's calls are one thread's at a time)."""
        while calls:
            top = calls[-1]
            if top.thread.is_alive() and _on_stack(top.frame, top.thread):
                if top.thread is threading.current_thread():
                    return True
                raise RuntimeError(
                    f"a state dict of this model is being made or loaded by another thread "
                    f"({top.thread.name}): one at a time (the two mixed up their entries)"
                )
            stale = calls.pop()
            if isinstance(stale, _Load):
                _put_back(stale)
        return False

    def _outermost(self, module: nn.Module, method: str) -> bool:
        """Whether this ``module.<method>()`` call is the user's, not torch's recursion into the
        submodules of a call on another module of this model: read from the call stack (which
        stays right when a call raised midway, as a counter would not). A call made inside a
        hook (a submodule's own ``state_dict()``) is the user's."""
        frame = _own_frame(module, method)
        caller = frame.f_back if frame is not None else None
        while caller is not None and _is_own(caller, module, method):
            caller = caller.f_back  # (an override of state_dict() calling super()'s)
        while caller is not None:
            if method == "state_dict":
                parent = caller.f_locals.get("self") if caller.f_code.co_name == method else None
            else:
                parent = caller.f_locals.get("module") if caller.f_code is _TORCH_LOAD else None
            if parent is None or parent in self.hooked:
                return parent is None
            # A module put around one of the model's after shard() (a block compiled in place,
            # peft's add_adapter / load_adapter wrapping a Linear): torch's recursion through it.
            caller = caller.f_back
        return True

    # ------------------------------------------------------------- state_dict
    def _state_dict_pre_hook_of_each(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self._outermost(module, "state_dict"):
            self.state_dict_pre_hook(module, prefix)

    @torch.no_grad()
    def state_dict_pre_hook(self, module: nn.Module, prefix: str) -> None:
        """The user's call begins: the checks, and how entries are made."""
        engine = self.engine
        engine.check_thread()  # (local_state_dict in a monitor thread: states mixed up)
        full, local = self.full, self.local  # (this call's: the ones made inside are plain)
        self.full, self.local = None, False
        if full is not None:  # (not the sharded ones: templates that a load fills)
            engine.check_trusted()
        engine.adopt_writes()
        keep = True  # whether this rank returns the entries it cuts
        if full is None and not local:
            refuse_split_pieces(engine, "model.state_dict()")
        if full is None:
            mesh = device_mesh(engine)
            convert = lambda t, dtype: as_sharded(t, mesh, dtype)  # noqa: E731
        else:
            rank0_only, cpu_offload = full
            keep = not rank0_only or engine.mesh.is_first
            device = torch.device("cpu") if cpu_offload else None
            convert = lambda t, dtype: t.to(device=device, dtype=dtype, copy=True)  # noqa: E731
        self._live(self.saves)
        frame = _own_frame(module, "state_dict")
        self.saves.append(_Save(module, prefix, convert, keep, frame, full=full, local=local))

    @torch.no_grad()
    def _fill_own(
        self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict
    ) -> None:
        """This module's parameters' entries, from the masters (torch put the parameters there:
        placeholders at stage 3), before the user's hooks on it run."""
        if not self._live(self.saves):
            return
        save = self.saves[-1]
        for name, p in module._parameters.items():
            key = prefix + name
            if p is None or key not in state_dict:
                continue
            if id(p) not in self.slot_of:  # zero-element: a plain parameter, nothing to gather
                if save.keep:
                    state_dict[key] = save.convert(p.detach(), p.dtype)
                continue
            flat, index = self.slot_of[id(p)]
            if id(flat) not in save.cut:
                self._cut(save, flat)
            if save.keep:  # (the other ranks' collectives still needed this rank's shard)
                state_dict[key] = self._unsplit(save, module, name, save.values[(id(flat), index)])
        if _saves_itself(module):
            self._own_entries(module, state_dict, prefix)

    def _unsplit(self, save: _Save, module: nn.Module, name: str, value: Any) -> Any:
        """The entry of ``module``'s parameter ``name`` as the unsplit model has it, where
        tensor parallelism split it: whole (gathered over the tp group) in ``full_state_dict``,
        placed in the whole tensor in ``local_state_dict`` (a checkpoint's). Done here, before
        the user's hooks on the module may rename the entry."""
        mesh = self.engine.mesh
        if mesh.tp_size == 1:
            return value
        from zeroshard import tensor_parallel

        split = tensor_parallel.split_of(module, name)
        if split is None:
            return value
        if save.local:
            return value.placed(tensor_parallel.placed(split, mesh.tp_rank, mesh.tp_size))
        return tensor_parallel.whole_tensor(value, split, mesh.tp_group)

    def _cut(self, save: _Save, flat: FlatParam) -> None:
        """Every slot of ``flat`` cut, and of the flats after it that one gather takes along
        (``flat_batch``: in engine order, within ``bucket_bytes``; the same on every rank, as is
        the first entry of each reached), the gathered buffers freed after."""
        if save.local:
            batch, sources = [flat], [None]
        else:
            flats = self.engine.flat_params
            take = lambda f: id(f) not in save.cut and self._saved(save, f)  # noqa: E731
            batch = flat_batch(flats, flats.index(flat), batch_cap(self.engine), take)
            sources = flat_sources(batch)
        for f, source in zip(batch, sources):
            save.cut.add(id(f))
            for index, s in enumerate(f.slots) if save.keep else ():
                if id(s.param) not in save.params:
                    continue
                if source is None:
                    value = _local_range(f, index)
                else:
                    piece = source[s.offset : s.offset + s.numel].view(s.shape)
                    value = save.convert(piece, f.orig_dtype)
                save.values[(id(f), index)] = value

    @staticmethod
    def _saved(save: _Save, flat: FlatParam) -> bool:
        return any(id(s.param) in save.params for s in flat.slots)

    def _own_entries(self, module: nn.Module, state_dict: dict, prefix: str) -> None:
        """Entries a module's own ``_save_to_state_dict`` made of its parameters under keys of
        its own (``kernel = weight.t()``: TF-ported and quantized layers). Views of a unit held
        gathered (inside ``summon_full_params``) are copied: that memory is given back after,
        and the entry read freed memory (a segmentation fault). Views of a placeholder (stage 3,
        at rest) are an error: they were saved as NaN."""
        flats = [
            self.slot_of[id(p)][0] for p in module._parameters.values() if id(p) in self.slot_of
        ]
        held = {f.full.untyped_storage().data_ptr() for f in flats}
        rest = {f._placeholder().untyped_storage().data_ptr() for f in flats}
        for key, value in list(state_dict.items()):
            own = key.startswith(prefix) and "." not in key[len(prefix) :]
            if not own or not isinstance(value, torch.Tensor) or is_dtensor(value):
                continue
            where = value.untyped_storage().data_ptr()
            if where in rest and all(f.state is ShardState.SHARDED for f in flats):
                raise ValueError(
                    f"{type(module).__name__} at {prefix or 'the root'} saves its parameters "
                    f"under keys of its own (_save_to_state_dict: {key!r}), which hold nothing "
                    "at rest at stage 3 (NaN placeholders): take the state dict inside "
                    "zeroshard.summon_full_params(model), or train it at stage 1-2"
                )
            if where in held:
                state_dict[key] = value.clone()

    def _finish_saving(
        self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict
    ) -> None:
        """After the hooks registered before ``shard()`` on the user's module (a
        checkpoint_wrapper's, which takes its level out of the keys)."""
        if (
            self._live(self.saves)
            and module is self.saves[-1].root
            and prefix == self.saves[-1].prefix
        ):
            save = self.saves.pop()
            self.state_dict_post_hook(module, state_dict, prefix, save)

    def state_dict_post_hook(
        self, module: nn.Module, state_dict: dict, prefix: str, save: _Save
    ) -> None:
        """The user's call ends: buffers in their declared dtype, entries on the CPU."""
        if save.keep:
            _buffers_in_their_dtype(module, state_dict, prefix)
        if save.full is not None and save.full[1] and save.keep:
            for key, value in state_dict.items():
                if key.startswith(prefix) and isinstance(value, torch.Tensor):
                    state_dict[key] = value.detach().cpu()

    # ------------------------------------------------------------- load_state_dict
    def _load_pre_hook_of_each(
        self, module: nn.Module, state_dict: dict, prefix: str, *args: Any
    ) -> None:
        """The load's setup for the user's call; then, on every module, its own entries taken
        out of ``state_dict`` into the masters (torch copies them right after the module's
        pre-hooks): after the hooks of the user's on it, which may rename or convert them
        (``spectral_norm``'s tells an up-to-date dict by its ``weight_orig``)."""
        if self._outermost(module, "load_state_dict"):
            self.load_pre_hook(module, state_dict, prefix, *args)
        if self._live(self.loads):
            self._take_own(module, state_dict, prefix, error_msgs=args[-1])

    @torch.no_grad()
    def load_pre_hook(
        self,
        module: nn.Module,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        engine = self.engine
        engine.check_thread()
        if engine.discarding:
            raise ValueError(
                "load_state_dict inside summon_full_params(model, writeback=False), which undoes "
                "writes on exit: whether the load should be undone too is ambiguous; load "
                "outside it"
            )
        engine.adopt_writes()
        for flat in engine.flat_params:
            if flat.gathering:
                flat.wait_unshard()
        self._live(self.loads)
        # Ours last on each submodule (hooks the user registered after shard() included).
        for m in module.modules():
            if m is not module and m in self._load_ids:
                m._load_state_dict_pre_hooks.move_to_end(self._load_ids[m])
        load = _Load(module, prefix, _own_frame(module, "load_state_dict"))
        load.assign = bool(local_metadata.get("assign_to_params_buffers", False))
        self.loads.append(load)
        # On this one, which runs its hooks now: those after ours run first, here, and are
        # left out of the rest of torch's loop over them (values replaced, put back at the end).
        args = (state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys)
        hooks = module._load_state_dict_pre_hooks
        keys = list(hooks)
        for key in keys[keys.index(self._load_ids[module]) + 1 :]:
            hook = hooks[key]
            hooks[key] = _skipped
            load.deferred.append((hooks, key, hook))
            hook(*args, error_msgs)
        # Other entries (zero-element parameters, buffers) the default loader copies: as whole
        # tensors, in the same order on every rank (gathering DTensors is a collective).
        names = all_names(module)
        params = {prefix + n for i in self.slot_of if i in names for n in names[i]}
        cap = batch_cap(engine)
        others = [k for k in state_dict if k.startswith(prefix) and k not in params]
        wholes = Wholes(others, state_dict.get, cap)
        with diagnosed("all_gather", COLLECTIVE, None):
            for key in others:
                if is_dtensor(state_dict[key]):
                    state_dict[key] = wholes.whole(key, state_dict[key])
        # The parameters' entries, gathered ahead in the order torch's recursion reaches them.
        # (checkpoint_wrapper's hook puts its level back into the keys as its module loads)
        lookup = lambda k: state_dict.get(k, state_dict.get(key_of(k)))  # noqa: E731
        load.wholes = Wholes(self._param_keys(module, prefix), lookup, cap)

    @torch.no_grad()
    def _take_own(
        self, module: nn.Module, state_dict: dict, prefix: str, error_msgs: list[str]
    ) -> None:
        """This module's parameters' entries into the masters (and the compute copies held
        gathered); as torch, a parameter under several names takes each, the last wins. The
        parameter itself given as its value (torch's ``set_model_state_dict`` fills keys a
        dict lacks so) keeps the master as it is: at stage 3 it is the NaN placeholder."""
        load = self.loads[-1]
        for name, p in module._parameters.items():
            key = prefix + name  # (under checkpoint_wrapper's own level, which its hook adds)
            if p is None or id(p) not in self.slot_of or key not in state_dict:
                continue
            value = state_dict.pop(key)
            load.consumed.add(key_of(key))
            flat, index = self.slot_of[id(p)]
            shape = flat.slots[index].shape
            if isinstance(value, torch.Tensor) and len(shape) == 0 and value.dim() == 1:
                value = value[0]  # (as torch: a scalar saved 1-D by torch 0.3)
            if isinstance(value, FlatRange):
                load.ranges_loaded = True
                _read_range(flat, index, value, key, error_msgs)
            elif not isinstance(value, torch.Tensor):
                error_msgs.append(
                    f'While copying the parameter named "{key}", expected torch.Tensor '
                    f"or Tensor-like object from checkpoint but received {type(value)}"
                )
            elif value.shape != shape:  # a DTensor's shape is global
                error_msgs.append(_size_mismatch(key, value.shape, shape, self.engine.mesh.tp_size))
            elif (
                load.assign
                and p.requires_grad
                and not (value.is_floating_point() or value.is_complex())
            ):
                error_msgs.append(  # (torch's assign makes it the parameter, and fails)
                    f'While assigning the parameter named "{key}": a {value.dtype} tensor cannot '
                    "be a parameter that requires grad (only floating point and complex ones "
                    "can); give it in the parameter's dtype, or load with assign=False (which "
                    "copies, casting)"
                )
            elif is_dtensor(value) or not _same_memory(value, p):
                with diagnosed("all_gather", COLLECTIVE, None):  # a DTensor's full_tensor()
                    _write_slot(flat, index, load.wholes.whole(key, value))

    def _param_keys(self, module: nn.Module, prefix: str) -> list[str]:
        """The keys of the sharded parameters' entries under ``module``, in the order torch's
        ``load`` reaches them (each module, then its children, depth first; a module
        registered twice is loaded twice)."""
        keys = []
        for name, m in module.named_modules(prefix=prefix.rstrip("."), remove_duplicate=False):
            head = f"{name}." if name else ""
            keys += [
                head + n
                for n, p in m._parameters.items()
                if p is not None and id(p) in self.slot_of
            ]
        return keys

    def _load_post_hook_of_each(self, module: nn.Module, incompatible_keys: Any) -> None:
        """First on each module: the keys taken are not missing, for the hooks of the user's
        after it too; the end of the user's call."""
        if not self._live(self.loads):
            return
        load = self.loads[-1]
        missing = incompatible_keys.missing_keys
        missing[:] = [k for k in missing if key_of(k) not in load.consumed]
        if module is load.root and self._outermost(module, "load_state_dict"):
            self.loads.pop()
            self.load_post_hook(module, load, incompatible_keys)

    def load_post_hook(self, module: nn.Module, load: _Load, incompatible_keys: Any) -> None:
        _put_back(load)
        # Entries assigned (assign=True, or a module's own _load_from_state_dict registering
        # one anew) in the state dict's dtypes replaced buffers: back to the engine's.
        module_buffers.restore_dtypes(module)
        if not incompatible_keys.missing_keys and module is self.engine.model:
            self.engine.loaded(module)  # the whole model: values known again
        loaded = {id(p) for p in module.parameters()}  # a graph made before is stale there
        for unit in self.engine.units:
            unit.updates += not unit.param_ids.isdisjoint(loaded)
        if load.ranges_loaded:  # the compute copies follow the masters read in place
            self.engine.params_changed()


def _is_own(frame: types.FrameType, module: nn.Module, method: str) -> bool:
    """Whether ``frame`` is of a call of ``method`` on ``module`` (for ``load_state_dict``, its
    inner ``load(module, ...)``, which runs for each module)."""
    if method == "state_dict":
        return frame.f_code.co_name == method and frame.f_locals.get("self") is module
    return frame.f_code is _TORCH_LOAD and frame.f_locals.get("module") is module


def _own_frame(module: nn.Module, method: str) -> types.FrameType | None:
    """The innermost frame of a call of ``method`` on ``module`` on the stack, if any."""
    frame = sys._getframe(1)
    while frame is not None and not _is_own(frame, module, method):
        frame = frame.f_back
    return frame


def _on_stack(target: Any, thread: threading.Thread) -> bool:
    """Whether frame ``target`` is on ``thread``'s stack (a call of it still running)."""
    if thread is threading.current_thread():
        frame = sys._getframe(1)
    else:
        frame = sys._current_frames().get(thread.ident)
    while frame is not None and frame is not target:
        frame = frame.f_back
    return frame is not None


def _put_back(load: _Load) -> None:
    """The user's pre-hooks that ``load`` set aside, where they still are (one removed by its
    handle meanwhile stays removed)."""
    for hooks, key, hook in load.deferred:
        if hooks.get(key) is _skipped:
            hooks[key] = hook
    load.deferred.clear()


def _skipped(*args: Any) -> None:
    """A pre-hook the load ran already (``_Hooks.load_pre_hook``)."""


def _saves_itself(module: nn.Module) -> bool:
    return type(module)._save_to_state_dict is not nn.Module._save_to_state_dict


def _same_memory(value: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether ``value`` is the parameter's own data (at rest, any placeholder of its shape:
    they hold no value)."""
    return value.data_ptr() == p.data_ptr() and value.shape == p.shape


def _read_range(flat: FlatParam, index: int, value: FlatRange, key: str, errors: list[str]) -> None:
    """A ``FlatRange`` entry: read in place already when it views this slot's master range
    (``zeroshard.checkpoint``), else copied there when it is a range of the same place (another
    model's ``local_state_dict`` at the same layout); any other is an error (it was taken as
    read, and nothing was loaded)."""
    mine = _local_range(flat, index)
    if value.data.data_ptr() == mine.data.data_ptr() and value.data.numel() == mine.data.numel():
        return
    if (value.shape, value.start, value.data.numel()) == (
        mine.shape,
        mine.start,
        mine.data.numel(),
    ):
        mine.data.copy_(value.data)
        return
    errors.append(
        f"{key} is a FlatRange of another layout (a local_state_dict of a model sharded over "
        "other ranks or stages): load a full or DTensor state dict (model.state_dict(), "
        "zeroshard.full_state_dict) instead"
    )


def _size_mismatch(key: str, got: torch.Size, want: torch.Size, tp: int = 1) -> str:
    """torch's own message; with tensor parallelism, what to do when ``got`` is whole."""
    said = (
        f"size mismatch for {key}: copying a param with shape {tuple(got)} from checkpoint, the "
        f"shape in current model is {tuple(want)}."
    )
    differ = [(g, w) for g, w in zip(got, want) if g != w]
    if tp > 1 and len(got) == len(want) and len(differ) == 1 and differ[0][0] == differ[0][1] * tp:
        said += (
            f" It is the whole tensor; this tensor-parallel rank holds 1/{tp} of it: load whole "
            "weights before tensor_parallel.parallelize, or through zeroshard.checkpoint (which "
            "splits them)."
        )
    return said


def _local_range(flat: FlatParam, index: int) -> FlatRange:
    """Slot ``index``'s elements this rank holds, as a view of the master, saved at the master's
    precision (FP32 also for a model built in bf16: a resume is exact); of ``full`` for frozen
    replicated slots without a master."""
    s = flat.slots[index]
    if flat.master is None:
        return FlatRange(s.shape, flat.orig_dtype, 0, flat.full[s.offset : s.offset + s.numel])
    start, _ = flat.piece_range(index)
    return FlatRange(s.shape, flat.master_dtype, start, flat.master_piece(index))


def _write_slot(flat: FlatParam, index: int, value: torch.Tensor) -> None:
    """Slot ``index`` of ``flat`` takes ``value`` (the whole parameter): this rank's master piece
    and, where the flat holds it now, the compute copy (the master's rounding of it)."""
    s = flat.slots[index]
    src = value.reshape(-1).to(device=flat.mesh.device)
    if flat.master is not None:
        src = src.to(flat.master_dtype)
        a, b = flat.piece_range(index)
        flat.master_piece(index).copy_(src[a:b])
    if flat.state is ShardState.UNSHARDED and not (
        flat.master_aliases_full and not flat.partition.optimizer_states
    ):
        flat.full[s.offset : s.offset + s.numel].copy_(src)


def install_state_dict_hooks(model: nn.Module, engine: Engine) -> None:
    """Register the state-dict hooks on ``model``'s modules (``zeroshard.shard`` calls this)."""
    setattr(engine, _HOOKS_ATTR, _Hooks(model, engine))


def _buffers_in_their_dtype(module: nn.Module, state_dict: dict, prefix: str) -> None:
    """Buffers that ``MixedPrecision.buffer_dtype`` cast (BatchNorm's statistics in BF16) as
    the model declared them (FP32), as FSDP1 gives them: a state dict loads into the model
    unsharded, or trained at another precision, as it was built; loading casts them back."""
    BUFFER_DTYPES = module_buffers.BUFFER_DTYPES

    for name, sub in module.named_modules(remove_duplicate=False):  # under each of its names
        for buf_name, dtype in getattr(sub, BUFFER_DTYPES, {}).items():
            key = key_of(f"{prefix}{name}.{buf_name}" if name else prefix + buf_name)
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and value.dtype != dtype:
                state_dict[key] = value.to(dtype)


def hooks_of(model: nn.Module) -> _Hooks:
    """The state-dict hooks of the sharded ``model`` (its engine's)."""
    from zeroshard.engine import engine_of

    return getattr(engine_of(model), _HOOKS_ATTR)
