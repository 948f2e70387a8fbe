"""Tensor (model) parallelism beside ZeRO: a 2-D mesh of data-parallel x tensor-parallel ranks.

The article's Nm. Inside a tensor-parallel group of ``tp`` ranks, each transformer block's
attention and MLP are split Megatron-style through ``torch.distributed.tensor.parallel``: the
first linear of each pair column-parallel (its output features split, ``ColwiseParallel``), the
second row-parallel (its input features split, one all-reduce of the output,
``RowwiseParallel``). The fused ``qkv`` projection is split by heads (``FusedColwiseParallel``):
rank r holds the q, k and v rows of heads ``[r * H/tp, (r+1) * H/tp)``. Everything else
(embeddings, layer norms, the head) is replicated in the group and gets the same gradient on
each of its ranks. Other models are split by the plan they declare (``plan_for``): a Hugging
Face config's ``base_model_tp_plan``, or a ``tp_plan`` attribute in the same format.

ZeRO shards over the data-parallel dimension only: ``zeroshard.shard(model, mesh=dp_mesh)`` with
the ``Mesh`` that ``mesh_2d`` returns. To let the engine flatten, gather and reduce them like any
other parameter, the split parameters are *local*: plain ``nn.Parameter`` tensors holding this
rank's piece (so ``model.state_dict()`` gives local pieces; ``gather_tensor_parallel`` rebuilds
the whole tensors). A forward pre-hook wraps them as ``DTensor`` views for the length of their
module's forward, so that DTensor's sharding rules run the math, including the all-reduce of
the input gradient in backward that a column-parallel layer needs.

Layout, for ``world = dp * tp`` ranks (``init_device_mesh(..., (dp, tp), ("dp", "tp"))``): ranks
``[d * tp, (d+1) * tp)`` form tensor-parallel group d; ranks with the same tp coordinate form a
data-parallel group (the ZeRO shard group). Every rank of a tensor-parallel group must see the
same batch: data is split by the data-parallel rank (``Mesh.rank``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard import tensor_parallel_checks
from zeroshard.flat_range import FlatRange, Split
from zeroshard.mesh import Mesh, cached_mesh
from zeroshard.watchdog import inherit_timeout

DIMS = ("dp", "tp")
"""Dim names of the 2-D ``DeviceMesh``: data-parallel x tensor-parallel."""

_MESHES: dict[tuple, tuple[object, object]] = {}
"""2-D meshes made by ``mesh_2d``, per (world size, tp, device type) in this process group:
models parallelized alike share process groups instead of creating new ones each time
(``zeroshard.mesh.cached_mesh``)."""

_SEQUENCE = "_zeroshard_sequence_parallel"
"""Attribute of a model whose sequences ``parallelize`` split."""

_LOCAL = "_zeroshard_tensor_parallel"
"""Attribute of a module whose parameters were localized: ``{name: _Split}``."""


@dataclass(frozen=True)
class _Split:
    """How one parameter is split across the tensor-parallel group."""

    dim: int | None
    """The dimension split in ``tp`` equal pieces (rank r holds piece r); None: replicated."""
    groups: int = 1
    """Fused projections (q, k, v): the dimension is ``groups`` blocks, each split separately,
    and rank r holds piece r of every block, concatenated."""
    placements: tuple = ()
    """The DTensor placements of the local piece (``Shard(dim)`` or ``Replicate()``)."""


def mesh_2d(tp: int, *, mesh: Mesh | None = None):
    """The (dp, tp) ``DeviceMesh`` of every rank, and the data-parallel ``Mesh`` ZeRO shards
    over (this rank's "dp" dim, with ``tp_group`` set). A collective: every rank calls it.

    A ValueError naming the fix when ``tp`` does not divide the world size."""
    from torch.distributed.device_mesh import init_device_mesh

    base = mesh or Mesh.current()
    world = dist.get_world_size()
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int (ranks per tensor-parallel group), got {tp!r}")
    if world % tp:
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise ValueError(
            f"tp={tp} does not divide the world size {world}; use one of {divisors} "
            "(or launch dp * tp ranks: --nproc)"
        )

    def make():
        made = init_device_mesh(base.device.type, (world // tp, tp), mesh_dim_names=DIMS)
        inherit_timeout(made.get_group("dp"), made.get_group("tp"))
        return made

    dm = cached_mesh(_MESHES, (world, tp, base.device.type), make)
    dp = Mesh.from_device_mesh(dm["dp"], device=base.device)
    dp = replace(dp, local_rank=base.local_rank, local_world_size=base.local_world_size)
    return dm, replace(dp, tp_group=dm.get_group("tp"))


def _fused_colwise():
    from torch.distributed.tensor.parallel import ColwiseParallel

    class FusedColwiseParallel(ColwiseParallel):
        """``ColwiseParallel`` for a projection whose output is ``groups`` fused blocks (q, k, v
        of ``nn.Linear(C, 3C)``): each block is split by rows, so rank r holds rows r of every
        block and the local output still splits into q, k, v of its own heads."""

        def __init__(self, groups: int, **kwargs) -> None:
            super().__init__(**kwargs)
            self.groups = groups

        def _partition_linear_fn(self, name, module, device_mesh):
            tp = device_mesh.size()
            with torch.no_grad():
                for param in module.parameters():
                    param.data = _interleave(param.data, self.groups, tp)
            super()._partition_linear_fn(name, module, device_mesh)

    return FusedColwiseParallel


def _interleave(t: torch.Tensor, groups: int, tp: int) -> torch.Tensor:
    """Rows of ``groups`` blocks, reordered so that an even split in ``tp`` gives rank r the
    r-th piece of every block: [g, tp, n/(g tp), ...] -> [tp, g, n/(g tp), ...]."""
    n = t.shape[0]
    return t.reshape(groups, tp, n // (groups * tp), *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def gpt_plan(model: nn.Module, tp: int, *, sequence_parallel: bool = False) -> dict:
    """The tensor-parallel plan of ``zeroshard.models.gpt.GPT`` (or any model with its module
    names: blocks of ``ln_1``, ``attn.qkv``, ``attn.proj``, ``ln_2``, ``mlp.fc``, ``mlp.proj``), for
    ``parallelize``. A ValueError naming the fix when heads or widths do not split in ``tp``.

    ``sequence_parallel`` (Megatron's sequence parallelism): between the attention and MLP
    pairs, the residual stream is split along the sequence (dim 1) over the tensor-parallel
    ranks, so the layer norms and residual adds run on 1/tp of the tokens and everything saved
    for them (and each checkpointed block input) is 1/tp per rank. Each pair's first linear
    all-gathers its input along the sequence and its second reduce-scatters its output (instead
    of all-reducing it: the same bytes). The embeddings' sum is sliced (``embed_out``); the
    head all-gathers the final layer norm's output."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    cfg = getattr(model, "cfg", None)
    blocks = getattr(model, "blocks", None)
    if cfg is None or blocks is None:
        raise ValueError(
            f"gpt_plan needs the reference GPT (blocks of attn.qkv/attn.proj/mlp.fc/mlp.proj), "
            f"got {type(model).__name__}; write a plan for parallelize() yourself"
        )
    if cfg.n_head % tp:
        raise ValueError(
            f"tensor parallelism splits attention by heads: n_head={cfg.n_head} does not split "
            f"in tp={tp}; use a tp that divides {cfg.n_head}"
        )
    gather = {"input_layouts": Shard(1)} if sequence_parallel else {}
    scatter = {"output_layouts": Shard(1)} if sequence_parallel else {}
    plan: dict = {}
    for i in range(len(blocks)):
        plan[f"blocks.{i}.attn.qkv"] = _fused_colwise()(3, **gather)
        plan[f"blocks.{i}.attn.proj"] = RowwiseParallel(**scatter)
        plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel(**gather)
        plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel(**scatter)
        if sequence_parallel:
            for norm in ("ln_1", "ln_2"):
                plan[f"blocks.{i}.{norm}"] = SequenceParallel(use_local_output=True)
    if sequence_parallel:
        plan["embed_out"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
        )
        plan["ln_f"] = SequenceParallel(use_local_output=True)
        plan["lm_head"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan


STYLES = ("colwise", "rowwise")
"""The styles of a plan by name (``plan_for``): a Linear's output features split
(``ColwiseParallel``), or its input features (``RowwiseParallel``, the output all-reduced)."""


def plan_for(model: nn.Module, tp: int, *, sequence_parallel: bool = False) -> dict:
    """``model``'s tensor-parallel plan, for ``parallelize``: ``gpt_plan`` for the reference GPT;
    else its Hugging Face config's ``base_model_tp_plan`` (transformers' Llama, Mistral, Qwen2
    and others declare one), or the model's ``tp_plan`` attribute: module names, ``*`` standing
    for one part (a layer number), each mapped to "colwise" or "rowwise". Each colwise Linear
    must be followed, through element-wise work and per-head attention, by a rowwise one (the
    pairs of Megatron's layout). A ValueError naming the fix when there is no plan, a style is
    another, a name matches no Linear, or a split does not divide. ``sequence_parallel``: the
    GPT's only (``gpt_plan``)."""
    if hasattr(model, "blocks") and hasattr(model, "cfg"):
        return gpt_plan(model, tp, sequence_parallel=sequence_parallel)
    if sequence_parallel:
        raise ValueError(
            f"sequence parallelism has a plan for the built-in GPT only, not "
            f"{type(model).__name__}; drop sequence_parallel (partition_activations splits its "
            "activation checkpoints instead)"
        )
    found = styles(model)
    modules = dict(model.named_modules())
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(
                f"tensor parallelism splits attention by heads: {field}={heads} does not split "
                f"in tp={tp}; use a tp that divides it"
            )
    plan = {name: _style(name, modules[name], style, tp) for name, style in found.items()}
    _check_pairs(plan)
    return plan


def styles(model: nn.Module) -> dict[str, str]:
    """``{module name: "colwise" | "rowwise"}``: the Linears ``plan_for`` splits, for any degree
    (nothing about ``tp`` is checked here). A ValueError naming the fix when the model declares
    no plan, a style is another, or an entry matches no module."""
    if hasattr(model, "blocks") and hasattr(model, "cfg"):  # the reference GPT (gpt_plan)
        pairs = (("attn.qkv", "colwise"), ("attn.proj", "rowwise"))
        pairs += (("mlp.fc", "colwise"), ("mlp.proj", "rowwise"))
        return {f"blocks.{i}.{n}": s for i in range(len(model.blocks)) for n, s in pairs}
    names, root = _declared_plan(model)
    modules = [name for name, _ in model.named_modules()]
    found: dict[str, str] = {}
    for pattern, style in names.items():
        if style not in STYLES:
            raise ValueError(
                f"tensor-parallel plan entry {pattern!r}: {style!r}; zeroshard splits layers "
                f"{' or '.join(STYLES)} only: change the entry or pass --tp 1 (zeroshard plan: "
                "--mp 1)"
            )
        regex = re.compile(re.escape(root + pattern).replace(r"\*", r"[^.]+"))
        matched = {name: style for name in modules if regex.fullmatch(name)}
        if not matched:
            raise ValueError(
                f"tensor-parallel plan entry {pattern!r} matches no module of "
                f"{type(model).__name__}; fix the plan (names as in named_modules()) or pass "
                "--tp 1 (zeroshard plan: --mp 1)"
            )
        found |= matched
    return found


def split_params(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): its module's name}`` for each parameter a tensor-parallel split cuts
    into pieces (``styles``): the weight of every planned Linear and the bias of the colwise
    ones (a rowwise Linear's bias is added whole, replicated). A ValueError when the model
    declares no plan."""
    out = {}
    for name, style in styles(model).items():
        module = model.get_submodule(name)
        out[id(module.weight)] = name
        if style == "colwise" and getattr(module, "bias", None) is not None:
            out[id(module.bias)] = name
    return out


def split_numel(model: nn.Module) -> int:
    """Elements of the parameters a tensor-parallel split cuts (``split_params``)."""
    cut = split_params(model)
    return sum(p.numel() for p in model.parameters() if id(p) in cut)


def _check_pairs(plan: dict) -> None:
    """A plan with colwise Linears has rowwise ones, and the reverse (Megatron's pairs): a
    colwise one left alone would end the model on 1/tp of its features, a rowwise one alone
    would sum unsplit inputs tp times. Which pairs with which is checked in the order they
    run, at the first forward (``tensor_parallel_checks``): the module order is not it."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    col = next((n for n in plan if isinstance(plan[n], ColwiseParallel)), None)
    row = next((n for n in plan if not isinstance(plan[n], ColwiseParallel)), None)
    if row is None:
        raise ValueError(
            f"tensor-parallel plan: {col} is colwise with no rowwise layer after it, so "
            "its output would stay split (1/tp of its features); add the rowwise layer that "
            "consumes it, or drop the entry"
        )
    if col is None:
        raise ValueError(
            f"tensor-parallel plan: {row} is rowwise with no colwise layer before it; "
            "its input would not be split. Pair it with the colwise layer that feeds it"
        )


def _declared_plan(model: nn.Module) -> tuple[dict[str, str], str]:
    """The model's declared plan and the prefix of the module it is relative to. A Hugging Face
    model's is its config's ``base_model_tp_plan`` (the blocks; its ``tp_plan`` adds the
    embeddings and head, which stay replicated here, as the GPT's do)."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if isinstance(plan, dict) and plan:
        base = getattr(model, "base_model", model)
        prefix = next(name for name, m in model.named_modules() if m is base)
        return plan, f"{prefix}." if prefix else ""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return plan, ""
    raise ValueError(
        f"{type(model).__name__} has no tensor-parallel plan (no config.base_model_tp_plan, no "
        "tp_plan attribute): give it a tp_plan ({'layers.*.mlp.up': 'colwise', "
        "'layers.*.mlp.down': 'rowwise', ...}) or pass --tp 1 (zeroshard plan: --mp 1)"
    )


def _style(name: str, module: nn.Module, style: str, tp: int):
    """The ``ParallelStyle`` of one Linear, its split checked."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(module, nn.Linear):
        raise ValueError(
            f"tensor-parallel plan: {name} is a {type(module).__name__}, not an nn.Linear; "
            "zeroshard splits Linear layers only: drop it from the plan or pass --tp 1 "
            "(zeroshard plan: --mp 1)"
        )
    features = module.out_features if style == "colwise" else module.in_features
    if features % tp:
        side = "output" if style == "colwise" else "input"
        raise ValueError(
            f"tensor-parallel plan: {name} ({style}) has {features} {side} features, which do "
            f"not split in tp={tp}; use a tp that divides {features}"
        )
    return ColwiseParallel() if style == "colwise" else RowwiseParallel()


def parallelize(
    model: nn.Module,
    device_mesh,
    plan: dict | None = None,
    *,
    sequence_parallel: bool = False,
    sync_module_states: bool = True,
) -> nn.Module:
    """Split ``model`` across the "tp" dim of ``device_mesh`` (from ``mesh_2d``) with ``plan``
    (module name -> ``ParallelStyle``; default ``plan_for(model, tp, sequence_parallel=...)``),
    in place, before ``zeroshard.shard``. Parameters must be materialized (not on the meta
    device). With ``sync_module_states`` every tensor-parallel rank first takes its group's
    first rank's parameters and buffers, so that the pieces are cut from one model and the
    replicated parameters are equal (``shard``'s own sync runs over the data-parallel ranks
    only). With ``sequence_parallel``, sequences must split evenly in tp (a ValueError says so
    at the forward)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from zeroshard.engine import _ATTR

    if getattr(model, _ATTR, None) is not None:
        raise ValueError(
            "parallelize() of a model zeroshard.shard() has sharded already: split it first, "
            "then shard it (parallelize(model, mesh); zeroshard.shard(model, ..., mesh=dp))"
        )
    if splits(model):
        raise ValueError(
            "parallelize() of a model it has split already (its split Linears hold 1/tp of "
            "their weights): call it once per model"
        )
    if not hasattr(device_mesh, "ndim"):  # (mesh_2d's second value, the data-parallel Mesh)
        raise TypeError(
            f"parallelize() takes the DeviceMesh mesh_2d returns first, got a "
            f"{type(device_mesh).__name__}: device_mesh, dp_mesh = mesh_2d(tp); "
            "parallelize(model, device_mesh); zeroshard.shard(model, ..., mesh=dp_mesh)"
        )
    names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
    if device_mesh.ndim > 1 and "tp" not in names:
        raise ValueError(
            f"parallelize() splits over a mesh dim named 'tp'; this mesh's dims are {names}: "
            "make it with zeroshard.tensor_parallel.mesh_2d(tp) (dims 'dp', 'tp'), or name "
            "yours so"
        )
    tp_mesh = device_mesh["tp"] if device_mesh.ndim > 1 else device_mesh
    tp = tp_mesh.size()
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "tensor parallelism needs materialized parameters: build the model on the CPU "
            "(or its device), then parallelize, then zeroshard.shard"
        )
    if plan is None:
        plan = plan_for(model, tp, sequence_parallel=sequence_parallel)
    else:
        plan = _given_plan(model, plan, tp)
    _check_untied(model, plan)
    if tp == 1:
        return model
    group = tp_mesh.get_group()
    if sync_module_states:
        _sync(model, group)
    tensor_parallel_checks.rng_at_first_forward(model, group)
    tensor_parallel_checks.unsplit_inside_pairs_at_first_forward(model, plan)
    styles = {name: style for name, style in plan.items()}
    parallelize_module(model, tp_mesh, styles)
    for name in styles:
        _localize(model.get_submodule(name), getattr(styles[name], "groups", 1))
    if sequence_parallel:
        model.register_forward_pre_hook(_even_sequences(tp), prepend=True, with_kwargs=True)
        setattr(model, _SEQUENCE, True)
    return model


def _given_plan(model: nn.Module, plan: dict, tp: int) -> dict:
    """A plan passed to ``parallelize`` checked before anything is split, as ``plan_for``'s
    are: each key a module's name, "colwise" / "rowwise" taken as ``plan_for`` takes them, and
    a column- or row-parallel Linear's (or Embedding's) split dimension dividing in ``tp``
    (an uneven split trained, then aborted the job at the state dict). Other styles (inputs,
    outputs, sequence parallelism) pass as they are."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    modules = dict(model.named_modules())
    checked = {}
    for name, style in plan.items():
        module = modules.get(name)
        if module is None:
            raise ValueError(
                f"tensor-parallel plan entry {name!r} names no module of "
                f"{type(model).__name__}; fix the plan (names as in named_modules()); nothing "
                "was split"
            )
        if isinstance(style, str):
            if style not in STYLES:
                raise ValueError(
                    f"tensor-parallel plan entry {name!r}: {style!r}; give a ParallelStyle or "
                    f"one of {' or '.join(STYLES)}"
                )
            style = _style(name, module, style, tp)
        elif isinstance(style, (ColwiseParallel, RowwiseParallel)):
            _check_divides(name, module, style, tp)
        checked[name] = style
    return checked


def _check_divides(name: str, module: nn.Module, style, tp: int) -> None:
    """The dimension a column- or row-parallel style splits (Linear: output or input features;
    Embedding: embedding dim or rows), in equal pieces per rank and fused block."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    weight = getattr(module, "weight", None)
    if not isinstance(module, (nn.Linear, nn.Embedding)) or weight is None:
        return
    colwise = isinstance(style, ColwiseParallel)
    dim = (0 if colwise else 1) if isinstance(module, nn.Linear) else (1 if colwise else 0)
    size, groups = weight.shape[dim], getattr(style, "groups", 1) if dim == 0 else 1
    if size % (groups * tp):
        pieces = f"{groups} fused blocks x tp={tp}" if groups > 1 else f"tp={tp}"
        raise ValueError(
            f"tensor-parallel plan: {name} ({type(style).__name__}) splits dim {dim} of its "
            f"{tuple(weight.shape)} weight, {size}, which does not divide in {pieces}; use a "
            f"tp that divides {size // groups}, or leave {name} out of the plan"
        )


def _check_untied(model: nn.Module, plan: dict) -> None:
    """A parameter a planned module distributes must be no other module's too (tied weights:
    ``parallelize_module`` makes each module's use a piece of its own, untying them silently).
    Styles that only lay out a module's inputs or outputs leave its parameters alone."""
    from torch.distributed.tensor import parallel

    layouts = tuple(
        getattr(parallel, name)
        for name in ("PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput")
        if hasattr(parallel, name)
    )
    uses: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        uses.setdefault(id(p), []).append(name)
    for module_name, style in plan.items():
        if isinstance(style, layouts):
            continue
        module = model.get_submodule(module_name)
        for p in module.parameters(recurse=False):
            names = uses.get(id(p), [])
            if len(names) > 1:
                raise ValueError(
                    f"tensor parallelism would split {names[0]}, which is tied to "
                    f"{', '.join(names[1:])} (one Parameter in several modules): the split "
                    "gives each module a piece of its own and the tie is lost. Untie them "
                    "before parallelize(), or leave these modules out of the plan"
                )


def _sync(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Every parameter and buffer of ``model`` as the first rank of ``group`` has it, whatever
    its dtype or layout (``shard``'s buffer sync, over the tensor-parallel group)."""
    from zeroshard import collectives as C

    with torch.no_grad():
        for p in model.parameters():
            C.broadcast_any(p.data, group=group)
        done: dict[int, torch.Tensor] = {}
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    if id(buf) not in done:
                        done[id(buf)] = C.broadcast_any(buf, group=group)
                    module._buffers[name] = done[id(buf)]


def is_sequence_parallel(model: nn.Module) -> bool:
    """Whether ``parallelize`` split ``model``'s sequences (its residual stream differs per
    tensor-parallel rank: Pa, which rebuilds checkpoints from pieces of a replicated tensor,
    cannot apply)."""
    return getattr(model, _SEQUENCE, False)


def _even_sequences(tp: int):
    """A forward pre-hook: the first input's dim 1 (the sequence) splits evenly in ``tp``
    (DTensor's sequence shards must be equal; a mismatch would fail inside a collective). The
    first input is the first positional one, else the first tensor passed by keyword."""

    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        given = [*args, *kwargs.values()]
        x = next((a for a in given if torch.is_tensor(a)), None)
        if x is not None and x.dim() > 1 and x.shape[1] % tp:
            raise ValueError(
                f"sequence parallelism splits each sequence evenly over tp={tp} ranks: a length "
                f"of {x.shape[1]} does not split; use lengths divisible by {tp}"
            )

    return check


def _localize(module: nn.Module, groups: int) -> None:
    """Replace ``module``'s DTensor parameters with plain ones holding the local piece; wrap
    them back as DTensors around its forward (module docstring)."""
    from torch.distributed.tensor import DTensor, Shard

    splits: dict[str, _Split] = {}
    locals_: dict[str, nn.Parameter] = {}
    mesh = None
    for name, p in list(module.named_parameters(recurse=False)):
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        shard = next((pl.dim for pl in p.placements if isinstance(pl, Shard)), None)
        splits[name] = _Split(
            dim=shard,
            groups=groups if shard == 0 else 1,
            placements=tuple(p.placements),
        )
        local = nn.Parameter(p.to_local().detach().clone(), requires_grad=p.requires_grad)
        local._zeroshard_tp_split = shard is not None  # read by the gradient-norm sum
        module._parameters[name] = local
        locals_[name] = local
    if not splits:
        return
    setattr(module, _LOCAL, splits)

    def wrap(mod: nn.Module, args: tuple) -> None:
        for name, split in splits.items():
            local = locals_[name]
            mod._parameters[name] = DTensor.from_local(  # type: ignore[assignment]
                local, mesh, split.placements, run_check=False
            )

    def unwrap(mod: nn.Module, args: tuple, output):
        for name in splits:
            mod._parameters[name] = locals_[name]
        return output

    module.register_forward_pre_hook(wrap)
    module.register_forward_hook(unwrap, always_call=True)


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether ``parallelize`` split some of ``model``'s parameters."""
    return any(hasattr(m, _LOCAL) for m in model.modules())


def splits(model: nn.Module) -> dict[str, _Split]:
    """``{parameter name: how it is split}`` for every split parameter of ``model``."""
    out = {}
    for mname, m in model.named_modules():
        for pname, split in getattr(m, _LOCAL, {}).items():
            out[f"{mname}.{pname}" if mname else pname] = split
    return out


def place_pieces(model: nn.Module, optim: dict[str, Any], tp_rank: int, tp_size: int) -> None:
    """A checkpoint's optimizer state of ``model`` (``FlatRange`` entries of
    ``zeroshard.checkpoint``), in place: split parameters' element-wise states placed as parts
    of the whole tensors (``Split``), so that the files hold the unsplit model and load at any
    tensor-parallel degree.
    (The model's own entries are placed as its state dict is made, under whatever names the
    user's state-dict hooks give them: ``zeroshard.state_dict``.)"""
    from zeroshard.checkpoint_files import CheckpointError

    for name, split in splits(model).items():
        if split.dim is None:
            continue
        where = placed(split, tp_rank, tp_size)
        states = optim["state"].get(name, {})
        # Element-wise states, not scalars such as Adam's step (the same on every rank).
        for key, value in states.items():
            if not _is_elementwise(value):
                continue
            if not isinstance(value, FlatRange):  # the same name, another piece per rank
                raise CheckpointError(
                    f"{name} is split tensor-parallel but its state {key!r} is a "
                    f"{type(value).__name__}, not this rank's range; checkpoints of it need "
                    "a model sharded by zeroshard.shard"
                )
            states[key] = value.placed(where)


def _is_elementwise(value: Any) -> bool:
    return isinstance(value, FlatRange) or (torch.is_tensor(value) and value.dim() > 0)


def whole_numel(model: nn.Module, tp_size: int) -> int:
    """Parameters of the unsplit model: split pieces counted whole."""
    split = {n for n, s in splits(model).items() if s.dim is not None}
    return sum(p.numel() * (tp_size if n in split else 1) for n, p in model.named_parameters())


def gather_tensor_parallel(
    model: nn.Module, state: dict[str, torch.Tensor], group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """``state`` (a state dict of ``model`` on this rank: local pieces) with every tensor whole:
    split ones all-gathered over the tensor-parallel ``group``, in the unsplit model's layout,
    and DTensors over the data-parallel ranks made full. A collective over every rank."""
    # DTensors over the data-parallel ranks (a sharded model's state dict): whole on this rank.
    out = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    for name, split in splits(model).items():
        if name not in out or split.dim is None:
            continue
        if out[name].shape != model.get_parameter(name).shape:
            continue  # whole already (zeroshard.full_state_dict gathers them)
        out[name] = whole_tensor(out[name], split, group)
    return out


def split_of(module: nn.Module, name: str) -> _Split | None:
    """How ``module``'s own parameter ``name`` is split across its tensor-parallel group; None
    where every rank holds it whole."""
    split = getattr(module, _LOCAL, {}).get(name)
    return split if split is not None and split.dim is not None else None


def whole_tensor(
    local: torch.Tensor, split: _Split, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The unsplit tensor of which ``local`` is this rank's piece (``split``), in the unsplit
    model's layout: all-gathered over the tensor-parallel ``group`` (every rank of it calls)."""
    local = local.contiguous()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local, group=group)
    if split.groups > 1:
        blocks = [p.chunk(split.groups, dim=split.dim) for p in pieces]
        return torch.cat([b[g] for g in range(split.groups) for b in blocks], dim=split.dim)
    return torch.cat(pieces, dim=split.dim)


def placed(split: _Split, tp_rank: int, tp_size: int) -> Split:
    """Where tensor-parallel rank ``tp_rank``'s piece of a ``split`` parameter lies in the whole
    tensor, as a checkpoint saves it."""
    return Split(split.dim, tp_rank, tp_size, split.groups)
