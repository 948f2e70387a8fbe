"""Which module calls are running, to tell an interrupted forward from one in progress.

torch runs a module's ``always_call`` forward hooks when its forward raises an ``Exception``,
not a ``BaseException``: a ``KeyboardInterrupt`` (Ctrl-C) in a forward leaves the engine
believing the forward runs on, and ``summon_full_params`` refused ("inside forward or
backward") until another forward cleaned up. The root's call is recorded as the id of its
``Module._call_impl`` frame (an id, not the frame: a frame holds every local of the forward);
the call still runs while that frame is on the caller's stack.
"""

from __future__ import annotations

import sys

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


def running(call: int | None) -> bool:
    """Whether the call recorded by ``current`` is on this thread's stack (an unknown one,
    None, counts as running: nothing is undone on a guess)."""
    if call is None:
        return True
    frame = sys._getframe(1)
    while frame is not None:
        if id(frame) == call:
            return True
        frame = frame.f_back
    return False
