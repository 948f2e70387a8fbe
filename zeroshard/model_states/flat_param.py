"""Parameter storage: a group of parameters as one flat, padded, sharded buffer behind the
original parameter objects.

The module keeps its own ``nn.Parameter`` objects (names, optimizer groups and hooks keep
working); what their ``.data`` is depends on the storage state (``ShardState``):

    UNSHARDED  every parameter is a view into ``full`` with its own shape, in ``param_dtype``.
               Always so when parameters are replicated (stages 0-2).
    SHARDED    (partitioned parameters, stage 3, at rest) every parameter keeps its shape, device
               and dtype (``param_dtype``, as gathered: a change of dtype through ``p.data``
               would drop its gradient accumulator, and ``autograd.grad`` or ``backward(
               inputs=...)`` would no longer find it in a forward's graph), but its data is one
               placeholder element broadcast to that shape
               (stride 0): NaN for floating point. Reading it never touches freed memory and
               gives NaN, not a silently wrong number; writing it raises (torch refuses writes
               to overlapping memory). Shape-based code (``p.ndim >= 2`` for weight decay,
               ``sum(p.numel())``) keeps working. The values are reached through
               ``summon_full_params``, ``model.state_dict()`` or ``load_state_dict``.

Tensors and who holds them (N = ``mesh.shard_size`` ranks share the states, r = this rank's
``mesh.shard_rank``; ``range`` = this rank's optimizer range: slice r of the padded buffer when
optimizer states are partitioned, the whole buffer otherwise). Without hybrid sharding N is every
rank; with it, N = k ranks of a shard group, and the ranks with the same r in other groups
(``mesh.replicate_group``) hold identical copies of every shard tensor below:

    full    # 1D padded_numel, param_dtype, every rank. Persistent when parameters are
            #   replicated; when they are partitioned its storage exists only while UNSHARDED
            #   (resized to 0 otherwise: autograd's saved views stay valid across the refill).
    master  # 1D range numel, master dtype (FP32 for floating point), this rank. Its own tensor,
            #   apart from what is gathered; it aliases full[range] only when ``full`` is a
            #   persistent buffer of the same dtype (nothing to keep in sync then).

The gather source of a partitioned ``full`` is ``master`` (cast into this rank's slot of ``full``
when the dtypes differ): the one seam a tier below the device (ZeRO-Offload) replaces. With
``Offload(parameters="nvme")`` a ``ParamSwapper`` (``master_swap``) keeps ``master`` in swap files
between uses: its storage is empty (0 bytes, same tensor and views) until read back, which the
gather waits for; reading ``flat.master`` brings it in memory (``master_view`` does not).
Gradients are not here: ``zeroshard.model_states.grads``.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from zeroshard import collectives as C
from zeroshard.mesh import Mesh
from zeroshard.model_states.partition import intersect, layout, padded_numel, shard_range
from zeroshard.precision import MASTER_DTYPE
from zeroshard.residual_states.buffers import BufferPool
from zeroshard.signals import grad_off
from zeroshard.stages import Partition
from zeroshard.streams import on_side_stream

if TYPE_CHECKING:
    from zeroshard.model_states.param_swap import ParamSwapper


class ShardState(enum.Enum):
    SHARDED = "sharded"
    """``full``'s storage is empty; parameters are placeholders of their own shape."""
    UNSHARDED = "unsharded"
    """``full`` holds every parameter; parameters are views into it."""


@dataclass
class Slot:
    """One original parameter inside the flat buffer."""

    param: nn.Parameter
    names: list[str]
    """Every fully qualified name the model registers it under (tied weights have several)."""
    shape: torch.Size
    offset: int
    """First element in the flat buffer."""

    @property
    def numel(self) -> int:
        return self.shape.numel()


