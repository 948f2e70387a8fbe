"""State dicts of sharded models and optimizers, in FSDP2's format.

``model.state_dict()`` of a model passed through ``zeroshard.shard`` (any stage) returns what
``torch.distributed.fsdp.fully_shard`` gives for the same model: every parameter name of the
original model (every name of a tied parameter too), each a ``DTensor`` placed ``(Shard(0),)``
on a 1-D ``DeviceMesh`` of the data-parallel group, with the parameter's global shape and, as
local tensor, rank r's row chunk ``torch.chunk(param, world_size, dim=0)[r]`` (empty, shape
``(0, *param.shape[1:])``, for ranks past the last chunk). Buffers are plain tensors, as in the
unsharded model. So ``torch.distributed.checkpoint`` (DCP) saves and reshards it like an FSDP2
checkpoint, and ``torch.save`` / ``torch.load`` (``weights_only`` included) round trip it.

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
parameters are consumed by a pre-hook of the root module and taken off ``missing_keys`` by its
post-hook; ``assign=True`` does not replace sharded parameters (their storage is the engine's).

The hooks live on the model passed to ``shard`` (the root): a submodule's own ``state_dict()``
is torch's default (at stage 3 its parameters are placeholders at rest). Call the root's, which
may itself sit inside a larger module (prefixes are honoured).

``full_state_dict(model)`` gives plain full tensors instead (rank 0 only and on the CPU by
default): for export.

``optimizer_state_dict(opt)`` / ``load_optimizer_state_dict(opt, sd)`` (what
``ShardedOptimizer.state_dict`` / ``load_state_dict`` call) use the format of
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` for an FSDP2 model:

    {"state": {fqn: {"step": tensor(3.),             # plain scalars as the optimizer holds them
                     "exp_avg": DTensor Shard(0),     # per-element states, like the parameter
                     "exp_avg_sq": DTensor Shard(0)}},
     "param_groups": [{"lr": ..., "betas": ..., ..., "params": [fqn, ...]}]}

A tied parameter's state is keyed by its first name in ``model.named_parameters()``. The loss
scaler is not part of it: ``opt.loss_scaler.state_dict()`` is saved apart. Before the first
step the sub-optimizers are first given their states as torch's ``get_optimizer_state_dict``
does (a zero-gradient step at learning rate 0: zeros, ``step`` 1), so that a fresh optimizer's
dict is a complete template for ``dcp.load``; like torch's, this counts as a step for the bias
correction of Adam if training then starts without loading anything.

``keep_vars=True`` changes nothing here: entries are new DTensors, not the parameters.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard import collectives as C
from zeroshard.model_states.flat_param import FlatParam, ShardState

if TYPE_CHECKING:  # DTensor is imported when first used: it costs `import zeroshard` ~0.5 s
    from torch.distributed.device_mesh import DeviceMesh

    from zeroshard.engine import Engine
    from zeroshard.model_states.optimizer import ShardedOptimizer, _SubGroup

__all__ = [
    "device_mesh",
    "full_state_dict",
    "install_state_dict_hooks",
    "load_optimizer_state_dict",
    "optimizer_state_dict",
]

_MESH_ATTR = "_zeroshard_device_mesh"
_HOOKS_ATTR = "_zeroshard_state_dict_hooks"

_IMPL_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Param-group keys that say how this process computes a step, not where training is: kept from
the running optimizer when a state dict is loaded (the rest of a saved group is taken)."""


# --------------------------------------------------------------------- mesh and layout


