"""State dicts of sharded models and optimizers, in FSDP2's format.

``model.state_dict()`` of a model passed through ``zeroshard.shard`` (any stage) returns what
``torch.distributed.fsdp.fully_shard`` gives for the same model: every parameter name of the
original model (every name of a tied parameter too), each a ``DTensor`` placed ``(Shard(0),)``
on a 1-D ``DeviceMesh`` of the data-parallel group, with the parameter's global shape and, as
local tensor, rank r's row chunk ``torch.chunk(param, world_size, dim=0)[r]`` (empty, shape
``(0, *param.shape[1:])``, for ranks past the last chunk). Buffers are plain tensors, as in the
unsharded model. So ``torch.distributed.checkpoint`` (DCP) saves and reshards it like an FSDP2
checkpoint, and ``torch.save`` / ``torch.load`` (``weights_only`` included) round trip it.

Hybrid sharding (shard groups of k ranks, ``zeroshard.mesh``): as FSDP2's HSDP, each entry is a
DTensor placed ``(Replicate(), Shard(0))`` on the 2-D ("replicate", "shard") mesh, its local
tensor the row chunk ``torch.chunk(param, k, dim=0)[shard_rank]``: the ranks of a replicate group
hold the same chunk, and DCP writes it once. ``local_state_dict`` ranges likewise repeat across
replicas (the same fqn and offsets: DCP's save planner keeps one of each).

    values      the FP32 masters cast to each parameter's original dtype: a model trained in
                bf16 saves full-precision weights, not its bf16 compute copy.
    0-dim       parameters without rows (``torch.tensor(1.0)``): FSDP2 refuses them
                ("fully_shard doesn't support scalar parameters"); here they come back as plain
                (replicated) tensors.
    0 elements  parameters stay plain, unsharded parameters in the engine; their entry is a
                DTensor of their (empty) shape, as FSDP2's.

How it is made, one ``FlatParam`` at a time (never more than one flat buffer whole): the flat's
master shards are all-gathered into a temporary FP32 buffer (stage >= 1; at stage 0 the master is
already whole, and FP32 replicated buffers are read in place), each parameter's row chunk is cut
out and cloned, the buffer is freed. At stage >= 1 this is a collective: every rank must call
``state_dict()`` (unlike FSDP2, whose shards are row-aligned already).

``model.load_state_dict(sd)`` accepts that format (DTensors on any mesh, e.g. filled in by
``dcp.load``) or plain full tensors (an unsharded model's ``state_dict()``, a ``torch.load``-ed
file), for every stage and precision, ``strict`` as usual. Each parameter's value (a DTensor is
gathered with ``full_tensor()``: one parameter at a time) is written into this rank's FP32 master
range and into the compute copy where one is held (replicated stages, or a stage-3 unit gathered
right now), so the next forward and the next optimizer step both continue from it. Sharded
parameters are consumed by a pre-hook of the module called and taken off ``missing_keys`` by its
post-hook; ``assign=True`` does not replace sharded parameters (their storage is the engine's).

The hooks live on every module of the model passed to ``shard``: a submodule's own
``state_dict()`` / ``load_state_dict()`` give and take its entries in the same format (as
FSDP2's do), and the root may itself sit inside a larger module (prefixes are honoured). Each
acts for the call made, not for torch's recursion into submodules (read from the call stack).

``full_state_dict(model)`` gives plain full tensors instead (rank 0 only and on the CPU by
default): for export, and for a model's own ``save_pretrained`` (``zeroshard.save_pretrained``).

``local_state_dict(model)`` gives, for every sharded parameter, a ``FlatRange`` (this rank's own
master range as a view: no collective, no copy) instead of a DTensor: what ``zeroshard.checkpoint``
saves (DCP writes the range as chunks) and loads into in place; ``load_state_dict`` of such a dict
then refreshes the compute copies.

``keep_vars=True`` changes nothing here: entries are new DTensors, not the parameters.

``zeroshard.optimizer_state_dict`` (module ``zeroshard.optim_state_dict``) gives the optimizer's
states in the same format.
"""

from __future__ import annotations

import math
import re
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard import collectives as C
from zeroshard.flat_range import FlatRange
from zeroshard.model_states.flat_param import FlatParam, ShardState
from zeroshard.watchdog import diagnosed

if TYPE_CHECKING:  # DTensor is imported when first used: it costs `import zeroshard` ~0.5 s
    from torch.distributed.device_mesh import DeviceMesh

    from zeroshard.engine import Engine

__all__ = [
    "device_mesh",
    "full_state_dict",
    "install_state_dict_hooks",
    "local_state_dict",
]

