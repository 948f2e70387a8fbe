"""The stage-agnostic schedule: gather / free around each unit's forward and backward, gradient
reduction as soon as a unit's backward is done, and prefetch of the next unit.

``shard(model, stage=..., wrap=...)`` cuts the model into units (``zeroshard.wrap``), moves each
unit's parameters into ``FlatParam`` storage and installs hooks. What a stage does comes from
``zeroshard.stages`` (which model states it partitions); nothing here branches on the stage number.

Per training step, for a unit U:

    forward:   pre-forward   gather U (wait for the prefetch), prefetch the next unit
               post-forward  free U (if parameters are partitioned; the root may keep its own)
    backward:  pre-backward  gather U again, bind gradient views into a shared bucket, prefetch
               post-backward start the reduction of U's gradient (of its bucket once all the
                             bucket's units are done), free U
    end of backward          reduce units whose backward never fired, wait for all reductions

With replicated parameters (stages 0-2) consecutive units share gradient buckets of up to
``ShardConfig.bucket_bytes``; with partitioned parameters each unit is its own (see
``FlatParam.grads_as_views`` for how a gradient reaches its flat buffer).
"""

from __future__ import annotations

import contextlib
import enum
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from zeroshard import collectives as C
from zeroshard.mesh import Mesh
from zeroshard.model_states.flat_param import FlatParam, ShardState
from zeroshard.precision import MixedPrecision, apply_tf32, policy_of
from zeroshard.stages import Partition, partition
from zeroshard.wrap import UnitSpec, WrapPolicy, units

_ATTR = "_zeroshard_engine"


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """How the schedule trades memory for overlap."""

    num_prefetch: int = 1
    """Units gathered ahead of the one computing (forward and backward; partitioned parameters
    only). At most ``1 + num_prefetch`` non-root units are gathered at once."""
    reshard_root_after_forward: bool = False
    """Free the root unit's parameters after forward too (saves memory, costs one more
    all-gather of the root per step)."""
    reduce_every_micro_step: bool = False
    """With partitioned gradients: reduce-scatter on every micro-step of gradient accumulation
    and accumulate into the shard (saves the full gradient's memory, costs communication)."""
    bucket_bytes: int = 25 * 2**20
    """With replicated parameters (stages 0-2): consecutive units share one flat buffer of up to
    this many bytes, reduced in one collective once all its units' backward is done (0: one
    buffer per unit). Stage 3 always gathers and reduces per unit."""
    max_inflight_reductions: int = 2
    """Gradient reductions in flight before the oldest is waited for (bounds the full-gradient
    buffers alive at stage 2/3)."""
    sync_module_states: bool = True
    """Broadcast rank 0's parameters at shard time so every rank starts identical."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0, got {self.bucket_bytes}")
        if self.num_prefetch < 0:
            raise ValueError(f"num_prefetch must be >= 0, got {self.num_prefetch}")
        if self.max_inflight_reductions < 1:
            raise ValueError(
                f"max_inflight_reductions must be >= 1, got {self.max_inflight_reductions}"
            )


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class Unit:
    """One wrapped module and the flat storage of the parameters it owns."""

    def __init__(self, name: str, module: nn.Module, flat_params: list[FlatParam], is_root: bool):
        self.name, self.module, self.flat_params, self.is_root = name, module, flat_params, is_root
        self.trainable = [f for f in flat_params if f.requires_grad]
        self.pre_backward_done = False
        self.post_backward_done = False

    def unshard(self, *, async_op: bool = True) -> None:
        for f in self.flat_params:
            f.unshard(async_op=async_op)

    def wait_unshard(self) -> None:
        for f in self.flat_params:
            f.wait_unshard()

    def reshard(self) -> None:
        for f in self.flat_params:
            f.reshard()

    @property
    def is_sharded(self) -> bool:
        return any(f.state is ShardState.SHARDED for f in self.flat_params)


class _BackwardHook(torch.autograd.Function):
    """Identity whose backward calls ``hook``: on a unit's outputs it fires as the unit's backward
    begins (gather again); on its inputs, once the unit's backward is done (reduce, free)."""

    @staticmethod
    def forward(ctx, hook, *tensors):  # type: ignore[override]
        ctx.hook = hook
        return tensors

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.hook()
        return (None, *grads)