def device_mesh(engine: Engine) -> DeviceMesh:
    """The 1-D ``DeviceMesh`` of ``engine``'s data-parallel group (built once, cached)."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = getattr(engine, _MESH_ATTR, None)
    if mesh is None:
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
    """This rank's row chunk of ``full`` (a copy in ``dtype``) as a ``(Shard(0),)`` DTensor of
    ``full``'s shape; a 0-dim ``full`` comes back as a plain copy (FSDP2 has no scalar shards)."""
    from torch.distributed.tensor import DTensor, Shard

    if full.ndim == 0:
        return full.to(dtype, copy=True)
    lo, hi = _row_chunk(full.shape[0], mesh.get_local_rank(), mesh.size())
    local = full[lo:hi].to(dtype, copy=True).contiguous()
    return DTensor.from_local(
        local,
        mesh,
        [Shard(0)],
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


def _all_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name each parameter is registered under (tied parameters have several), keyed by
    ``id``, in ``state_dict`` order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _first_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's first name, as ``get_optimizer_state_dict`` keys optimizer states."""
    return {id(p): name for name, p in model.named_parameters()}


def _flat_source(flat: FlatParam) -> torch.Tensor:
    """1D padded_numel: the whole flat buffer at master precision (for frozen buffers held only
    as ``full``, in their own dtype). A new buffer gathered from every rank's master when the
    masters are partitioned (a collective); otherwise a tensor the flat already holds."""
    if flat.master is None or flat.master_aliases_full:
        return flat.full  # replicated and current (after wait_params)
    if not flat.partition.optimizer_states:
        return flat.master  # the whole buffer (range is everything)
    return _gather_flat(flat, flat.master.to(flat.mesh.device))


def _gather_flat(flat: FlatParam, local: torch.Tensor) -> torch.Tensor:
    """1D padded_numel, every rank: every rank's ``local`` (1D, its optimizer range of ``flat``,
    any dtype) gathered into a new buffer. A collective, kept out of the engine's ledger."""
    out = torch.empty(flat.padded_numel, dtype=local.dtype, device=flat.mesh.device)
    C.all_gather(
        out, local, group=flat.mesh.group, ledger=C.Ledger(), label="state_dict", async_op=False
    ).wait()
    return out


def _gathered_flats(engine: Engine) -> Iterator[tuple[FlatParam, torch.Tensor]]:
    """Each FlatParam with its whole buffer (``_flat_source``), one at a time, in the same order
    on every rank."""
    for flat in engine.flat_params:
        yield flat, _flat_source(flat)


# --------------------------------------------------------------------- model hooks


class _Hooks:
    """The state-dict hooks of one sharded model (registered on its root module)."""

    def __init__(self, model: nn.Module, engine: Engine) -> None:
        self.engine = engine
        self.full: tuple[bool, bool] | None = None
        """(rank0_only, cpu_offload) while ``full_state_dict`` runs; None: sharded entries."""
        self.consumed: set[str] = set()
        """Keys the last load's pre-hook consumed (not missing, whatever the default says)."""
        # Functions, not bound methods: torch marks a state-dict post-hook with an attribute.
        model.register_state_dict_post_hook(lambda *a: self.state_dict_post_hook(*a))
        model.register_load_state_dict_pre_hook(lambda *a: self.load_pre_hook(*a))
        model.register_load_state_dict_post_hook(lambda *a: self.load_post_hook(*a))

    # ------------------------------------------------------------- state_dict
    @torch.no_grad()
    def state_dict_post_hook(
        self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict
    ) -> None:
        engine = self.engine
        engine.wait_params()
        names = _all_names(module)
        keep = True  # whether this rank returns the entries it cuts
        if self.full is None:
            mesh = device_mesh(engine)
            convert = lambda t, dtype: _as_sharded(t, mesh, dtype)  # noqa: E731
        else:
            rank0_only, cpu_offload = self.full
            keep = not rank0_only or engine.mesh.rank == 0
            device = torch.device("cpu") if cpu_offload else None
            convert = lambda t, dtype: t.to(device=device, dtype=dtype, copy=True)  # noqa: E731

        in_flats: set[int] = set()
        for flat, source in _gathered_flats(engine):
            for s in flat.slots:
                in_flats.add(id(s.param))
                keys = [prefix + n for n in names.get(id(s.param), [])]
                keys = [k for k in keys if k in state_dict]
                if not keys or not keep:
                    continue  # (the other ranks' collectives still need this rank's shard)
                value = convert(
                    source[s.offset : s.offset + s.numel].view(s.shape), flat.orig_dtype
                )
                for k in keys:
                    state_dict[k] = value
            del source  # a gathered buffer is freed before the next flat's
        # Zero-element parameters stay plain parameters: the same layout, nothing to gather.
        for module_name, p in module.named_parameters(remove_duplicate=False):
            key = prefix + module_name
            if id(p) not in in_flats and key in state_dict and keep:
                state_dict[key] = convert(p.detach(), p.dtype)
        if self.full is not None and self.full[1] and keep:
            for key, value in state_dict.items():
                if key.startswith(prefix) and isinstance(value, torch.Tensor):
                    state_dict[key] = value.detach().cpu()

    # ------------------------------------------------------------- load_state_dict
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
        engine.wait_params()
        names = _all_names(module)
        self.consumed = set()
        for flat in engine.flat_params:
            if flat.gathering:
                flat.wait_unshard()
            for i, s in enumerate(flat.slots):
                keys = [prefix + n for n in names.get(id(s.param), [])]
                keys = [k for k in keys if k in state_dict]
                if not keys:
                    continue
                value = state_dict[keys[0]]
                for k in keys:
                    del state_dict[k]
                    self.consumed.add(k)
                if not isinstance(value, torch.Tensor):
                    error_msgs.append(
                        f'While copying the parameter named "{keys[0]}", expected torch.Tensor '
                        f"or Tensor-like object from checkpoint but received {type(value)}"
                    )
                    continue
                if value.shape != s.shape:  # a DTensor's shape is global
                    error_msgs.append(
                        f"size mismatch for {keys[0]}: copying a param with shape "
                        f"{tuple(value.shape)} from checkpoint, the shape in current model is "
                        f"{tuple(s.shape)}."
                    )
                    continue
                _write_slot(flat, i, _full_value(value))
        # Other entries (zero-element parameters, buffers) the default loader copies: as whole
        # tensors, in the same order on every rank (gathering DTensors is a collective).
        for key in list(state_dict):
            if key.startswith(prefix) and _is_dtensor(state_dict[key]):
                state_dict[key] = state_dict[key].full_tensor()

    def load_post_hook(self, module: nn.Module, incompatible_keys: Any) -> None:
        missing = incompatible_keys.missing_keys
        missing[:] = [k for k in missing if k not in self.consumed]
        self.consumed = set()


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
    """Register the state-dict hooks on ``model``'s root (``zeroshard.shard`` calls this)."""
    setattr(engine, _HOOKS_ATTR, _Hooks(model, engine))


def _hooks(model: nn.Module) -> _Hooks:
    from zeroshard.engine import engine_of

    return getattr(engine_of(model), _HOOKS_ATTR)


def full_state_dict(
    model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, torch.Tensor]:
    """The whole model as plain, full tensors (FP32 masters in each parameter's original dtype;
    every name, buffers included), gathered one FlatParam at a time.

    A collective at stage >= 1: every rank calls it. With ``rank0_only`` the other ranks get
    ``{}``; with ``cpu_offload`` the tensors are copied to the CPU as they are cut."""
    hooks = _hooks(model)
    hooks.full = (rank0_only, cpu_offload)
    try:
        sd = model.state_dict()
    finally:
        hooks.full = None
    if rank0_only and hooks.engine.mesh.rank != 0:
        return {}
    return sd


# --------------------------------------------------------------------- optimizer


def _init_states(opt: ShardedOptimizer) -> None:
    """Give every sub-optimizer without state one, as torch's ``_init_optim_state`` does for
    ``get_optimizer_state_dict``: a step with zero gradients at learning rate 0, after which
    the learning rates are restored. States then exist (zeros; ``step`` counts 1), so the state
    dict is a complete template, e.g. for ``dcp.load`` before training."""
    for sg in opt._subgroups:
        o = sg.optimizer
        if o.state:
            continue
        lrs = []
        for group in o.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
            if "lr" in group:
                lrs.append(group["lr"])
                group["lr"] = torch.tensor(0.0) if torch.is_tensor(group["lr"]) else 0.0
        o.step()
        for group in o.param_groups:
            if "lr" in group:
                group["lr"] = lrs.pop(0)
            for p in group["params"]:
                p.grad = None


def _subgroup_of(opt: ShardedOptimizer) -> dict[int, _SubGroup]:
    """This rank's sub-group of each bucket (by ``id``); a rank holding none of a bucket's
    trainable elements has none."""
    return {id(sg.bucket): sg for sg in opt._subgroups}


def _is_elementwise_state(value: Any, piece: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.ndim >= 1 and value.shape == piece.shape


def _state_layout(opt: ShardedOptimizer) -> list[dict[int, dict[str, Any]]]:
    """Per bucket (engine order) and user group: each state key, either ``("elementwise",
    dtype)`` (a tensor shaped like the piece) or ``("value", v)`` (anything else, e.g. a 0-dim
    ``step``), as the first rank holding such a piece has it; the same on every rank (one
    object all-gather)."""
    subgroups = _subgroup_of(opt)
    mine: list[dict[int, dict[str, Any]]] = []
    for bucket in opt.engine.buckets:
        entry: dict[int, dict[str, Any]] = {}
        sg = subgroups.get(id(bucket))
        if sg is not None:
            for gi, pieces in zip(sg.groups, sg.pieces):
                st = sg.optimizer.state.get(pieces[0].tensor) if pieces else None
                if not st:
                    continue
                entry[gi] = {
                    k: ("elementwise", v.dtype)
                    if _is_elementwise_state(v, pieces[0].tensor)
                    else ("value", v.detach().cpu().clone() if torch.is_tensor(v) else v)
                    for k, v in st.items()
                }
        mine.append(entry)
    mesh = opt.engine.mesh
    if mesh.world_size == 1:
        return mine
    every: list[Any] = [None] * mesh.world_size
    dist.all_gather_object(every, mine, group=mesh.group)
    merged: list[dict[int, dict[str, Any]]] = [{} for _ in opt.engine.buckets]
    for rank_layout in every:
        for bi, entry in enumerate(rank_layout):
            for gi, keys in entry.items():
                merged[bi].setdefault(gi, keys)
    return merged


def _copy_value(v: Any) -> Any:
    return v.clone() if torch.is_tensor(v) else v


@torch.no_grad()
def optimizer_state_dict(opt: ShardedOptimizer) -> dict[str, Any]:
    """``opt``'s state in the format of ``get_optimizer_state_dict`` for an FSDP2 model (module
    docstring): per-parameter states keyed by name, element-wise states as ``(Shard(0),)``
    DTensors cut out of each sub-group's pieces, and the param groups with parameter names.

    Sub-optimizers without state yet are first given one (``_init_states``: a zero-gradient step
    at learning rate 0, as torch does), so the dict is a complete template. A collective: every
    rank calls it (one flat buffer per state key is gathered at a time)."""
    engine = opt.engine
    model = engine.model
    mesh = device_mesh(engine)
    _init_states(opt)
    first = _first_names(model)
    group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    layout = _state_layout(opt)
    subgroups = _subgroup_of(opt)
    per_param: dict[int, dict[str, Any]] = {}
    for bi, bucket in enumerate(engine.buckets):
        flat: FlatParam = bucket.flat
        sg = subgroups.get(id(bucket))
        keys: dict[str, torch.dtype] = {}
        for gi_keys in layout[bi].values():
            for k, (kind, v) in gi_keys.items():
                if kind == "elementwise":
                    keys.setdefault(k, v)
        for k, dtype in keys.items():
            assert flat.master is not None
            local = torch.zeros(flat.master.numel(), dtype=dtype, device=flat.mesh.device)
            if sg is not None:
                for pieces in sg.pieces:
                    for piece in pieces:
                        v = sg.optimizer.state.get(piece.tensor, {}).get(k)
                        if v is not None:
                            local[piece.span].copy_(v)
            if flat.partition.optimizer_states and flat.mesh.world_size > 1:
                full = _gather_flat(flat, local)
            else:
                full = local
            for s in flat.slots:
                gi = group_of.get(id(s.param))
                if gi is None or k not in layout[bi].get(gi, {}):
                    continue
                view = full[s.offset : s.offset + s.numel].view(s.shape)
                per_param.setdefault(id(s.param), {})[k] = _as_sharded(view, mesh, dtype)
            del full, local
        for s in flat.slots:
            gi = group_of.get(id(s.param))
            for k, (kind, v) in layout[bi].get(gi, {}).items() if gi is not None else ():
                if kind == "value":
                    per_param.setdefault(id(s.param), {})[k] = _copy_value(v)
    # Zero-element parameters are not in any FlatParam; FSDP2 gives them states of their shape.
    by_group: dict[int, dict[str, Any]] = {}
    for entry in layout:
        for gi, keys_ in entry.items():
            by_group.setdefault(gi, keys_)
    for gi, group in enumerate(opt.param_groups):
        for p in group["params"]:
            if p.numel() or not p.requires_grad or id(p) in per_param or gi not in by_group:
                continue
            per_param[id(p)] = {
                k: _as_sharded(torch.zeros(p.shape, dtype=v, device=p.device), mesh, v)
                if kind == "elementwise"
                else _copy_value(v)
                for k, (kind, v) in by_group[gi].items()
            }
    state: dict[str, dict[str, Any]] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) in per_param and first[id(p)] not in state:
                state[first[id(p)]] = per_param[id(p)]
    param_groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [first[id(p)] for p in g["params"]],
        }
        for g in opt.param_groups
    ]
    return {"state": state, "param_groups": param_groups}


