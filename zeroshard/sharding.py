"""``shard()``: a model cut into units, their parameters moved into flat storage, the engine
installed.

The steps, in order: check the model is the same on every rank, cut it into units
(``zeroshard.wrap``), give each unit its ``FlatParam`` storage (materialized from the meta device
one unit at a time when needed; stages 0-2 pack consecutive units into buckets of up to
``ShardConfig.bucket_bytes``), a ``GradBucket`` per trainable one, then the ``Engine`` with its
hooks. Every rank must call it with the same model.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard import collectives as C
from zeroshard import (
    generation,
    model_checks,
    module_buffers,
    save_pretrained,
    tensor_parallel,
    zero_grad,
)
from zeroshard.engine import _ATTR, SHARDED_PARAM, Engine, ShardConfig
from zeroshard.loss_scaling import GradScaling
from zeroshard.mesh import Mesh, settle_collective_threads_at_exit
from zeroshard.model_states.flat_param import FlatParam, master_dtype_of
from zeroshard.model_states.grads import GradBucket
from zeroshard.model_states.init import Materializer, check_same_model
from zeroshard.model_states.param_swap import ParamSwapper
from zeroshard.model_states.partition import layout, padded_numel
from zeroshard.offload.folder import padded_bytes
from zeroshard.offload.placement import Offload
from zeroshard.precision import (
    MixedPrecision,
    UnitPrecisionError,
    hold_tf32,
    outputs_to_parents,
    own_dtype,
    policy_of,
    tf32_policy,
    unit_overrides,
    unit_policy,
    warn_reduce,
)
from zeroshard.residual_states.activations import train_without_caches
from zeroshard.residual_states.buffers import BufferPool, TensorPool
from zeroshard.residual_states.partitioned import CheckpointKeeper
from zeroshard.stages import Partition, partition
from zeroshard.state_dict_hooks import install_state_dict_hooks
from zeroshard.unit import Unit
from zeroshard.wrap import UnitSpec, WrapPolicy, as_policy, units, with_classes, without_a_unit

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)


_DATA_PARALLEL = (nn.parallel.DistributedDataParallel, nn.DataParallel)


_FAILED = "_zeroshard_failed_shard"
"""Set on every module of a model whose ``shard()`` failed once it had begun changing it: why."""


def _check_init_fn(param_init_fn: Any) -> None:
    """A TypeError before anything is materialized (the model was left partly sharded, and
    refused again, by a ``param_init_fn`` that is not a function of one module)."""
    if param_init_fn is None:
        return
    said = f"param_init_fn is called with each module to initialize; got {param_init_fn!r}"
    if not callable(param_init_fn):
        raise TypeError(f"{said}: pass a function, e.g. lambda m: m.reset_parameters()")
    try:
        inspect.signature(param_init_fn).bind(nn.Module())
    except TypeError:
        raise TypeError(f"{said}, which does not take one module: write lambda m: ...") from None
    except ValueError:  # a builtin without a signature: called as it is
        pass


def _out_of_inference_mode(model: nn.Module) -> None:
    """Parameters and buffers made under ``torch.inference_mode()`` (a model built or loaded
    there) become plain tensors of the same values: inference tensors have no version counter,
    so they could be neither flattened nor trained (FSDP2 shards them too). New parameter objects
    (nothing could have trained the old ones); one tied to another stays so."""
    new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (old, its replacement)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or not t.is_inference():
                    continue
                if id(t) not in new:
                    plain = t.clone()
                    if isinstance(t, nn.Parameter):
                        plain = nn.Parameter(plain, requires_grad=t.requires_grad)
                    new[id(t)] = (t, plain)
                table[name] = new[id(t)][1]


# (What it makes under inference mode, buffers and masters, could never train: inference tensors
# have no version counter and cannot be saved for backward.)
@torch.inference_mode(False)
def shard(
    model: nn.Module,
    *,
    stage: int = 3,
    wrap: WrapPolicy | None = None,
    mixed_precision: MixedPrecision | str | None = None,
    unit_precision: Mapping[type | str, MixedPrecision | str] | None = None,
    config: ShardConfig | None = None,
    mesh: Mesh | DeviceMesh | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    offload: Offload | None = None,
) -> nn.Module:
    """Shard ``model`` in place over the data-parallel ranks and return it.

    ``stage`` 0-3 picks which model states are partitioned (``zeroshard.stages``); ``wrap``
    (``zeroshard.wrap.by_class(Block)`` ...; a module class, a class name or a list of them
    reads as ``by_class``) cuts the model into units, the root always being one.
    ``mixed_precision`` is a ``MixedPrecision`` policy or a name ("fp32", "tf32", "bf16", "fp16",
    "auto": ``zeroshard.precision.resolve``); master weights stay FP32 under every policy.
    ``unit_precision`` ``{module class or name: policy}`` gives those modules a policy of their
    own (FSDP2's per-module ``mp_policy``: ``{nn.LayerNorm: "fp32"}`` under "bf16"); each
    becomes a unit, whose inputs are cast to its ``param_dtype``.
    Parameters keep their names and objects; their data move into per-unit flat buffers on
    ``mesh.device``. Every rank must call it with the same model structure (checked).

    A model built under ``torch.device("meta")`` is materialized one unit at a time: each module
    holding the unit's parameters gets ``param_init_fn(module)`` (default: its own
    ``reset_parameters()``), the unit keeps this rank's shard and frees the rest, so the peak is
    the shards plus one unit.

    Process-wide state, each said once here: without ``mesh`` and with no process group yet,
    ``shard`` starts the default one (``Mesh.from_env``: a one-rank group outside torchrun) and
    logs it at INFO on the "zeroshard" logger; pass ``mesh=Mesh.from_env(...)`` or call
    ``torch.distributed.init_process_group`` first to decide it yourself. A "tf32" policy turns
    TF32 on (``zeroshard.precision.hold_tf32``) until the last model that asked for it is freed.

    Hybrid sharding (HSDP): ``mesh`` a 2-D ``DeviceMesh`` with dims ("replicate", "shard"), or
    ``config=ShardConfig(shard_group_size=k)``: stages 1-3 partition inside groups of k
    consecutive ranks and replicate across groups (``zeroshard.mesh``). Stage 0 partitions
    nothing: it stays plain data parallelism over every rank, with a warning.

    ``offload=zeroshard.Offload(optimizer="nvme", folder=...)`` places model states on a slower
    memory tier (ZeRO-Offload / ZeRO-Infinity, ``zeroshard.offload.placement``); a placement the
    stage or device cannot have is a ValueError here. The optimizer built on the model applies
    the optimizer and gradient placements (their swap files are checked and created then);
    ``parameters="nvme"`` (stage 3) is applied here: each unit's FP32 master shard is written to
    ``<folder>/rank<r>-params`` as the unit is made and read back ahead of its gathers
    (``zeroshard.model_states.param_swap``).
    """
    part: Partition = partition(stage)
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard() takes an nn.Module, got {type(model).__name__}")
    if config is not None and not isinstance(config, ShardConfig):
        raise TypeError(
            f"config must be a zeroshard ShardConfig, got {type(config).__name__} "
            "(ShardConfig(**options) builds one)"
        )
    wrap = as_policy(wrap)
    if offload is not None and not isinstance(offload, Offload):
        raise TypeError(f"offload must be a zeroshard.Offload, got {type(offload).__name__}")
    _check_init_fn(param_init_fn)
    if getattr(model, _ATTR, None) is not None:
        raise ValueError(
            f"{type(model).__name__} is already sharded; shard a model once (build a new one "
            "to change the stage or wrap policy)"
        )
    failed = next((why for m in model.modules() if (why := getattr(m, _FAILED, None))), None)
    if failed is not None:
        raise ValueError(
            f"{type(model).__name__} was left partly sharded by a shard() that failed ({failed}):"
            " its parameters were already being materialized and moved into flat shards, and "
            "another shard() would take those leftovers (NaN placeholders, values of the "
            "failed init) for its weights. Build the model again (under torch.device('meta') "
            "too) and shard it once"
        )
    if any(hasattr(p, SHARDED_PARAM) for p in model.parameters()):  # a part, or a whole, sharded
        raise ValueError(
            f"{type(model).__name__} cannot be sharded: its parameters are part of a sharded "
            "model already. Shard the whole model once, with a wrap policy for its blocks "
            "(zeroshard.wrap.by_class(Block)), not submodules one by one as with FSDP2; two "
            "models that share a module (an embedding) are sharded together: put both in one "
            "nn.ModuleDict, shard it with each model a unit (wrap=zeroshard.wrap.by_class("
            "Encoder, Decoder)), and call its entries (the dict's own forward never runs: "
            "what only its root holds is not gathered at stage 3)"
        )
    wrapper = next((m for m in model.modules() if isinstance(m, _DATA_PARALLEL)), None)
    if wrapper is not None:
        raise ValueError(
            f"the model holds a {type(wrapper).__name__}, whose own hooks all-reduce gradients "
            "beside zeroshard's: shard the plain model (its .module) instead"
        )
    # (before the memory check, whose storage pointers a DTensor refuses)
    if any(type(p.data).__name__ == "DTensor" for p in model.parameters()):
        raise ValueError(
            "the model holds DTensor parameters (torch's parallelize_module or fully_shard "
            "ran on it): zeroshard shards plain parameters; split a model tensor-parallel with "
            "zeroshard.tensor_parallel (zeroshard train --tp N) instead"
        )
    _out_of_inference_mode(model)
    model_checks.strided_parameters(model)  # (before the memory check: a sparse one has none)
    model_checks.no_shared_memory(model)
    complex_ = next((n for n, p in model.named_parameters() if p.is_complex()), None)
    if complex_ is not None:
        raise ValueError(
            f"parameter {complex_} is complex: zeroshard keeps real FP32 masters and unscales "
            "real gradients; register it as real pairs (torch.view_as_real) and take "
            "torch.view_as_complex in forward"
        )
    model_checks.trainable_embeddings(model)
    devices = {p.device for p in model.parameters()} - {torch.device("meta")}
    if len(devices) > 1:
        raise ValueError(
            f"parameters are on different devices {sorted(map(str, devices))}; move the model "
            "to one device (or leave it on CPU: shard moves it to the rank's device)"
        )
    if mesh is None:
        started = not dist.is_initialized()
        mesh = Mesh.current()
        if started:
            log.info(
                "shard() started the default process group (%s, %d rank(s), %s) because none "
                "existed; pass mesh= or init_process_group() first to choose it",
                mesh.backend,
                mesh.world_size,
                mesh.device,
            )
    config = config or ShardConfig()
    mesh = _as_mesh(mesh)
    if mesh.tp_size == 1 and tensor_parallel.is_tensor_parallel(model):
        # Its ranks hold different pieces under the same names: sharding over them would mix
        # (and broadcast over) pieces of different tensors. (Before the hybrid mesh's groups:
        # every rank refuses, none waits in their making.)
        raise ValueError(
            f"{type(model).__name__} is split tensor-parallel, and the mesh has no tensor-parallel "
            "dim: pass mesh=dp_mesh, the data-parallel mesh from "
            "zeroshard.tensor_parallel.mesh_2d(tp)"
        )
    if offload is not None:
        offload.check(part, mesh.device)
        offload.log_host_tiers(part, mesh.device, log)
    mixed_precision = policy_of(mixed_precision, mesh.device)
    if mixed_precision.param_dtype is None:  # (the declared pair was checked as it was made)
        warn_reduce(*mixed_precision.resolved(own_dtype(model)), stacklevel=3)
    overrides = unit_overrides(unit_precision, mesh.device, mixed_precision, model)
    wrap = with_classes(wrap, tuple(overrides), "unit_precision")
    own_policy = lambda m: unit_policy(m, mixed_precision, overrides) is not mixed_precision
    specs = units(model, wrap, keep=own_policy)
    if overrides and (unplaced := without_a_unit(model, specs, own_policy)):
        raise UnitPrecisionError(unplaced)
    policies = [unit_policy(s.module, mixed_precision, overrides) for s in specs]
    policies = outputs_to_parents(
        [s.name for s in specs], [s.module for s in specs], policies, mixed_precision,
        unit_precision, overrides, mesh.device,
    )  # fmt: skip
    tf32 = tf32_policy([(s.name, [p for _, p, _ in s.params]) for s in specs], policies)
    placed = "none"
    if offload is not None:  # the tiers, not the folder (each node may have its own)
        placed = ", ".join(
            f"{f}={getattr(offload, f)}"
            for f in ("optimizer", "gradients", "parameters", "activations", "param_prefetch")
        )
    settings = {
        "stage": str(stage),
        "wrap policy": f"{len(specs)} units: " + ", ".join(s.name or "(root)" for s in specs),
        "offload": placed,
    }
    for name, value in (("mixed_precision", mixed_precision), ("ShardConfig", config)):
        for f in dataclasses.fields(value):  # one entry each: the error names the field
            settings[f"{name}.{f.name}"] = repr(getattr(value, f.name))
    settings["unit_precision"] = repr(sorted((str(k), repr(v)) for k, v in overrides.items()))
    # (a 2-D DeviceMesh given on some ranks only: hybrid there, plain on the others)
    settings["mesh's shard group size"] = repr(mesh.hybrid.shard_size if mesh.hybrid else None)
    check_same_model(model, mesh, settings)
    # After the check: making the shard groups is a collective, in which a rank given another
    # shard_group_size (or none) waited past the job's timeout, named by the others as hung.
    mesh = _hybrid_mesh(mesh, config.shard_group_size, part)
    _warn_unused_settings(config, stage, part)
    ledger = C.Ledger()
    materialize = Materializer(model, mesh.device, param_init_fn)
    param_swap = None
    if offload is not None and offload.parameters == "nvme":
        # masters leave memory as each unit is made: the peak is a few units, not the model
        need = _master_bytes(specs, mesh.shard_size)  # checked before any master is written
        param_swap = ParamSwapper(offload, mesh, config.num_prefetch, need)

    # Stage 3: every unit's gathered storage borrows from fixed buffers, made once (ZeRO-R's CB);
    # as many per size as units are gathered at once (the one computing and the prefetched).
    buffers = BufferPool(keep=1 + config.num_prefetch if config.constant_buffers else 0)
    # Stages 2-3 on the CPU: collected full gradients reuse memory too, as many per size as
    # reductions are in flight at a collection; at stage 3 first the gather buffer the unit's
    # parameters just gave back (the same bytes in FP32), as a caching allocator would.
    pooled = config.constant_buffers and mesh.device.type == "cpu" and part.gradients
    spare = buffers if part.parameters and config.constant_buffers else None
    grad_buffers = TensorPool(config.max_inflight_reductions, spare) if pooled else None

    policy_of_flat: dict[FlatParam, MixedPrecision] = {}

    changing: list[bool] = []  # once make() ran: the model's parameters are being replaced

    def make(params: list[tuple], dtype: torch.dtype, policy: MixedPrecision) -> FlatParam:
        changing.append(True)
        materialize([p for p, _ in params])
        flat = FlatParam(
            params,
            mesh=mesh,
            partition=part,
            param_dtype=_dtypes(policy, dtype)[0],
            ledger=ledger,
            sync_module_states=config.sync_module_states,
            buffers=buffers,
        )
        if param_swap is not None:
            param_swap.adopt(flat)
        policy_of_flat[flat] = policy
        return flat

    bucket_bytes = 0 if part.parameters else config.bucket_bytes
    meta = [p for p in model.parameters() if p.is_meta]
    try:
        flats = _flat_params(specs, bucket_bytes, make, policies, materialize)
    except BaseException as exc:
        # Changed already (a parameter materialized, or moved into a FlatParam): marked, so
        # that a second shard() is refused rather than take the leftovers for weights.
        if changing or any(not p.is_meta for p in meta):
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            for m in model.modules():  # (a submodule sharded on its own is refused too)
                setattr(m, _FAILED, why)
        raise
    if param_swap is not None:
        param_swap.finish_adopting()  # all dropped from memory
    scaling = GradScaling()
    buckets: dict[FlatParam, GradBucket] = {}
    for unit_flats in flats:
        for f in unit_flats:
            if f.requires_grad and f not in buckets:
                buckets[f] = GradBucket(
                    f,
                    partition=part,
                    reduce_dtype=_dtypes(policy_of_flat[f], f.orig_dtype)[1],
                    scaling=scaling,
                    num_units=sum(f in fs for fs in flats),
                    pool=grad_buffers,
                )
    unit_list = [
        Unit(
            s.name,
            s.module,
            f,
            [buckets[x] for x in f if x in buckets],
            is_root=i == 0,
            owners=list(
                dict.fromkeys(m for regs, _, _ in s.params for m, _ in regs if m is not s.module)
            ),
            params=[p for _, p, _ in s.params],
        )
        for i, (s, f) in enumerate(zip(specs, flats))
    ]
    for unit, policy in zip(unit_list, policies):
        unit.precision = policy
    materialize.leftovers(model)
    own = {id(m): pol for spec, pol in zip(specs, policies) for m in spec.module.modules()}
    module_buffers.move(model, mesh, own, mixed_precision, sync=config.sync_module_states)
    engine = Engine(
        model,
        unit_list,
        mesh=mesh,
        stage=stage,
        config=config,
        mixed_precision=mixed_precision,
        ledger=ledger,
        scaling=scaling,
        checkpoint_keeper=_checkpoint_keeper(config, mesh, offload, ledger, model),
    )
    if engine.checkpointing is not None:
        engine._handles += train_without_caches(model)
    engine.offload = offload  # read by the optimizer built on this model (its state tier)
    engine.param_swap = param_swap
    if offload is not None and offload.any:
        log.info("offload placements at stage %d: %s", stage, offload)
    install_state_dict_hooks(model, engine)
    save_pretrained.install(model)
    zero_grad.install(model, engine)
    for module in model.modules():
        module.__deepcopy__ = _refuse_deepcopy
        module.__reduce_ex__ = functools.partial(_refuse_pickle, module)
    setattr(model, _ATTR, engine)
    for p in model.parameters():
        setattr(p, SHARDED_PARAM, True)
    if engine.partition.parameters:  # every rank runs every forward of generate()
        generation.mark(model)
    # Last, once nothing can fail: TF32 stays on while this model lives (process-global torch
    # state, restored by the last release; see hold_tf32).
    release_tf32 = hold_tf32(tf32 or mixed_precision, mesh.device)
    if release_tf32 is not None:
        weakref.finalize(model, release_tf32)
    settle_collective_threads_at_exit()
    return model


def _refuse_deepcopy(memo: dict) -> None:
    """``copy.deepcopy`` of a sharded model or one of its modules (an EMA or teacher copy)
    would copy placeholders at stage 3 and hooks that drive the original's engine: a copy that
    silently computes NaN or disturbs the original. Refused, naming the ways that work."""
    raise TypeError(
        "copy.deepcopy of a model sharded by zeroshard (or of one of its modules): its "
        "parameters live in the engine's shards and its hooks drive that engine; deep-copy the "
        "model before zeroshard.shard(), or build a new one and load "
        "zeroshard.full_state_dict(model, rank0_only=False) into it"
    )


def _refuse_pickle(module: nn.Module, protocol: int) -> Any:
    """``torch.save(model)`` or ``pickle.dumps(model)`` of a sharded model: it failed deep in
    pickle on one of the engine's hooks. Refused, naming the ways to save that work;
    ``copy.copy``, which reduces the same way, still makes its shallow copy."""
    if sys._getframe(1).f_globals.get("__name__") == "copy":
        return object.__reduce_ex__(module, protocol)
    raise TypeError(
        "pickling a model sharded by zeroshard (torch.save(model), pickle.dumps): its "
        "parameters live in the engine's shards and its hooks drive that engine; save its "
        "weights instead: torch.save(zeroshard.full_state_dict(model), path), "
        "model.save_pretrained(...) or zeroshard.checkpoint.save(path, model, optimizer)"
    )


def _checkpoint_keeper(
    config: ShardConfig, mesh: Mesh, offload: Offload | None, ledger: C.Ledger, model: nn.Module
) -> CheckpointKeeper | None:
    """Where activation checkpoints are kept (Pa, Pa+cpu); None without checkpointing."""
    if config.partition_activations and tensor_parallel.is_sequence_parallel(model):
        raise ValueError(
            "partition_activations with a sequence-parallel model: its checkpoints are this "
            "rank's part of each sequence already (1/tp), not a tensor Pa can split and rebuild; "
            "drop partition_activations"
        )
    where = offload.activations if offload is not None else None
    if not config.checkpoint_every:
        if where:
            raise ValueError(
                f"activations={where!r} offloads activation checkpoints, and there are none: "
                "set ShardConfig(checkpoint_every=k) too"
            )
        return None
    return CheckpointKeeper(
        device=mesh.device,
        ledger=ledger,
        tp_group=mesh.tp_group,
        partition=config.partition_activations,
        offload=where,
        store=offload.activation_store_config(mesh.global_rank) if offload is not None else None,
    )


def _as_mesh(mesh: Mesh | DeviceMesh | dist.ProcessGroup) -> Mesh:
    """``mesh`` as a ``Mesh`` (a torch ``DeviceMesh`` or process group converted); a ``Mesh``
    made by hand is checked against its group."""
    if isinstance(mesh, Mesh):
        mesh.check_group()
        return mesh
    if isinstance(mesh, dist.ProcessGroup):
        return Mesh.from_group(mesh)
    if not hasattr(mesh, "mesh_dim_names"):
        raise TypeError(
            "mesh must be a zeroshard Mesh, a torch DeviceMesh or a process group "
            f"(dist.new_group(ranks)), got {type(mesh).__name__}"
        )
    return Mesh.from_device_mesh(mesh)


def _hybrid_mesh(mesh: Mesh, shard_group_size: int, part: Partition) -> Mesh:
    """``mesh`` with shard groups when asked (a collective: it makes groups)."""
    if shard_group_size:
        mesh = mesh.hybrid_sharded(shard_group_size)
    if mesh.hybrid is not None and not part.optimizer_states:
        warnings.warn(
            f"hybrid sharding (shard groups of {mesh.shard_size} ranks) is ignored at stage 0, "
            "which partitions nothing: gradients are all-reduced over every rank (plain data "
            "parallel); use stage 1-3 to shard inside groups",
            stacklevel=3,
        )
        mesh = mesh.without_hybrid()
    return mesh


def _warn_unused_settings(config: ShardConfig, stage: int, part: Partition) -> None:
    """A warning for each setting of ``config`` that this stage never reads (asked for, it
    did nothing, silently), as for hybrid sharding at stage 0."""
    unused = []
    if config.num_prefetch != ShardConfig.num_prefetch and not part.parameters:
        unused.append(f"num_prefetch={config.num_prefetch} (stage 3 gathers ahead)")
    if config.reduce_every_micro_step and not part.gradients:
        unused.append("reduce_every_micro_step=True (stages 2-3 reduce into gradient shards)")
    if unused:
        warnings.warn(f"ShardConfig {'; '.join(unused)}: ignored at stage {stage}", stacklevel=3)


def _dtypes(policy: MixedPrecision, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(param_dtype, reduce_dtype) of parameters stored as ``dtype`` (integers stay as they are)."""
    return policy.resolved(dtype) if dtype.is_floating_point else (dtype, dtype)