def _on_backward(hook, tree: Any) -> Any:
    """``tree`` with its tensors that require grad passed through one ``_BackwardHook(hook)``."""
    leaves, spec = tree_flatten(tree)
    idx = [i for i, x in enumerate(leaves) if torch.is_tensor(x) and x.requires_grad]
    if not idx:
        return tree
    outs = _BackwardHook.apply(hook, *(leaves[i] for i in idx))
    for i, out in zip(idx, outs):
        leaves[i] = out
    return tree_unflatten(leaves, spec)


class Engine:
    """Per-model state of zeroshard: the units, the stage's partition and the schedule."""

    def __init__(
        self,
        model: nn.Module,
        unit_list: list[Unit],
        *,
        mesh: Mesh,
        stage: int,
        config: ShardConfig,
        mixed_precision: MixedPrecision,
        ledger: C.Ledger,
    ) -> None:
        self.model, self.units, self.mesh = model, unit_list, mesh
        self.stage, self.partition = stage, partition(stage)
        self.config, self.mixed_precision, self.ledger = config, mixed_precision, ledger
        self.phase = Phase.IDLE
        self.sync_grads = True
        self.forward_order: list[Unit] = []
        self._order_frozen = False
        self._pending: deque[FlatParam] = deque()
        # Every FlatParam once, in unit order (units may share a bucket).
        self.flat_params = list(dict.fromkeys(f for u in unit_list for f in u.flat_params))
        self._units_left: dict[FlatParam, int] = {}  # per backward: units yet to finish, per buffer
        self._handles: list[Any] = []
        for unit in unit_list:
            self._install_hooks(unit)

    # ----------------------------------------------------------------- queries
    @property
    def root(self) -> Unit:
        return self.units[0]

    # ----------------------------------------------------------------- hooks
    def _install_hooks(self, unit: Unit) -> None:
        self._handles.append(
            unit.module.register_forward_pre_hook(
                lambda m, args, kwargs: self._pre_forward(unit, args, kwargs),
                with_kwargs=True,
                prepend=True,
            )
        )
        self._handles.append(
            unit.module.register_forward_hook(
                lambda m, args, output: self._post_forward(unit, output)
            )
        )

    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if unit.is_root and self.phase is not Phase.FORWARD:
            self._begin_forward()
        if not self._order_frozen:
            self.forward_order.append(unit)
        unit.unshard(async_op=False)
        unit.wait_unshard()
        if self.partition.parameters and self._order_frozen:
            self._prefetch(self.forward_order, unit)
        mp = self.mixed_precision
        if unit.is_root and mp.cast_root_inputs and mp.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), mp.param_dtype)
        if torch.is_grad_enabled():
            args, kwargs = _on_backward(lambda: self._post_backward(unit), (args, kwargs))
        return args, kwargs

    def _post_forward(self, unit: Unit, output: Any) -> Any:
        keep = unit.is_root and not self.config.reshard_root_after_forward
        if not torch.is_grad_enabled() or not keep:
            unit.reshard()
        if unit.is_root:
            self.phase = Phase.IDLE
            self._order_frozen = True
            if self.mixed_precision.output_dtype is not None:
                output = _cast_floats(output, self.mixed_precision.output_dtype)
        if torch.is_grad_enabled():
            output = _on_backward(lambda: self._pre_backward(unit), output)
        return output

    def _begin_forward(self) -> None:
        self.phase = Phase.FORWARD
        self._finish_reductions(keep=0)  # a backward not followed by a step left some in flight

    def _pre_backward(self, unit: Unit) -> None:
        if self.phase is not Phase.BACKWARD:
            self.phase = Phase.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if unit.pre_backward_done:
            return
        unit.pre_backward_done = True
        unit.unshard(async_op=False)
        unit.wait_unshard()
        for f in unit.trainable:
            f.bind_grads()
        if self.partition.parameters:
            backward_order = self.forward_order[::-1]
            self._prefetch(backward_order, None if unit.is_root else unit)

    def _post_backward(self, unit: Unit) -> None:
        if unit.post_backward_done:
            return
        unit.post_backward_done = True
        reduce_now = self.sync_grads or (
            self.partition.gradients and self.config.reduce_every_micro_step
        )
        for f in unit.trainable:
            self._units_left[f] = self._units_left.get(f, f.num_units) - 1
            if reduce_now and self._units_left[f] == 0:
                # Every rank reduces every buffer, used or not, so the collectives always match.
                f.bind_grads()
                f.reduce_grads()
                self._pending.append(f)
        self._finish_reductions(keep=self.config.max_inflight_reductions)
        unit.reshard()

    def _end_backward(self) -> None:
        """Autograd's final callback: reduce what no hook reduced, then wait for everything."""
        for unit in reversed(self.forward_order or self.units):
            self._post_backward(unit)
        for unit in self.units:
            self._post_backward(unit)
            unit.pre_backward_done = unit.post_backward_done = False
        self._finish_reductions(keep=0)
        self._units_left.clear()
        self.phase = Phase.IDLE

    def _finish_reductions(self, *, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.popleft().finish_reduce()

    def _prefetch(self, order: list[Unit], current: Unit | None) -> None:
        """Start gathering the next ``num_prefetch`` sharded units after ``current`` in
        ``order`` (from the start when ``current`` is None)."""
        start = order.index(current) + 1 if current is not None and current in order else 0
        budget = self.config.num_prefetch
        for nxt in order[start:]:
            if budget == 0:
                break
            if nxt.is_root or (nxt.pre_backward_done and self.phase is Phase.BACKWARD):
                continue
            if nxt.is_sharded:
                nxt.unshard(async_op=True)
            budget -= 1

    # ----------------------------------------------------------------- user controls
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate local gradients without communicating."""
        previous, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = previous

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Every parameter gathered (read-only use: tests, evaluation, export)."""
        sharded = [u for u in self.units if u.is_sharded]
        for u in sharded:
            u.unshard(async_op=False)
            u.wait_unshard()
        try:
            yield
        finally:
            for u in sharded:
                u.reshard()


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors in ``tree`` to ``dtype``; other leaves pass through."""
    leaves, spec = tree_flatten(tree)
    leaves = [
        x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() and x.dtype != dtype else x
        for x in leaves
    ]
    return tree_unflatten(leaves, spec)


def engine_of(model: nn.Module) -> Engine:
    """The engine of a model passed through ``shard``; a ValueError otherwise."""
    engine = getattr(model, _ATTR, None)
    if engine is None:
        raise ValueError(
            f"{type(model).__name__} is not sharded; call zeroshard.shard(model, ...) first"
        )
    return engine


def shard(
    model: nn.Module,
    *,
    stage: int = 3,
    wrap: WrapPolicy | None = None,
    mixed_precision: MixedPrecision | str | None = None,
    config: ShardConfig | None = None,
    mesh: Mesh | None = None,
) -> nn.Module:
    """Shard ``model`` in place over the data-parallel ranks and return it.

    ``stage`` 0-3 picks which model states are partitioned (``zeroshard.stages``); ``wrap``
    (``zeroshard.wrap.by_class(Block)`` ...) cuts the model into units, the root always being one.
    ``mixed_precision`` is a ``MixedPrecision`` policy or a name ("fp32", "tf32", "bf16", "fp16",
    "auto": ``zeroshard.precision.resolve``); master weights stay FP32 under every policy.
    Parameters keep their names and objects; their data move into per-unit flat buffers on
    ``mesh.device``. Every rank must call it with the same model structure.
    """
    part: Partition = partition(stage)
    if getattr(model, _ATTR, None) is not None:
        raise ValueError(
            f"{type(model).__name__} is already sharded; shard a model once (build a new one "
            "to change the stage or wrap policy)"
        )
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(
            f"parameters are on different devices {sorted(map(str, devices))}; move the model "
            "to one device (or leave it on CPU: shard moves it to the rank's device)"
        )
    mesh = mesh or Mesh.current()
    config = config or ShardConfig()
    mixed_precision = policy_of(mixed_precision, mesh.device)
    apply_tf32(mixed_precision, mesh.device)
    ledger = C.Ledger()
    specs = units(model, wrap)
    make = lambda params, dtype: FlatParam(  # noqa: E731
        params,
        mesh=mesh,
        partition=part,
        param_dtype=_dtypes(mixed_precision, dtype)[0],
        reduce_dtype=_dtypes(mixed_precision, dtype)[1],
        ledger=ledger,
        sync_module_states=config.sync_module_states,
    )
    bucket_bytes = 0 if part.parameters else config.bucket_bytes
    flats = _flat_params(specs, bucket_bytes, make, mixed_precision)
    unit_list = [
        Unit(s.name, s.module, f, is_root=i == 0) for i, (s, f) in enumerate(zip(specs, flats))
    ]
    _move_buffers(model, mesh, mixed_precision)
    engine = Engine(
        model,
        unit_list,
        mesh=mesh,
        stage=stage,
        config=config,
        mixed_precision=mixed_precision,
        ledger=ledger,
    )
    setattr(model, _ATTR, engine)
    return model


def _dtypes(policy: MixedPrecision, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(param_dtype, reduce_dtype) of parameters stored as ``dtype`` (integers stay as they are)."""
    return policy.resolved(dtype) if dtype.is_floating_point else (dtype, dtype)


def _flat_params(
    specs: list[UnitSpec], bucket_bytes: int, make, policy: MixedPrecision
) -> list[list[FlatParam]]:
    """The FlatParams each unit uses: one per (requires_grad, dtype) group of its parameters.

    Partitioned parameters are gathered per unit, so each unit gets its own (``bucket_bytes`` 0).
    Replicated parameters are never gathered: consecutive units then share one flat buffer of up
    to ``bucket_bytes``, so that gradients are reduced in few, large collectives (DDP's buckets,
    ZeRO-R's constant-size buffers) and the buffer is reduced once all its units' backward is done.
    """
    per_unit: list[list[FlatParam]] = [[] for _ in specs]
    open_buckets: dict[tuple[bool, torch.dtype], tuple[list, list[int]]] = {}

    def close(key: tuple[bool, torch.dtype]) -> None:
        params, owners = open_buckets.pop(key)
        flat = make(params, key[1])
        flat.num_units = len(owners)
        for i in owners:
            per_unit[i].append(flat)

    for i, spec in enumerate(specs):
        groups: dict[tuple[bool, torch.dtype], list[tuple[nn.Parameter, list[str]]]] = {}
        for regs, p, name in spec.params:
            if p.numel() == 0:
                continue  # nothing to shard; it stays a plain parameter
            names = [name] + [f"{type(m).__name__}.{a}" for m, a in regs[1:]]
            groups.setdefault((p.requires_grad, p.dtype), []).append((p, names))
        for key, params in groups.items():
            elem_bytes = _dtypes(policy, key[1])[0].itemsize
            numel = sum(p.numel() for p, _ in params)
            if key in open_buckets:
                held = sum(p.numel() for p, _ in open_buckets[key][0])
                if (held + numel) * elem_bytes > bucket_bytes:
                    close(key)
            bucket = open_buckets.setdefault(key, ([], []))
            bucket[0].extend(params)
            bucket[1].append(i)
    for key in list(open_buckets):
        close(key)
    return per_unit


def _move_buffers(model: nn.Module, mesh: Mesh, mp: MixedPrecision) -> None:
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            dtype = mp.buffer_dtype if buf.is_floating_point() and mp.buffer_dtype else buf.dtype
            new = buf.to(device=mesh.device, dtype=dtype)
            if mesh.world_size > 1:
                C.broadcast(new, src=0, group=mesh.group)
            module._buffers[name] = new
