"""What a ``zeroshard train`` run shows and writes while it trains: the progress display and the
metrics sinks (``metrics.jsonl``, and TensorBoard event files with ``--log tensorboard``).

Progress goes to stderr on rank 0: a live tqdm bar when stderr is a terminal, else one plain line
every ``every_s`` seconds (and at the end), so a log file gets lines, not carriage returns.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm


class Progress:
    """A progress display with tqdm's ``update`` / ``set_postfix`` / ``close``."""

    def __init__(
        self,
        *,
        total: int,
        initial: int,
        desc: str,
        enabled: bool,
        every_s: float,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = stream or sys.stderr
        self.total, self.n, self.desc, self.enabled = total, initial, desc, enabled
        self.every_s = every_s
        self.postfix: dict[str, str] = {}
        self._t_start = self._t_last = time.monotonic()
        is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar = (
            tqdm(total=total, initial=initial, desc=desc, file=self.stream)
            if enabled and is_tty
            else None
        )

    def set_postfix(self, **values: str) -> None:
        self.postfix = values
        if self._bar is not None:
            self._bar.set_postfix(**values)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and time.monotonic() - self._t_last >= self.every_s:
            self._line()

    def _line(self) -> None:
        self._t_last = now = time.monotonic()
        extra = " ".join(f"{k} {v}" for k, v in self.postfix.items())
        pct = 100 * self.n / max(1, self.total)
        print(
            f"{self.desc}: step {self.n}/{self.total} ({pct:.0f}%) {extra} "
            f"[{now - self._t_start:.0f} s]".replace("  ", " "),
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            self._line()  # the last state, once
        self.enabled = False


def tensorboard_problem() -> str | None:
    """Why ``--log tensorboard`` cannot work, or None: the package is missing, or installed
    and failing to import (a protobuf it does not support, as a rule: it crashed rank 0 after
    launch)."""
    if importlib.util.find_spec("tensorboard") is None:
        return "needs the tensorboard package, which is not installed; pip install tensorboard"
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except Exception as exc:  # whatever its dependencies raise
        said = " ".join(str(exc).split())[:300] or type(exc).__name__
        return f"cannot import tensorboard ({type(exc).__name__}: {said}); repair its install"
    return None


def _summary_writer(folder: Path, purge_step: int | None) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(folder), purge_step=purge_step)


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """An ``OSError`` inside names ``path`` when it names no file: a buffered write to a full
    disk says only "No space left on device", and the one line the command prints should say
    where."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or is left as it was (a full disk left a 0-byte
    ``summary.json`` that readers then failed to parse)."""
    tmp = path.with_name(path.name + ".tmp")
    with naming(path):
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # (replaced: gone already; failed: not left behind)


def _line(record: dict) -> str:
    """``record`` as one line of strict JSON: a NaN or infinite value (a skipped step's loss)
    is ``null``, which every JSON reader takes (Python's ``NaN`` is not JSON)."""
    finite = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }
    return json.dumps(finite, allow_nan=False) + "\n"


class MetricsLog:
    """Rank 0 appends each record to ``metrics.jsonl`` (and TensorBoard scalars); every rank
    keeps ``records`` in memory."""

    def __init__(self, out: Path, records: list[dict], *, write: bool, tensorboard: bool) -> None:
        self.path = out / "metrics.jsonl"
        self.records, self.write = records, write
        # Resumed: TensorBoard drops what it holds past the records kept (steps done again); a
        # fresh run, all an earlier run left in the folder (metrics.jsonl is rewritten too).
        purge = max((r["step"] for r in records), default=-1) + 1
        self.writer = _summary_writer(out / "tensorboard", purge) if write and tensorboard else None
        if write:  # the records kept from a resumed run (whole or not at all), then appends
            write_atomically(self.path, "".join(map(_line, records)))

    def __call__(self, record: dict) -> None:
        self.records.append(record)
        if not self.write:
            return
        with naming(self.path), self.path.open("a") as f:
            f.write(_line(record))
        if self.writer is not None:
            for key, value in record.items():  # (TensorBoard keeps each event's time itself)
                if key not in ("kind", "step", "time") and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
