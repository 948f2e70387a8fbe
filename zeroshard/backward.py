"""The engine's backward: each unit gathered again as autograd reaches it (``_pre_backward``),
finished once autograd is done with every use of it (``_finish_unit``: freed, its bucket
reduced in the ranks' one order once all the bucket's units are done), and the backward ended
(``_end_backward``: units no hook finished, late gradients reduced again, every reduction
waited for). A backward that makes no gradient of the model (``autograd.grad`` of inputs)
reduces nothing.

``Backward`` is the ``Engine``'s part that does it, on the engine's own attributes (``units``,
``buckets``, ``phase``, ``summoned``, ``partition``, ``reduction_order`` and the running
backward's pending sets).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Collection

import torch

from zeroshard import autograd_hooks, call_frames
from zeroshard.autograd_hooks import weakly
from zeroshard.model_states import flat_param
from zeroshard.model_states.agreement import reduced_again_anywhere
from zeroshard.model_states.grads import GradBucket, pools
from zeroshard.signals import deferred
from zeroshard.unit import Phase, TrainingState, Unit


class Backward:
    """The ``Engine``'s methods that run its backward."""

    def _when_reached(self, unit: Unit) -> Callable[[bool], None]:
        """``_pre_backward`` of ``unit`` as the hook on its outputs, which keeps neither alive;
        at stage 3, a backward that reaches it once they are freed is an error that says so
        (the unit's parameters went with them: torch failed on a storage of size 0)."""
        gone = None
        if self.partition.parameters:
            gone = (
                f"backward through unit {unit.name or '<root>'!r} of a sharded model (stage 3) "
                "that was freed after this forward (del model and its optimizer): its "
                "parameters went with it, and the backward needs them. Keep the model alive "
                "until the backward has run"
            )
        return weakly(self._pre_backward, unit, unit.updates, gone=gone)

    def _pre_backward(self, unit: Unit, made_at: int, graph: bool) -> None:
        if graph and made_at != unit.updates:  # (a graph retained across a step or load)
            raise autograd_hooks.stale_graph(unit.name)
        if self._inside_forward():
            self._backward_in_forward(unit)
            return
        if self.phase is Phase.FORWARD:  # a forward interrupted since the loss's (a Ctrl-C
            self._forward_over()  # runs no hook): over, as its next forward would find it
        if self.phase is not Phase.BACKWARD:  # the backward's first unit: once per backward
            autograd_hooks.warn_graph_of_backward(self.partition.parameters and not self.summoned)
            self._no_grads = not _makes_grads(self.flat_params)
            if self._no_grads:
                self._grads_before = self._own_grads()
            else:
                self.scaling.begin_backward()
            self.phase = Phase.BACKWARD
            self._arrivals_at = self.arrivals()
            self._zeroed_by.clear()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        elif self._no_grads and _makes_grads(unit.flat_params):
            self._grads_after_all()
        if unit.state is TrainingState.PRE_BACKWARD:
            return  # another use of the unit got here first
        if unit.state is TrainingState.POST_BACKWARD:
            # Finished already in this backward, and reached again (a reentrant checkpoint's
            # backward of another forward): its buckets are reduced once more at the end.
            self._again.add(unit)
        unit.to(TrainingState.PRE_BACKWARD)
        unit.unshard(async_op=False)
        unit.wait_unshard()
        if self.partition.parameters and not self.summoned:
            for f in unit.flat_params:  # written before this backward (held since its forward)
                f.adopt_gathered_writes()
        for b in unit.buckets:
            if self._no_grads:
                self._unbound[b] = None
            else:
                b.bind()
        if self.partition.parameters:
            backward_order = self.forward_order[::-1]
            self._prefetch(backward_order, None if unit.is_root else unit)
            self._free_idle_buffers(backward_order)

    def _inside_forward(self) -> bool:
        """Whether the root's forward runs (on the stack of the thread that runs it: on an
        accelerator the backward's hooks run on a thread of autograd's), not one a Ctrl-C
        interrupted (its phase left FORWARD)."""
        if self.phase is not Phase.FORWARD:
            return False
        owner = self.step_thread
        elsewhere = owner is not None and owner is not threading.current_thread()
        thread = owner.ident if elsewhere else None
        return call_frames.running(self._forward_call, self.model, thread=thread)

    def _backward_in_forward(self, unit: Unit) -> None:
        """A backward inside the model's forward (``torch.autograd.grad`` of an output with
        respect to an input as the forward runs: forces from an energy, a gradient penalty
        computed in the forward) reached ``unit``: not the step's backward, which comes later
        and runs through it too (``create_graph=True``). With the parameters whole (stages 0-2)
        it needs nothing of the engine; sharded ones are freed after their unit's forward, and
        the graph of its derivative keeps reading them."""
        if self.partition.parameters and not self.summoned and not unit.is_root:
            raise RuntimeError(
                f"a backward inside the model's forward (torch.autograd.grad as the forward "
                f"runs, e.g. forces from an energy) reached unit {unit.name!r}, whose "
                "parameters are sharded (stage 3) and freed after its forward, while the graph "
                "of that derivative keeps reading them: train such a model at stage 2 or below "
                "(parameters whole; gradients and optimizer states still sharded)"
            )

    def _post_backward(self, unit: Unit) -> None:
        """One use of ``unit`` is done with its backward; the last one finishes the unit."""
        if self._inside_forward():
            return  # a backward inside the forward (``_backward_in_forward``)
        unit.pending_uses -= 1
        if unit.pending_uses <= 0:
            self._finish_unit(unit)

    def _finish_unit(self, unit: Unit) -> None:
        """Autograd is done with ``unit`` for this backward: reduce its gradient (once every
        unit of its bucket is done), free its gathered parameters."""
        if unit.state is TrainingState.POST_BACKWARD:
            return
        if unit.state is not TrainingState.PRE_BACKWARD:
            unit.to(TrainingState.PRE_BACKWARD)  # no hook saw its backward begin
        unit.to(TrainingState.POST_BACKWARD)
        unit.pending_uses = 0
        unit.generation += 1
        ready = []
        for b in unit.buckets:
            if unit in self._again:
                if self._units_left.get(b, 1) <= 0 and not self.reduction_order.is_waiting(b):
                    self._dirty[b] = None  # reduced already: reduce what came since at the end
                continue
            self._units_left[b] = self._units_left.get(b, b.num_units) - 1
            if self._units_left[b] == 0:
                ready.append(b)
        # Free the gathered parameters and finish the oldest reductions before a new full
        # gradient is collected: none is alive beside it at this peak of backward.
        if not self.summoned:  # (a write between the root's forward and backward: kept)
            if self.partition.parameters:
                written = [n for f in unit.flat_params for n in f.written_since_gather()]
                if written:  # dropped, here and in every unit held: the masters stay as they were
                    for u in self.units:
                        if u is unit or any(f.written_since_gather() for f in u.flat_params):
                            u.reshard()
                    raise _written_in_backward(written)
            unit.reshard(adopt=True)
        if self._no_grads:
            self._held += ready
        else:
            self._reduce_ready(ready)

    def _reduce_ready(self, ready: list[GradBucket]) -> None:
        """Buckets whose units are all done: folded while accumulating (summed in
        ``reduce_dtype`` where it is wider), else reduced in the ranks' one order."""
        if not self._reduce_now:
            for b in ready:
                b.fold()
        else:
            for b in self.reduction_order.ready(ready):
                self._reduce(b)

    def _grads_after_all(self) -> None:
        """A backward taken for one that makes no parameter's gradient makes some after all:
        a reentrant checkpoint's inner backward (``torch.utils.checkpoint(use_reentrant=True)``)
        accumulates into parameters its outer graph did not reach. Begun as usual from here:
        the buckets bound (taking what came meanwhile), those ready reduced."""
        self._no_grads = False
        self.scaling.begin_backward()
        for b in self._unbound:
            b.bind()
        self._unbound.clear()
        held, self._held = self._held, []
        self._reduce_ready(held)

    def _reduce(self, bucket: GradBucket) -> None:
        self._finish_reductions(keep=self.config.max_inflight_reductions - 1)
        bucket.reduce()
        self._pending.append(bucket)

    def _end_backward(self) -> None:
        """Autograd's final callback: finish the units no hook finished, in the same order on
        every rank (every rank reduces every bucket, so the collectives match), then wait.
        A backward that made no parameter's gradient (``torch.autograd.grad`` of inputs only:
        an adversarial example, a saliency map) reduces nothing, as under DDP: it ran a full
        reduction of zeros, which hung when one rank took it alone (inside
        ``summon_full_params``, or an example made on one rank's batch only)."""
        if self._no_grads and self._grads_came():
            self._grads_after_all()
        for unit in [*reversed(self.forward_order), *self.units]:
            self._finish_unit(unit)
        if self._no_grads:
            self._end_without_grads()
            return
        self._finish_reductions(keep=0)
        again = [b in self._dirty or b.came_late() for b in self.buckets]
        again = reduced_again_anywhere(again, self.mesh) if self._reduce_now else again
        for i, b in enumerate(self.buckets):
            if not self._reduce_now:
                b.fold()  # what came after a unit's fold (a unit reached again)
            elif again[i]:
                b.reduce()
                b.finish()
            b.end_backward()
        with deferred():  # (a Ctrl-C in here left units half idle: the next step refused a
            # gradient "set by hand" and was lost)
            self._units_to_idle()
            self.reduction_order.end_backward(self.mesh)
            self.scaling.accumulating = not self._reduce_now
            self._arrivals_at, self._partial = None, False
            self.phase, self._backward_due = Phase.IDLE, False
        if self.summoned:
            self._regather_stepped()
        unowned = self.partition.optimizer_states and not self.optimizers
        # (not for an input-only autograd.grad: no parameter's gradient was made)
        if self._reduce_now and unowned and any(any(b.touched) for b in self.buckets):
            _warn_no_sharded_optimizer()

    def _regather_stepped(self) -> None:
        """Inside ``summon_full_params``, the units that stepped in this backward
        (``step_in_backward``) are held gathered with their values from before the update:
        refilled from the new masters, as ``step()`` refills them. Else the summon's exit took
        every element differing from its master for a write and put the old values back over
        the update (nothing trained, without a word). Which buckets stepped is the same on every
        rank (the refill is a collective)."""
        stepped = set()
        for opt in self.optimizers:
            bs = opt._backward_step
            stepped |= bs.stepped if bs is not None else set()
        stale = [
            b.flat
            for b in self.buckets
            if id(b) in stepped
            and b.flat.partition.parameters
            and b.flat.state is flat_param.ShardState.UNSHARDED
        ]
        if stale:
            self.params_changed(stale)

    def _grads_came(self) -> bool:
        """Whether a gradient reached a parameter during this backward, in a graph task of its
        own (a reentrant checkpoint's, which the running one's ``_makes_grads`` cannot see)."""
        return self.arrivals() != self._arrivals_at or self._own_grads() != self._grads_before

    def _own_grads(self) -> list[tuple[int, int] | None]:
        """Which autograd ``.grad`` the buckets without views hold (stage 3's), and their
        versions: accumulation micro-steps leave theirs there, which autograd adds to."""
        own = (s.param.grad for b in self.buckets if not b.as_views for s in b.flat.slots)
        return [None if g is None else (id(g), g._version) for g in own]

    def _end_without_grads(self) -> None:
        """The end of a backward that made no parameter's gradient: units back to idle, no
        collective, the gradients and the reduction order as they were before it."""
        with deferred():
            self._units_to_idle()
            self._no_grads = False
            self._arrivals_at = None
            self.phase, self._backward_due = Phase.IDLE, False

    def _units_to_idle(self) -> None:
        """At a backward's end: gather buffers released (kept through one backward, not
        between steps), every unit idle, the backward's pending sets emptied."""
        for pool in pools(self.buckets):
            pool.release()
        sharded = self.partition.parameters and not self.summoned
        for unit in self.units:
            if sharded and not unit.is_root and unit.is_gathered:
                # Lent again after its own backward, with grad, by a hook (create_graph=True
                # runs hooks with grad) whose output no backward took: held for nothing.
                unit.reshard()
            unit.to(TrainingState.IDLE)
            unit.recomputing = 0  # (a Ctrl-C inside one runs no hook of its end)
            unit.lend_again()
        for pending in (self._units_left, self._again, self._dirty, self._held, self._unbound):
            pending.clear()

    @property
    def _reduce_now(self) -> bool:
        return self.sync_grads or (self.partition.gradients and self.config.reduce_every_micro_step)

    def _finish_reductions(self, *, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.popleft().finish()


def _written_in_backward(names: list[str]) -> RuntimeError:
    """A unit's gathered parameters were written during its backward at stage 3."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return RuntimeError(
        f"{shown} written during the backward (an optimizer stepped in a gradient hook, as in "
        "PyTorch's optimizer-in-backward recipe?): with parameters partitioned, a unit's "
        "parameters in its backward are a gathered copy and its gradient this rank's own, not "
        "yet reduced, so the write would put a different update into each rank's shard. It was "
        "dropped. Step in the backward with zeroshard.optimizer(model, ..., "
        "step_in_backward=True), or step after the backward"
    )


def _warn_no_sharded_optimizer() -> None:
    """Gradients were reduced into shards, which only ``zeroshard.optimizer`` reads, and the
    model has no such optimizer (shown once by default: one call site)."""
    warnings.warn(
        "gradients were reduced into zeroshard's shards, but the model has no "
        "zeroshard.optimizer(model, ...): at stages 1-3 p.grad stays None, so a torch optimizer "
        "over model.parameters() trains nothing; build the optimizer with zeroshard.optimizer",
        stacklevel=3,
    )


def _makes_grads(flats: Collection[flat_param.FlatParam]) -> bool:
    """Whether the running backward accumulates a gradient into any trainable parameter of
    ``flats``: ``loss.backward()``, ``backward(inputs=...)`` with parameters among them; not
    one of other inputs only, and never ``torch.autograd.grad``, which returns gradients
    instead (as under DDP, nothing is reduced; torch refuses the question there). Asked of
    autograd's running graph task, during backward only."""
    for f in flats:
        for s in f.slots:
            if s.param.requires_grad:
                node = torch.autograd.graph.get_gradient_edge(s.param).node
                try:
                    if torch._C._will_engine_execute_node(node):
                        return True
                except RuntimeError:  # "... but we are currently running autograd.grad()"
                    return False
    return False
