"""Which optimizer owns which gradient bucket, when several optimizers share one model.

torch's optimizers each act on their own parameters: ``opt_a.zero_grad()`` leaves ``opt_b``'s
gradients for ``opt_b.step()``, in either order. Here gradients live in buckets (a unit's flat
gradient at stage 3; consecutive units' at stages 0-2, up to ``ShardConfig.bucket_bytes``), so
each bucket records its owners: the live optimizers holding some of its parameters. An
optimizer built over parameters that an older one holds in a bucket, all of them, replaces it
there (an optimizer built anew, e.g. after a checkpoint is loaded, while the old object lives
on in a scheduler); owners of distinct parameters of one bucket share it. A replaced optimizer
that is used again (``step``, ``zero_grad``: a head's optimizer, then one over the whole
model) takes its buckets back as if built anew (``reclaim``), so each acts on the gradients of
its own parameters, as torch's do.

- ``zero_grad`` drops the buckets its optimizer owns alone; in a bucket shared with another
  optimizer it zeroes its own parameters' gradients only, keeping the memory (``opt_a.step();
  opt_a.zero_grad(); opt_b.step()`` and a GAN's ``zero_grad; backward; step`` per optimizer
  are both exact).
- Each bucket has its own inf/NaN flag (``GradBucket.found_inf``) and a step looks at those of
  its optimizer's buckets only: one optimizer's overflow skips that optimizer's step, not the
  others' (one stepped every k iterations keeps its flag until it zeroes its gradients). A
  shared bucket's flag is reset once every owner has zeroed its part, so no step misses an
  overflow of its own gradients; an overflow in another owner's part of a shared bucket skips
  both (the flag is per bucket, not per parameter).
- ``step_in_backward`` hands a bucket's whole reduced shard to one optimizer during backward:
  a bucket it would share with another owner is refused (``claim``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeroshard.model_states.grads import GradBucket
    from zeroshard.model_states.optimizer import ShardedOptimizer


def _owners(bucket: GradBucket) -> list[ShardedOptimizer]:
    return [o for o in (r() for r in bucket.owners) if o is not None]


def _ids(bucket: GradBucket) -> set[int]:
    return {id(slot.param) for slot in bucket.flat.slots}


def owns_any(optimizer: ShardedOptimizer) -> bool:
    """Whether ``optimizer`` still owns a bucket (not replaced everywhere by a newer one)."""
    return any(optimizer in _owners(b) for b in optimizer.engine.buckets)


def claim(optimizer: ShardedOptimizer, step_in_backward: bool) -> list[GradBucket]:
    """Make ``optimizer`` (its parameters' ``id``s in ``optimizer._param_ids``) an owner of
    every bucket holding some of them; returns those buckets. A ValueError naming the fix, and
    nothing changed, when one of them would be shared with another owner while either steps
    during backward. Decided from the parameters alone: the same on every rank."""
    engine, params = optimizer.engine, optimizer._param_ids
    plan = []
    for b in engine.buckets:
        ids = _ids(b)
        if not ids & params:
            continue
        kept = [o for o in _owners(b) if o is not optimizer and (ids & o._param_ids) - params]
        if kept and (step_in_backward or any(o._backward_step is not None for o in kept)):
            split = "wrap the parts as units of their own"
            if not engine.partition.parameters:  # stages 0-2: units share flat buckets
                split += " with ShardConfig(bucket_bytes=0) (a bucket per unit)"
            raise ValueError(
                f"step_in_backward: the parameters of {b.flat.name!r} are split between two "
                "optimizers, and one of them steps during backward, which hands their whole "
                "gradient to one optimizer; give them all to one optimizer (param groups set "
                f"their own lr, weight decay...), {split}, or drop step_in_backward (the other "
                "one an optimizer you replace? delete it, and whatever holds it such as its "
                "learning-rate scheduler, before building the new one)"
            )
        plan.append((b, kept))
    _refuse_half_replacing(optimizer, plan)
    for b, kept in plan:
        if not kept and b.handoff is not None and b.consumed_at_handoff:
            b.on_reduce = b.handoff = None  # a replaced optimizer that stepped in backward
            b.consumed_at_handoff = False
        b.owners = [weakref.ref(o) for o in (*kept, optimizer)]
    return [b for b, _ in plan]


def _refuse_half_replacing(
    optimizer: ShardedOptimizer, plan: list[tuple[GradBucket, list[ShardedOptimizer]]]
) -> None:
    """A ValueError when ``optimizer`` would replace one that steps in backward in some of its
    buckets and leave it the others: torch's replaced optimizer acts no more, that one would
    go on updating the others in every backward (kept alive by a learning-rate scheduler)."""
    taken = {id(b) for b, _ in plan}
    for b, kept in plan:
        for old in _owners(b):
            if old is optimizer or old in kept or old._backward_step is None:
                continue
            left = [o.flat.name for o in old._buckets if id(o) not in taken and old in _owners(o)]
            if left:
                raise ValueError(
                    "this optimizer replaces an older one that steps in backward "
                    f"(step_in_backward) over {b.flat.name!r} but not over {left[0]!r}"
                    f"{f' and {len(left) - 1} more' if len(left) > 1 else ''}, which the older "
                    "one would go on updating in every backward: delete the older optimizer "
                    "and whatever holds it (its learning-rate scheduler: del sched, opt) before "
                    "building this one, or build this one over all of its parameters"
                )


def reclaim(optimizer: ShardedOptimizer) -> None:
    """Before ``optimizer`` steps or zeroes: where a newer optimizer replaced it, it claims its
    buckets again (``claim``; nothing changes where it owns them all). The same on every rank:
    the calls are the program's."""
    params, stale = (
        optimizer._param_ids,
        [b for b in optimizer._buckets if optimizer not in _owners(b)],
    )
    for b in stale:
        ids = _ids(b)
        displaced = [o for o in _owners(b) if not (ids & o._param_ids) - params]
        if any(o._backward_step is not None for o in displaced):
            raise ValueError(
                "this optimizer was replaced by a newer one over its parameters that steps in "
                "backward (step_in_backward): used again, it would take that one's gradients "
                "from it. Use the newer one, or give the two optimizers distinct parameters"
            )
    if stale:
        claim(optimizer, optimizer._backward_step is not None)


def zero_grad(optimizer: ShardedOptimizer, set_to_none: bool) -> None:
    """``optimizer.zero_grad``'s effect on the buckets and the inf/NaN flag (module docstring):
    its own buckets (and those no optimizer owns) are dropped, in a shared one only its
    parameters' gradients are zeroed."""
    engine = optimizer.engine
    others = False  # another optimizer's gradients remain
    for b in engine.buckets:
        owners = _owners(b)
        others = others or any(o is not optimizer for o in owners)
        if not owners or owners == [optimizer]:
            b.zero(keep_touched=not set_to_none)
        elif optimizer in owners:
            mine = [i for i, s in enumerate(b.flat.slots) if id(s.param) in optimizer._param_ids]
            b.zero_slots(mine, keep_touched=not set_to_none)
            # Once the current owners' parameters are all zeroed (by any of them: they may
            # overlap), nothing that raised the flag is left.
            b.zeroed.update(mine)
            held = {
                i for o in owners for i, s in enumerate(b.flat.slots) if id(s.param) in o._param_ids
            }
            if held <= b.zeroed:
                b.found_inf.zero_()
                b.zeroed.clear()
    if not others:  # no gradient is left waiting: the next backward may use another scale
        engine.scaling.reset()