def _match_groups(opt: ShardedOptimizer, saved: list[dict[str, Any]], first: dict[int, str]):
    """For each of ``opt``'s param groups, the saved group holding its parameters (by name,
    else by position)."""
    where = {name: j for j, g in enumerate(saved) for name in g.get("params", [])}
    out = []
    for i, g in enumerate(opt.param_groups):
        hits = [where[first[id(p)]] for p in g["params"] if first.get(id(p)) in where]
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


@torch.no_grad()
def load_optimizer_state_dict(opt: ShardedOptimizer, state_dict: dict[str, Any]) -> None:
    """Load what ``optimizer_state_dict`` returns (per parameter name: DTensors of any mesh, e.g.
    resharded by ``dcp.load``, or plain full tensors) into ``opt``'s sub-groups, at any world
    size or stage. Param-group hyperparameters are taken from the saved group holding the same
    parameters (by name, else by position), except the implementation choices ``foreach``,
    ``fused``, ``capturable``, ``differentiable`` (kept). A collective (DTensors are gathered
    one parameter and key at a time)."""
    engine = opt.engine
    model = engine.model
    first = _first_names(model)
    all_names = _all_names(model)
    saved_state: dict[str, dict[str, Any]] = state_dict.get("state", {})
    for g, saved in zip(opt.param_groups, _match_groups(opt, state_dict["param_groups"], first)):
        for k, v in saved.items():
            if k not in ("params", "param_names") and k not in _IMPL_KEYS:
                g[k] = v
    # Which keys are element-wise, per bucket and group: from the running optimizer's own
    # states (a 0-dim parameter's ``exp_avg`` has the shape of ``step``), made if none yet.
    _init_states(opt)
    layout = _state_layout(opt)
    group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    subgroups = _subgroup_of(opt)
    for bi, bucket in enumerate(engine.buckets):
        flat: FlatParam = bucket.flat
        sg = subgroups.get(id(bucket))
        # Per piece of the sub-group (torch's parameter order): key -> state being assembled.
        pieces = [p for ps in sg.pieces for p in ps] if sg is not None else []
        assembled: list[dict[str, Any]] = [{} for _ in pieces]
        for i, (s, span) in enumerate(flat.pieces()):
            names = [n for n in all_names.get(id(s.param), []) if n in saved_state]
            if not names:
                continue
            st = saved_state[names[0]]
            kinds = layout[bi].get(group_of.get(id(s.param), -1), {})
            owner = next(
                (
                    j
                    for j, piece in enumerate(pieces)
                    if span.stop > span.start
                    and piece.span.start <= span.start
                    and span.stop <= piece.span.stop
                ),
                None,
            )
            for k in sorted(st):
                v = _full_value(st[k])  # on every rank, in the same order (a collective)
                if k in kinds:
                    elementwise = kinds[k][0] == "elementwise"
                else:
                    elementwise = torch.is_tensor(v) and v.ndim >= 1 and v.shape == s.shape
                if owner is None:
                    continue
                piece = pieces[owner]
                if elementwise:
                    if v.numel() != s.numel:
                        raise ValueError(
                            f"optimizer state {k!r} of {names[0]} has shape {tuple(v.shape)}, "
                            f"the parameter {tuple(s.shape)}"
                        )
                    buf = assembled[owner].get(k)
                    if buf is None:
                        buf = torch.zeros(
                            piece.tensor.numel(), dtype=v.dtype, device=flat.mesh.device
                        )
                        assembled[owner][k] = buf
                    a, b = flat.piece_range(i)
                    lo = span.start - piece.span.start
                    buf[lo : lo + (b - a)].copy_(v.reshape(-1)[a:b])
                else:
                    assembled[owner].setdefault(k, _copy_value(v))
        if sg is None:
            continue
        packed = sg.optimizer.state_dict()
        groups = packed["param_groups"]
        for tg, gi in zip(groups, sg.groups):
            tg.update({k: v for k, v in opt.param_groups[gi].items() if k != "params"})
        packed["state"] = {j: st for j, st in enumerate(assembled) if st}
        sg.optimizer.load_state_dict(packed)
