"""Checks at the first training forward of a tensor-parallel model: what would otherwise let
the ranks of a tensor-parallel group compute pieces of different models without an error
(random generators seeded per rank, a batch split by the global rank, a module with parameters
of its own between a column-parallel Linear and its row-parallel partner). Each check's hooks
remove themselves once it ran (``tensor_parallel.parallelize`` installs them)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.trees import tensors_in


def rng_at_first_forward(model: nn.Module, group) -> None:
    """Tensor-parallel ranks compute the replicated activations each on its own: dropout there
    must draw the same numbers on every rank of the group, else the replicas (and Pa's
    checkpoint pieces) silently differ. At the first training forward, a warning when this
    rank's CPU generator is not the others' (one all-gather of its 5 KB state, once). In the
    same forward, one of the inputs' fingerprint: the ranks of a group must see the same batch
    (split by the data-parallel rank, not the global one, DDP's habit), else each computes its
    pieces from other rows and the result is no model's, without an error."""

    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        handle.remove()
        _same_inputs((args, kwargs), group)
        if _differs(torch.get_rng_state(), group):
            warnings.warn(
                "the tensor-parallel ranks' random number generators differ (seeded per rank?): "
                "dropout on activations they share draws different masks on each, and their "
                "copies diverge; seed every rank of a tensor-parallel group alike "
                "(torch.manual_seed(seed), the same seed)",
                stacklevel=2,
            )

    handle = model.register_forward_pre_hook(check, prepend=True, with_kwargs=True)


def unsplit_inside_pairs_at_first_forward(model: nn.Module, plan: dict) -> None:
    """The first forward checks the pairs in the order they run: a rowwise Linear with no
    colwise one run before it, or a colwise one whose split output reaches the end of the
    forward, is refused (the plan's module order cannot tell: a feed-forward registering ``w1,
    w2, w3`` runs ``w1`` and ``w3`` before ``w2``). And a parameter the plan does not split,
    used between a colwise Linear and its rowwise partner (a norm of each head of q and k:
    Phi's ``qk_layernorm``; a learned temperature of the attention module holding the pair),
    sees this rank's heads only: its gradient is a part of the whole and differs across the
    tensor-parallel ranks, so their replicas drift apart without an error. Every torch call of
    the first forward is looked at (a ``TorchFunctionMode``): one taking such a parameter while
    a pair is open is refused, naming it. The hooks are gone after a forward that passed."""
    from torch.overrides import TorchFunctionMode

    from zeroshard.tensor_parallel_plans import (
        GRAD_SUM,
        closes_split,
        opens_split,
        plan_key,
        sums_gradient,
    )

    inside: list[str] = []  # the colwise Linear whose split output is in flight
    entered: list[bool] = []  # the mode below is entered (``enter`` ran, ``leave`` not yet)
    handles: list[Any] = []
    split = tuple(f"{name}." for name in plan)
    unsplit = {  # the Parameter objects stay the module's through sharding
        id(p): name for name, p in model.named_parameters() if not name.startswith(split)
    }
    summed = {  # GRAD_SUM's: a part of their gradient per rank inside a pair, never outside
        id(p): f"{name}.{pname}" if name else pname
        for name, style in plan.items()
        if sums_gradient(style)
        for pname, p in model.get_submodule(name).named_parameters(recurse=False)
    }

    class Uses(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            # (attribute reads and writes, ``p.data = ...``, ``p._version``, are the engine's
            # gathers and checks of the units it enters or prefetches: no computation)
            computes = getattr(func, "__name__", None) not in ("__get__", "__set__")
            outside = computes and not inside and summed
            if outside and any(id(t) in summed for t in tensors_in((args, kwargs or {}))):
                out = func(*args, **(kwargs or {}))
                # (a computation autograd records: the engine's gathers read and copy the
                # parameters too, without a graph)
                if any(t.grad_fn is not None for t in tensors_in(out)):
                    name = next(
                        summed[id(t)] for t in tensors_in((args, kwargs or {})) if id(t) in summed
                    )
                    raise ValueError(
                        f"tensor-parallel plan: {name}'s module is {GRAD_SUM}, and it is used "
                        "outside a colwise / rowwise pair, on whole tensors: every rank has its "
                        "whole gradient, and the sum over the ranks would be tp times it. "
                        "Declare only modules used between a colwise Linear and its rowwise "
                        "partner so (a norm of each head of q and k), and drop this entry"
                    )
                return out
            if inside and computes:
                for t in tensors_in((args, kwargs or {})):
                    if id(t) in unsplit:
                        name = unsplit[id(t)]
                        key = plan_key(model, name.rpartition(".")[0])
                        raise ValueError(
                            f"tensor-parallel plan: {name} is not split by the plan, and is "
                            f"used after the colwise {inside[0]}, before its rowwise partner, "
                            "on this rank's heads or features only (a per-head norm of q and "
                            "k, a learned temperature?): each rank would train it on a part "
                            "of its gradient. If it acts on each head alone (a norm over a "
                            "head's features, a scalar), add "
                            f"{{{key!r}: {GRAD_SUM!r}}} to the plan (its gradient is then "
                            "summed over the ranks, as Qwen3's q_norm declares); else pass "
                            "--tp 1 (or turn that option of the model off)"
                        )
            return func(*args, **(kwargs or {}))

    mode = Uses()

    def opened(name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            inside[:] = [name]

        return hook

    def fed(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            if not inside:
                raise ValueError(
                    f"tensor-parallel plan: {name} is rowwise with no colwise layer run before "
                    "it; its input is not split. Pair it with the colwise layer that feeds it"
                )

        return hook

    def closed(module: nn.Module, args: tuple, output: Any) -> None:
        inside.clear()

    def enter(*_: Any) -> None:
        inside.clear()
        mode.__enter__()
        entered.append(True)

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        # Always called: a refusal leaves the mode too; a pre-hook before ``enter`` that
        # raised (sequence parallelism's length check) never entered it.
        if entered:
            entered.clear()
            mode.__exit__(None, None, None)

    def done(*_: Any) -> None:
        if inside:  # (the hooks stay: a caught refusal refuses the next forward too)
            raise ValueError(
                f"tensor-parallel plan: {inside[0]} is colwise with no rowwise layer run after "
                "it, so the output stays split (1/tp of its features); add the rowwise layer "
                "that consumes it, or drop the entry"
            )
        for h in handles:
            h.remove()

    handles.append(model.register_forward_pre_hook(enter))
    for name, module in model.named_modules():
        style = plan.get(name)
        if opens_split(style):
            handles.append(module.register_forward_hook(opened(name)))
        elif closes_split(style):  # (not one slicing a whole input: rowwise_split_input)
            handles.append(module.register_forward_pre_hook(fed(name)))
            handles.append(module.register_forward_hook(closed))
    handles.append(model.register_forward_hook(leave, always_call=True))
    handles.append(model.register_forward_hook(done))


def _same_inputs(args: Any, group) -> None:
    """A warning when the ranks of the tensor-parallel ``group`` got other inputs: (count,
    elements, sum, sum of squares) of the tensors in ``args`` in FP64, all-gathered once."""
    tensors = [t.detach() for t in tensors_in(args)]
    if not tensors:
        return
    parts = [
        [1.0, t.numel(), t.double().sum().item(), t.double().square().sum().item()] for t in tensors
    ]
    mine = torch.tensor(
        [sum(c) for c in zip(*parts)], dtype=torch.float64, device=tensors[0].device
    )
    if _differs(mine, group):
        warnings.warn(
            "the ranks of a tensor-parallel group got different inputs at the first training "
            "forward: they compute one model's pieces and must see the same batch; split the "
            "data by the data-parallel rank (mesh_2d's Mesh: mesh.rank of mesh.world_size), "
            "not by the global rank",
            stacklevel=2,
        )


def _differs(mine: torch.Tensor, group) -> bool:
    """Whether some rank of ``group`` holds another ``mine`` (one all-gather)."""
    seen = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(seen, mine, group=group)
    return any(not torch.equal(s, seen[0]) for s in seen)