def _groups(spec: UnitSpec) -> dict[tuple[bool, torch.dtype], list[tuple]]:
    """``spec``'s parameters by (requires_grad, dtype), each group one FlatParam of the unit's
    (``spec.params`` entries; zero-element ones left out: they stay plain parameters)."""
    groups: dict[tuple[bool, torch.dtype], list[tuple]] = {}
    for entry in spec.params:
        if entry[1].numel():
            groups.setdefault((entry[1].requires_grad, entry[1].dtype), []).append(entry)
    return groups


def _master_bytes(specs: list[UnitSpec], shard_size: int) -> int:
    """Bytes of this rank's swap files of master shards once stage 3 has flattened ``specs``
    (``_flat_params`` with no buckets: one FlatParam per unit and ``_groups`` entry, its range of
    ``padded_numel / shard_size`` elements in the master dtype, each file padded to whole
    blocks). Known from shapes alone (meta too): checked before any master is written."""
    total = 0
    for spec in specs:
        for (_, dtype), members in _groups(spec).items():
            numel = layout([p.numel() for _, p, _ in members], dtype.itemsize)[1]
            per_rank = padded_numel(numel, shard_size) // shard_size
            total += padded_bytes(per_rank * master_dtype_of(dtype).itemsize)
    return total


def _flat_params(
    specs: list[UnitSpec],
    bucket_bytes: int,
    make,
    policies: list[MixedPrecision],
    materialize=lambda params: None,
) -> list[list[FlatParam]]:
    """The FlatParams each unit uses: one per (requires_grad, dtype) group of its parameters,
    made with the unit's mixed-precision policy (``policies``, one per spec). A model on meta
    is ``materialize``d a whole unit at a time, in unit order, whatever the buckets: the random
    numbers its init draws come in the same order at every stage and bucket size (several
    units per bucket took them in another order: other initial weights at stages 0-2).

    Partitioned parameters are gathered per unit, so each unit gets its own (``bucket_bytes`` 0).
    Replicated parameters are never gathered: units of one policy then share flat buffers of up
    to ``bucket_bytes``, filled in unit order, so that gradients are reduced in few, large
    collectives (DDP's buckets, ZeRO-R's constant-size buffers) and the buffer is reduced once
    all its units' backward is done.
    """
    per_unit: list[list[FlatParam]] = [[] for _ in specs]
    module_names = {id(m): n for n, m in specs[0].module.named_modules(remove_duplicate=False)}
    open_buckets: dict[tuple, tuple[list, list[int], MixedPrecision]] = {}
    unit_groups = [_groups(spec) for spec in specs]
    totals: dict[tuple, int] = {}  # bytes of each group over every unit
    for found, policy in zip(unit_groups, policies):
        for key, members in found.items():
            numel = sum(p.numel() for _, p, _ in members)
            k = (*key, id(policy))
            totals[k] = totals.get(k, 0) + numel * _dtypes(policy, key[1])[0].itemsize

    def close(key: tuple) -> None:
        params, owners, policy = open_buckets.pop(key)
        flat = make(params, key[1], policy)
        for i in owners:
            per_unit[i].append(flat)

    for i, (spec, found, policy) in enumerate(zip(specs, unit_groups, policies)):
        groups = {
            (*key, id(policy)): [
                (p, [name] + [f"{module_names[id(m)]}.{a}".lstrip(".") for m, a in regs[1:]])
                for regs, p, name in members
            ]
            for key, members in found.items()
        }
        for key, params in groups.items():  # full buckets made first (sizes known on meta)
            elem_bytes = _dtypes(policy, key[1])[0].itemsize
            numel = sum(p.numel() for p, _ in params)
            if key in open_buckets:
                held = sum(p.numel() for p, _ in open_buckets[key][0])
                if (held + numel) * elem_bytes > bucket_bytes:
                    close(key)
        materialize([p for params in groups.values() for p, _ in params])
        for key, params in groups.items():
            bucket = open_buckets.setdefault(key, ([], [], policy))
            bucket[0].extend(params)
            bucket[1].append(i)
        if not bucket_bytes:  # one FlatParam per unit and group: made now
            for key in list(open_buckets):
                close(key)
        elif not spec.name:
            # The root's own where a group fills more than a bucket: its head's gradient comes
            # first in backward and its embedding's last, so a bucket shared with the first
            # units was bound through the whole backward beside every other (at stage 2 all
            # of the unreduced gradient at once, 3 buckets of 3 alive).
            for key in [k for k in groups if totals[k] > bucket_bytes]:
                close(key)
    for key in list(open_buckets):
        close(key)
    return per_unit
