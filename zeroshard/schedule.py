"""Learning-rate schedules of ``zeroshard train``: a linear warm-up, then cosine, linear or
constant.

``lr_at`` is a pure function of the step, so a resumed run gets the same learning rates without
saving any scheduler state. Steps count optimizer steps from 0 (one step may hold several
micro-batches of gradient accumulation).
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "linear", "constant")
"""Shapes after the warm-up: cosine and linear decay from the peak to ``final_fraction`` of it
at the last step; constant keeps the peak."""


def lr_at(
    step: int,
    *,
    peak_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    schedule: str = "cosine",
    final_fraction: float = 0.1,
) -> float:
    """Learning rate of optimizer step ``step`` (0-based) out of ``total_steps``.

    Steps ``0 .. warmup_steps - 1`` rise linearly to ``peak_lr`` (step ``i`` gets
    ``peak_lr * (i + 1) / warmup_steps``); after it ``schedule`` takes over: ``cosine`` and
    ``linear`` reach ``peak_lr * final_fraction`` at the last step, ``total_steps - 1``, and stay
    there, ``constant`` stays at ``peak_lr``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak_lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps))
    if warmup_steps and step >= total_steps - 1:  # (also when it follows the warm-up's end
        progress = 1.0  # at once: it had stayed at the peak; a one-step run stays there)
    if schedule == "cosine":
        shape = 0.5 * (1 + math.cos(math.pi * progress))  # 1 -> 0
    else:
        shape = 1.0 - progress
    return peak_lr * (final_fraction + (1 - final_fraction) * shape)
