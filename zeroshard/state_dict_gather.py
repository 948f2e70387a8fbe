"""The collectives behind sharded state dicts (``zeroshard.state_dict``,
``zeroshard.optim_state_dict``): whole flat buffers gathered from every rank's master range
(``flat_sources``), and whole tensors of DTensor entries being loaded (``Wholes``).

Both batch: consecutive flats, or consecutive entries in the order a load takes them, share one
all-gather of up to ``cap`` bytes (whole, at the gathered dtype; at least one item), where a
flat, or a ``DTensor.full_tensor()``, each cost one. On 2 gloo ranks a model of 400 small units
made its state dict with 400 gathers and loaded it with 1,600 (0.8 s and 2.3 s, FSDP2 0.03 and
0.16 s). Every rank must take part, in the same order: items are grouped by what every rank
sees alike (the model's structure, the entries' global shapes, meshes and placements), never by
this rank's local values."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zeroshard import collectives as C
from zeroshard.model_states.flat_param import FlatParam
from zeroshard.state_dict_layout import COLLECTIVE, is_dtensor, row_chunk

__all__ = ["Wholes", "batch_cap", "flat_batch", "flat_sources"]

BATCH_BYTES = 4 * 2**20
"""The most one batch gathers (whole tensors at the gathered dtype), below ``bucket_bytes``:
batching saves the collectives of small flats and entries; past a few MiB a collective costs
little beside its bytes, and a batch holds about twice its size while it is cut (8 units of
4 MB held 40 MB more at a 25 MiB cap than one at a time, and were no faster: an explorer)."""


def batch_cap(engine: Any) -> int:
    """Bytes one batch of ``engine``'s state dicts may gather: ``BATCH_BYTES`` or its
    ``bucket_bytes`` if smaller (0: one flat or entry at a time)."""
    return min(engine.config.bucket_bytes, BATCH_BYTES)


def full_value(value: Any) -> torch.Tensor:
    """A state dict value as one whole tensor (a DTensor is gathered: a collective)."""
    if is_dtensor(value):
        return value.full_tensor()
    return value.detach() if isinstance(value, torch.Tensor) else value


def _all_gather(local: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """``(world, local.numel())``: every rank's ``local`` (1D, the same size on every rank),
    row r rank r's. A collective kept out of the engine's ledger."""
    out = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    C.all_gather(
        out, local, group=group, ledger=C.Ledger(), label=COLLECTIVE, async_op=False
    ).wait()
    return out.view(world, local.numel())


def partitioned(flat: FlatParam) -> bool:
    """Whether the ranks of ``flat``'s shard group hold different optimizer ranges of it."""
    return flat.partition.optimizer_states and flat.mesh.shard_size > 1


def gathered(flat: FlatParam) -> bool:
    """Whether ``flat``'s whole master buffer must be gathered: its masters are partitioned
    and not a view of the whole compute buffer (FP32 at stages 1-2)."""
    return partitioned(flat) and flat.master_view is not None and not flat.master_aliases_full


def _own_source(flat: FlatParam) -> torch.Tensor:
    """The whole flat buffer a rank already holds (``gathered(flat)`` is False): ``full`` where
    the master aliases it or none is kept (frozen buffers in their own dtype), else the
    master, which is whole."""
    if flat.master_view is None or flat.master_aliases_full:
        return flat.full  # replicated and current
    return flat.master


