"""Tensor-parallel plans: which Linears a model's tensor-parallel split cuts, and how.

The reference GPT's (``gpt_plan``: the fused ``qkv`` by heads, the MLP column- then
row-parallel, optionally Megatron's sequence parallelism), a Hugging Face config's
``base_model_tp_plan`` or a ``tp_plan`` attribute (``plan_for``, by ``styles``), and plans given
to ``parallelize`` (``given_plan``), all checked before anything is split: every name a module,
column-parallel layers paired with row-parallel ones, splits that divide in ``tp``, no weight
tied across a split (``check_untied``)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = [
    "GRAD_SUM",
    "STYLES",
    "check_untied",
    "closes_split",
    "given_plan",
    "gpt_plan",
    "opens_split",
    "plan_for",
    "plan_key",
    "split_params",
    "styles",
    "sums_gradient",
]


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


def sums_gradient(style: Any) -> bool:
    """Whether ``style`` is ``GRAD_SUM``'s."""
    return isinstance(style, _grad_sum())


@functools.cache
def _grad_sum():
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class ReplicatedGradSum(ParallelStyle):
        """``GRAD_SUM``: the module's parameters stay whole; the gradient autograd brings each
        of them in a backward (before it is accumulated, so that micro-batches accumulate sums,
        not sums of sums) is summed over the tensor-parallel ranks, each of which saw its own
        heads. A tensor hook, not a module's, so that recomputed checkpoints and a parameter
        used twice are summed once per backward; put on at each forward onto the parameters
        that take a gradient then and have none yet (one frozen when split may be unfrozen
        later: a hook cannot be put on a tensor without gradients)."""

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            group = device_mesh.get_group()

            def hook_params(mod: nn.Module, args: tuple) -> None:
                if not torch.is_grad_enabled():
                    return
                for p in mod.parameters(recurse=False):
                    if p.requires_grad and not getattr(p, _SUMMED, False):
                        p.register_hook(lambda grad: _summed(grad, group))
                        setattr(p, _SUMMED, True)

            module.register_forward_pre_hook(hook_params)
            return module

    return ReplicatedGradSum


_SUMMED = "_zeroshard_grad_summed"
"""Attribute of a parameter whose gradients a ``GRAD_SUM`` hook sums."""


def _summed(grad: torch.Tensor, group) -> torch.Tensor:
    """``grad`` summed over ``group``, in a tensor of its own (autograd may hand one that
    another node holds)."""
    import torch.distributed as dist

    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


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


GRAD_SUM = "replicated_with_grad_allreduce"
"""A module left whole on every tensor-parallel rank whose gradient is summed over them: a
norm applied to each head of q and k between a colwise Linear and its rowwise partner (Qwen3's,
Gemma3's ``q_norm`` / ``k_norm``) sees this rank's heads only, so its gradient is a part."""

STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", GRAD_SUM)
"""The styles of a plan by name (``plan_for``), as transformers names them: a Linear's output
features split (``ColwiseParallel``), or its input features (``RowwiseParallel``, the output
all-reduced); ``colwise_gather_output`` all-gathers the split output so that what follows sees
every feature (a fused projection sliced by ``chunk``, a norm over whole q and k: Phi-3's,
OLMo2's, GLM-4's layers), and ``rowwise_split_input`` takes such a whole input and uses this
rank's slice of it. Those two need no partner. ``GRAD_SUM``: any module, split nowhere."""


