"""What ``shard()`` refuses in a model before it changes anything: parameters that would train
apart from torch's (two Parameters over the same elements, a buffer viewing a parameter's, a
sparse Parameter; an embedding with sparse gradients or ``max_norm``), each a ValueError naming
the module and the fix; and what no forward of a
sharded model can run under (``torch.func`` transforms)."""

from __future__ import annotations

import warnings

import torch
from torch import nn


def strided_parameters(model: nn.Module) -> None:
    """A sparse Parameter (COO, CSR): the flat buffers hold dense elements (it raised torch's
    "Cannot access data pointer of Tensor that doesn't have storage" from inside ``shard``)."""
    for name, p in model.named_parameters():
        if p.layout is not torch.strided:
            raise ValueError(
                f"parameter {name} is sparse ({p.layout}): zeroshard shards dense parameters "
                "into flat buffers; register it dense (p.to_dense()) and, if it must stay "
                "sparse in the computation, take p.to_sparse() in forward"
            )


def no_shared_memory(model: nn.Module) -> None:
    """Two Parameters over the same elements (``Parameter(fc.weight.data.t())``): sharding gives
    each its own master, and they drifted apart without a word (FSDP2 refuses them too).
    Parameters over separate elements of one storage (a checkpoint's views of a fused tensor)
    are fine. Address ranges first; elements only where two ranges meet (interleaved views)."""
    spans: dict[int, list[tuple[int, int, str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():  # each Parameter once (tied ones are one)
        if p.device.type == "meta" or not p.numel():
            continue
        start = p.data_ptr()
        spans.setdefault(p.untyped_storage().data_ptr(), []).append(
            (start, start + _extent(p) * p.element_size(), name, p)
        )
    _buffers_over(model, spans)
    for group in spans.values():
        group.sort(key=lambda span: span[:2])
        for i, (start, _, name, p) in enumerate(group):
            for _, end, first, q in group[:i]:
                if start < end and _same_elements(q, p):
                    raise ValueError(
                        f"parameters {first} and {name} share memory (one a view of the "
                        "other): sharded, each would get its own copy and they would drift "
                        "apart; register one Parameter and derive the other from it in forward "
                        "(e.g. self.fc.weight.t())"
                    )


def _buffers_over(model: nn.Module, spans: dict[int, list]) -> None:
    """A buffer that views a parameter's elements (``register_buffer("w_t", fc.weight.data.t())``):
    sharding moves the parameter into a flat buffer of its own, and the view kept the initial
    weights while torch's followed every update (trained apart without a word)."""
    for name, b in model.named_buffers():
        if b.layout is not torch.strided or b.device.type == "meta" or not b.numel():
            continue
        start = b.data_ptr()
        end = start + _extent(b) * b.element_size()
        for p_start, p_end, param, p in spans.get(b.untyped_storage().data_ptr(), []):
            if start < p_end and p_start < end and _same_elements(p, b):
                raise ValueError(
                    f"buffer {name} views parameter {param}'s memory: sharded, the parameter "
                    "moves into the engine's flat buffers and the view would keep its initial "
                    f"values while {param} trains; derive it from the parameter in forward "
                    "(e.g. self.fc.weight.t()) instead of registering a view"
                )


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether views ``a`` and ``b`` of one storage (one dtype) share an element: marked in a
    mask over the range of the storage they span (views of two dtypes over one byte range:
    taken as sharing)."""
    if a.dtype != b.dtype:
        return True
    lo = min(a.storage_offset(), b.storage_offset())
    hi = max(t.storage_offset() + _extent(t) for t in (a, b))
    mask = torch.zeros(hi - lo, dtype=torch.bool)
    mask.as_strided(a.shape, a.stride(), a.storage_offset() - lo).fill_(True)
    return bool(mask.as_strided(b.shape, b.stride(), b.storage_offset() - lo).any())


def _extent(t: torch.Tensor) -> int:
    """Elements of its storage that view ``t`` spans, from its first to its last."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1


def trainable_embeddings(model: nn.Module) -> None:
    """A ValueError naming the module and the fix for a trainable embedding that the engine
    cannot train as torch does: sparse gradients (the flat buckets hold dense ones) or
    ``max_norm`` (its forward renormalizes rows of the weight in place: a write to the gathered
    copy, lost at stage 3, partly kept at stages 1-2, and left to drift between the replicas at
    stage 0; also for a frozen weight, whose saved values then differ from torch's, a patchwork
    of the ranks' writes at stage 3)."""
    for name, m in model.named_modules():
        if not isinstance(m, nn.Embedding | nn.EmbeddingBag):
            continue
        which = f"module {name or '<root>'!r} ({type(m).__name__})"
        if m.sparse and m.weight.requires_grad:
            raise ValueError(
                f"{which} has sparse=True: its gradients are sparse tensors, which the flat "
                "gradient buckets cannot hold; build it with sparse=False (dense gradients, "
                "with an element-wise optimizer such as Adam instead of SparseAdam) or freeze it"
            )
        if m.max_norm is not None:
            raise ValueError(
                f"{which} has max_norm={m.max_norm}: its forward rescales rows of the weight in "
                "place, a write to the gathered parameter that sharding does not keep (lost at "
                "stage 3, in part at stages 1-2, different on each replica at stage 0); build "
                "it with max_norm=None and bound the norms another way (a penalty, or "
                "renormalize inside zeroshard.summon_full_params(model) after each step)"
            )


def not_wrapped(model: nn.Module) -> None:
    """A ValueError when the sharded ``model`` runs inside torch's DDP (``DDP(model)``, as
    accelerate's ``prepare`` wraps models) or was made an FSDP2 module (``fully_shard``): their
    gradient hooks reduce beside zeroshard's (stage 0 sent every gradient twice) or write
    ``.grad`` where the sharded optimizer reads none (stages 1-2 failed at the step, blaming a
    ``.grad`` set by hand)."""
    from torch.distributed.fsdp import FSDPModule

    ddp = nn.parallel.DistributedDataParallel._get_active_ddp_module()
    inside = ddp is not None and any(m is model for m in ddp.module.modules())
    if inside and any(p.requires_grad for p in model.parameters()):  # (a frozen teacher
        wrapper = "DistributedDataParallel"  # inside a DDP student reduces nothing)
    elif isinstance(model, FSDPModule):
        wrapper = "FSDP2's fully_shard"
    else:
        return
    raise ValueError(
        f"this zeroshard model runs inside {wrapper}, which reduces gradients too: a sharded "
        "model reduces its own. Call it directly (with accelerate, leave it out of "
        "accelerator.prepare), and step it with zeroshard.optimizer"
    )


def no_functorch_transform() -> None:
    """A forward under ``torch.func.grad`` / ``vmap`` / ``jacrev``: the engine's hooks (an
    ``autograd.Function`` without ``setup_context``) and gathered storages (memory swapped in from
    a pool) are not functorch's, and it failed deep inside them. One line naming the way."""
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(
            "torch.func transforms (grad, vmap, jacrev, ...) cannot run a sharded model's "
            "forward: compute them on an unsharded copy, e.g. copy = MyModel(); "
            "copy.load_state_dict(zeroshard.full_state_dict(model, rank0_only=False)); "
            "torch.func.functional_call(model, ...) without a transform works"
        )


_registered = [0, False]  # modules and parameters registered in this process; hooks installed


def registrations() -> int:
    """How many modules and parameters this process has registered since the first call (torch's
    global registration hooks, installed then: they count and change nothing). A forward walks
    the model for ``added_parameters`` only when it moved, not at every forward."""
    if not _registered[1]:
        from torch.nn.modules import module as torch_module

        def count(*_: object) -> None:
            _registered[0] += 1

        torch_module.register_module_module_registration_hook(count)
        torch_module.register_module_parameter_registration_hook(count)
        _registered[1] = True
    return _registered[0]


def added_parameters(model: nn.Module, known: set[int]) -> bool:
    """Warn (and return True) when the model holds trainable parameters that ``shard()`` did not
    flatten (``known``: their ids): a module added afterwards (an adapter) that a torch optimizer
    of its own trains. Nothing averages its gradients across ranks, so each rank trains its own
    copy (as under DDP and FSDP2, silently)."""
    added = [
        name
        for name, p in model.named_parameters()
        if isinstance(p, nn.Parameter)
        and p.requires_grad
        and p.numel() > 0  # (shard() leaves zero-element ones plain: nothing to diverge)
        and id(p) not in known
    ]
    if not added:
        return False
    warnings.warn(
        f"{len(added)} trainable parameter(s) added after zeroshard.shard() (e.g. {added[0]!r}): "
        "their gradients are not averaged across ranks, so each rank trains its own copy. Add "
        "the module before shard() (LoRA adapters too), or all-reduce their gradients yourself",
        stacklevel=4,
    )
    return True
