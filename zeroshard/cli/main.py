"""Entry point of the ``zeroshard`` command: builds the parser from the subcommand modules and
dispatches. Each subcommand module has ``add_parser(subparsers)`` and ``run(args) -> int``.

A user mistake (``ValueError``/``UsageError`` from a subcommand), or a disk full or read-only,
prints one line naming the problem and the fix and exits with status 2, with no traceback; Ctrl-C
exits with 130.
``zeroshard --version`` prints the version.
"""

from __future__ import annotations

import signal

_EARLY: list[int] = []
"""SIGINT/SIGTERM that came while this module was imported as the command, before ``_parse``
holds them: the stdlib imports below take tens of ms (seconds on a loaded machine), and a Ctrl-C
there, as torchrun's agent forwards it to ranks just started, printed a traceback."""
_BEFORE = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
if __name__ == "__main__":
    for _sig, _was in _BEFORE.items():
        if _was is not signal.SIG_IGN:  # (a job started in the background ignores SIGINT)
            signal.signal(_sig, lambda signum, _: _EARLY.append(signum))

import argparse
import contextlib
import errno
import gc
import importlib
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from zeroshard.cli.held_signals import held

# Subcommands, in the order ``--help`` lists them; each is ``zeroshard.cli.<name>``.
SUBCOMMANDS = ("train", "plan", "checkpoint", "export")


class UsageError(ValueError):
    """A mistake in what the user asked for; the message says what to change."""


DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
"""A file system full or read-only: the machine's state, not a bug."""


def bad_input(exc: BaseException) -> str | None:
    """The one line (exit 2) for an error of the input or of the machine's disks, which a rerun
    as it stands would repeat; None for anything else (a bug: its traceback is wanted)."""
    if isinstance(exc, (UsageError, ValueError, FileNotFoundError, PermissionError)):
        return str(exc)
    if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
        return f"{exc}; free space on that file system, or write elsewhere (e.g. --out-dir)"
    return None


def version() -> str:
    """The installed distribution's version, else the source tree's ``zeroshard.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("zeroshard")
    except PackageNotFoundError:
        from zeroshard import __version__

        return __version__


class _Parser(argparse.ArgumentParser):
    """argparse, taking any word that starts with a minus and a digit as a value: a negative
    size (``--params -7.5B``) was read as an unknown option ("expected one argument" under the
    whole usage) where ``--params=-7.5B`` was said to be negative. No option starts so."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="zeroshard",
        description="ZeRO / fully sharded data parallel training on torch.distributed.",
    )
    parser.add_argument("--version", action="version", version=f"zeroshard {version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"zeroshard.cli.{name}")
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run)
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace | int:
    """The parsed command line, or the signal that came meanwhile: building the parser imports
    torch (seconds), and a Ctrl-C or SIGTERM then is only noted (``held_signals``)."""
    with held() as noted:
        args = build_parser().parse_args(argv)
    if __name__ == "__main__":  # held() put the early handlers back: the original ones now
        for sig, was in _BEFORE.items():
            signal.signal(sig, was)
    noted = _EARLY + noted
    return noted[0] if noted else args


def _say_warnings_as(command: str) -> None:
    """Warnings that zeroshard's code raises read ``zeroshard COMMAND: warning: ...`` on stderr
    (the file and line of zeroshard's own call site mean nothing to a user of the command),
    from rank 0 only under torchrun; others, a user's model's or a library's, keep Python's
    form."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    default = warnings.formatwarning

    quiet = "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("RANK", "0") != "0"

    def formatwarning(message, category, filename, lineno, line=None) -> str:
        if os.path.abspath(filename).startswith(package + os.sep):
            # Every rank meets the same: rank 0 says it for the job.
            return "" if quiet else f"zeroshard {command}: warning: {message}\n"
        return default(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning


def _to_devnull(stream: Any) -> None:
    """Point ``stream``'s file at ``/dev/null``: its reader is gone, and what is still written
    (buffered text, the flush at exit) must not raise."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


class _GoesQuiet:
    """A text stream that drops what it is given once its reader is gone (EPIPE: a pipe into
    ``head``, a ``tee`` killed at logout; EIO: a closed terminal), its file then pointed at
    ``/dev/null`` for writes made past it (C++ warnings, the flush at exit)."""

    def __init__(self, stream: Any) -> None:
        self._stream, self.gone = stream, False

    def _guarded(self, call: Callable[[], Any], default: Any) -> Any:
        if self.gone:
            return default
        try:
            return call()
        except OSError as exc:
            if not isinstance(exc, BrokenPipeError) and exc.errno != errno.EIO:
                raise
            self.gone = True
            with contextlib.suppress(OSError, ValueError):
                _to_devnull(self._stream)
            return default

    def write(self, text: str) -> int:
        return self._guarded(lambda: self._stream.write(text), len(text))

    def flush(self) -> None:
        self._guarded(self._stream.flush, None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def unread_output_goes_quiet() -> Iterator[None]:
    """For a training run: its output is progress, whose reader leaving must not end the run
    (a BrokenPipeError failed it at the next line, status "failed"; an explorer)."""
    before = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _GoesQuiet(sys.stdout), _GoesQuiet(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = before


def main(argv: list[str] | None = None) -> int:
    """The command (``argv`` None: ``sys.argv``'s, in a process of its own), or a caller's
    ``main([...])``."""
    if argv is not None:
        return _main(argv)
    try:
        return _main(None)
    finally:
        # The interpreter's last garbage collections walk every object torch made (0.3-0.7 s,
        # on every rank at every exit); frozen, they skip them. Nothing is left to collect by
        # now: ``zeroshard train`` frees its process groups itself (``mesh.tear_down``).
        gc.freeze()


def _main(argv: list[str] | None) -> int:
    args = _parse(argv)
    if isinstance(args, int):
        # Under torchrun (the launcher signalled, or a peer failed, as the ranks start) rank 0
        # says it for the job: the launcher adds nothing for a signal it forwarded.
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            print("zeroshard: interrupted", file=sys.stderr)
        elif os.environ.get("RANK") == "0":
            print("interrupted before training started; nothing saved", flush=True)
        return 128 + args
    if argv is None:  # the command itself, not a caller's main([...])
        _say_warnings_as(args.command)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C where no subcommand handles it: no traceback
        print(f"zeroshard {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `zeroshard plan | head -1`: the reader left, as for any tool
        _to_devnull(sys.stdout)  # no error at exit
        return 141
    except Exception as exc:
        line = bad_input(exc)
        if line is None:
            raise
        print(f"zeroshard {args.command}: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
