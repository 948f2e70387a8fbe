"""Stage 0's gradients as DDP's users see them: after the reduction each ``.grad`` shows the
averaged gradient (``_show_average``), and what the caller's code does to it before the step is
what the step takes: an edit in place (``clip_grad_norm_``, a mask; ``adopt_edits``, found by
the buffer's version counter or its L1 norm), a tensor put there by hand or ``None``
(``adopt_rebinds``).

``ShownGradients`` is the ``GradBucket``'s part that does it, on the bucket's own attributes
(``flat``, ``full_grad``, ``shard_grad``, ``reduction``, the per-slot ``_bound`` / ``touched``
flags and ``_shown_version`` / ``_shown_norm``).
"""

from __future__ import annotations

import torch


class ShownGradients:
    """The ``GradBucket``'s methods for the gradients ``.grad`` shows at stage 0."""

    def _show_average(self, averaged: torch.Tensor, accumulated: bool) -> None:
        """Stage 0: ``.grad`` (views of ``full_grad``) show the averaged gradient after the
        reduction, as under DDP, also where it was reduced in a copy (a ``reduce_dtype`` wider
        than ``param_dtype``: they showed this rank's own gradient); after a second reduction
        before ``zero_grad`` (several synchronized backwards), the sum of the averages that the
        step takes, as DDP's ``.grad`` holds it."""
        assert self.full_grad is not None and self.shard_grad is not None
        if accumulated:
            lo, hi = self.flat.range
            self.full_grad[lo:hi].copy_(self.shard_grad)
        elif averaged.data_ptr() != self.full_grad.data_ptr():
            self.full_grad.copy_(averaged)
        self._note_shown(aliased=self.shard_grad.data_ptr() == self.full_grad.data_ptr())

    def _note_shown(self, *, aliased: bool) -> None:
        """What ``.grad`` shows now is the reference for ``adopt_edits`` (nothing to note when
        ``.grad`` is the step's own memory: FP32)."""
        assert self.full_grad is not None
        lo, hi = self.flat.range
        self._shown_version = None if aliased else self.full_grad._version
        self._shown_norm = None if aliased else _magnitude(self.full_grad[lo:hi])
        self._found_version = self.full_grad._version

    def _edited(self) -> bool:
        """Whether ``.grad`` changed since ``_note_shown``: its version, or else its L1 norm
        (one read of it, stage 0 in mixed precision only; a NaN that was there is no change).
        The norm, not the sum, catches an unscale of a gradient summing to 0; an unscale is
        what changes it with no version bump (GradScaler's kernel)."""
        assert self.full_grad is not None and self._shown_norm is not None
        if self.full_grad._version != self._shown_version:
            return True
        lo, hi = self.flat.range
        now, then = _magnitude(self.full_grad[lo:hi]), self._shown_norm
        return bool((now != then) & ~(now.isnan() & then.isnan()))

    def adopt_edits(self) -> None:
        """Stage 0: a gradient changed in place through ``.grad`` since the reduction
        (``torch.nn.utils.clip_grad_norm_``, a mask, a rescale; the buffer's version counter
        says so) is the one the step takes, as under DDP; unchanged, the step keeps the FP32
        reduced values, not their rounding to ``param_dtype``. (In FP32 the two are one tensor
        and edits need nothing.) Only parameters whose ``.grad`` the edit changed somewhere are
        taken, whole: a no-op edit (torch's ``clip_grad_norm_`` multiplies by 1.0 when it does
        not clip) kept FP16's rounding, where small unscaled gradients read as zero, as if it
        were the gradient; a mask writing zeros where FP16 showed zeros is taken with the rest
        of its parameter. (One whose every value showed as zero cannot tell a zeroing from no
        edit: drop it with ``p.grad = None``.)"""
        if self.full_grad is None or self.shard_grad is None:
            return
        if self._shown_version is None:  # (FP32: edited in place in the step's own memory)
            if self._found_version is not None and self.full_grad._version != self._found_version:
                self._found_inf_again()
            return
        if self._edited():
            lo, hi = self.flat.range
            edited = self.full_grad[lo:hi]
            changed = edited != self.shard_grad.to(edited.dtype)  # (what ``.grad`` showed)
            spans = [span for _, span in self.flat.pieces() if span.stop > span.start]
            hit = torch.stack([changed[span].any() for span in spans]).tolist() if spans else []
            for span, edited_here in zip(spans, hit):  # (one host sync for all of them)
                if edited_here:
                    changed[span] = True
            self.shard_grad.copy_(torch.where(changed, edited, self.shard_grad))
            self._note_shown(aliased=False)
            self._found_inf_again()

    def adopt_writes_over_zeros(self) -> None:
        """Stage 0 after ``zero_grad(set_to_none=False)``, no backward since: ``.grad`` written
        in place (``copy_``, ``add_``: a gradient computed by hand) is what the step takes, this
        rank's own values, as DDP's optimizer takes them (the step took zeros). Called at the
        step and the clip only: a backward's own writes bind the buffer again first."""
        if self._zeroed_version is None or self.full_grad is None or self.shard_grad is not None:
            return
        if self.full_grad._version == self._zeroed_version:
            return
        self._zeroed_version = None
        self._take_shown()

    def show_shard(self) -> None:
        """Stage 0: ``shard_grad`` changed by the engine (``opt.clip_grad_norm``,
        ``clip_grad_value``) is what ``.grad`` shows too, as DDP's after torch's clip, and the
        reference for ``adopt_edits`` again: ``.grad`` went on showing the unclipped values,
        and any later touch of it in place (a ``clip_grad_norm_`` taking the norm for a log)
        adopted them back, the clip undone."""
        if self._shown_version is None or self.full_grad is None or self.shard_grad is None:
            return
        lo, hi = self.flat.range
        self.full_grad[lo:hi].copy_(self.shard_grad)
        self._note_shown(aliased=False)

    def adopt_rebinds(self, slots: list[int]) -> None:
        """``.grad`` of ``slots`` reassigned by hand. At stage 0 after a reduction, where
        ``.grad`` shows the averaged gradient as under DDP, a tensor put there
        (``p.grad = p.grad * 3``) is the slot's gradient for the step, as DDP takes it (also
        for a parameter this rank's backward did not reach, or from ``torch.autograd.grad``:
        this rank's own values then, as under DDP), and ``None`` leaves the parameter out of
        it, as torch's optimizers do; with nothing reduced since the gradients were dropped it
        is taken over zeros (``_reduced_zeros``). Elsewhere the step never reads ``.grad``
        (stages 1-3 keep only reduced shards): one set by hand is a ValueError naming the
        parameter, where it was ignored; so is a gradient that came after the last backward's
        end from one that reached no unit (``_arrived``), except added to a shown average.
        Decided from what the caller's code did, not from which parameters this rank's data
        reached: ranks agree."""
        shown = self.all_reduced and self._reduced
        stray = sorted(self._arrived.intersection(slots))
        if stray and not shown:  # (shown: added to the average, as under DDP)
            raise ValueError(
                f"a gradient reached {self.flat.slots[stray[0]].names[0]} after "
                "the last backward through the model ended, from a backward that ran through "
                "none of its units (a loss of the parameters alone, such as a penalty "
                "backpropagated on its own): no backward reduced it over the ranks, and the "
                "step would have taken none of it; add the term to the loss before its "
                "backward (loss = loss + penalty)"
            )
        if not shown and self._reduced_zeros(slots):
            shown = True
        changed = False
        for i in slots:
            slot = self.flat.slots[i]
            grad = slot.param.grad
            if grad is not None and not self._by_hand(i):
                continue  # its region of the buffer, as bound
            bound = self._bound[i] and self.full_grad is not None
            # (unbound and None: no rank's backward reached it, ``end_backward``: none shown)
            reduced = shown and self.shard_grad is not None and self.full_grad is not None
            if grad is None and bound and not reduced:  # over zero_grad(set_to_none=False)'s
                self._bound[i] = self.touched[i] = False  # zeros: out of the step, as torch's
                continue
            if reduced and (bound or grad is not None):
                span = self.flat.pieces()[i][1]
                if grad is None:  # dropped: out of the step (and of a norm)
                    self.shard_grad[span].zero_()
                    self._view(i).zero_()
                    self._bound[i] = self.touched[i] = False
                else:  # replaced: the new tensor is the gradient
                    self._view(i).copy_(grad)
                    self.shard_grad[span].copy_(grad.reshape(-1)[: span.stop - span.start])
                    slot.param.grad, self._bound[i] = self._view(i), True
                    self.touched[i] = self.reached = True
                changed = True
            elif grad is not None:
                raise ValueError(
                    f"{slot.names[0]}.grad was set by hand, but the sharded optimizer reads "
                    "the gradients that its backward reduced over the ranks (at stages 1-3 "
                    "each rank keeps only its shard of them, and .grad is None): compute "
                    "gradients with opt.backward(loss) or loss.backward(), edit them with "
                    "opt.clip_grad_norm or, at stage 0, through .grad after the backward, and "
                    "leave .grad alone otherwise (set it back to None). Never set it? Then its "
                    "weight was read outside its unit's forward, and the gradient came after the "
                    "unit's backward: read it inside the unit, or wrap so that the module that "
                    "reads it owns it"
                )
        if changed and self._shown_version is not None and self.full_grad is not None:
            self._note_shown(aliased=False)  # adopted: not an edit to copy again
        if changed and self.shard_grad is not None:
            self._found_inf_again()

    def _found_inf_again(self) -> None:
        """Stage 0, the step's gradient edited through ``.grad``: whether it holds inf/NaN is
        decided from it as edited, not as reduced (a NaN put to zero by hand, ``nan_to_num_``,
        or its parameter's ``.grad`` set to None, is stepped on, as DDP's optimizer steps; the
        step was skipped). The ranks still agree at the step (``ShardedOptimizer._agree``)."""
        bad = ~self.shard_grad.isfinite().all()
        self.found_inf.copy_(bad.to(self.found_inf.dtype).reshape(self.found_inf.shape))
        if self.full_grad is not None:
            self._found_version = self.full_grad._version

    def _reduced_zeros(self, slots: list[int]) -> bool:
        """Stage 0 with nothing reduced since the gradients were dropped, and a ``.grad`` of
        ``slots`` put there by hand (``torch.autograd.grad``'s, which reduces nothing, as under
        DDP): the state a reduction of zeros leaves, so that the step takes what was put there,
        as DDP's optimizer does. Not for gradients autograd accumulated with no backward of
        the engine's around them (a loss of the parameters alone): those stay an error."""
        if not self.all_reduced:
            return False
        if not any(self._by_hand(i) for i in slots):
            return False
        flat, device = self.flat, self.flat.mesh.device
        if self.full_grad is None:
            self.full_grad = torch.empty(flat.padded_numel, dtype=flat.param_dtype, device=device)
        self.full_grad.zero_()
        self._take_shown()
        return True

    def _take_shown(self) -> None:
        """What ``.grad`` shows (``full_grad``'s range) as the step's gradient, as if reduced:
        ``shard_grad`` from it (the same memory when the dtypes agree), noted as shown."""
        assert self.full_grad is not None
        lo, hi = self.flat.range
        self.shard_grad = self.full_grad[lo:hi].to(self.flat.master_dtype)
        self._note_shown(aliased=self.shard_grad.data_ptr() == self.full_grad[lo:hi].data_ptr())
        self._reduced = True

    def _by_hand(self, i: int) -> bool:
        """Whether slot ``i``'s ``.grad`` was put there by hand (not its region of the buffer,
        to which ``zero_grad(set_to_none=False)`` or a backward bound it)."""
        grad = self.flat.slots[i].param.grad
        bound = self._bound[i] and self.full_grad is not None
        return grad is not None and not (bound and self._is_region(i, grad))


def _magnitude(grad: torch.Tensor) -> torch.Tensor:
    """``grad``'s L1 norm in FP32, FP64 for a float64 ``grad`` (which FP32 refused: stage 0 of a
    float64 model reducing in FP32 failed at its first backward); a 0-dim tensor, no host sync:
    what tells an in-place rescale of it."""
    return torch.linalg.vector_norm(grad, 1, dtype=torch.promote_types(grad.dtype, torch.float32))