_MESH_ATTR = "_zeroshard_device_mesh"
_HOOKS_ATTR = "_zeroshard_state_dict_hooks"
COLLECTIVE = (
    "the state dict (a collective where masters are sharded: every rank calls state_dict(), "
    "load_state_dict() and opt.state_dict(), not rank 0 alone)"
)
"""How a timed-out state-dict gather is named (``zeroshard.watchdog``): the DDP habit of
saving under ``if rank == 0:`` leaves the other ranks out of it."""


# --------------------------------------------------------------------- mesh and layout


def device_mesh(engine: Engine | nn.Module) -> DeviceMesh:
    """The ``DeviceMesh`` of ``engine``'s state-dict DTensors (built once, cached): the 1-D mesh
    of its data-parallel group, or with hybrid sharding the 2-D ("replicate", "shard") mesh, as
    FSDP2's HSDP has it (entries ``(Replicate(), Shard(0))``: replicas hold the same rows).
    ``engine`` may be the sharded model."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(engine, nn.Module):
        from zeroshard.engine import engine_of

        engine = engine_of(uncompiled(engine))  # (an unsharded model: the error says so)

    mesh = getattr(engine, _MESH_ATTR, None)
    if mesh is None:
        if engine.mesh.hybrid is not None:
            mesh = engine.mesh.hybrid.device_mesh
        else:
            group = engine.mesh.group if engine.mesh.group is not None else dist.group.WORLD
            mesh = DeviceMesh.from_group(group, engine.mesh.device.type)
        setattr(engine, _MESH_ATTR, mesh)
    return mesh


def _row_chunk(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``torch.chunk(t, world_size, dim=0)[rank]`` (empty past the last)."""
    size = math.ceil(num_rows / world_size)
    lo = min(rank * size, num_rows)
    return lo, min(lo + size, num_rows)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def _as_sharded(full: torch.Tensor, mesh: DeviceMesh, dtype: torch.dtype) -> torch.Tensor:
    """This rank's row chunk of ``full`` (a copy in ``dtype``) as a DTensor of ``full``'s shape,
    ``(Shard(0),)`` on a 1-D mesh, ``(Replicate(), Shard(0))`` on the 2-D hybrid one (the chunk
    of this rank's place in its shard group); a 0-dim ``full`` comes back as a plain copy (FSDP2
    has no scalar shards)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if full.ndim == 0:
        return full.to(dtype, copy=True)
    shard_dim = mesh.ndim - 1  # the last: "shard" of a hybrid mesh
    lo, hi = _row_chunk(full.shape[0], mesh.get_local_rank(shard_dim), mesh.size(shard_dim))
    local = full[lo:hi].to(dtype, copy=True).contiguous()
    return DTensor.from_local(
        local,
        mesh,
        [Replicate()] * shard_dim + [Shard(0)],
        run_check=False,
        shape=full.shape,
        stride=_contiguous_stride(full.shape),
    )


def _full_value(value: Any) -> torch.Tensor:
    """A state dict value as one whole tensor (a DTensor is gathered: a collective)."""
    if _is_dtensor(value):
        return value.full_tensor()
    return value.detach() if isinstance(value, torch.Tensor) else value


def _is_dtensor(value: Any) -> bool:
    """Without importing DTensor: none exists before its module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


_TORCH_LOAD = next(
    c
    for c in nn.Module.load_state_dict.__code__.co_consts
    if isinstance(c, types.CodeType) and c.co_name == "load"
)
"""The code of ``Module.load_state_dict``'s inner ``load(module, ...)``: it, not
``load_state_dict``, runs for each submodule (and for the sharded model, when the call is made
on a module around it)."""

_WRAPPED = "_checkpoint_wrapped_module."
"""What torch's ``checkpoint_wrapper`` inserts into parameter names and its own state-dict hooks
take out of the keys (``get_state_dict`` does alike): names here are the keys' names."""


def key_of(name: str) -> str:
    """The state-dict key of a parameter or buffer named ``name`` in ``named_modules()``'s
    terms (torch's ``checkpoint_wrapper`` inserts a level that its keys leave out)."""
    return name.replace(_WRAPPED, "")


def _all_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name each parameter is registered under (tied parameters have several), keyed by
    ``id``, in ``state_dict`` order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name.replace(_WRAPPED, ""))
    return names


