"""Unwinding the engine's schedule after an exception: a root forward, a unit's own call or a
backward that raised (an out-of-memory caught and retried, a NaN check hooked on the loss, a
Ctrl-C), so that the next forward, step or ``summon_full_params`` starts from idle units with
nothing gathered that is stale. Not after a failed collective: freeing would wait for the
gathers in flight, each another timeout; the next forward cleans up then.

``Unwinding`` is the ``Engine``'s part that does it, on the engine's own attributes (``units``,
``root``, ``phase``, ``summoned``, ``checkpointing``, the running pass's pending sets and
``reduction_order``).
"""

from __future__ import annotations

import sys
import warnings

from zeroshard import call_frames
from zeroshard.autograd_hooks import in_backward
from zeroshard.trees import undo
from zeroshard.unit import Phase, TrainingState, Unit
from zeroshard.watchdog import collective_failed


class Unwinding:
    """The ``Engine``'s methods that clean up after a call that raised."""

    def _after_raised_backward(self, *, dropping: bool = False) -> None:
        """Outside any backward with the phase still BACKWARD, the last backward raised (its
        end never ran): clean up before a unit is used on its own (the root's forward does),
        or ``summon_full_params``. Not inside the root's forward (an ``autograd.grad`` there
        that raised and was caught: the forward goes on)."""
        if self.phase is not Phase.BACKWARD or in_backward():
            return
        in_root = self.root.state is TrainingState.FORWARD  # (and its call on the stack)
        if in_root and call_frames.running(self._forward_call, self.model):
            return
        self._clean_after_backward(dropping=dropping)
        self.phase = Phase.IDLE

    def _after_interrupted_forward(self) -> None:
        """Outside any backward with the phase still FORWARD and the model's forward no longer
        on the stack, that forward was interrupted (a Ctrl-C runs no hook of torch's): over,
        before a unit is used on its own or ``summon_full_params`` (the root's next forward
        does the same). Not inside the root's forward."""
        if self.phase is not Phase.FORWARD or in_backward():
            return
        if not call_frames.running(self._forward_call, self.model):
            self._forward_raised()

    def _after_interrupted_call(self, unit: Unit) -> None:
        """``unit`` entered on its own still in FORWARD with no call of it running: its last
        call, on its own too, was interrupted (a Ctrl-C runs no hook of torch's), and this is
        not a nested call. Over: the unit idle, freed (a loop that never calls the root, two
        nets sharded in one container, stayed broken: the next backward found it in forward)."""
        if unit.state is not TrainingState.FORWARD:
            return
        if call_frames.running(id(unit), unit.module, besides_current=True):
            return  # (a call of it inside its own: recursion)
        unit.depth = 0
        self._call_raised(unit)

    def arrivals(self) -> int:
        """Gradients of autograd's that the buckets have taken in, ever (a counter)."""
        return sum(b.arrivals for b in self.buckets)

    def _made_gradients(self) -> bool:
        """Whether the backward whose end never ran had made gradients: those the buckets took
        in (into views as they came, or collected from finished units), and those still on the
        parameters of units it had reached (an input-only ``autograd.grad`` makes none, nor
        does a backward that raised at once, at a hook on the loss: the step takes the
        gradients of before it, as torch's does)."""
        if self._arrivals_at is None:
            return False
        if self.arrivals() != self._arrivals_at:
            return True
        reached = [u for u in self.units if u.state is TrainingState.PRE_BACKWARD]
        own = [s.param for u in reached for b in u.buckets if not b.as_views for s in b.flat.slots]
        return any(p.grad is not None for p in own)

    def partial_gradients(self) -> str | None:
        """Why the gradients are not to be stepped on, if they are not: the last backward
        raised after it had made some (its end never ran), and neither ``zero_grad`` (of every
        optimizer of the model, or the model's) nor a backward that finished came since. A
        step would take part of a batch's gradient, reduced for some units and not others.
        Each rank decides from its own backward (no collective)."""
        if in_backward() or not (self._partial or self._made_gradients()):
            return None
        return (
            "the last backward raised after it had made gradients for some of the model's "
            "parameters: they hold part of that batch's gradient, and a step would train on it"
        )

    def gradients_discarded(self, by: object | None = None) -> None:
        """``zero_grad`` of the optimizer ``by`` (its parameters' gradients), or of the model
        (None: all of them): what a backward that raised left goes with the rest once every
        optimizer of the model has dropped its part."""
        self._after_raised_backward(dropping=True)
        if self._arrivals_at is None and not self._partial:
            return
        if by is not None:
            self._zeroed_by.add(id(by))
            if not {id(o) for o in self.optimizers} <= self._zeroed_by:
                return
        self._arrivals_at, self._partial = None, False
        self._zeroed_by.clear()

    def _clean_after_backward(self, *, dropping: bool = False) -> None:
        """Before a forward: finish the reductions that a backward not followed by a step left
        in flight, and start clean from one that never finished (an exception inside it);
        ``dropping``: for ``zero_grad``, which drops the gradients that one made."""
        self._finish_reductions(keep=0)
        stale = [u for u in self.units if u.state is not TrainingState.IDLE]
        if not stale:
            return
        self._partial = self._partial or self._made_gradients()  # (read before the states go)
        for opt in self.optimizers:
            opt.backward_raised()  # step_in_backward: updates it applied stay, said once
        if not self._partial:
            after = ""
        elif dropping:
            after = ", and zero_grad() drops the gradients it made"
        else:
            after = (
                ". The gradients it made stay, as torch's would (the next backward adds to "
                "them): opt.zero_grad() drops them"
            )
        warnings.warn(
            f"units {[u.name or '<root>' for u in stale]} were left in "
            f"{sorted({u.state.value for u in stale})} by a backward that did not finish; "
            f"they start clean{after}",
            stacklevel=5,
        )
        # (and units its prefetch gathered: their gathers stayed in flight, memory held)
        ahead = [u for u in self.units if u.state is TrainingState.IDLE and u.is_gathered]
        self._start_clean(stale + ahead)

    def _start_clean(self, units: list[Unit]) -> None:
        """Forget ``units``' part in a forward or backward that ended by an exception: their
        uses, their state, and their gathered parameters (kept while summoned)."""
        for pending in (self._units_left, self._again, self._dirty, self._held, self._unbound):
            pending.clear()
        self._no_grads = False
        self.reduction_order.forget()
        undo_calls(units)
        for u in units:
            u.state, u.pending_uses, u.lender, u.depth = TrainingState.IDLE, 0, None, 0
            u.recomputing = 0
            u.generation += 1
            u.lend_again()  # (a Ctrl-C in its call ran no `_leave`)
            if not self.summoned:
                u.reshard()

    def _leave(self, unit: Unit) -> None:  # after each call of the unit, also one that raised
        unit.depth = unit.depth if in_backward() else max(0, unit.depth - 1)
        if in_backward():
            unit.recomputing = max(0, unit.recomputing - 1)
            if self.partition.parameters and not self.summoned:
                for f in unit.flat_params:  # its forward's own writes, again (a clamp_ under
                    f.adopt_gathered_writes()  # no_grad): not the backward's (``_finish_unit``)
        if unit.edits:
            undo(unit.edits.pop()[0])  # the caller's containers hold its own tensors again
        unit.lend_again()
        left_in_forward = unit.state is TrainingState.FORWARD and not in_backward()
        if left_in_forward and not unit.is_root and unit.depth == 0:  # (its post hook did
            self._call_raised(unit)  # not run: the call raised)

    def _call_raised(self, unit: Unit, *, keep: bool = False) -> None:
        """A call of a unit other than the root (its module's, or a lend to an owner) raised:
        undo what its pre hook did, the unit idle again and freed (unless ``keep``: gathered
        before the lend). The root's ``_forward_raised`` cleans up after a whole forward; a
        unit called on its own, or whose error the model caught and went on, has only this
        (its next backward found it still in forward). Not after a failed collective (see
        ``_forward_raised``)."""
        if comm_failed():
            return
        unit.lender = None
        if unit.state is TrainingState.FORWARD:
            unit.to(TrainingState.IDLE)
        if not keep and not self.summoned:
            unit.reshard()

    def _forward_raised(self) -> None:
        """After the root's forward: when it raised (its ``post`` hook did not run, so the phase
        is still FORWARD), free at once what the forward held (gathered units, the open span
        of activation checkpoints), not only when the next forward starts: a caller that
        catches the error (an out-of-memory retried with a smaller batch) gets it back. Not
        after a failed collective: freeing would wait for the gathers in flight, each another
        timeout before the error reaches the caller; the next forward cleans up then."""
        # (ending: the root's forward was over for the user's hooks, one of which raised)
        ending, self.ending_forward = self.ending_forward, False
        if (self.phase is not Phase.FORWARD and not ending) or in_backward() or comm_failed():
            return
        self._forward_over()

    def _forward_over(self) -> None:
        """The root's forward is over without its ``post`` hook (it raised, or a Ctrl-C ran none
        of its hooks): what it held freed, every unit idle."""
        self.phase, self._recording = Phase.IDLE, None
        self._start_clean(
            [u for u in self.units if u.state is not TrainingState.IDLE or u.is_gathered]
        )
        if self.checkpointing is not None:
            self.checkpointing.close()


def comm_failed() -> bool:
    """Inside a hook that torch runs in its ``except`` block (``always_call``): whether the
    error is a failed or timed-out collective."""
    return collective_failed(sys.exc_info()[1])


def undo_calls(units: list[Unit]) -> None:
    """Put back what the calls of ``units`` left edited in their inputs, the latest call first
    (a KeyboardInterrupt skips the hooks that run after a call that raised)."""
    calls = sorted((c for u in units for c in u.edits), key=lambda c: c[3], reverse=True)
    for call in calls:
        undo(call[0])
    for u in units:
        u.edits.clear()
