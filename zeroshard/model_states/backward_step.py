"""The optimizer step inside backward (``zeroshard.optimizer(..., step_in_backward=True)``).

With partitioned gradients (stages 2-3) every rank holds, at the end of a plain backward, the
reduced FP32 shard of every gradient (4 Psi / N bytes) next to the masters and optimizer states:
that is why the stage-3 peak falls at the end of backward. Here a sub-group steps as soon as
its bucket's reduction finishes (``GradBucket.handoff``) and its shard is dropped right after, so
backward holds the shards of the reductions in flight only: the peak loses up to 4 Psi / N bytes
(PyTorch's "optimizer in backward", for a sharded optimizer).

What changes for the caller (each refused with a clear error where it would be wrong):

- ``step()`` finishes the step (agrees on inf/NaN, refreshes parameters); the updates were
  applied during ``backward``. A second backward before ``step()`` is an error: accumulate
  gradients with ``backward(loss, sync=False)`` for all micro-batches but the last.
- Every update of a step sees the hyperparameters (LR) current at its ``backward``; one changed
  between that ``backward`` and ``step()`` (which a plain step would use) is an error at
  ``step()`` (it was ignored without a word).
- An update consumes its gradients: a backward after ``step()`` without ``zero_grad()`` (which
  torch would add to the gradients already applied) is an error naming the fix.
- Global-norm clipping needs every gradient before any update: refused.
- FP16's dynamic loss scaling must skip whole steps: refused (train in bf16 or fp32).
- Non-finite values never reach a master: a rank leaves its shard of a bucket untouched once
  it has seen inf/NaN in this backward, and every rank does so from the bucket after the first
  rank to see one. Earlier buckets have stepped; ``step()`` returns False (counted as skipped,
  so divergence is still reported).
- Parameters that no rank's backward reached are left out of the step, as in a plain step; a
  backward that reaches none of a unit's (``torch.autograd.grad`` of the inputs) is no update.
- Only the optimizer whose ``backward()`` runs (or any, for a plain ``loss.backward()``) steps
  in it: another's gradients accumulate, as torch's ``.grad`` do, until its ``step()`` or
  ``zero_grad()`` (a GAN's generator loss reaches the discriminator's parameters too: run it
  through the generator's optimizer, or a plain backward steps the discriminator on it).

Both rest on one small all-reduce (MAX) per bucket of [inf/NaN seen so far, a flag per
parameter reached], started with the bucket's reduce-scatter and waited for when it finishes,
so that it overlaps the reduction instead of stopping every rank at each unit.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from zeroshard import collectives as C
from zeroshard.loss_scaling import DynamicLossScaler
from zeroshard.model_states.agreement import agree, agreed
from zeroshard.model_states.grads import GradBucket, Reduction
from zeroshard.model_states.optimizer_args import user_stacklevel

if TYPE_CHECKING:
    from zeroshard.model_states.optimizer import ShardedOptimizer


def check_step_in_backward(optimizer: ShardedOptimizer) -> None:
    """A ValueError naming the fix when ``optimizer`` cannot step inside backward."""
    engine = optimizer.engine
    if not engine.partition.gradients:
        raise ValueError(
            f"step_in_backward needs partitioned gradients (stage 2 or 3); at stage "
            f"{engine.stage} every rank keeps the whole gradient until the step, so stepping "
            "early frees nothing. Use stage 2 or 3, or drop step_in_backward"
        )
    if isinstance(optimizer.loss_scaler, DynamicLossScaler):
        raise ValueError(
            "step_in_backward cannot be combined with FP16 dynamic loss scaling, which must "
            "skip whole steps; train in bf16 or fp32, or drop step_in_backward"
        )
    offload = getattr(engine, "offload", None)
    if offload is not None and "nvme" in (offload.optimizer, offload.gradients):
        raise ValueError(
            "step_in_backward steps each sub-group during backward; states or gradients on "
            "NVMe are streamed in step order. Drop step_in_backward or keep them in memory"
        )


class BackwardStep:
    """Steps ``optimizer``'s sub-groups as their buckets' reductions finish (module docstring).
    Takes over ``buckets``, those holding the optimizer's parameters (``bucket_owners.claim``)."""

    def __init__(self, optimizer: ShardedOptimizer, buckets: list[GradBucket]) -> None:
        engine = optimizer.engine
        self._optimizer = weakref.ref(optimizer)  # the buckets must not keep it alive
        self._subgroups = {id(sg.bucket): sg for sg in optimizer._subgroups}
        # First index of each bucket's slots among the engine's trainable slots.
        self._first_slot: dict[int, int] = {}
        index = 0
        for b in engine.buckets:
            self._first_slot[id(b)] = index
            index += len(b.touched)
        self.stepped: set[int] = set()
        """Buckets (ids) stepped since the last ``step()`` / ``zero_grad()``."""
        self.dropped: set[int] = set()
        """Of them, those a submodule's ``zero_grad()`` reached since (all of them: the
        backward's step is over, as after the optimizer's own ``zero_grad``)."""
        self.consumed: dict[int, int] = {}
        """Per bucket (id) whose gradients a ``step()`` applied and freed: its ``zeroings`` then
        (one since: a ``zero_grad``, the optimizer's, the model's or a submodule's, followed)."""
        self._flags: dict[int, C.Handle] = {}  # per bucket: its agreement in flight
        self._used: dict[int, dict] = {}
        """Per user param group stepped since ``reset``: the hyperparameters it stepped with."""
        self._seen = torch.zeros(1, dtype=torch.float32, device=engine.mesh.device)
        """(1,) FP32, this rank: > 0 once a bucket reduced in this backward held inf/NaN."""
        ref = self._optimizer

        def on_reduce(bucket: GradBucket) -> None:
            if ref() is not None:
                self._agree(bucket)

        def handoff(bucket: GradBucket) -> None:
            if ref() is not None:
                self._reduced(bucket)

        for b in buckets:
            assert b.reduction is Reduction.SCATTER_AND_FREE
            b.on_reduce, b.handoff = on_reduce, handoff
            b.consumed_at_handoff = True

    def _agree(self, bucket: GradBucket) -> None:
        """Start the bucket's agreement: [inf/NaN seen so far on this rank, a flag per parameter
        of the bucket that this rank's backward reached], MAX over every rank."""
        optimizer = self._optimizer()
        assert optimizer is not None
        engine = optimizer.engine
        touched = [bucket.reached, *bucket.touched]  # (reached: not zero_grad's kept zeros)
        touched = torch.tensor(touched, dtype=torch.float32, device=engine.mesh.device)
        self._flags[id(bucket)] = agree(
            self._seen.clone(), touched, engine.mesh, engine.ledger, async_op=True
        )

    def _reduced(self, bucket: GradBucket) -> None:
        """The bucket's reduced shard is in ``shard_grad``: step its sub-group, drop the shard."""
        optimizer = self._optimizer()
        assert optimizer is not None
        engine = optimizer.engine
        flags = self._flags.pop(id(bucket)).wait()
        seen, (reached, *touched) = agreed(flags, engine.forget_order, stepped=len(self.stepped))
        torch.maximum(self._seen, bucket.found_inf, out=self._seen)
        if not reached:  # no rank's backward reached it since zero_grad (``torch.autograd.grad``
            bucket.shard_grad = None  # of the inputs alone): zeros, and no update is due
            return
        consumed = self.consumed.get(id(bucket)) == bucket.zeroings  # (its shard is gone)
        if consumed and engine.backward_by in (None, optimizer):
            other = (
                ". If this loss is another optimizer's (a GAN's generator loss through the "
                "discriminator), run it through that one instead, opt_g.backward(loss): a plain "
                "loss.backward() steps every step_in_backward optimizer whose parameters it "
                "reaches, so a zero_grad() here would step this one on it"
            )
            raise RuntimeError(
                f"step_in_backward: a backward after optimizer.step() without zero_grad() "
                f"(unit {bucket.flat.name!r}): torch would add these gradients to the last "
                "step's, which step_in_backward applied during that backward and freed. Call "
                "optimizer.zero_grad() after each step(), or drop step_in_backward to "
                "accumulate gradients across steps" + (other if engine.backward_by is None else "")
            )
        if id(bucket) in self.stepped:  # (also through another optimizer's backward: its
            raise RuntimeError(  # gradients would be kept for a step that has happened)
                f"step_in_backward: unit {bucket.flat.name!r} received gradients again after "
                "its update in this step: a second backward before optimizer.step() (this "
                "optimizer's or another's reaching it), or, in one backward, a gradient that "
                "came after the update (one of its parameters also read outside the unit, "
                "earlier in the forward; a layer of it called again in the backward, as "
                "reversible layers do; or a gradient penalty's create_graph=True graph reaching "
                "it a second time). Accumulate micro-batches with optimizer.backward(loss, "
                "sync=False) and call step() after the last one, run the other optimizer's "
                "backward first, read its parameters inside the unit only, or drop "
                "step_in_backward"
            )
        if not engine.sync_grads or engine.backward_by not in (None, optimizer):
            # A micro-step that reduces (reduce_every_micro_step), or another optimizer's
            # backward (a GAN's generator loss reaching the discriminator: torch accumulates
            # its .grad too): the shard accumulates until this optimizer's step or zero_grad,
            # apart from the full gradient it was reduced in.
            if bucket.shard_grad is not None:
                bucket.shard_grad = bucket.shard_grad.clone()
            return
        self.stepped.add(id(bucket))
        # Writes since the forward adopted them (between it and this backward, or with no root
        # forward at all: submodules called on their own) reach the master before it steps,
        # or the refresh after the step would overwrite them.
        engine.adopt_writes([bucket.flat])
        # This rank's inf/NaN so far (its shard of this bucket included), or any rank's before
        # this bucket's reduction started.
        seen = seen or bool(self._seen.item() > 0)
        sg = self._subgroups.get(id(bucket))
        if sg is not None and not (seen and optimizer.loss_scaler.checks):
            first = self._first_slot[id(bucket)]
            unused = {first + i for i, used in enumerate(touched) if not used}
            if not self._used:  # (the step's first sub-group)
                optimizer.check_groups()
            for i in sg.groups:
                if i not in self._used:  # (per unit per step: copied once per group)
                    self._used[i] = _hyperparameters(optimizer.param_groups[i])
            with torch.no_grad():
                optimizer._step_subgroup(sg, unused)
        bucket.shard_grad = None  # applied (or skipped): the memory this mode exists to free
        bucket.applied_by = (self._optimizer, bucket.zeroings)

    def changed(self, param_groups: list[dict]) -> str | None:
        """Why ``step()`` must fail once it is complete: a group's hyperparameters changed
        after this step's updates were applied (an LR set between ``backward`` and ``step()``,
        which a plain step would use); None when none did."""
        for i, used in self._used.items():
            now = _hyperparameters(param_groups[i])
            keys = [k for k in used if not _same(used[k], now.get(k))]
            if keys:
                return (
                    f"param group {i}'s {keys[0]} changed from {used[keys[0]]} to "
                    f"{now.get(keys[0])} after the backward that applied this step: with "
                    "step_in_backward each unit updates during backward with the values current "
                    "then. Set hyperparameters before the backward (a scheduler's step() right "
                    "after optimizer.step()), or drop step_in_backward"
                )
        return None

    def again(self, buckets: list) -> str | None:
        """Why ``step()`` may not run: a second one after the same backward, whose gradients
        were applied and freed unit by unit (``consumed``, no ``zero_grad`` since): it stepped
        on zeros, where torch's would take the same gradients again."""
        if all(id(b) in self.stepped or self.consumed.get(id(b)) != b.zeroings for b in buckets):
            return None
        return (
            "optimizer.step() again after the step of the same backward with "
            "step_in_backward=True: its gradients were applied and freed in backward, so they "
            "cannot be applied twice; call opt.zero_grad() and run another backward, or use "
            "step_in_backward=False"
        )

    def reset(self) -> None:
        self._used.clear()
        self.stepped.clear()
        self.dropped.clear()
        self._seen.zero_()
        for handle in self._flags.values():  # an interrupted backward: complete, then forget
            handle.wait()
        self._flags.clear()


