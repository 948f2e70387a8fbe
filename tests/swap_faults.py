"""Faults injected into swap files, shared by the offload tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from zeroshard.offload import OffloadError


def flip_byte(path: Path, offset: int) -> None:
    """Invert one byte of ``path`` at ``offset``: what a bad disk block does to a swap file."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def refused_steps(train_step: Callable[[int], object], steps: tuple[int, ...]) -> list[str]:
    """The ``OffloadError`` message of each of ``steps``: the first stops at the bad file, later
    ones refuse to train as well."""
    messages = []
    for step in steps:
        with pytest.raises(OffloadError) as err:
            train_step(step)
        messages.append(str(err.value))
        del err  # its traceback holds the model and the optimizer
    return messages
