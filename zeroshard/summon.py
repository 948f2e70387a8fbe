"""``summon_full_params``: every parameter of a sharded model gathered at once, outside forward
and backward (an EMA update, a weight inspection, a forward of the whole model by hand), with its
writes taken into the FP32 masters on exit, or undone."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from zeroshard import generation
from zeroshard.engine import Engine, Phase
from zeroshard.model_states import param_checks


@contextlib.contextmanager
def summon_full_params(engine: Engine, *, writeback: bool = True) -> Iterator[None]:
    """Every parameter of ``engine``'s model gathered, as views in ``param_dtype`` with their
    own shapes. Forward (and backward) inside work and keep everything gathered. With
    ``writeback``, elements written inside are copied into the FP32 masters on exit (unchanged
    elements keep their full-precision master values), so the next step and gather see them;
    without, undone. Nested, a level inside one without ``writeback`` writes nothing back:
    the outer one undoes its writes too."""
    engine.check_thread()  # (before the checks below take another thread's step as over)
    engine._after_interrupted_forward()  # (Ctrl-C'd, which runs no hook of torch's: over)
    engine._after_raised_backward()  # (a backward that raised, caught: over too)
    engine.check_trusted()
    if engine.phase is not Phase.IDLE:
        raise RuntimeError("summon_full_params cannot be entered inside forward or backward")
    engine.adopt_writes()  # (and a write to a parameter at rest is an error before any gather)
    gathered = [u for u in engine.units if u.is_sharded]
    for u in gathered:
        u.unshard(async_op=False)
        u.wait_unshard()
    # Gathered whole, the model runs no collective of zeroshard's: transformers' generate() need
    # not keep the ranks stepping together (synced_gpus, which its FSDP mark turns on), so one
    # rank can generate alone (rank 0's evaluation; it hung in a collective the others never
    # joined). A tensor-parallel forward still all-reduces: every rank of a tp group runs it.
    marked = [m for m in engine.model.modules() if getattr(m, generation.MARK, 0)]
    marked = marked if not engine.summoned else []
    for m in marked:
        setattr(m, generation.MARK, False)
    # Inside a level that discards, nothing reaches the masters: the outermost discarding
    # level decides (an inner writeback=True, a helper's own summon, kept its writes there);
    # its writes stay visible until that level's exit undoes them.
    keep = writeback and not engine.discarding
    engine.summoned += 1
    engine.discarding += not writeback
    raised = False
    try:
        nested = engine.summoned > 1
        with param_checks.discarding_writes(
            engine.flat_params, discard=not writeback, nested=nested
        ):
            yield
    except BaseException:
        raised = True  # (its own error goes first; not sys.exc_info(): a caller's except block)
        raise
    finally:
        engine.summoned -= 1
        engine.discarding -= not writeback
        problem = None
        if keep:
            with torch.no_grad():
                # data replaced inside (p.data = ..., a parametrization baked): taken; another
                # dtype or shape: raised once resharded
                problem = param_checks.check_views(engine.flat_params)
                for f in engine.flat_params:
                    f.write_back()
        if not engine.summoned:
            for u in engine.units:
                u.reshard()
        for m in marked:
            setattr(m, generation.MARK, True)
        if keep:
            engine.params_changed()
        if problem is not None and not raised:
            raise problem