def _unset(dtype: torch.dtype) -> float | int | bool:
    """What a parameter at rest reads: NaN for floats, the minimum for integers."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def _replaced_at_rest(name: str) -> str:
    """The error for parameter ``name``'s data replaced at rest (stage 3, its unit not
    gathered: it held a NaN placeholder, so whatever was computed from it is lost)."""
    said = (
        f"{name}'s data was replaced after zeroshard.shard() while its unit was at rest (stage "
        "3: it holds a NaN placeholder there), e.g. by model.to_empty() (FSDP2's meta-init "
        "recipe: here shard() itself materializes a model built on meta, a unit at a time; "
        "pass shard(..., param_init_fn=...) or give modules reset_parameters()), p.data = "
        "..., model.to(memory_format=torch.channels_last) (parameters stay contiguous in the "
        "engine's memory: give the inputs that format, convolutions follow them), "
        "torch.nn.utils.prune's remove(), or a parametrization removed "
        "(torch.nn.utils.parametrize.remove_parametrizations computes the weight from the "
        "placeholder)"
    )
    if ".parametrizations." in name:
        said += (
            f". {name.split('.parametrizations.')[0] or 'the module'} now holds the "
            "un-parametrized original in its place: register the parametrization again (or "
            "load a state dict), and remove parametrizations inside "
            "zeroshard.summon_full_params(model), where they are whole"
        )
    return (
        f"{said}. The replacement was undone (the parameter holds its values from before it); "
        "set values with model.load_state_dict() or inside zeroshard.summon_full_params(model)"
    )


def _written(elements: torch.Tensor) -> list[int]:
    """Indices of the placeholder ``elements`` that no longer hold ``_unset`` (one host read)."""
    if elements.dtype.is_floating_point or elements.dtype.is_complex:
        unset = elements.isnan()
    else:
        unset = elements == _unset(elements.dtype)
    return [] if bool(unset.all()) else (~unset).nonzero().flatten().tolist()


def master_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """FP32 for the 16- and 32-bit float formats; wider floats and integers keep their dtype."""
    if dtype.is_floating_point and dtype.itemsize <= MASTER_DTYPE.itemsize:
        return MASTER_DTYPE
    return dtype


def _common_module(names: list[str]) -> str:
    """The longest dotted prefix of the modules of parameter ``names`` (``<root>`` if none)."""
    common = os.path.commonprefix([n.split(".")[:-1] for n in names]) if names else []
    return ".".join(common) or "<root>"


def moved_message(name: str, now: torch.device, engine: torch.device) -> str:
    """The error for a parameter moved to another device after ``shard()``."""
    return (
        f"{name} was moved to {now} after zeroshard.shard() (model.to(...)): the engine holds "
        f"the parameters' memory on {engine}, given back to them. Move the model before "
        "shard() (a model built on the meta device: shard(..., param_init_fn=...) "
        "materializes it)"
    )


def _point(p: nn.Parameter, view: torch.Tensor) -> None:
    """``p.data = view``; a parameter whose tensor was swapped for another kind
    (``model.to("meta")`` under torch's ``swap_module_params_on_conversion``) is swapped back,
    keeping its attributes."""
    try:
        p.data = view
    except RuntimeError:
        kept = dict(p.__dict__)
        torch.utils.swap_tensors(p, nn.Parameter(view, requires_grad=p.requires_grad))
        p.__dict__.update(kept)


class FlatParam:
    """Parameters sharing ``requires_grad`` and dtype, as one flat buffer (module docstring)."""

    def __init__(
        self,
        params: list[tuple[nn.Parameter, list[str]]],
        *,
        mesh: Mesh,
        partition: Partition,
        param_dtype: torch.dtype | None,
        ledger: C.Ledger,
        sync_module_states: bool = True,
        buffers: BufferPool | None = None,
    ) -> None:
        self.mesh, self.partition, self.ledger = mesh, partition, ledger
        self.buffers = buffers or BufferPool(keep=0)
        """Where a partitioned ``full`` gets its memory while gathered: lent and taken back
        (``zeroshard.residual_states.buffers``; ``keep=0``: allocated per gather)."""
        self.name = _common_module([s for _, names in params for s in names[:1]])
        """The module holding every parameter here (the unit's name; ``<root>`` for the root):
        named in errors, e.g. a collective that timed out."""
        self.requires_grad = params[0][0].requires_grad
        self.orig_dtype = params[0][0].dtype
        self.param_dtype = param_dtype or self.orig_dtype
        self.master_dtype = master_dtype_of(self.orig_dtype)
        offsets, self.numel = layout([p.numel() for p, _ in params], self.orig_dtype.itemsize)
        self.slots = [Slot(p, names, p.shape, o) for (p, names), o in zip(params, offsets)]
        ends = [s.offset + s.numel for s in self.slots]
        self.gaps = [(e, s.offset) for e, s in zip(ends, self.slots[1:]) if s.offset > e]
        """``[start, end)`` of the elements between parameters (``layout``): zeros, as the
        padding, in every gradient reduced."""
        self.padded_numel = padded_numel(self.numel, mesh.shard_size)
        num_opt_shards = mesh.shard_size if partition.optimizer_states else 1
        self.range = shard_range(
            mesh.shard_rank if partition.optimizer_states else 0, self.padded_numel, num_opt_shards
        )
        self.state = ShardState.UNSHARDED
        self._gather: C.Handle | None = None
        self.master_swap: ParamSwapper | None = None
        """Set by ``ParamSwapper.adopt``: the master lives on NVMe between uses."""
        self._master: torch.Tensor | None = None
        self.masters_ahead = False
        """The master stepped and ``full`` not yet refreshed (a step inside backward)."""
        self._init_storage(sync_module_states)
        self._versions = self._param_versions()
        """The parameters' version counters when ``full`` last equaled the cast master, for
        ``adopt_writes`` (None: nothing to adopt)."""
        self._gathered_versions: list[int] | None = None
        """Partitioned: the version counters when ``full`` was last gathered (a write to the
        gathered parameters, between a forward and its backward or inside a unit's forward, is
        adopted as above, at the latest when the engine reshards it)."""

    # ----------------------------------------------------------------- construction
    def _init_storage(self, sync_module_states: bool) -> None:
        device = self.mesh.device
        # 1D padded_numel, model dtype, every rank, transient: the values as the model was built.
        flat = torch.zeros(self.padded_numel, dtype=self.orig_dtype, device=device)
        with torch.no_grad():
            for s in self.slots:
                flat[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        if sync_module_states and self.mesh.world_size > 1:
            # Every rank starts from rank 0's values, as DDP does.
            C.broadcast(flat, src=0, group=self.mesh.group)
        lo, hi = self.range
        if self.partition.parameters:
            self.full = torch.empty(self.padded_numel, dtype=self.param_dtype, device=device)
        else:
            self.full = flat if flat.dtype == self.param_dtype else flat.to(self.param_dtype)
        self.master_aliases_full = (
            not self.partition.parameters and self.param_dtype == self.master_dtype
        )
        if self.master_aliases_full:
            self.master = self.full[lo:hi]
        elif self.requires_grad or self.partition.parameters or self.param_dtype != flat.dtype:
            # Frozen replicated parameters keep one too when computing in a narrower dtype, so
            # that state dicts return the values as built, not rounded.
            self.master = flat[lo:hi].to(self.master_dtype, copy=True)
        else:
            self.master = None  # frozen, replicated, same dtype: ``full`` is all there is
        self._pieces = self._master_pieces()
        self.use_full_views()
        if self.partition.parameters:
            self.reshard()

    @property
    def master(self) -> torch.Tensor | None:
        """The master shard, in memory (read back and held until the next optimizer step when
        it is offloaded: ``zeroshard.model_states.param_swap``)."""
        if self.master_swap is not None:
            self.master_swap.fetch(self, hold=True)
        return self._master

    @master.setter
    def master(self, value: torch.Tensor | None) -> None:
        self._master = value

    @property
    def master_view(self) -> torch.Tensor | None:
        """The master tensor as it is: shape and dtype always right, values only when resident
        (its storage is empty while offloaded). For sizes, and for views made once."""
        return self._master

    def _master_pieces(self) -> list[slice]:
        """For each slot, the slice of ``master`` this rank holds of it (possibly empty)."""
        lo, hi = self.range
        out = []
        for s in self.slots:
            a, b = intersect((s.offset, s.offset + s.numel), (lo, hi))
            out.append(slice(a - lo, b - lo))
        return out

    # ----------------------------------------------------------------- views
    def use_full_views(self) -> None:
        for s in self.slots:
            _point(s.param, self.full[s.offset : s.offset + s.numel].view(s.shape))

    def _placeholder(self, *, reset: bool = False) -> torch.Tensor:
        """What the parameters view at rest (SHARDED above): one element per slot, of this
        FlatParam's own, in ``full``'s dtype (shape ``(len(slots),)``), so that a write no
        version counter sees (``p.data.zero_()``) reaches no other parameter and names its
        own; ``reset``: written back to ``_unset``."""
        dtype = self.full.dtype
        elements = self.__dict__.get("_rest_elements")
        if elements is None or elements.dtype != dtype:
            n = len(self.slots)
            elements = torch.full((n,), _unset(dtype), dtype=dtype, device=self.mesh.device)
            self._rest_elements = elements
        elif reset:
            elements.fill_(_unset(dtype))
        return elements

    def _use_rest_views(self) -> None:
        placeholder = self._placeholder()
        for i, s in enumerate(self.slots):
            _point(s.param, placeholder[i].expand(s.shape))
        self._rest_versions = [s.param._version for s in self.slots]

    def check_views(self) -> None:
        """Parameters must view this FlatParam's memory. Data replaced in the same dtype and
        shape while they view ``full`` (``p.data = t``, ``vector_to_parameters``, ``model.half()
        .float()``) is copied in and the view restored, as a write to the parameter (the next
        step starts from it, as it would unsharded). Anything else raises, the views restored
        first so that the model stays usable: another dtype (``model.half()``) or shape
        (``resize_token_embeddings``), or data replaced at rest (stage 3: the parameter holds
        nothing there to replace)."""
        self.copy_in(self.read_replacements())

    def read_replacements(
        self, storages: set[int] | None = None
    ) -> list[tuple[Slot, torch.Tensor]]:
        """``check_views``' reading half: the slots whose data was replaced in the same dtype
        and shape, each with its new data, cloned where it lies in one of ``storages`` (data
        pointers of storages about to be written; default: ``full``'s own) or raising as
        ``check_views`` does."""
        rest = self.state is ShardState.SHARDED
        base = self._placeholder() if rest else self.full
        if storages is None:
            storages = {base.untyped_storage().data_ptr()}
        adopted = []
        for i, s in enumerate(self.slots):
            at = base.data_ptr() + (i if rest else s.offset) * base.element_size()
            p = s.param
            if not s.numel or (p.data_ptr() == at and p.dtype == base.dtype and p.shape == s.shape):
                continue  # still the engine's memory, as shard() left it
            if p.device != base.device:
                moved = moved_message(s.names[0], p.device, base.device)
                self._use_rest_views() if rest else self.use_full_views()
                raise ValueError(moved)
            if not rest and p.dtype == base.dtype and p.shape == s.shape:
                # Copied in once every replacement is read: one may be another slot's memory
                # (a.data, b.data = b.data, a.data).
                written = p.untyped_storage().data_ptr() in storages
                adopted.append((s, p.data.clone() if written else p.data))
                continue
            shape, dtype = p.shape, p.dtype
            self._use_rest_views() if rest else self.use_full_views()
            if shape != s.shape:
                raise ValueError(
                    f"{s.names[0]} was changed after zeroshard.shard() (its shape is now "
                    f"{tuple(shape)}, it was {tuple(s.shape)}: e.g. "
                    "resize_token_embeddings, or p.data = ...): the engine holds the parameters' "
                    "memory in their shapes at shard(); change the model before sharding it "
                    "(the parameter was given its memory back)"
                )
            if dtype != base.dtype:
                raise ValueError(
                    f"{s.names[0]}'s data was replaced after zeroshard.shard() (model.half(), "
                    f"model.to(dtype), p.data = ..., a tie_weights() that pads a head's bias, "
                    f"torch.nn.utils.prune's remove(); it is {dtype}, the engine's "
                    f"{base.dtype}): the engine holds the parameters' memory, given back to the "
                    "parameter. Pick compute dtypes with shard(..., mixed_precision='bf16'), "
                    "convert before sharding, or set values with model.load_state_dict() or "
                    "inside zeroshard.summon_full_params(model)"
                )
            raise ValueError(_replaced_at_rest(s.names[0]))
        return adopted

    def copy_in(self, adopted: list[tuple[Slot, torch.Tensor]]) -> None:
        """``check_views``' writing half: each replacement copied into its slot's region of
        ``full``, which the parameter views again."""
        for s, data in adopted:
            view = self.full[s.offset : s.offset + s.numel].view(s.shape)
            view.copy_(data)
            s.param.data = view
        if adopted:
            self.write_back()

    def check_rest_writes(self) -> None:
        """Raise if a parameter at rest (a placeholder, stage 3) was written: ``fill_``-like
        writes (``nn.init.zeros_``, ``constant_``, ``p.data.zero_()``) succeed on a stride-0
        view, write the parameter's placeholder element and would be lost at the next gather.
        The placeholder is restored first. Writes through ``p.data`` (its own version counter:
        the classic ``_init_weights``) are found by the elements' values, on the CPU only (on
        an accelerator that read would wait for the device at every gather; there the write
        stays in the parameter's own element, which no other parameter reads)."""
        if self.state is not ShardState.SHARDED:
            return
        written = [
            s.names[0] for s, v in zip(self.slots, self._rest_versions) if s.param._version != v
        ]
        elements = self._placeholder()
        if not written and elements.device.type == "cpu":
            written = [f"{self.slots[i].names[0]} (through .data)" for i in _written(elements)]
        if written:
            self._placeholder(reset=True)
            self._use_rest_views()
            raise ValueError(
                f"{written[0]} was written while at rest (stage 3 keeps no values of "
                "a parameter between uses, so the write would be lost): write parameters inside "
                "`with zeroshard.summon_full_params(model):`, or before zeroshard.shard()"
            )

    # ----------------------------------------------------------------- parameters
    def unshard(self, *, async_op: bool = True) -> None:
        """Start gathering ``full`` from every rank's ``master`` (no-op if already unsharded or
        under way). Parameters become views into ``full`` at ``wait_unshard``."""
        if self.state is ShardState.UNSHARDED or self._gather is not None:
            return
        self.check_rest_writes()
        self.check_views()  # (data replaced at rest: the gather would drop it without a word)
        try:
            # Refill the same storage object: views autograd saved in forward see the refill.
            self.buffers.lend(self, self.full.untyped_storage(), self.buffer_key[1])
            self._gather = self._gather_from_master(async_op=True)
        except BaseException:  # a Ctrl-C in a master's read from NVMe (or as the loan was
            # made: every later gather of the unit was refused), a failed fetch
            if self.buffers.holds(self):
                self.buffers.take_back(self, self.full.untyped_storage())
            else:  # (inside ``lend``, its memory given before the loan was noted: freed)
                self.full.untyped_storage().resize_(0)
            raise
        if not async_op:
            # Waited here, not inside the gather: a wait that raises (a Ctrl-C, a late peer)
            # leaves the receives posted into the lent memory, and ``_gather`` set, so the
            # memory goes back to the pool only after a later wait (reshard's) finishes them.
            self._gather.wait()

    def wait_unshard(self) -> None:
        if self._gather is not None:
            if self.state is ShardState.SHARDED:
                # Replaced since the gather began (it was read ahead): an error before the views
                # go to ``full``, the gather left to finish as after an interrupted wait.
                self.check_views()
            self._gather.wait()
            self._gather = None
            if self.master_swap is not None:
                self.master_swap.gathered(self)  # the store's copy is current: drop it
            if self.state is ShardState.SHARDED:
                self.state = ShardState.UNSHARDED
                self.use_full_views()
                self._gathered_versions = [s.param._version for s in self.slots]

    def reshard(self) -> None:
        """Free ``full``'s storage; parameters become placeholders (partitioned only)."""
        if not self.partition.parameters:
            return
        self.wait_unshard()
        self._use_rest_views()
        self.buffers.take_back(self, self.full.untyped_storage())
        self.state = ShardState.SHARDED

    @property
    def buffer_key(self) -> tuple[torch.device, int]:
        """The (device, bytes) of the pool buffer a gather of ``full`` borrows."""
        return self.full.device, self.padded_numel * self.full.element_size()

    @property
    def gathering(self) -> bool:
        return self._gather is not None

    def _gather_from_master(self, *, async_op: bool) -> C.Handle:
        """All-gather the shard group's master shards into ``full``, in place: the local shard
        is cast into this rank's slot first when the dtypes differ, so no temporary is made."""
        if self.master_swap is not None:
            self.master_swap.fetch(self)  # read ahead by the engine, or now
        assert self._master is not None and self.partition.optimizer_states
        # On a GPU the cast and the collective run on the all-gather stream, off the compute one.
        with on_side_stream(self.mesh.device, "all_gather"):
            shard = self._master  # 1D shard_numel, this rank's (in place when it aliases full)
            if shard.dtype != self.param_dtype:
                lo, hi = self.range
                shard = self.full[lo:hi]
                shard.copy_(self._master)
            # Inside the shard group only: replicas hold the same shards (hybrid sharding).
            return C.all_gather(
                self.full,
                shard,
                group=self.mesh.shard_group,
                ledger=self.ledger,
                async_op=async_op,
                unit=self.name,
            )

    def refresh_full(self, *, async_op: bool = True) -> C.Handle | None:
        """Bring a replicated ``full`` up to date with ``master`` after the master changed (an
        optimizer step, a load): a copy when this rank holds all of it, else an all-gather of
        every rank's shard. Partitioned parameters are gathered afresh at their next use."""
        self.masters_ahead = False
        if self.partition.parameters or self.master is None:
            return None
        if not self.partition.optimizer_states:
            if not self.master_aliases_full:
                self.full.copy_(self.master)
            return None
        return self._gather_from_master(async_op=async_op)

    def regather(self) -> None:
        """Refill a gathered ``full`` from the (changed) masters: partitioned parameters held
        gathered across an optimizer step (inside ``summon_full_params``)."""
        if self.partition.parameters and self.state is ShardState.UNSHARDED:
            self._gather_from_master(async_op=False)

    def write_back(self) -> None:
        """Copy elements of a gathered ``full`` that differ from the (cast) master into the
        master: values written while it was held gathered (``summon_full_params``)."""
        if self._master is None or self.master_aliases_full:
            return
        if self.master_swap is not None:
            self.master_swap.fetch(self)
        master = self._master
        lo, hi = self.range
        seen = self.full[lo:hi]  # 1D range numel, param_dtype
        changed = seen != master.to(seen.dtype)
        if bool(changed.any()):
            master[changed] = seen[changed].to(master.dtype)
            if self.master_swap is not None:
                self.master_swap.mark_dirty(self)  # written back at params_changed

    def _param_versions(self) -> list[int] | None:
        if self.master_aliases_full or self.partition.parameters or self._master is None:
            return None  # the parameter is the master, read-only at rest, or all there is
        return [s.param._version for s in self.slots]

    def adopt_writes(self, *, keep: bool = True) -> None:
        """Copy into the master the elements written to the parameters (``nn.init``, ``p.mul_``
        under ``no_grad``) since ``full`` last equaled the cast master, so that the next step
        starts from them as it would unsharded: replicated parameters computing in a narrower
        dtype than their master (in FP32 the parameter is the master's memory), and
        partitioned ones held gathered (the root between a forward and its backward; at rest
        they are read-only). Not unless ``keep`` (inside ``summon_full_params(writeback=False)``,
        which undoes them: a forward there left them in the masters). Writes are found by the
        parameters' version counters: one through ``p.data`` is not seen."""
        self.check_views()
        self.check_rest_writes()
        if not keep:
            return
        if self.partition.parameters:
            self.adopt_gathered_writes()
            return
        if self._versions is None or self.masters_ahead:
            return
        versions = self._param_versions()
        if versions != self._versions:
            self.write_back()
            self._versions = versions

    def adopt_gathered_writes(self) -> None:
        """Partitioned parameters held gathered: copy into the master the elements written to
        them since the gather (the root between a forward and its backward; a unit's own
        forward writing its weights under ``no_grad``, or replacing their data: ``p.data =
        t``), which a reshard would drop with ``full`` (a NaN-free ``fill_`` at rest is
        ``check_rest_writes``' error instead)."""
        held = self.state is ShardState.UNSHARDED and self._gather is None
        if not held or self._gathered_versions is None or self.masters_ahead:
            return
        with grad_off():
            self.check_views()  # ``p.data = t`` in its forward (MoCo's momentum encoder)
        versions = [s.param._version for s in self.slots]
        if versions != self._gathered_versions:
            with grad_off():
                self.write_back()
            self._gathered_versions = versions

    def written_since_gather(self) -> list[str]:
        """The names of the parameters held gathered (partitioned) that were written in place
        since the gather or the last ``adopt_gathered_writes``, by their version counters."""
        held = self.state is ShardState.UNSHARDED and self._gather is None
        if not held or self._gathered_versions is None or self.masters_ahead:
            return []
        return [
            s.names[0]
            for s, version in zip(self.slots, self._gathered_versions)
            if s.param._version != version
        ]

    # ----------------------------------------------------------------- per-parameter access
    def master_piece(self, index: int) -> torch.Tensor:
        """1D view of ``master`` for slot ``index``: the elements of that parameter this rank
        holds (possibly empty)."""
        assert self.master is not None
        return self.master[self._pieces[index]]

    def piece_range(self, index: int) -> tuple[int, int]:
        """``[start, end)`` inside slot ``index``'s flattened parameter of ``master_piece``."""
        s, piece = self.slots[index], self._pieces[index]
        start = self.range[0] + piece.start - s.offset
        return start, start + (piece.stop - piece.start)

    def pieces(self) -> list[tuple[Slot, slice]]:
        """For each slot, the slice of ``master`` that this rank owns (possibly empty)."""
        return list(zip(self.slots, self._pieces))
