"""``summon_full_params``: every parameter of a sharded model gathered at once, outside forward
and backward (an EMA update, a weight inspection, a forward of the whole model by hand), with its
writes taken into the FP32 masters on exit, or undone."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from zeroshard.engine import Engine, Phase
from zeroshard.model_states import flat_param


@contextlib.contextmanager
def summon_full_params(engine: Engine, *, writeback: bool = True) -> Iterator[None]:
    """Every parameter of ``engine``'s model gathered, as views in ``param_dtype`` with their
    own shapes. Forward (and backward) inside work and keep everything gathered. With
    ``writeback``, elements written inside are copied into the FP32 masters on exit (unchanged
    elements keep their full-precision master values), so the next step and gather see them;
    without, undone."""
    if engine.phase is not Phase.IDLE:
        raise RuntimeError("summon_full_params cannot be entered inside forward or backward")
    engine.adopt_writes()  # (and a write to a parameter at rest is an error before any gather)
    gathered = [u for u in engine.units if u.is_sharded]
    for u in gathered:
        u.unshard(async_op=False)
        u.wait_unshard()
    engine.summoned += 1
    engine.discarding += not writeback
    try:
        nested = engine.summoned > 1
        with flat_param.discarding_writes(engine.flat_params, discard=not writeback, nested=nested):
            yield
    finally:
        engine.summoned -= 1
        engine.discarding -= not writeback
        if writeback:
            with torch.no_grad():
                for f in engine.flat_params:
                    f.write_back()
        if not engine.summoned:
            for u in engine.units:
                u.reshard()
        if writeback:
            engine.params_changed()