def tied_names(model: nn.Module) -> dict[str, str]:
    """``{alias: source}``: each further name under which ``model`` registers a parameter or a
    buffer (tied weights, a module registered at two places), as its state dict's keys have
    them; ``source`` is the first name."""
    pairs: dict[str, str] = {}
    buffers: dict[int, str] = {}  # persistent ones: non-persistent buffers have no key
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                full = f"{prefix}.{name}".lstrip(".").replace(_WRAPPED, "")
                if buffers.setdefault(id(b), full) != full:
                    pairs[full] = buffers[id(b)]
    for names in _all_names(model).values():
        pairs.update((alias, names[0]) for alias in names[1:])
    return pairs


def _first_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's first name, as ``get_optimizer_state_dict`` keys optimizer states."""
    return {id(p): name.replace(_WRAPPED, "") for name, p in model.named_parameters()}


def refuse_split_pieces(engine: Engine, what: str) -> None:
    """A ValueError for a state dict of DTensors over the data-parallel mesh of a
    tensor-parallel model: each would hold a tp rank's piece with the piece's shape as the
    global one, and ``dcp.save`` would keep one tp rank's pieces for all, silently."""
    if engine.mesh.tp_size > 1:
        raise ValueError(
            f"{what} of a tensor-parallel model (tp={engine.mesh.tp_size}) would hold each tp "
            "rank's pieces as whole tensors: save with zeroshard.checkpoint.save (the unsplit "
            "model, loadable at any tp), or take plain whole tensors with "
            "zeroshard.full_state_dict(model)"
        )


def _flat_source(flat: FlatParam) -> torch.Tensor:
    """1D padded_numel: the whole flat buffer at master precision (for frozen buffers held only
    as ``full``, in their own dtype). A new buffer gathered from every rank's master when the
    masters are partitioned (a collective); otherwise a tensor the flat already holds."""
    if flat.master is None or flat.master_aliases_full:
        return flat.full  # replicated and current
    if not flat.partition.optimizer_states:
        return flat.master  # the whole buffer (range is everything)
    return _gather_flat(flat, flat.master.to(flat.mesh.device))


def _gather_flat(flat: FlatParam, local: torch.Tensor) -> torch.Tensor:
    """1D padded_numel, every rank: every shard-group rank's ``local`` (1D, its optimizer range
    of ``flat``, any dtype) gathered into a new buffer. A collective (inside the shard group:
    the other groups hold the same ranges), kept out of the engine's ledger."""
    out = torch.empty(flat.padded_numel, dtype=local.dtype, device=flat.mesh.device)
    C.all_gather(
        out,
        local,
        group=flat.mesh.shard_group,
        ledger=C.Ledger(),
        label=COLLECTIVE,
        async_op=False,
    ).wait()
    return out


def _cutter(flat: FlatParam, convert: Callable) -> Callable[[FlatParam, int], torch.Tensor]:
    """Slot ``index`` of ``flat`` as ``convert(view, orig_dtype)``, cut from the whole flat
    buffer (``_flat_source``: gathered here, a collective, when the masters are partitioned)."""
    source = _flat_source(flat)

    def cut(flat: FlatParam, index: int) -> torch.Tensor:
        s = flat.slots[index]
        return convert(source[s.offset : s.offset + s.numel].view(s.shape), flat.orig_dtype)

    return cut


# --------------------------------------------------------------------- model hooks


class _Save:
    """One ``state_dict()`` of the model under way: how its entries are made, and the values
    cut so far. Each module fills its own parameters' entries at its turn, so that hooks of
    submodules see and edit real values; a flat is gathered once, at the first entry of it that
    is reached, and every slot of it is cut then (one flat gathered at a time, as before; tied
    names share one tensor, as torch's)."""

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
            convert = lambda t, dtype: _as_sharded(t, mesh, dtype)  # noqa: E731
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
        """Every slot of ``flat`` cut (gathered here when partitioned, in the same order on
        every rank: the first entry of each reached), the gathered buffer freed after."""
        save.cut.add(id(flat))
        cut = _local_range if save.local else _cutter(flat, save.convert)
        if save.keep:
            for index, s in enumerate(flat.slots):
                if id(s.param) in save.params:
                    save.values[(id(flat), index)] = cut(flat, index)

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
            if not own or not isinstance(value, torch.Tensor) or _is_dtensor(value):
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
        names = _all_names(module)
        params = {prefix + n for i in self.slot_of if i in names for n in names[i]}
        with diagnosed("all_gather", COLLECTIVE, None):
            for key in list(state_dict):
                value = state_dict[key]
                if key.startswith(prefix) and key not in params and _is_dtensor(value):
                    state_dict[key] = value.full_tensor()

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
            load.consumed.add(key.replace(_WRAPPED, ""))
            flat, index = self.slot_of[id(p)]
            shape = flat.slots[index].shape
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
            elif _is_dtensor(value) or not _same_memory(value, p):
                with diagnosed("all_gather", COLLECTIVE, None):  # a DTensor's full_tensor()
                    _write_slot(flat, index, _full_value(value))

    def _load_post_hook_of_each(self, module: nn.Module, incompatible_keys: Any) -> None:
        """First on each module: the keys taken are not missing, for the hooks of the user's
        after it too; the end of the user's call."""
        if not self._live(self.loads):
            return
        load = self.loads[-1]
        missing = incompatible_keys.missing_keys
        missing[:] = [k for k in missing if k.replace(_WRAPPED, "") not in load.consumed]
        if module is load.root and self._outermost(module, "load_state_dict"):
            self.loads.pop()
            self.load_post_hook(module, load, incompatible_keys)

    def load_post_hook(self, module: nn.Module, load: _Load, incompatible_keys: Any) -> None:
        _put_back(load)
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
    from zeroshard.sharding import BUFFER_DTYPES

    for name, sub in module.named_modules():
        for buf_name, dtype in getattr(sub, BUFFER_DTYPES, {}).items():
            key = key_of(f"{prefix}{name}.{buf_name}" if name else prefix + buf_name)
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and value.dtype != dtype:
                state_dict[key] = value.to(dtype)


