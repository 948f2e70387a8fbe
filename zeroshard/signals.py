"""Stopping a training run cleanly on SIGINT/SIGTERM: every rank finishes its step, the caller
saves it when checkpoints are on, and ``Stopped`` carries the step, the checkpoint (or None) and
the shell's exit status.

The handlers only note the signal (a handler must not run collectives); once per step
``StopOnSignal.agreed`` asks every rank with one 1-element all-reduce whether any got one, so all
ranks stop at the same step; a deadline (``StopOnSignal.GRACE_S``) ends a rank that cannot
reach that agreement. Used by ``zeroshard.train`` for the whole run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class Stopped(Exception):
    """Raised by ``train`` on every rank when SIGINT/SIGTERM stopped the run after ``step``;
    ``path`` is the checkpoint of that step (None when checkpoints are off, or when it stopped
    before this run's first step: not ``started``)."""

    def __init__(
        self, signum: int, step: int, path: Path | None, cause: str = "", *, started: bool = True
    ) -> None:
        cause = cause or signal.Signals(signum).name
        if path is not None:
            saved = f"saved step {step} to {path}"
        elif not started:  # (in the evaluation before this run's first step)
            saved = "nothing trained in this run yet: no checkpoint saved"
        else:
            saved = "no checkpoint saved (--save-every N keeps progress)"
        super().__init__(f"interrupted at step {step} by {cause}; {saved}")
        self.signum, self.step, self.path = signum, step, path

    @property
    def exit_code(self) -> int:
        """The shell's status for a process ended by the signal: 130 (SIGINT), 143 (SIGTERM),
        129 (SIGHUP)."""
        return 128 + self.signum


AGENT_PID = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
"""torchrun's agent, this rank's parent at import (None when not launched by torchrun; a
process forked from a rank inherits it, and its parent is then another)."""
_agent_gone = False  # set on every rank alike by ``StopOnSignal.agreed``


def agent_gone() -> bool:
    """Whether some rank's torchrun agent is gone, as ``StopOnSignal.agreed`` told every rank at
    once: the job's store may be gone with it (and a check-in there would differ by rank)."""
    return _agent_gone


_ASYNC = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a training run (Ctrl-C, a scheduler's), whose Python handlers raise
or note a stop: ``deferred``'s. (Swapping a handler puts Python's own C handler back in place:
one that ``faulthandler.register`` chained over it is gone; other signals are left alone.)"""


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Python's signal handlers held back for the block and run when it ends: a
    KeyboardInterrupt lands before or after it, never inside it. For a few statements that
    must run together (an addition and the bookkeeping that says it was made: an interrupt
    between them, the work taken up again, added twice). The handlers are swapped for one that
    notes the signal, not the signal blocked: the OS may deliver it to any thread (gloo's), and
    Python runs the handler in the main thread at its next check whatever the mask. Main
    thread only, where Python runs its handlers; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    held: dict[int, Any] = {}
    open_ = [True]

    def note(signum: int, frame: Any) -> None:
        if open_[0]:
            noted.append(signum)
        else:  # (still installed: a signal that came while the handlers were put back)
            held[signum](signum, frame)

    try:
        for sig in _ASYNC:
            handler = signal.getsignal(sig)
            if callable(handler):
                held[sig] = handler
                signal.signal(sig, note)
        yield
    finally:
        open_[0] = False
        raised: BaseException | None = None
        for sig, handler in held.items():
            while True:  # (a signal pending at this call runs its handler first, and may raise)
                try:
                    signal.signal(sig, handler)
                    break
                except BaseException as exc:
                    raised = raised or exc
        for sig in noted:  # every handler runs; the first exception (KeyboardInterrupt) is
            try:  # raised here, once the block is done
                held[sig](sig, None)
            except BaseException as exc:
                raised = raised or exc
        if raised is not None:
            raise raised


@contextlib.contextmanager
def grad_off() -> Iterator[None]:
    """``torch.no_grad()`` that a Ctrl-C cannot leave in force: Python may run a signal
    handler right after ``no_grad().__enter__`` has turned grad mode off and before the block
    begins, where its ``__exit__`` never runs: autograd stayed off for the whole process
    (every later step refused its loss). Here the mode is restored by the ``finally`` that the
    switch runs inside."""
    before = torch.is_grad_enabled()
    try:
        torch._C._set_grad_enabled(False)
        yield
    finally:
        torch._C._set_grad_enabled(before)


_FIRST = 256
"""Above every signal number: ``agreed`` takes the largest of ``_FIRST - signum``."""


_BEFORE_GIVING_UP: list[Callable[[], None]] = []
"""What a process must still do when ``StopOnSignal`` gives up (``os._exit``: no ``finally``
runs), newest first (``before_giving_up``)."""


@contextlib.contextmanager
def before_giving_up(fn: Callable[[], None]) -> Iterator[None]:
    """Run ``fn`` (from the deadline's thread, its errors ignored) if a signal's deadline ends
    the process inside the block: the command line's one-process run lets go of its output
    folder (its lock file, a folder it created and left unused), as its own exit would."""
    _BEFORE_GIVING_UP.append(fn)
    try:
        yield
    finally:
        _BEFORE_GIVING_UP.remove(fn)


class StopOnSignal:
    """SIGINT/SIGTERM handlers that only note the signal; ``agreed()`` (a collective, one
    2-element all-reduce) says on every rank whether any rank got one, and why.

    A signal also arms a deadline: if the ranks have not agreed to stop within ``grace_s``
    seconds (a peer died and this rank waits in a collective that can only fail, or a step is
    that slow), the process exits at once with 128 + the signal number, saving nothing (rank 0
    says so when ``announce``). torchrun's agent stops the surviving ranks of a failed job with
    SIGTERM, so they too are gone within ``grace_s``. An agent that is itself killed outright
    (SIGKILL, an OOM kill) sends nothing: a rank whose agent is gone (reparented) acts as if it
    got SIGTERM, rather than train on unsupervised (``cause`` says so)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    """SIGHUP too (the terminal closed; a SLURM or nohup-less hangup): it ended the ranks at
    once, with no save and no word. One ignored as the ranks start (``nohup``) stays ignored."""
    GRACE_S = 4.0
    """Deadline when nothing is to be saved: every rank gone within 5 s of a signal."""
    GRACE_SAVING_S = 30.0
    """Deadline when the stop saves a checkpoint (slow steps still get their save); torchrun's
    agent kills its ranks 30 s after its own SIGTERM anyway."""

    def __init__(
        self, device: torch.device, *, grace_s: float = GRACE_S, announce: bool = True
    ) -> None:
        self.signum = 0
        self.grace_s, self.announce = grace_s, announce
        self._flag = torch.zeros(2, device=device)  # (_FIRST - signal number, agent lost)
        self._old: dict[int, Any] = {}
        self._deadline: threading.Timer | None = None
        self.cause = ""
        self.training = False  # set once the caller's steps begin: a late stop's deadline
        self._grace_s = grace_s

    def __enter__(self) -> StopOnSignal:
        for sig in self.SIGNALS:
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # (nohup's)
            self._old[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        self._disarm()
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _note(self, signum: int, frame: object) -> None:
        if self.signum:
            return
        self.signum = signum
        # Before the first step nothing can be saved: the short deadline, whatever the run's
        # (a set-up slower than it waited out GRACE_SAVING_S under --save-every).
        self._grace_s = self.grace_s if self.training else min(self.grace_s, self.GRACE_S)
        self._deadline = threading.Timer(self._grace_s, self._give_up)
        self._deadline.daemon = True
        self._deadline.start()

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _give_up(self) -> None:
        if self.announce:
            name = signal.Signals(self.signum).name
            why = (
                "the ranks did not reach a step boundary together within "
                f"{self._grace_s:g} s (a rank failed, or a step is that slow); stopped without "
                "saving"
                if self.training
                else f"still setting up after {self._grace_s:g} s, before training started; "
                "nothing saved"
            )
            print(f"interrupted by {name}: {why}", file=sys.stderr, flush=True)
        for fn in reversed(_BEFORE_GIVING_UP):
            with contextlib.suppress(Exception):
                fn()
        store = sys.modules.get("zeroshard.offload.store")
        if store is not None:  # (its swap files: no finalizer runs past os._exit)
            store.discard_unclosed()
        os._exit(128 + self.signum)  # no teardown: a peer may be gone, and nothing to save

    def agreed(self) -> int:
        """The signal number any rank got (the smallest), or 0. Once they agree, the deadline
        is off: the caller saves and stops in an orderly way."""
        if not self.signum and AGENT_PID is not None and os.getppid() != AGENT_PID:
            self.cause = f"the loss of torchrun's agent (pid {AGENT_PID})"
            self._note(signal.SIGTERM, None)
        # The smallest signal number any rank got: Ctrl-C reaches every rank as SIGINT and the
        # agent then sends SIGTERM too; the launcher exits 130, and the line says SIGINT.
        self._flag.copy_(
            torch.tensor([_FIRST - self.signum if self.signum else 0, bool(self.cause)])
        )
        from zeroshard.watchdog import diagnosed  # (it reads agent_gone from here)

        with diagnosed("all_reduce", "the stop agreement (any rank signalled?)", None):
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        first, agent_lost = (int(v) for v in self._flag.tolist())
        signum = _FIRST - first if first else 0
        if agent_lost and not self.cause:  # another rank saw it first: the same words for all
            self.cause = "the loss of torchrun's agent"
        if agent_lost:
            global _agent_gone
            _agent_gone = True
        if signum:
            self._disarm()
        return signum
