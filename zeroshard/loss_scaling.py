"""Loss scaling: static and dynamic loss scalers, and the default one for a model's dtypes.

FP16's narrow range lets small gradients underflow: the loss is multiplied by a scale before
backward and the FP32 shard gradients divided by it before the step. A step whose gradients
hold inf/NaN on any rank is skipped (master weights and optimizer states untouched); a
``DynamicLossScaler`` then lowers the scale, and raises it again after ``growth_interval``
clean steps, as ``torch.amp.GradScaler`` does. ``GradScaling`` is the engine's side: the scale
of the loss whose gradients are being reduced, removed in the pass that averages them.

    zeroshard.optimizer(model, AdamW, lr=3e-4, loss_scaler=DynamicLossScaler(growth_interval=1000))
"""

from __future__ import annotations

import math
import numbers
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

NONFINITE_CAUSES = (
    "At stage 3 a parameter read outside its own unit's forward reads its NaN placeholder at "
    "rest: a penalty over model.parameters() in the loss (compute it in a module's forward), or "
    "a module using another unit's weight directly, e.g. F.linear(h, self.embed.weight) for a "
    "tied head (call the owning module, or wrap both in one unit); or run forward and backward "
    "inside `with zeroshard.summon_full_params(model):`. Otherwise lower the learning rate or "
    "look for inf/NaN in the data"
)
"""Why gradients hold inf/NaN when no loss scale is to blame (the skip warning's and the
dynamic scaler's error's advice)."""


