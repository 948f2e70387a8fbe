"""The files a ``zeroshard train`` run writes in its folder (its configuration, metrics,
summary, plot and TensorBoard events), read before a launch and put back when the launch trained
nothing, and whether a launch trained a step (from rank 0's summary or metrics)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "loss.png")
"""What a run writes in its folder before its first step, and at its end (not checkpoints)."""


_EVENTS = "tensorboard"  # (--log tensorboard's folder: event files are only added to)


def run_files(out: Path) -> dict[str, Any]:
    """``RUN_FILES`` in ``out`` as they are (None: absent), and the names of the TensorBoard
    event files (None: no folder), for ``put_back``."""
    files: dict[str, Any] = {
        name: (out / name).read_bytes() if (out / name).is_file() else None for name in RUN_FILES
    }
    events = out / _EVENTS
    files[_EVENTS] = {p.name for p in events.iterdir()} if events.is_dir() else None
    return files


def put_back(out: Path, files: dict[str, Any]) -> None:
    """The run's files in ``out`` as they were before this command (``run_files``): a run
    refused before it trained a step leaves a folder that existed as it was, and one it created
    with nothing in it but the launcher's files (removed then, ``hold_out_dir``)."""
    events = files[_EVENTS]
    for name in RUN_FILES:
        content = files[name]
        if content is not None:
            (out / name).write_bytes(content)
        else:
            (out / name).unlink(missing_ok=True)
    if (out / _EVENTS).is_dir():  # the event files this run added go
        for path in (out / _EVENTS).iterdir():
            if path.is_file() and (events is None or path.name not in events):
                path.unlink(missing_ok=True)
        if events is None:
            with contextlib.suppress(OSError):
                (out / _EVENTS).rmdir()


def trained_since(out: Path, t: float) -> bool:
    """Whether a run trained a step in ``out`` since ``t``: by its ``summary.json`` (rank 0's,
    written also when a run fails in training) a step past the one it started from; without one
    written since, whether rank 0 rewrote its metrics (once the model is built and the
    checkpoint loaded: what failed before that trained nothing). A rank that refused the first
    step's input (a vocabulary too small for the data, a model's logits of the wrong shape)
    trained nothing either."""
    try:
        if (out / "summary.json").stat().st_mtime >= t:
            summary = json.loads((out / "summary.json").read_text())
            return summary.get("last_step", 0) > summary.get("resumed_at_step", 0)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return (out / "metrics.jsonl").stat().st_mtime >= t
    except OSError:
        return False
