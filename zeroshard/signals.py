"""Stopping a training run cleanly on SIGINT/SIGTERM: every rank finishes its step, the caller
saves it, and ``Stopped`` carries the step, the checkpoint and the shell's exit status.

The handlers only note the signal (a handler must not run collectives); once per step
``StopOnSignal.agreed`` asks every rank with one 1-element all-reduce whether any got one, so all
ranks stop at the same step. Used by ``zeroshard.train`` when checkpoints are on.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class Stopped(Exception):
    """Raised by ``train`` on every rank when SIGINT/SIGTERM stopped the run, after ``path``
    (the checkpoint of ``step``) was saved."""

    def __init__(self, signum: int, step: int, path: Path) -> None:
        super().__init__(f"stopped by signal {signum} after step {step}, saved to {path}")
        self.signum, self.step, self.path = signum, step, path

    @property
    def exit_code(self) -> int:
        """The shell's status for a process ended by the signal: 130 (SIGINT), 143 (SIGTERM)."""
        return 128 + self.signum


class StopOnSignal:
    """SIGINT/SIGTERM handlers that only note the signal; ``agreed()`` (a collective, one
    1-element all-reduce) says on every rank whether any rank got one."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, device: torch.device) -> None:
        self.signum = 0
        self._flag = torch.zeros(1, device=device)
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        for sig in self.SIGNALS:
            self._old[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _note(self, signum: int, frame: object) -> None:
        self.signum = self.signum or signum

    def agreed(self) -> int:
        """The signal number any rank got (the largest), or 0."""
        self._flag.fill_(self.signum)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return int(self._flag.item())
