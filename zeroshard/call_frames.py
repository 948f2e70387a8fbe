"""Which module calls are running, to tell an interrupted forward from one in progress.

torch runs a module's ``always_call`` forward hooks when its forward raises an ``Exception``,
not a ``BaseException``: a ``KeyboardInterrupt`` (Ctrl-C) in a forward leaves the engine
believing the forward runs on, and ``summon_full_params`` refused ("inside forward or
backward") until another forward cleaned up. The root's call is recorded as the id of its
``Module._call_impl`` frame (an id, not the frame: a frame holds every local of the forward),
and it still runs while a call of that module is on the caller's stack.
"""

from __future__ import annotations

import sys
import types

from torch import nn

_CALLS = ("_call_impl", "_wrapped_call_impl")


def current(module: nn.Module) -> int | None:
    """The id of the innermost frame on this thread's stack calling ``module`` (its
    ``Module.__call__``), or None outside any."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _CALLS and frame.f_locals.get("self") is module:
            return id(frame)
        frame = frame.f_back
    return None


def running(
    call: int | None,
    module: nn.Module,
    *,
    besides_current: bool = False,
    thread: int | None = None,
) -> bool:
    """Whether the call of ``module`` that ``current`` recorded as ``call`` may still run: a
    call of ``module`` (a ``Module._call_impl`` frame of it) is on this thread's stack (or on
    ``thread``'s, by its ident: the one running a forward, asked from autograd's), not
    counting the innermost one with ``besides_current`` (asked from inside a new call). An
    unknown call (None: none that ``current`` could see, as under ``torch.compile``) counts as
    running: nothing is undone on a guess. Matched by the module, not by the frame's id: a
    frame object freed when its call ended leaves its id to a later one (the Ctrl-C'd
    forward's was taken by a frame of the ``summon_full_params`` that followed, which then
    refused "inside forward")."""
    if call is None:
        return True
    needed = 2 if besides_current else 1  # (stops at it: the root's call is a few frames up)
    frame = sys._getframe(1) if thread is None else sys._current_frames().get(thread)
    while frame is not None:
        if frame.f_code.co_name == "_call_impl" and frame.f_locals.get("self") is module:
            needed -= 1
            if not needed:
                return True
        frame = frame.f_back
    return False


def in_functional_call() -> bool:
    """Whether torch's ``functional_call`` (``torch.func``'s or ``nn.utils.stateless``'s) runs
    on this thread's stack: for its length the model's modules hold the caller's tensors,
    parameters of another model too (an EMA copy's, MAML's fast weights), in place of theirs."""
    from torch.nn.utils import stateless

    return on_stack(stateless._functional_call.__code__)


def on_stack(code: types.CodeType) -> bool:
    """Whether a call of the function whose code is ``code`` runs on this thread's stack."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame is not None
