"""Arithmetic intensity and efficiency of streaming model states and activations from slower
memory, after the ZeRO-Infinity paper (§8).

With Psi = 12 * nl * hd^2, one iteration computes 2 * 4 * 12 * bsz * seq * nl * hd^2 FLOPs
(forward 1, backward 2, recomputation 1; 2 FLOPs per multiply-add). Dividing by the bytes each
category moves per iteration gives its arithmetic intensity (ait, FLOPs per byte):

- parameters and gradients, 2 * 4 * Psi bytes (fp16: three loads and one store): ait = seq * bsz;
- optimizer states, 2 * 16 * Psi bytes (read and write): ait = seq * bsz / 4;
- activation checkpoints, 4 * (nl / ci) * hd * seq * bsz bytes: ait = 24 * hd * ci.

Without overlap, a device that computes at ``peak`` FLOP/s and moves data at ``bw`` bytes/s spends
FLOPs / peak computing and FLOPs / (ait * bw) waiting, so efficiency = ait * bw / (ait * bw + peak).
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.planner.describe import TransformerShape

CATEGORIES = ("params_grads", "optimizer_states", "activation_checkpoints")
"""The streams the paper analyses, in its order."""


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


def flops_per_iteration(
    *, micro_batch_size: int, seq_len: int, num_layers: int, hidden_size: int
) -> int:
    """2 * 4 * 12 * bsz * seq * nl * hd^2 FLOPs, with activation recomputation."""
    return 2 * 4 * 12 * micro_batch_size * seq_len * num_layers * hidden_size**2


def flops_per_iteration_params(*, num_params: int, micro_batch_size: int, seq_len: int) -> int:
    """The same count for a model known only by Psi: 8 * Psi * bsz * seq."""
    return 8 * num_params * micro_batch_size * seq_len


def ait_params_grads(*, micro_batch_size: int, seq_len: int) -> float:
    """seq * bsz FLOPs per byte of fp16 parameters and gradients moved."""
    return float(seq_len * micro_batch_size)


def ait_optimizer_states(*, micro_batch_size: int, seq_len: int) -> float:
    """seq * bsz / 4 FLOPs per byte of optimizer states moved (16 bytes per parameter, twice)."""
    return seq_len * micro_batch_size / 4


def ait_activation_checkpoints(*, hidden_size: int, num_layers_per_checkpoint: int) -> float:
    """24 * hd * ci FLOPs per byte of activation checkpoints moved."""
    return float(24 * hidden_size * num_layers_per_checkpoint)


def efficiency(ait: float, bandwidth_bytes_per_s: float, peak_flops: float) -> float:
    """ait * bw / (ait * bw + peak): the fraction of time computing when nothing overlaps."""
    _positive("ait", ait)
    _positive("bandwidth", bandwidth_bytes_per_s)
    _positive("peak FLOP/s", peak_flops)
    return ait * bandwidth_bytes_per_s / (ait * bandwidth_bytes_per_s + peak_flops)


def required_bandwidth(ait: float, peak_flops: float, target_efficiency: float) -> float:
    """Bytes/s needed for ``target_efficiency``: eff * peak / (ait * (1 - eff))."""
    _positive("ait", ait)
    _positive("peak FLOP/s", peak_flops)
    if not 0 < target_efficiency < 1:
        raise ValueError(f"target efficiency must be in (0, 1), got {target_efficiency!r}")
    return target_efficiency * peak_flops / (ait * (1 - target_efficiency))


@dataclass(frozen=True, kw_only=True)
class Intensity:
    """Arithmetic intensity (FLOPs per byte moved) of each stream, for one configuration."""

    params_grads: float
    """seq * bsz (the model's FLOPs / 8 Psi where they were counted)."""
    optimizer_states: float
    """seq * bsz / 4 (FLOPs / 32 Psi)."""
    activation_checkpoints: float | None
    """24 * hd * ci (FLOPs / twice the measured checkpoints); None without a transformer shape
    or measured checkpoints."""

    def as_dict(self) -> dict[str, float | None]:
        return {c: getattr(self, c) for c in CATEGORIES}

    def efficiencies(
        self, bandwidth_bytes_per_s: float, peak_flops: float
    ) -> dict[str, float | None]:
        """Efficiency of each stream at one bandwidth (None where the ait is unknown)."""
        return {
            c: None if a is None else efficiency(a, bandwidth_bytes_per_s, peak_flops)
            for c, a in self.as_dict().items()
        }

    def required_bandwidths(
        self, peak_flops: float, target_efficiency: float
    ) -> dict[str, float | None]:
        """Bandwidth each stream needs for ``target_efficiency``."""
        return {
            c: None if a is None else required_bandwidth(a, peak_flops, target_efficiency)
            for c, a in self.as_dict().items()
        }


def intensity(
    *,
    micro_batch_size: int,
    seq_len: int,
    shape: TransformerShape | None = None,
    num_layers_per_checkpoint: int = 1,
    counted_flops: int | None = None,
    num_params: int | None = None,
    checkpoint_bytes: int | None = None,
) -> Intensity:
    """The three intensities; the activation one needs the transformer ``shape``. With
    ``counted_flops`` (one iteration's FLOPs counted on the built model, ``flops.of_config``) and
    ``num_params`` (Psi), the paper's bytes per stream divide the model's own FLOPs instead of
    the GPT's: flops / (8 Psi) and flops / (32 Psi); and with ``checkpoint_bytes`` (the
    checkpoints of one micro-batch, measured, each written once and read once),
    flops / (2 * checkpoint_bytes)."""
    _positive("micro_batch_size", micro_batch_size)
    _positive("seq_len", seq_len)
    _positive("num_layers_per_checkpoint", num_layers_per_checkpoint)
    act = None
    if shape is not None:
        act = ait_activation_checkpoints(
            hidden_size=shape.hidden_size,
            num_layers_per_checkpoint=min(num_layers_per_checkpoint, shape.num_layers),
        )
    if counted_flops is not None:
        _positive("num_params", num_params)
        if checkpoint_bytes:
            act = counted_flops / (2 * checkpoint_bytes)
        return Intensity(
            params_grads=counted_flops / (8 * num_params),
            optimizer_states=counted_flops / (32 * num_params),
            activation_checkpoints=act,
        )
    return Intensity(
        params_grads=ait_params_grads(micro_batch_size=micro_batch_size, seq_len=seq_len),
        optimizer_states=ait_optimizer_states(micro_batch_size=micro_batch_size, seq_len=seq_len),
        activation_checkpoints=act,
    )


def combined_efficiency(
    aits: list[float], bandwidths_bytes_per_s: list[float], peak_flops: float
) -> float:
    """Efficiency when several streams are waited on one after another (no overlap):
    1 / (1 + sum(peak / (ait_i * bw_i))). One stream gives ``efficiency``."""
    _positive("peak FLOP/s", peak_flops)
    wait = 0.0
    for ait, bw in zip(aits, bandwidths_bytes_per_s, strict=True):
        _positive("ait", ait)
        _positive("bandwidth", bw)
        wait += peak_flops / (ait * bw)
    return 1 / (1 + wait)