def plan_for(model: nn.Module, tp: int, *, sequence_parallel: bool = False) -> dict:
    """``model``'s tensor-parallel plan, for ``parallelize``: ``gpt_plan`` for the reference GPT;
    else its Hugging Face config's ``base_model_tp_plan`` (transformers' Llama, Mistral, Qwen2
    and others declare one), or the model's ``tp_plan`` attribute: module names, ``*`` standing
    for one part (a layer number), each mapped to one of ``STYLES``. Each colwise Linear must
    be followed, through element-wise work and per-head attention, by a rowwise one (the pairs
    of Megatron's layout); ``colwise_gather_output`` and ``rowwise_split_input`` need none.
    A ValueError naming the fix when there is no plan, a style is another, a name matches no
    Linear, or a split does not divide. ``sequence_parallel``: the GPT's only (``gpt_plan``)."""
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
    """``{module name: one of STYLES}``: the Linears ``plan_for`` splits, for any degree
    (nothing about ``tp`` is checked here). A ValueError naming the fix when the model declares
    no plan, a style is another, or an entry matches no module."""
    if hasattr(model, "blocks") and hasattr(model, "cfg"):  # the reference GPT (gpt_plan)
        pairs = (("attn.qkv", "colwise"), ("attn.proj", "rowwise"))
        pairs += (("mlp.fc", "colwise"), ("mlp.proj", "rowwise"))
        return {f"blocks.{i}.{n}": s for i in range(len(model.blocks)) for n, s in pairs}
    names, root, from_config = _declared_plan(model)
    modules = [name for name, _ in model.named_modules()]
    found: dict[str, str] = {}
    embeddings = [p for p, style in names.items() if style.startswith("embedding")]
    if embeddings and len(embeddings) == len(names):
        raise ValueError(
            f"{type(model).__name__}'s tensor-parallel plan splits only its embeddings "
            f"({', '.join(embeddings)}), which stay replicated here: nothing to split; pass "
            "tensor_parallel.parallelize a plan of its Linear layers ({'layers.*.mlp.up': "
            "'colwise', 'layers.*.mlp.down': 'rowwise', ...}) or --tp 1 (zeroshard plan: --mp 1)"
        )
    unmatched = []
    for pattern, style in names.items():
        if pattern in embeddings:  # (GPT-NeoX's, GPT-J's embedding_rowwise)
            continue  # the embeddings stay replicated, as the GPT's do
        matched = dict.fromkeys(_matching(root + pattern, modules), style)
        if not matched and from_config:
            # A config's plan names the modules of every variant of its family (Doge's MoE
            # router, Qwen3-Next's full-attention layers): those this config builds are split,
            # as transformers does.
            unmatched.append(pattern)
            continue
        if not matched:
            raise ValueError(
                f"tensor-parallel plan entry {pattern!r} matches no module of "
                f"{type(model).__name__}; fix the plan (names as in named_modules()) or pass "
                "--tp 1 (zeroshard plan: --mp 1)"
            )
        if style not in STYLES:
            raise ValueError(
                f"tensor-parallel plan entry {pattern!r}: {style!r}; zeroshard splits layers "
                f"{', '.join(STYLES)} only: change the entry or pass --tp 1 (zeroshard plan: "
                "--mp 1)"
            )
        found |= matched
    if not found:
        raise ValueError(
            f"{type(model).__name__}'s tensor-parallel plan matches none of its modules "
            f"({', '.join(unmatched)}); pass tensor_parallel.parallelize a plan of its Linear "
            "layers, or --tp 1 (zeroshard plan: --mp 1)"
        )
    return found


def _matching(pattern: str, names: Iterable[str]) -> list[str]:
    """The ``names`` (module names) that plan key ``pattern`` names, ``*`` standing for one part
    of a name (a layer number)."""
    regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
    return [name for name in names if regex.fullmatch(name)]


