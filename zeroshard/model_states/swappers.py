"""What the swappers of model states share (optimizer states ``state_swap``, FP32 masters
``param_swap``, reduced gradients ``grad_swap``): opening a rank's tensor store, a collective
that fails on every rank when one rank's folder is unusable; and stopping for good on a swap
that failed, its files deleted, since what it held is no longer trusted."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from zeroshard.offload import OffloadError, OffloadSetupError, TensorStore
from zeroshard.offload.folder import clear_crashed
from zeroshard.offload.placement import discard_absent_ranks

if TYPE_CHECKING:
    from zeroshard.mesh import Mesh

log = logging.getLogger(__name__)


@contextlib.contextmanager
def stopping_on_refusal(
    stop: Callable[[str, str, BaseException], OffloadError], what: str, noun: str
) -> Iterator[None]:
    """A swap the store refuses before it begins (the disk filled up since the check) stops
    training as one that failed does (``StopsOnFailure.stop``): the step may be half applied."""
    try:
        yield
    except OffloadError as e:
        raise stop(what, noun, e) from e


class StopsOnFailure:
    """A swapper whose failed swap stops training for good: its store's files are deleted and
    every later call raises the same ``OffloadError`` (what was swapped is not trusted)."""

    store: TensorStore
    _error: str | None
    _in_step: bool
    failed: str | None = None
    """The first failed swap's error (``stop``; a ``close`` is not a failure): the engine
    refuses every later forward, step and save with it before any collective
    (``Engine.check_trusted``), as ranks that failed at different points of a backward would
    otherwise pair the next forward's gathers with leftovers of that backward."""

    def _check(self) -> None:
        if self._error is not None:
            raise OffloadError(self._error)

    def stop(self, what: str, noun: str, exc: BaseException) -> OffloadError:
        """The error to raise for a swap that failed (``what``: which one, and how); after a
        first failure, the first's (later ones follow from it: "the store is closed")."""
        self._in_step = False
        if self._error is not None:
            return OffloadError(self._error)
        self._error = (
            f"{what} ({type(exc).__name__}: {exc}); training stopped: these {noun} are not "
            "trusted. Restart the run from the last checkpoint (a new process: this one's "
            "offloaded states are closed)"
        )
        self.failed = self._error
        try:
            self.store.close()  # the files are useless now: delete them (waits for the rest)
        except OSError as cleanup:  # (a folder gone read-only): the swap error is the news
            log.warning("could not delete the swap files after the failure: %s", cleanup)
        return OffloadError(self._error)


def open_store(config: Any, mesh: Mesh, owner: object) -> TensorStore:
    """This rank's store in ``config.folder``, the swap files a crashed run left there
    discarded first (states and masters come back from checkpoints, never from those). A
    collective: a rank whose folder is unusable raises, and so does every other rank, naming
    it, instead of waiting for it in the next collective. Once every rank holds its folder,
    the folders of ranks the job does not have (a crashed larger run's) are discarded. The
    store is closed (its files deleted) when ``owner``, the swapper, is collected."""
    store, problem = None, None
    try:
        clear_crashed(Path(config.folder))
        store = TensorStore(config)
    except (OffloadError, OSError) as exc:
        problem = exc
    said: list[Any] = [None] * max(1, mesh.world_size)
    if mesh.world_size > 1:
        dist.all_gather_object(said, None if problem is None else str(problem), group=mesh.group)
    if problem is not None:
        raise problem
    failed = next(((r, e) for r, e in enumerate(said) if e is not None), None)
    if failed is not None:
        assert store is not None
        store.close()
        raise OffloadSetupError(f"rank {failed[0]} cannot offload: {failed[1]}")
    assert store is not None
    if mesh.local_rank == 0:  # once per node, now that every rank of the job holds its folder
        world = dist.get_world_size() if dist.is_initialized() else 1
        discard_absent_ranks(Path(config.folder).parent, world)
    store.close_with(owner)
    return store