def applied_elsewhere(optimizer: ShardedOptimizer) -> str | None:
    """Why ``optimizer.step()`` may not run: another optimizer's step in backward applied and
    freed the gradients of some of its buckets, and no zero_grad came since (an optimizer
    made again after that backward: it stepped on nothing and returned True)."""
    for b in optimizer._buckets:
        by = b.applied_by
        if by is not None and by[1] == b.zeroings and by[0]() is not optimizer:
            return (
                f"optimizer.step(): the gradients of unit {b.flat.name or '<root>'!r} were "
                "applied and freed during the last backward by another optimizer, made with "
                "step_in_backward=True; this one has none to apply, where torch's would step "
                "on the same .grad. Call zero_grad() and run another backward before stepping it"
            )
    return None


def _hyperparameters(group: dict) -> dict:
    """A group's settings (not its parameters), tensors copied: an LR changed in place counts."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in group.items() if k != "params"}


def _same(a: object, b: object) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    return a == b


class StepsInBackward:
    """The ``ShardedOptimizer``'s methods that end a step taken in backward: by ``step()``
    (``_finish_backward_step``), by a ``zero_grad`` with no ``step()`` (the optimizer's, or
    submodules' dropping every updated unit), or by a backward that raised. Its updates stay
    (an applied step cannot be undone), and every rank's replicas follow them."""

    def _finish_backward_step(self, bs: BackwardStep, found_inf: bool, unused: set[int]) -> bool:
        """``step`` with ``step_in_backward``: the sub-groups stepped during backward; those
        reduced only in micro-steps (``reduce_every_micro_step``, no synchronized backward) step
        now, then parameters are refreshed. A second step is refused (``BackwardStep.again``)."""
        if (again := bs.again(self._buckets)) is not None:
            self.engine.end_step()
            raise ValueError(again)
        problem = bs.changed(self.param_groups)
        if not found_inf:
            for sg in self._subgroups:
                bucket = sg.bucket
                if id(bucket) not in bs.stepped and (
                    bucket.shard_grad is not None or any(bucket.touched)
                ):
                    self._step_subgroup(sg, unused)
        self._end_backward_step(bs, changed=bool(bs.stepped) or not found_inf)
        if problem:
            raise ValueError(problem)
        return not found_inf

    def _end_backward_step(self, bs: BackwardStep, *, changed: bool) -> None:
        """The end of a step with ``step_in_backward``, also one that raised after units had
        stepped in backward: their updates stay, and every rank's replicas follow them (a
        refused step left each rank with only its own slice updated at stage 2)."""
        bs.consumed |= {id(b): b.zeroings for b in self._buckets if id(b) in bs.stepped}
        bs.reset()
        if changed:
            self._changed()
        self.engine.end_step()

    def drop_applied(self, zeroed: Collection[GradBucket]) -> None:
        """A submodule's ``zero_grad`` is about to drop the gradients of ``zeroed`` buckets
        after units stepped in backward. Once such calls have reached every stepped bucket,
        the backward's step ends, as after the optimizer's own ``zero_grad`` (before a part
        of it, a ``step()`` may still follow: a GAN's ``netD.zero_grad()``)."""
        bs = self._backward_step
        if bs is None or not bs.stepped:
            return
        before = set(bs.dropped)
        bs.dropped |= {id(b) for b in zeroed} & bs.stepped
        if bs.dropped == bs.stepped:
            self.end_applied_step()
            for key in before:  # (zeroed by the earlier calls, after their update)
                bs.consumed.pop(key, None)
        elif bs.dropped != before:
            _warn_applied("a submodule's zero_grad() after a backward whose updates "
                          "step_in_backward already applied to its unit(s)")  # fmt: skip

    def end_applied_step(self) -> bool:
        """A ``zero_grad`` without ``step()`` after units stepped in backward: their updates
        stay, and every rank's replicas follow them, as ``step()`` makes them (at stages 1-2
        each rank had only its own slice updated: the ranks trained apart, and the next
        backward raised "received gradients again"). Whether it ended one."""
        bs = self._backward_step
        if bs is None or not bs.stepped:
            return False
        n = len(bs.stepped)
        self._end_backward_step(bs, changed=True)
        _warn_applied(f"zero_grad() after a backward whose updates step_in_backward already "
                      f"applied to {n} unit(s), without step()")  # fmt: skip
        return True

    def backward_raised(self) -> None:
        """The engine's cleanup after a backward that raised: with step_in_backward, the units
        it had updated keep their update (no step can be undone), said once; the next backward
        steps every unit again."""
        bs = self._backward_step
        if bs is None:
            return
        if bs.stepped:
            warnings.warn(
                f"a backward that raised had already applied step_in_backward's update to "
                f"{len(bs.stepped)} unit(s): they keep it (an applied step cannot be undone), "
                "and the next step updates every unit",
                stacklevel=user_stacklevel(),
            )
        bs.reset()


def _warn_applied(what: str) -> None:
    """The gradients a ``zero_grad`` drops were applied already, in backward (``what``)."""
    warnings.warn(
        f"{what}: they stay (a plain optimizer would drop them with the gradients). Use a "
        "separate optimizer without step_in_backward for parameters that a backward reaches "
        "without being meant to update them (a GAN's discriminator under the generator's loss)",
        stacklevel=user_stacklevel(),
    )
