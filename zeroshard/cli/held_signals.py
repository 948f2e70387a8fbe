"""Ctrl-C and SIGTERM held back while the command starts, then acted on.

Python turns SIGINT into a ``KeyboardInterrupt`` wherever the main thread happens to be. While
modules are being imported (torch, and the modules torchrun's agent imports lazily while it
sets up) that exception can be swallowed, in a weakref callback, and the run goes on as if no
key was pressed; SIGTERM there ends the process with no word. So while the command starts, the
signals are only noted, and the caller acts on them once it can (``cli.main`` after its imports,
``cli.agent`` once torchrun's agent has started the ranks). Imports nothing heavy: it runs
before torch.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def held(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[list[int]]:
    """Note ``signals`` instead of acting on them; yields the list of those noted (in order).
    On exit the handlers from before are back. Off the main thread (where handlers cannot be
    set) nothing is held."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    previous = {sig: signal.signal(sig, lambda signum, _: noted.append(signum)) for sig in signals}
    try:
        yield noted
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