def flat_sources(
    flats: Sequence[FlatParam], ranges: Sequence[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """1D padded_numel each, every rank: the whole buffer of each of ``flats``, from ``ranges``
    (each flat's optimizer range, one dtype; default: the masters). The ``partitioned`` ones
    (``gathered`` for the masters; one shard group) come from one all-gather of every rank's
    ranges side by side; the others are whole already: their ``ranges``, or by default tensors
    the flats hold."""
    if ranges is None:
        need = [gathered(f) for f in flats]
        ranges = [f.master.to(f.mesh.device) if n else None for f, n in zip(flats, need)]
    else:
        need = [partitioned(f) for f in flats]
    parts = [(f, r) for f, r, n in zip(flats, ranges, need) if n]
    whole: dict[int, torch.Tensor] = {}
    if parts:
        mesh = parts[0][0].mesh
        packed = torch.cat([r.reshape(-1) for _, r in parts]) if len(parts) > 1 else parts[0][1]
        rows = _all_gather(packed, mesh.shard_group, mesh.shard_size)
        at = 0
        for f, r in parts:  # (a copy each: row k holds rank k's ranges of every flat)
            whole[id(f)] = rows[:, at : at + r.numel()].reshape(-1)
            at += r.numel()
    own = [r if r is not None else _own_source(f) for f, r in zip(flats, ranges)]
    return [whole.get(id(f), o) for f, o in zip(flats, own)]


def flat_batch(
    flats: Sequence[FlatParam], start: int, cap: int, take: Callable[[FlatParam], bool]
) -> list[FlatParam]:
    """``flats[start]`` and the ``gathered`` ones after it (then those before it) that ``take``
    accepts, of its shard group and master dtype, while their whole buffers stay within ``cap``
    bytes: what one ``flat_sources`` gathers. ``flats[start]`` alone where it is not
    gathered."""
    first = flats[start]
    if not gathered(first):
        return [first]
    key = (first.mesh.shard_group, first.master_view.dtype)
    batch, total = [first], first.padded_numel * first.master_view.element_size()
    for f in [*flats[start + 1 :], *flats[:start]]:  # (the root's flat first, reached last)
        if not gathered(f) or not take(f) or (f.mesh.shard_group, f.master_view.dtype) != key:
            continue
        total += f.padded_numel * f.master_view.element_size()
        if total > cap:
            break
        batch.append(f)
    return batch


# --------------------------------------------------------------------- DTensor entries


def _signature(value: Any) -> tuple | None:
    """What DTensors gathered in one collective share: mesh, placements, dtype, device. Only
    row chunks (``Shard(0)`` on the last mesh dimension, ``Replicate()`` on the others: FSDP2's
    and HSDP's layout) are batched; None for anything else (``full_tensor()`` alone)."""
    if not is_dtensor(value) or value.ndim == 0:
        return None
    from torch.distributed.tensor import Replicate, Shard

    *rest, last = value.placements
    if type(last) is not Shard or last.dim != 0 or any(type(p) is not Replicate for p in rest):
        return None
    return (id(value.device_mesh), tuple(value.placements), value.dtype, value.device.type)


def _chunk_sizes(value: Any) -> list[int]:
    """Elements of each rank's row chunk of ``value`` (a DTensor of a batched ``_signature``)
    over the mesh's last dimension, by rank there."""
    world = value.device_mesh.size(value.device_mesh.ndim - 1)
    row = math.prod(value.shape[1:])
    return [
        (hi - lo) * row for lo, hi in (row_chunk(value.shape[0], r, world) for r in range(world))
    ]


def holds_its_row_chunk(value: Any) -> bool:
    """Whether ``value`` is no batched DTensor, or one whose local tensor holds this rank's row
    chunk (what ``_gather_rows`` needs). No collective."""
    if _signature(value) is None:
        return True
    mesh = value.device_mesh
    return value.to_local().numel() == _chunk_sizes(value)[mesh.get_local_rank(mesh.ndim - 1)]


def not_row_chunk(bad: Any) -> str:
    """The error for a DTensor entry that is not its rank's row chunk (``bad``: this rank's,
    or None where another rank holds it)."""
    said = "" if bad is None else f" (here one of shape {tuple(bad.shape)} holds "
    said += "" if bad is None else f"{bad.to_local().numel()} elements)"
    return (
        "a DTensor entry does not hold its rank's row chunk (torch.chunk's split over the "
        f"mesh) on every rank{said}: load a state dict of row chunks, as state_dict() or "
        "dcp.load gives it"
    )


def _gather_rows(values: Sequence[Any]) -> list[torch.Tensor]:
    """The whole tensors of ``values`` (DTensors of one ``_signature``) from one all-gather
    over the mesh's last dimension: every rank packs its row chunks side by side, padded to the
    longest rank's total (chunks differ in size by rank, as ``torch.chunk``'s)."""
    mesh = values[0].device_mesh
    dim = mesh.ndim - 1
    world, rank = mesh.size(dim), mesh.get_local_rank(dim)
    sizes = [_chunk_sizes(v) for v in values]  # per value, per rank: elements of its chunk
    # A rank whose piece is not its row chunk says so in the gather's last element, so that
    # every rank raises (a rank raising alone left the others waiting in the gather).
    bad = next((v for v in values if not holds_its_row_chunk(v)), None)
    longest = max(sum(c[r] for c in sizes) for r in range(world))
    packed = torch.zeros(longest + 1, dtype=values[0].dtype, device=values[0].to_local().device)
    at = 0
    for v, counts in zip(values, sizes) if bad is None else ():
        packed[at : at + counts[rank]].copy_(v.to_local().reshape(-1))
        at += counts[rank]
    packed[-1] = bad is not None
    rows = _all_gather(packed, mesh.get_group(dim), world)
    del packed
    if bool(rows[:, -1].any()):
        raise ValueError(not_row_chunk(bad))
    out, offsets = [], [0] * world
    for v, counts in zip(values, sizes):
        pieces = [rows[r, offsets[r] : offsets[r] + counts[r]] for r in range(world)]
        out.append(torch.cat(pieces).view(v.shape))
        offsets = [o + c for o, c in zip(offsets, counts)]
    return out


def _version(value: Any) -> tuple[int, int] | None:
    """The version counters of a DTensor and of its local tensor: a hook of the user's that
    edits an entry in place bumps one of them (a checkpoint upgrade's ``mul_`` on the DTensor
    bumps the DTensor's alone). None for inference tensors, which keep none (made under
    ``torch.inference_mode``: an edit there is not seen)."""
    try:
        return value._version, value._local_tensor._version
    except RuntimeError:
        return None


class Wholes:
    """Whole tensors of a load's entries, taken in a known ``order`` of keys: the DTensors
    among them are gathered ahead, a batch at a time, the batch starting at the key asked for
    and running on through ``order`` while the entries share a ``_signature`` and their whole
    tensors stay within ``cap`` bytes. ``lookup(key)`` reads an entry as it is when the batch
    is made (hooks of the user's may have renamed, replaced or edited entries in place since:
    an entry asked for that is not the one gathered, or was written since, or a key not in
    ``order``, is gathered alone). Every rank asks for the same keys in the same order (a
    collective)."""

    def __init__(self, order: Sequence[Any], lookup: Callable[[Any], Any], cap: int) -> None:
        self.order, self.lookup, self.cap = list(order), lookup, cap
        self.position = {key: i for i, key in enumerate(self.order)}
        self.ready: dict[Any, tuple[Any, tuple[int, int] | None, torch.Tensor]] = {}
        """key -> (the entry gathered, its ``_version`` then, the whole tensor)"""

    def whole(self, key: Any, value: Any) -> Any:
        """``full_value(value)``, ``value`` being ``key``'s entry."""
        if not is_dtensor(value):
            return full_value(value)
        hit = self.ready.pop(key, None)
        if hit is None and key in self.position:
            self._gather_from(self.position[key], value)
            hit = self.ready.pop(key, None)
        if hit is not None and hit[0] is value and _version(value) == hit[1]:
            return hit[2]
        return full_value(value)  # (renamed, replaced or written in place since the gather)

    def _gather_from(self, start: int, first: Any) -> None:
        """Gather ``first`` (the entry of ``order[start]``, which the caller may have taken out
        of the dict already) and the entries after it that share its signature, within
        ``cap``."""
        self.ready.clear()  # (entries skipped are not asked for again)
        signature = _signature(first)
        if signature is None:
            return
        keys, values = [self.order[start]], [first]
        total = first.numel() * first.element_size()
        for key in self.order[start + 1 :]:
            value = self.lookup(key)
            if not is_dtensor(value):
                continue
            total += value.numel() * value.element_size()
            if _signature(value) != signature or total > self.cap:
                break
            keys.append(key)
            values.append(value)
        for key, value, whole in zip(keys, values, _gather_rows(values)):
            self.ready[key] = (value, _version(value), whole)
