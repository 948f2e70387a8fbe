"""Asynchronous checkpoint saves: ``checkpoint.save(..., async_save=True)``'s background thread.

The caller's state is copied to CPU memory first (``snapshot``), so that training may go on;
a thread then writes, hashes and publishes it, its collectives on a gloo group of its own
(``background_group``: they must not interleave with the training thread's). One save is in
flight per process (``wait``); at exit, a save still being written is finished first.
"""

from __future__ import annotations

import atexit
import functools
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.checkpoint_files import CheckpointError
from zeroshard.flat_range import FlatRange
from zeroshard.mesh import cached_mesh
from zeroshard.watchdog import CollectiveTimeout, diagnosed, inherit_timeout


def start(path: Path, write: Callable[[dist.ProcessGroup], None], group) -> SaveHandle:
    """Run ``write(background group)`` in a thread; its handle (the save in flight)."""
    background = background_group(group)
    handle = SaveHandle(path)
    handle._thread = threading.Thread(
        target=handle._run,
        args=(write, background),
        name=f"zeroshard-save-{path.name}",
        daemon=True,
    )
    global _pending, _exit_hook
    if not _exit_hook:
        _exit_hook = True
        # Run by threading's shutdown, before concurrent.futures' own exit hook (registered
        # earlier; they run in reverse), which refuses the save's writer threads new work.
        getattr(threading, "_register_atexit", atexit.register)(_finish_at_exit)
        _finish_before_destroy()
    _pending = handle
    handle._thread.start()
    return handle


def _finish_at_exit() -> None:
    """At exit: an asynchronous save still being written is finished first, as
    ``torch.distributed.checkpoint.async_save``'s is (its thread is a daemon: the interpreter
    would stop it mid-write, and gloo aborted the process under it). A failure is said on
    stderr; the exit status stays the script's (forcing it here would skip the interpreter's
    own shutdown: atexit handlers, unflushed files)."""
    _finish_pending("exiting")


def _finish_pending(before: str) -> CheckpointError | None:
    """Finish this process's asynchronous save that no one waited for, saying so on stderr,
    and say so if it failed (a failure no one waited for was lost without a word); the
    failure, if any."""
    if _pending is None:
        return None
    path = _pending.path
    if not _pending.done():
        print(
            f"zeroshard: finishing the asynchronous save of {path} before {before} (up to the "
            "collective timeout if another rank is gone)",
            file=sys.stderr,
        )
    try:
        _pending.wait()
    except Exception as exc:  # said in one line, no traceback: the caller is leaving
        print(f"zeroshard: the asynchronous save of {path} failed: {exc}", file=sys.stderr)
        return CheckpointError(f"the asynchronous save of {path} failed: {exc}")
    return None


def _finish_before_destroy() -> None:
    """``dist.destroy_process_group()``, most scripts' last line, first finishes the save in
    flight: it took the save's group from under it (the checkpoint was lost, and the script
    exited 0). A save that failed is raised there, once the group is destroyed, so that the
    script exits 1 (it exited 0 with the loss said on stderr, and a scheduler took the run as
    a success). Called through ``torch.distributed``'s attribute only: a name imported before
    (``from torch.distributed import destroy_process_group``) is torch's own function, which
    cannot be reached; ``checkpoint.wait()`` first is the way that works for every script.
    ``zeroshard.mesh.tear_down`` calls torch's own function."""
    destroy = dist.destroy_process_group

    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        failed = None
        if threading.current_thread() is threading.main_thread():
            failed = _finish_pending("destroying the process group")
        destroy(group)
        if failed is not None:
            raise failed

    dist.destroy_process_group = destroy_process_group


class SaveHandle:
    """An asynchronous ``save`` in flight: ``done()`` says whether it has ended, ``wait()``
    blocks until then and returns the checkpoint's path, or raises the save's error."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _run(self, write: Callable[[dist.ProcessGroup], None], group) -> None:
        try:
            with diagnosed("save", f"checkpoint {self.path.name}", group):
                write(group)
        except BaseException as exc:  # re-raised by wait(), in the caller's thread
            self._error = exc

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint {self.path} is still being saved")
        global _pending
        if _pending is self:
            _pending = None
        if isinstance(self._error, CollectiveTimeout):
            raise CollectiveTimeout(str(self._error), report=self._error.report) from self._error
        if isinstance(self._error, CheckpointError):
            raise CheckpointError(str(self._error)) from self._error
        if self._error is not None:
            raise CheckpointError(
                f"asynchronous save of checkpoint {self.path} failed: {self._error}"
            ) from self._error
        return self.path


_pending: SaveHandle | None = None  # this process's asynchronous save in flight
_exit_hook = False  # _finish_at_exit registered (once per process)
_BACKGROUND_GROUPS: dict[tuple, tuple[object, dist.ProcessGroup]] = {}


def wait() -> Path | None:
    """Wait for this process's asynchronous save in flight, if any: its path, or its error."""
    return None if _pending is None else _pending.wait()


def background_group(group) -> dist.ProcessGroup:
    """A gloo group of ``group``'s ranks for the background thread's collectives (created once:
    they must not interleave with the training thread's on the same group)."""
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))

    def make() -> dist.ProcessGroup:
        made = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
        inherit_timeout(made)  # else gloo's 30 minutes for a stuck peer
        return made

    # (per default group: after destroy_process_group and a new one, the old group was
    # returned, "not registered", and every asynchronous save failed)
    return cached_mesh(_BACKGROUND_GROUPS, ranks, make)


def snapshot(tree: Any) -> Any:
    """A copy of a (nested) state dict whose tensors (DTensors: their local shards) are new
    CPU tensors: what training does next cannot change it."""
    if isinstance(tree, dict):
        return {k: snapshot(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(snapshot(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, FlatRange):
        return tree.snapshot()
    return tree
