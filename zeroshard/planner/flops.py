"""FLOPs of one training iteration of a built model, counted on the meta device.

The ZeRO-Infinity paper's arithmetic intensities (``bandwidth``) divide the FLOPs of an
iteration by the bytes each stream moves. Its count, 2 * 4 * 12 * bsz * seq * nl * hd^2
(``bandwidth.flops_per_iteration``), holds for the GPT it describes; a model built for the planner
(``describe.from_module``, ``from_hf_config``) gets its own instead: one forward and backward on
meta under torch's ``FlopCounterMode`` (matmuls, convolutions, attention; 2 FLOPs per
multiply-add), at the planned micro-batch. A convolution's weights are used at every pixel and
a 50k-token head at every token, which 8 * Psi * bsz * seq does not see, and a model fed images
has no ``seq`` at all.

Activation checkpointing runs each unit's forward once more in backward (``recomputed``): the
units' own forward FLOPs, not the root's (embeddings, a head), which the engine does not
checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Flops:
    """FLOPs of one micro-batch (all ranks' work: tensor parallelism divides it by Nm)."""

    forward: int
    """The forward and the loss."""
    backward: int
    """The backward: about twice the forward (the inputs' and the weights' gradients), less
    where an input needs no gradient (the first layer's)."""
    recomputed: int
    """The forward inside the wrapped units (each call of each outermost unit): what activation
    checkpointing computes again."""

    def per_iteration(self, *, checkpointing: bool) -> int:
        """Forward + backward, + the recomputation with ``checkpointing``."""
        return self.forward + self.backward + (self.recomputed if checkpointing else 0)


def counter():
    """torch's ``FlopCounterMode``, silent, that also counts the CPU's fused attention kernels
    (``_scaled_dot_product_flash_attention_for_cpu`` and its backward: torch 2.13 counts them as
    0, and the planner's forward on meta takes them wherever the CPU would) as its other
    attention kernels: q @ k^T and p @ v in full (no causal discount); and grouped matmuls."""
    import torch
    from torch.utils import flop_counter

    def forward(q, k, v, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(q, k, v)

    def backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out, q, k, v)

    aten = torch.ops.aten
    return flop_counter.FlopCounterMode(
        display=False,
        custom_mapping={
            aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
            aten._grouped_mm: _grouped_mm_flops,
        },
    )


def _grouped_mm_flops(a, b, *args, out_shape=None, **kwargs) -> int:
    """``torch._grouped_mm`` (mixture-of-experts layers: each token's rows by its expert's
    weights), which torch 2.13 does not count: 2 FLOPs per multiply-add of each output element
    over the contracted dimension; two 2-D operands are grouped over that dimension (the
    experts' weight gradients), so each of its elements works for one group."""
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * math.prod(out_shape) * a[-1]


def count(profile, *, micro_batch_size: int, seq_len: int, checkpointing: bool) -> Flops:
    """The ``Flops`` of ``profile``'s model (a ``saved.ActivationProfile``: the model on meta,
    how it is called, its units) at ``micro_batch_size`` samples (of ``seq_len`` tokens), run as
    the engine runs it (``checkpointing``: Hugging Face models without their key/value cache).
    Raises what the forward or backward raised."""
    import copy

    import torch

    from zeroshard.planner import saved
    from zeroshard.residual_states.activations import train_without_caches

    model = copy.deepcopy(profile.module).train()
    x, y = saved.batch(
        profile.call, profile.inputs, profile.vocab_size, micro_batch_size, seq_len, torch.float32
    )
    mode = counter()
    depth = inside = entered = 0  # open unit calls; FLOPs inside units; the count at the entry

    def enter(*_) -> None:
        nonlocal depth, entered
        if depth == 0:  # (a unit nested in another is counted with it)
            entered = mode.get_total_flops()
        depth += 1

    def leave(*_) -> None:
        nonlocal depth, inside
        depth -= 1
        if depth == 0:
            inside += mode.get_total_flops() - entered

    handles = train_without_caches(model) if checkpointing else []
    for name in profile.unit_names:
        unit = model.get_submodule(name)
        handles += [unit.register_forward_pre_hook(enter), unit.register_forward_hook(leave)]
    with saved.on_meta(), mode:
        try:
            loss = saved.loss_of(model, profile.call, x, y, profile.vocab_size)
        finally:  # (a reentrant checkpoint's recomputation in backward is not the forward)
            for h in handles:
                h.remove()
        forward = mode.get_total_flops()
        loss.backward()
    return Flops(forward=forward, backward=mode.get_total_flops() - forward, recomputed=inside)


def of_config(model, config) -> tuple[int, Flops | None]:
    """FLOPs of one micro-batch of ``config`` (a ``MemoryConfig``) for ``model`` (a
    ``ModelDescription``), and the count they come from: counted on the built model where it has
    a profile that runs there and counts some (recomputation included under activation
    checkpointing); else ``None`` and the paper's 8 * Psi * bsz * seq (with recomputation), from
    the shape when known."""
    from zeroshard.planner import bandwidth

    checkpointing = config.activation_checkpointing
    if model.activations is not None:
        try:
            counted = model.activations.flops(
                micro_batch_size=config.micro_batch_size,
                seq_len=config.seq_len,
                checkpointing=checkpointing,
            )
        except ValueError:  # its forward fails there: ``saved.problem`` says why
            counted = None
        total = 0 if counted is None else counted.per_iteration(checkpointing=checkpointing)
        if total:  # (none: no matmul or convolution, the only operations torch counts)
            return total, counted
    mb, seq = config.micro_batch_size, config.seq_len
    if model.shape is not None:
        s = model.shape
        return bandwidth.flops_per_iteration(
            micro_batch_size=mb, seq_len=seq, num_layers=s.num_layers, hidden_size=s.hidden_size
        ), None
    return bandwidth.flops_per_iteration_params(
        num_params=model.num_params, micro_batch_size=mb, seq_len=seq
    ), None