def split_params(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): its module's name}`` for each parameter a tensor-parallel split cuts
    into pieces (``styles``): the weight of every planned Linear and the bias of the colwise
    ones (a rowwise Linear's bias is added whole, replicated). A ValueError when the model
    declares no plan."""
    out = {}
    for name, style in styles(model).items():
        if style == GRAD_SUM:
            continue  # (whole on every rank)
        module = model.get_submodule(name)
        out[id(module.weight)] = name
        if style.startswith("colwise") and getattr(module, "bias", None) is not None:
            out[id(module.bias)] = name
    return out


def _check_pairs(plan: dict) -> None:
    """A plan with colwise Linears has rowwise ones, and the reverse (Megatron's pairs): a
    colwise one left alone would end the model on 1/tp of its features, a rowwise one alone
    would sum unsplit inputs tp times. Which pairs with which is checked in the order they
    run, at the first forward (``tensor_parallel_checks``): the module order is not it."""
    col = next((n for n in plan if opens_split(plan[n])), None)
    row = next((n for n in plan if closes_split(plan[n])), None)
    if col is None and row is None:
        return  # (only gathered outputs and slices of whole inputs: no pair to make)
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


def opens_split(style: Any) -> bool:
    """Whether ``style`` is a colwise one whose output stays split (1/tp of the features) until
    a rowwise partner sums it."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    return isinstance(style, ColwiseParallel) and isinstance(style.output_layouts[0], Shard)


def closes_split(style: Any) -> bool:
    """Whether ``style`` is a rowwise one that takes a split input (a colwise partner's
    output), not a whole one it slices itself (``rowwise_split_input``)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    return isinstance(style, RowwiseParallel) and isinstance(style.input_layouts[0], Shard)


def plan_key(model: nn.Module, module_name: str) -> str:
    """The key naming ``module_name`` and its like in every layer in ``model``'s declared plan:
    layer numbers as ``*``, relative to the base model for a config's plan."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    base = getattr(model, "base_model", model) if isinstance(plan, dict) and plan else model
    prefix = next((name for name, m in model.named_modules() if m is base), "")
    if prefix and module_name.startswith(prefix + "."):
        module_name = module_name[len(prefix) + 1 :]
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", module_name)


def _declared_plan(model: nn.Module) -> tuple[dict[str, str], str, bool]:
    """The model's declared plan, the prefix of the module it is relative to, and whether it is
    a Hugging Face config's: its ``base_model_tp_plan`` (the blocks, and in some families the
    input embedding, ``embedding_rowwise``; its ``tp_plan`` adds the head: embeddings and head
    stay replicated here, as the GPT's do, ``styles``)."""
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if isinstance(plan, dict) and plan:
        base = getattr(model, "base_model", model)
        prefix = next(name for name, m in model.named_modules() if m is base)
        return plan, f"{prefix}." if prefix else "", True
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return plan, "", False
    raise ValueError(
        f"{type(model).__name__} has no tensor-parallel plan (no config.base_model_tp_plan, no "
        "tp_plan attribute): give it a tp_plan ({'layers.*.mlp.up': 'colwise', "
        "'layers.*.mlp.down': 'rowwise', ...}) or pass --tp 1 (zeroshard plan: --mp 1)"
    )


def _style(name: str, module: nn.Module, style: str, tp: int):
    """The ``ParallelStyle`` of one Linear, its split checked (of any module for
    ``GRAD_SUM``)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == GRAD_SUM:
        return _grad_sum()()
    if not isinstance(module, nn.Linear):
        raise ValueError(
            f"tensor-parallel plan: {name} is a {type(module).__name__}, not an nn.Linear; "
            "zeroshard splits Linear layers only: drop it from the plan or pass --tp 1 "
            "(zeroshard plan: --mp 1)"
        )
    colwise = style.startswith("colwise")
    features = module.out_features if colwise else module.in_features
    if features % tp:
        side = "output" if colwise else "input"
        raise ValueError(
            f"tensor-parallel plan: {name} ({style}) has {features} {side} features, which do "
            f"not split in tp={tp}; use a tp that divides {features}"
        )
    if style == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise_split_input":
        return RowwiseParallel(input_layouts=Replicate())
    return ColwiseParallel() if colwise else RowwiseParallel()


def given_plan(model: nn.Module, plan: dict, tp: int) -> dict:
    """A plan passed to ``parallelize`` checked before anything is split, as ``plan_for``'s
    are: each key a module's name, "colwise" / "rowwise" taken as ``plan_for`` takes them, and
    a column- or row-parallel Linear's (or Embedding's) split dimension dividing in ``tp``
    (keys with "*" stand for every module they match, as torch's ``parallelize_module`` takes
    them)
    (an uneven split trained, then aborted the job at the state dict). Other styles (inputs,
    outputs, sequence parallelism) pass as they are."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    modules = dict(model.named_modules())
    checked = {}
    for key, given in plan.items():
        names = _matching(key, modules)  # (as torch's parallelize_module and a tp_plan)
        if not names:
            raise ValueError(
                f"tensor-parallel plan entry {key!r} names no module of "
                f"{type(model).__name__}; fix the plan (names as in named_modules(), '*' for "
                "one part of a name); nothing was split"
            )
        for name in names:
            style, module = given, modules[name]
            if isinstance(style, str):
                if style not in STYLES:
                    raise ValueError(
                        f"tensor-parallel plan entry {key!r}: {style!r}; give a ParallelStyle "
                        f"or one of {', '.join(STYLES)}"
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


def check_untied(model: nn.Module, plan: dict) -> None:
    """A parameter a planned module distributes must be no other module's too (tied weights:
    ``parallelize_module`` makes each module's use a piece of its own, untying them silently).
    One module reached under several names (a block shared by two parents) is split once for
    all of them: not a tie. Styles that only lay out a module's inputs or outputs leave its
    parameters alone."""
    from torch.distributed.tensor import parallel

    layouts = tuple(
        getattr(parallel, name)
        for name in ("PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput")
        if hasattr(parallel, name)
    )
    uses: dict[int, list[str]] = {}
    holders: dict[int, set[int]] = {}  # id(parameter) -> ids of the modules holding it
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False):
            uses.setdefault(id(p), []).append(f"{module_name}.{attr}" if module_name else attr)
            holders.setdefault(id(p), set()).add(id(module))
    for module_name, style in plan.items():
        if isinstance(style, layouts):
            continue
        module = model.get_submodule(module_name)
        for p in module.parameters(recurse=False):
            names = uses.get(id(p), [])
            if len(holders.get(id(p), ())) > 1:
                raise ValueError(
                    f"tensor parallelism would split {names[0]}, which is tied to "
                    f"{', '.join(names[1:])} (one Parameter in several modules): the split "
                    "gives each module a piece of its own and the tie is lost. Untie them "
                    "before parallelize(), or leave these modules out of the plan"
                )
