"""Divergence is an error, never a success: ``DivergenceGuard`` stops a training run whose
gradients, validation loss or master weights have become non-finite, on every rank at once.

Every decision is made from values that are already the same on every rank (the optimizer's
all-reduced skip flag, the all-reduced validation loss, an all-reduced flag of the master
weights), so all ranks raise ``Diverged`` at the same step and none is left waiting in a
collective.

* fp32 / tf32 / bf16: a step with inf/NaN gradients is skipped (``opt.step()`` returns False);
  ``max_skipped_steps`` of them in a row stop the run.
* fp16: the dynamic loss scaler's own rule (it halves its scale on each such step and raises
  ``FloatingPointError`` at its minimum scale) stops the run.
* After a skipped step the master weights are checked (a NaN there never heals), and at each
  evaluation the validation loss.
"""

from __future__ import annotations

import math

import torch

from zeroshard.loss_scaling import DynamicLossScaler
from zeroshard.model_states.optimizer import ShardedOptimizer

_ADVICE = "lower the learning rate (--lr) or lengthen the warm-up (--warmup-steps)"
_BEFORE_UPDATE = (
    "non-finite before any update, so not the learning rate: look for inf/NaN in the data and "
    "in the weights the run started from (initialization, or the checkpoint resumed)"
)
_AT_REST = (
    "; at stage 3 it is most often a parameter read outside its own unit's forward, which "
    "finds its NaN placeholder at rest (a module using another unit's weight directly, e.g. "
    "F.linear(h, self.embed.weight) for a tied head, or a term over model.parameters() in the "
    "loss): call the owning module or wrap both in one unit (--wrap), and check with --stage 2"
)


class Diverged(Exception):
    """Raised by ``train`` on every rank when training diverged; the message is one line."""

    def __init__(self, step: int, what: str, last_loss: float, advice: str = _ADVICE) -> None:
        super().__init__(f"diverged at step {step}: {what} (last loss {last_loss:.4g}); {advice}")
        self.step, self.last_loss = step, last_loss

    exit_code = 3
    """The command's exit status for a diverged run."""


class DivergenceGuard:
    """Counts consecutive skipped steps and checks what can diverge; raises ``Diverged``."""

    def __init__(
        self,
        opt: ShardedOptimizer,
        *,
        max_skipped_steps: int,
        num_skipped: int = 0,
        num_consecutive_skipped: int = 0,
        num_taken: int = 0,
    ) -> None:
        self.opt = opt
        opt.loss_scaler.warn_on_skip = False  # the guard says it, with the training's advice
        self.max_skipped_steps = max_skipped_steps
        self.num_skipped = num_skipped
        """Skipped steps in the whole run (a resumed run starts from its checkpoint's)."""
        self.num_consecutive_skipped = num_consecutive_skipped
        """Skipped steps in a row up to now (a resume inside a streak goes on counting it)."""
        self.last_loss = math.nan
        self.num_taken = num_taken
        """Steps taken in the whole run (0: nothing updated yet, the model is as built; a
        resumed run starts from its checkpoint's, whose run may have trained it into the
        streak)."""

    def _advice(self, advice: str = _ADVICE) -> str:
        """``advice``; where nothing was updated yet, what else it can be (stage 3's usual
        cause first)."""
        if self.num_taken:
            return advice
        return _BEFORE_UPDATE + (_AT_REST if self.opt.engine.partition.parameters else "")

    @property
    def scaler_rules(self) -> bool:
        """fp16: the dynamic loss scaler decides when skipping has gone on too long."""
        return isinstance(self.opt.loss_scaler, DynamicLossScaler)

    def step(self, step: int, loss: float) -> bool:
        """``opt.step()`` for optimizer step ``step`` (1-based) whose mean local loss was
        ``loss``; returns whether it stepped, raises ``Diverged`` (on every rank) when done."""
        self.last_loss = loss
        try:
            stepped = self.opt.step()
        except FloatingPointError:  # the fp16 scaler, at its minimum scale: agreed by all ranks
            self.num_skipped += 1
            n = self.num_consecutive_skipped + 1
            what = f"{n} consecutive non-finite gradient steps, at the minimum fp16 loss scale"
            raise Diverged(step, what, loss, self._advice(f"{_ADVICE}, or train in bf16")) from None
        if stepped:
            self.num_consecutive_skipped = 0
            self.num_taken += 1
            return True
        self.num_skipped += 1
        self.num_consecutive_skipped += 1
        self.check_masters(step)  # a collective: every rank skipped this step too
        n = self.num_consecutive_skipped
        if not self.scaler_rules and n >= self.max_skipped_steps:
            raise Diverged(step, f"{n} consecutive non-finite gradient steps", loss, self._advice())
        return False

    def check_masters(self, step: int) -> None:
        """Raise ``Diverged`` if any rank's FP32 master weights hold inf/NaN (a collective)."""
        device = self.opt.engine.mesh.device
        bad = torch.zeros(1, device=device)  # 1 when this rank's shard holds inf/NaN
        # sub-group by sub-group: offloaded masters are in memory only while checked
        for params in self.opt.master_pieces():
            if any(p.numel() and not torch.isfinite(p).all() for p in params):
                bad.fill_(1)
                break
        if self.opt.engine.mesh.world_size > 1:
            torch.distributed.all_reduce(
                bad, op=torch.distributed.ReduceOp.MAX, group=self.opt.engine.mesh.group
            )
        if bad.item():
            raise Diverged(step, "non-finite master weights", self.last_loss, self._advice())

    def check_validation(self, step: int, val_loss: float) -> None:
        """Raise ``Diverged`` if the (all-reduced, so agreed) validation loss is inf/NaN."""
        if not math.isfinite(val_loss):
            raise Diverged(step, f"validation loss {val_loss}", self.last_loss, self._advice())
