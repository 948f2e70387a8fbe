"""The model's buffers under the engine (running statistics, position tables, masks): moved to
the device at ``shard()``, floating ones that are saved in ``MixedPrecision.buffer_dtype``,
rank 0's values on every rank; and cast back to that dtype when a conversion of the whole model
(``model.half()``, ``.to(dtype)``) or a load that assigns (``load_state_dict(..., assign=True)``)
gave them another, as the engine gives the parameters their memory back then. State dicts give
cast buffers in their declared dtype (``zeroshard.state_dict_hooks``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from zeroshard import collectives as C
from zeroshard.call_frames import on_stack

if TYPE_CHECKING:
    from zeroshard.mesh import Mesh
    from zeroshard.precision import MixedPrecision


BUFFER_DTYPES = "_zeroshard_buffer_dtypes"
"""Attribute of a module whose buffers ``buffer_dtype`` cast: {buffer name: original dtype}."""
ENGINE_DTYPES = "_zeroshard_engine_buffer_dtypes"
"""Attribute of a module with floating buffers: {buffer name: the dtype ``move`` gave it}."""


def move(model: nn.Module, mesh: Mesh, own: dict, default: MixedPrecision, *, sync: bool) -> None:
    """Buffers to the device, floating ones that are saved with the model (running statistics)
    in ``buffer_dtype``; non-persistent ones are constants a module derives and computes with in
    its own precision (RoPE's inverse frequencies: rounded to BF16 they are off by a radian at
    position 8000) and keep their dtype. Rank 0's values on every rank with ``sync``
    (``sync_module_states``), whatever their dtype or layout. A buffer registered in
    several modules stays one tensor (an EMA two modules update in place), in the dtype of its
    first registration in module order. ``own``: each
    module's unit's policy by ``id`` (``unit_precision``'s, a BatchNorm kept FP32), else
    ``default``."""
    registered, dtypes = [], {}  # (module, name, buffer); id -> the dtype it is given
    where = {id(m): prefix for prefix, m in model.named_modules()}
    for module in model.modules():
        mp, derived = own.get(id(module), default), module._non_persistent_buffers_set
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            cast = buf.is_floating_point() and mp.buffer_dtype and name not in derived
            dtype = mp.buffer_dtype if cast else buf.dtype
            registered.append((module, name, buf))
            # One tensor however many registrations, in the dtype the first one asks for (they
            # were cast apart when another asked otherwise: unit_precision's FP32, or
            # non-persistent there, and each update was seen by one name only).
            dtypes.setdefault(id(buf), dtype)
    moved: dict[int, torch.Tensor] = {}
    wholes = _converted_wholes(registered, dtypes, mesh, sync=sync)
    floating = []  # (qualified name, module, name): what restore_dtypes checks
    for module, name, buf in registered:
        dtype = dtypes[id(buf)]
        if dtype != buf.dtype:  # state dicts give it back in this one (as FSDP1 does)
            module.__dict__.setdefault(BUFFER_DTYPES, {})[name] = buf.dtype
        if dtype.is_floating_point:
            module.__dict__.setdefault(ENGINE_DTYPES, {})[name] = dtype
            prefix = where.get(id(module), "")
            floating.append((f"{prefix}.{name}" if prefix else name, module, name))
        if id(buf) in moved:
            pass
        elif (key := _storage(buf)) in wholes:  # a storage other buffers view: it stays one
            whole = wholes[key]
            moved[id(buf)] = whole.as_strided(buf.shape, buf.stride(), buf.storage_offset())
        else:
            moved[id(buf)] = buf.to(device=mesh.device, dtype=dtype)
            if sync and mesh.world_size > 1:
                moved[id(buf)] = C.broadcast_any(moved[id(buf)], group=mesh.group)
        module._buffers[name] = moved[id(buf)]
    model.__dict__[_FLOATING] = floating
    _watch_assignments()


def _storage(buf: torch.Tensor) -> int | None:
    """The data pointer of ``buf``'s storage; None where it has none to share: meta, empty,
    sparse tensors and subclasses."""
    plain = type(buf) in (torch.Tensor, nn.Parameter) and buf.layout is torch.strided
    if not plain or buf.device.type == "meta" or not buf.untyped_storage().nbytes():
        return None
    return buf.untyped_storage().data_ptr()


@torch.no_grad()
def _converted_wholes(
    registered: list[tuple[nn.Module, str, torch.Tensor]],
    dtypes: dict[int, torch.dtype],
    mesh: Mesh,
    *,
    sync: bool,
) -> dict[int, torch.Tensor]:
    """Storage -> the whole storage moved and cast (and broadcast with ``sync``), for buffers
    that view one storage with other buffers (``part = whole[:4]``) and must change dtype or
    device: each is made a view of it again, so an update of one reaches the others, as in
    torch (cast apart under a BF16 ``buffer_dtype``, ``part`` stopped following ``whole``
    without a word). Such views all take the dtype the first of them asks for (``dtypes`` is
    updated), as a buffer registered several times does: a non-persistent view among cast ones
    split them all. Views of one storage in several dtypes (``.view(dtype)``), and buffers
    without a storage to share (``_storage``), are left out; so are views that stay as they
    are (``.to`` keeps them, and any other reference to their storage)."""
    by_storage: dict[int, dict[int, torch.Tensor]] = {}
    for _, _, buf in registered:
        key = _storage(buf)
        if key is not None:
            by_storage.setdefault(key, {})[id(buf)] = buf
    wholes = {}
    for key, bufs in by_storage.items():
        first = next(iter(bufs.values()))  # (the first registered, in module order)
        if len(bufs) < 2 or len({b.dtype for b in bufs.values()}) > 1:
            continue  # one tensor (however many names), or views in several dtypes: apart
        target = dtypes[id(first)]
        for b in bufs.values():
            dtypes[id(b)] = target
        if target == first.dtype and first.device == mesh.device:
            continue
        whole = torch.empty(0, dtype=first.dtype, device=first.device)
        whole.set_(first.untyped_storage())
        whole = whole.to(device=mesh.device, dtype=target)
        if sync and mesh.world_size > 1:
            whole = C.broadcast_any(whole, group=mesh.group)
        wholes[key] = whole
    return wholes


_FLOATING = "_zeroshard_floating_buffers"
"""Attribute of a sharded model: its floating buffers as ``move`` left them, a list to check at
each forward without walking the modules."""


def restore_dtypes(model: nn.Module) -> list[str]:
    """Cast back every floating buffer of ``model`` whose dtype is no longer the one ``move``
    gave it (its values as they are now: rounded by the conversion that changed it); each one
    cast back, as "name (now dtype, was dtype)"."""
    entries = model.__dict__.get(_FLOATING)
    if entries is None:  # a submodule: its own records
        entries = [
            (f"{prefix}.{name}" if prefix else name, module, name)
            for prefix, module in model.named_modules()
            for name in module.__dict__.get(ENGINE_DTYPES, {})
        ]
    restored = []
    for qualified, module, name in entries:
        buf, dtype = module._buffers.get(name), module.__dict__[ENGINE_DTYPES].get(name)
        if isinstance(buf, torch.Tensor) and buf.is_floating_point() and buf.dtype != dtype:
            with torch.no_grad():
                module._buffers[name] = buf.to(dtype)
            restored.append(f"{qualified} ({str(buf.dtype)[6:]}, was {str(dtype)[6:]})")
    return restored


def restore_after_conversion(model: nn.Module, problem: Exception | None) -> Exception | None:
    """``restore_dtypes`` of the sharded ``model`` before a forward, a step or a state dict, and
    the error to raise: ``problem`` (its parameters' own, ``param_checks.check_views``) naming
    the buffers cast back with them, or, where a conversion left the parameters as they were
    (``model.to(torch.bfloat16)`` under BF16 mixed precision: RoPE's FP32 frequencies rounded
    without a word), one of its own; None when nothing was converted."""
    restored = restore_dtypes(model)
    if not restored:
        return problem
    said = f"{', '.join(restored[:4])}{', ...' if len(restored) > 4 else ''}"
    if problem is not None:
        return ValueError(
            f"{problem}. Buffers converted with them were cast back to their dtypes too "
            f"({said}), with the values the conversion rounded"
        )
    return ValueError(
        f"buffers were converted after zeroshard.shard() (model.to(dtype), model.half(): "
        f"{said}): cast back to the dtypes the engine keeps, with the values the conversion "
        "rounded. Pick compute dtypes with shard(..., mixed_precision=...) (buffer_dtype for "
        "buffers), or convert before sharding"
    )


LOST = "_zeroshard_lost_buffers"
"""Attribute of a sharded model whose buffers a move to meta emptied: their names."""


def put_back(model: nn.Module, device: torch.device) -> list[str]:
    """Buffers a move of the whole model (``model.to(...)``, refused for its parameters) put on
    another device, moved back to the engine's ``device`` with their values (one registered in
    several modules stays one tensor, as ``move`` keeps it); those it put on meta have none
    left: their names, which every later forward names until they are filled again
    (``check_filled``)."""
    lost, moved = [], {}  # id of a buffer -> its tensor on ``device``
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if not isinstance(buf, torch.Tensor) or buf.device == device:
                continue
            if buf.is_meta:
                lost.append(f"{module_name}.{name}" if module_name else name)
            else:
                with torch.no_grad():
                    module._buffers[name] = moved.setdefault(id(buf), buf.to(device))
    if lost:
        model.__dict__[LOST] = lost
    return lost


def lost_message(lost: list[str]) -> str:
    """What to do about the buffers ``lost`` (names) on meta."""
    said = f"{', '.join(lost[:4])}{', ...' if len(lost) > 4 else ''}"
    return (
        f"buffers moved to meta have no values left ({said}): fill them again "
        "(model.load_state_dict(buffers, strict=False, assign=True) with their saved values), "
        "or shard a fresh model"
    )


def check_filled(model: nn.Module) -> None:
    """A ValueError while buffers a move to meta emptied (``put_back``) are still there."""
    lost = model.__dict__.get(LOST)
    if not lost:
        return
    on_meta = {name for name, b in model.named_buffers(remove_duplicate=False) if b.is_meta}
    still = [name for name in lost if name in on_meta]
    if still:
        raise ValueError(
            f"after model.to('meta') following zeroshard.shard(): {lost_message(still)}"
        )
    del model.__dict__[LOST]


_WATCHING: list[bool] = []


def _watch_assignments() -> None:
    """Tell a buffer the module assigns (``self.cache = t.to(x.dtype)``, ``register_buffer``
    again: torch's global registration hook) from one a conversion replaced (``Module._apply``
    writes ``_buffers`` directly): an assigned dtype is the module's choice, kept from then on
    (an FP32 statistic a module keeps itself under a BF16 ``buffer_dtype``: FSDP2 keeps it
    too); one in the dtype the model declared, where ``buffer_dtype`` cast it, assigned by a
    load (``load_state_dict(..., assign=True)``), is the state dict's entry, cast back."""
    if _WATCHING:
        return
    from torch.nn.modules import module as torch_module

    def assigned(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        records = module.__dict__.get(ENGINE_DTYPES)
        if records is None or name not in records or not isinstance(tensor, torch.Tensor):
            return
        declared = module.__dict__.get(BUFFER_DTYPES, {}).get(name)
        if tensor.is_floating_point() and (tensor.dtype != declared or not _loading()):
            records[name] = tensor.dtype

    torch_module.register_module_buffer_registration_hook(assigned)
    _WATCHING.append(True)


def _loading() -> bool:
    """Whether ``load_state_dict`` is running in this thread (its entries assigned by torch's
    ``assign=True`` or by a module's own ``_load_from_state_dict``, which re-registers a
    buffer to take another shape)."""
    return on_stack(nn.Module.load_state_dict.__code__)
