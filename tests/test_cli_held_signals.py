"""Signals held while the command starts: noted, not raised, handlers put back."""

from __future__ import annotations

import os
import signal
import time

from zeroshard.cli.held_signals import held


def _wait_for(condition, seconds: float = 2.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_held_signal_is_noted_not_raised_and_the_old_handler_is_back():
    before = signal.getsignal(signal.SIGINT)
    with held() as noted:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt in here
        assert _wait_for(lambda: noted == [signal.SIGINT])
        os.kill(os.getpid(), signal.SIGTERM)  # nor the default SIGTERM's death
        assert _wait_for(lambda: noted == [signal.SIGINT, signal.SIGTERM])
    assert signal.getsignal(signal.SIGINT) is before