COMPILED = "_orig_mod."
"""What ``torch.compile``'s wrapper puts before every name in its ``state_dict``: checkpoints of a
compiled model that zeroshard saved before it used the model's own names carry it."""


_COMPILED_LEVEL = re.compile(r"(?:^|(?<=\.))" + re.escape(COMPILED))


def own_key(key: str) -> str:
    """``key`` without the levels that ``torch.compile``'s wrappers put in it (a block compiled
    by ``torch.compile(block)`` inside the model: ``blocks.0._orig_mod.fc.weight``), as
    torch's ``get_state_dict`` names it."""
    return _COMPILED_LEVEL.sub("", key)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile(model)`` wraps (its ``_orig_mod``), else ``model``: the names
    of the uncompiled model, as torch's ``get_state_dict`` gives them (the wrapper's
    ``state_dict`` prefixes every key with ``COMPILED``: a checkpoint of the compiled model
    was another model's to the uncompiled one, and its export loaded as random weights)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # (imported by torch.compile)
    while eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def _hooks(model: nn.Module) -> _Hooks:
    from zeroshard.engine import engine_of

    return getattr(engine_of(model), _HOOKS_ATTR)


def local_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with a ``FlatRange`` (a view of this rank's master range, module
    ``zeroshard.flat_range``) instead of a DTensor for every sharded parameter: no collective,
    no copy. What ``zeroshard.checkpoint`` saves and loads into (in place, through DCP);
    ``model.load_state_dict`` of it then refreshes the compute copies."""
    model = uncompiled(model)
    hooks = _hooks(model)
    hooks.local = True
    try:
        return model.state_dict()
    except (AttributeError, TypeError) as exc:
        if "FlatRange" not in str(exc):
            raise
        raise TypeError(
            f"a state_dict hook of this model computes on its entries ({exc}), which "
            "zeroshard.checkpoint takes as ranges of the masters, read and written in place "
            "(FlatRange): let the hook rename or drop keys only, or save with "
            "torch.distributed.checkpoint.save(model.state_dict(), ...)"
        ) from exc
    finally:
        hooks.local = False


def full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, torch.Tensor]:
    """The whole model as plain, full tensors (FP32 masters in each parameter's original dtype;
    every name, buffers included), gathered one FlatParam at a time.

    A collective at stage >= 1: every rank calls it. With ``rank0_only`` the other ranks get
    ``{}``; with ``cpu_offload`` the tensors are copied to the CPU as they are cut. A
    tensor-parallel model's split parameters are gathered whole over its tp group as each
    module's entries are made, before the user's state-dict hooks may rename them."""
    model = uncompiled(model)
    hooks = _hooks(model)
    mesh = hooks.engine.mesh
    split = mesh.tp_size > 1  # every rank cuts its pieces on the device, then they are gathered
    hooks.full = (rank0_only and not split, cpu_offload and not split)
    try:
        sd = model.state_dict()
    finally:
        hooks.full = None
    if split and cpu_offload:  # (whole already: each module's entries gathered as made)
        sd = {k: v.cpu() for k, v in sd.items()}
    if rank0_only and not mesh.is_first:  # (not every tp rank of data-parallel rank 0)
        return {}
    # Blocks compiled inside the model: their wrappers' level left out (save_pretrained wrote
    # weights no model has, "blocks.0._orig_mod.fc.weight").
    return {own_key(k): v for k, v in sd.items()}