@dataclass(kw_only=True)
class LossScaler:
    """Static loss scaling: ``backward`` multiplies the loss by ``scale``; ``step`` divides the
    FP32 shard gradients by it. Steps whose gradients hold inf/NaN on any rank are skipped when
    ``skip_nonfinite`` (master weights and optimizer states untouched)."""

    scale: float = 1.0
    """Loss multiplier (1.0: none, the default for FP32 and BF16)."""
    skip_nonfinite: bool = True
    """Skip a step whose gradients hold inf/NaN (costs one one-element all-reduce per step)."""
    num_skipped: int = field(default=0, init=False)
    """Steps skipped so far."""
    num_skipped_in_a_row: int = field(default=0, init=False)
    """Steps skipped since the last step taken."""
    warn_on_skip: bool = True
    """Warn at the 1st, 10th, 100th ... skipped step in a row (``skip_warning``): a static scale
    lowers nothing, so a skip repeats while its cause stays."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a positive finite number, got {self.scale}")

    @property
    def checks(self) -> bool:
        """Whether ``step`` must look for inf/NaN gradients."""
        return self.skip_nonfinite

    def claim(self, optimizer: object, holds: Callable[[Any], bool]) -> None:
        """Bind this scaler to the one optimizer whose ``step`` updates it. Shared by two, it was
        updated by each of their steps (a scale halved twice for one overflow, doubled every
        growth_interval / 2 clean steps): a ValueError while another optimizer that still
        ``holds`` gradients to step has it (one replaced by a rebuild hands it on)."""
        owner = getattr(self, "_owner", None)
        held = owner() if owner is not None else None
        if held is not None and held is not optimizer and holds(held):
            raise ValueError(
                f"this {type(self).__name__} already belongs to another zeroshard optimizer, "
                "whose step() updates it once per step: each optimizer needs a loss scaler of "
                "its own (loss_scaler=zeroshard.DynamicLossScaler()); the loss is scaled by the "
                "scaler of the optimizer whose backward() is called"
            )
        self._owner = weakref.ref(optimizer)

    def scale_for(self, loss: torch.Tensor) -> float:
        """The scale to multiply ``loss`` by: the loss's own gradient is the scale, in the
        loss's dtype, so above that dtype's range (FP16: 65504) every step would overflow. A
        static scale there is a ValueError."""
        if loss.dtype.is_floating_point and self.scale > torch.finfo(loss.dtype).max:
            raise ValueError(
                f"a loss scale of {self.scale:g} overflows the gradient of a {loss.dtype} loss "
                f"(at most {torch.finfo(loss.dtype).max:g}): compute the loss in FP32 "
                f"(loss.float()) or use a smaller scale"
            )
        return self.scale

    def update(self, found_inf: bool, *, scaled_here: bool = True) -> None:
        """Record one step's outcome (the same on every rank); ``scaled_here``: whether the
        gradients carry this scaler's scale (not another optimizer's, whose ``backward`` took
        the loss through this one's model too: that scaler is told, ``overflowed_elsewhere``)."""
        self.num_skipped += int(found_inf)
        self.num_skipped_in_a_row = self.num_skipped_in_a_row + 1 if found_inf else 0

    def overflowed_elsewhere(self) -> None:
        """Gradients of a loss this scaler scaled overflowed in a model that another optimizer
        steps (one loss through two models sharded apart): a static scale changes nothing."""

    def skip_warning(self) -> str | None:
        """After ``update``: what to warn about the step just skipped, at the 1st, 10th, 100th
        ... in a row (a run that skipped every step trained nothing without a word)."""
        n = self.num_skipped_in_a_row
        if not (self.warn_on_skip and n and 10 ** (len(str(n)) - 1) == n):
            return None
        too_large = (
            f"a static scale of {self.scale:g} may itself overflow FP16 gradients "
            "(DynamicLossScaler finds one that fits); "
            if self.scale > 1
            else ""
        )
        return (
            f"optimizer step skipped: gradients hold inf/NaN on some rank ({n} step(s) in a "
            f"row, {self.num_skipped} in all; master weights untouched). A static loss scale "
            f"lowers nothing, so steps stay skipped while the cause stays: {too_large}"
            f"{NONFINITE_CAUSES} (LossScaler(warn_on_skip=False) silences this)"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": type(self).__name__,
            "scale": self.scale,
            "num_skipped": self.num_skipped,
            "num_skipped_in_a_row": self.num_skipped_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state``; its scale only from a scaler of the same kind (a BF16 run's 1.0
        would leave an FP16 run at the minimum scale, an FP16 run's scale would stay on in
        FP32 for good). A streak of skipped steps goes on (its warnings, and the error at the
        minimum scale, count it as the uninterrupted run does)."""
        self.num_skipped = int(state.get("num_skipped", 0))
        self.num_skipped_in_a_row = int(state.get("num_skipped_in_a_row", 0))
        if self.same_kind(state):
            self.scale = float(state["scale"])

    def same_kind(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` came from a scaler of this one's class (older states, without a
        ``kind``: told apart by the dynamic scaler's own fields; ``torch.amp.GradScaler``'s is
        dynamic)."""
        dynamic = "clean_steps" in state or "_growth_tracker" in state
        kind = state.get("kind", "DynamicLossScaler" if dynamic else "LossScaler")
        return kind == type(self).__name__


@dataclass(kw_only=True)
class DynamicLossScaler(LossScaler):
    """Dynamic loss scaling for FP16: start at ``init_scale``; on a step with inf/NaN gradients
    skip it and multiply the scale by ``backoff_factor``; after ``growth_interval`` clean steps
    in a row multiply it by ``growth_factor``. A non-finite gradient at ``min_scale`` raises
    ``FloatingPointError``: the model diverged, no scale can fix it."""

    init_scale: float = 2.0**16
    """First scale (``scale`` starts here)."""
    growth_factor: float = 2.0
    """Multiplier after ``growth_interval`` clean steps."""
    backoff_factor: float = 0.5
    """Multiplier on a step with inf/NaN gradients."""
    growth_interval: int = 2000
    """Clean steps in a row before the scale grows."""
    hysteresis: int = 1
    """Consecutive inf/NaN steps before the scale is lowered (each one is still skipped);
    1 lowers it at once. A clean step restores the count."""
    min_scale: float = 1.0
    """The scale never goes below this; inf/NaN gradients here raise ``FloatingPointError``."""
    max_scale: float = 2.0**24
    """The scale never grows above this."""
    skip_nonfinite: bool = field(default=True, init=False)
    warn_on_skip: bool = field(default=False, init=False)
    """Off: lowering the scale is the remedy, and at its minimum it raises."""
    scale: float = field(default=0.0, init=False)
    _clean_steps: int = field(default=0, init=False, repr=False)
    _hysteresis_left: int = field(default=0, init=False, repr=False)
    _losses: int = field(default=0, init=False, repr=False)  # losses scaled so far
    _own_inf_for: int = field(default=-1, init=False, repr=False)  # (which loss's overflow
    _foreign_inf_for: int = field(default=-1, init=False, repr=False)  # was seen where)
    _before_clean: tuple = field(default=(-1,), init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {value!r}")
        for name in ("growth_interval", "hysteresis"):  # (2.5 acted as 3, True as 1)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, as torch.amp.GradScaler's, got {value!r}")
        # (an infinite scale makes every gradient inf: each step skipped, then the error at a
        # minimum scale that is infinite too; LossScaler(scale=inf) is refused likewise)
        if not 0 < self.min_scale <= self.init_scale <= self.max_scale < math.inf:
            raise ValueError(
                "need 0 < min_scale <= init_scale <= max_scale < inf, got "
                f"{self.min_scale}, {self.init_scale}, {self.max_scale}"
            )
        if self.growth_factor <= 1 or not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"need growth_factor > 1 and 0 < backoff_factor < 1, got {self.growth_factor} "
                f"and {self.backoff_factor}"
            )
        if self.growth_interval < 1 or self.hysteresis < 1:
            raise ValueError(
                f"growth_interval and hysteresis must be >= 1, got {self.growth_interval} and "
                f"{self.hysteresis}"
            )
        self.scale = float(self.init_scale)
        self._hysteresis_left = self.hysteresis

    def scale_for(self, loss: torch.Tensor) -> float:
        """The scale, kept within what a ``loss`` of its dtype carries as its gradient."""
        self.fit(loss.dtype)
        self._losses += 1
        return self.scale

    def fit(self, dtype: torch.dtype) -> None:
        """Keep the scale (and ``max_scale``) at most the largest power of two of ``dtype``: a
        loss, or any scalar on its way to it, in that dtype carries the scale itself as its
        gradient (FP16: 2**15; at 2**16 every step was skipped, and again at each growth).
        ``default_scaler`` fits it to FP16 for a model computing in FP16."""
        cap = _largest_power_of_two(dtype)
        self.max_scale = min(self.max_scale, max(cap, self.min_scale))
        self.scale = min(self.scale, self.max_scale)

    def update(self, found_inf: bool, *, scaled_here: bool = True) -> None:
        super().update(found_inf)
        if not scaled_here:
            return  # another scaler's scale: that one lowers (``overflowed_elsewhere``)
        if found_inf:
            self._own_inf_for = self._losses
            if self._foreign_inf_for != self._losses:  # (once per loss, as one torch scaler)
                self._lower()
            return
        if self._foreign_inf_for == self._losses:
            return  # this loss overflowed in another model: not a clean step
        # Undone if the other model's step, later, finds this loss overflowed there.
        self._before_clean = (self._losses, self.scale, self._clean_steps, self._hysteresis_left)
        self._clean_steps += 1
        self._hysteresis_left = self.hysteresis
        if self._clean_steps >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, self.max_scale)
            self._clean_steps = 0

    def overflowed_elsewhere(self) -> None:
        """Lower the scale for an overflow of this scaler's loss in a model another optimizer
        steps (its skip decision is its own, as ``torch.amp.GradScaler.step`` per optimizer;
        the scale is lowered once per loss, as by one scaler's ``update()`` after both steps)."""
        if self._losses in (self._own_inf_for, self._foreign_inf_for):
            return
        self._foreign_inf_for = self._losses
        if self._before_clean[0] == self._losses:  # counted clean by this one's own step
            self.scale, self._clean_steps, self._hysteresis_left = self._before_clean[1:]
        self._lower()

    def _lower(self) -> None:
        self._clean_steps = 0
        if self.scale <= self.min_scale:
            raise FloatingPointError(
                f"gradients hold inf/NaN at the minimum loss scale {self.min_scale} "
                f"({self.num_skipped_in_a_row} step(s) skipped in a row): no scale clears "
                f"them, so FP16's range is not the cause. {NONFINITE_CAUSES}; if the loss was "
                "finite until lately, training diverged: lower the learning rate, clip "
                "gradients, or train in bf16"
            )
        self._hysteresis_left -= 1
        if self._hysteresis_left <= 0:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return dict(
            super().state_dict(),
            clean_steps=self._clean_steps,
            hysteresis_left=self._hysteresis_left,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if not self.same_kind(state):
            return
        # torch.amp.GradScaler's state: its clean steps and settings, as its load_state_dict does.
        self._clean_steps = int(state.get("clean_steps", state.get("_growth_tracker", 0)))
        # (at most this scaler's own: one of hysteresis 1 lowers at once, whatever it loads)
        left = int(state.get("hysteresis_left", self.hysteresis))
        self._hysteresis_left = min(left, self.hysteresis)
        for name in ("growth_factor", "backoff_factor", "growth_interval"):
            if "_growth_tracker" in state and name in state:
                setattr(self, name, type(getattr(self, name))(state[name]))


@dataclass
class GradScaling:
    """The loss scale that every bucket removes from its reduced gradient in the one pass that
    averages it (and raises the bucket's ``found_inf`` in, so that the optimizer's skip decision
    costs no extra pass over the gradients). One per engine, shared by its buckets."""

    loss_scale: float = 1.0  # what the loss was multiplied by before the backward
    next_scale: float | None = None  # set by ``ShardedOptimizer.backward``: its loss's scale
    next_scaler: LossScaler | None = None  # and the scaler it came from
    scaler: LossScaler | None = None  # the last backward's (None: a plain one, unscaled)
    accumulating: bool = False  # an earlier backward's gradients wait unreduced (micro-step)
    warn_unscaled: bool = False  # the optimizer scales losses (FP16): a plain backward warns

    def reset(self) -> None:
        self.accumulating = False

    def begin_backward(self) -> None:
        """At a backward's start: its loss's scale (1 for a plain ``loss.backward()``) is the
        one its reduction removes, and must be that of unreduced gradients it adds to."""
        plain, scale = self.next_scale is None, self.next_scale or 1.0
        self.scaler, self.next_scale, self.next_scaler = self.next_scaler, None, None
        if plain and self.warn_unscaled:
            self.warn_unscaled = False  # once
            warnings.warn(
                "a backward outside opt.backward(loss) with FP16 loss scaling: its loss is not "
                "scaled, so small gradients may underflow to zero; call opt.backward(loss) (and "
                "opt.backward(loss, sync=False) for accumulation micro-steps)",
                stacklevel=2,
            )
        if self.accumulating and scale != self.loss_scale:
            raise ValueError(
                f"this backward's loss is scaled by {scale:g} but the unreduced gradients it "
                f"adds to by {self.loss_scale:g} (opt.backward scales by the loss scaler's "
                "scale, a plain loss.backward() does not): use opt.backward(loss, sync=False) "
                "for every accumulation micro-step and opt.backward(loss) for the last"
            )
        self.loss_scale = scale


def _largest_power_of_two(dtype: torch.dtype) -> float:
    """The largest power of two that ``dtype`` holds (inf for a non-float dtype)."""
    if not dtype.is_floating_point:
        return math.inf
    return math.ldexp(1.0, math.frexp(torch.finfo(dtype).max)[1] - 1)


def default_scaler(param_dtypes: set[torch.dtype], given: LossScaler | None = None) -> LossScaler:
    """``given``, or dynamic scaling when any gradient is computed in FP16, else none (skip on
    inf/NaN); a dynamic one of an FP16 model kept within FP16 (``fit``: an FP32 loss of FP16
    terms overflows at 2**16 too)."""
    fp16 = torch.float16 in param_dtypes
    scaler = given or (DynamicLossScaler() if fp16 else LossScaler())
    if fp16 and isinstance(scaler, DynamicLossScaler):
        scaler.fit(torch.float16)
    return scaler
