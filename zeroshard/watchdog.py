"""Collectives that fail with a diagnosis, not a hang: which collective, which unit, which rank.

A rank that stops answering (killed, stopped with SIGSTOP, stuck in other code, or issuing a
different collective) leaves its peers blocked until the process group's timeout
(``Mesh.from_env(timeout_s=...)``, 300 s by default; a group from ``dist.new_group`` takes its own
``timeout=``). The backend then raises an error that names neither the collective nor the rank
("Timed out waiting 300000ms for recv operation to complete"). ``diagnosed(op, label, group)``,
wrapped around every collective and every wait in ``zeroshard.collectives``, turns such an error
into ``CollectiveTimeout``, whose one-line message says what happened and what to do::

    all_gather of params (unit blocks.3) timed out after 60 s on rank 0: rank 1 did not arrive
    (stopped, hung in other code, or dead); ranks 0, 2 reached it. Look at rank 1 (its log,
    py-spy dump), or raise the timeout (Mesh.from_env(timeout_s=...), zeroshard train --timeout)
    if it is only slow

How the missing ranks are found: after a timeout gloo closes the group's connections, so nothing
more can be asked over the group itself (``dist.monitored_barrier`` on it fails at once with
"Application timeout caused pair closure"). The ranks that failed check in on the job's
rendezvous store instead (a TCP key-value store, independent of the backend): each writes the
collective it was in under ``zeroshard/watchdog/<group>/<rank>`` and waits up to ``grace_s`` (the
group's timeout, at most 10 s) for the others. A rank that never checks in did not arrive; one
that checks in from another collective ran a different schedule (a deadlock in the program).
If the store itself does not answer (outside torchrun rank 0 hosts it, so a stopped rank 0
stops it too), the check-in gives up after the grace and the message says so. The check-in is
once per group: the group is unusable after a timeout anyway.

Run on gloo (CPU) in ``tests/test_watchdog.py``. On nccl the same code runs when the timeout
reaches Python as an exception; with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` at its default, nccl's
own watchdog may end the process first (not run here: no GPU).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from zeroshard.signals import agent_gone

T = TypeVar("T")
log = logging.getLogger(__name__)

# Lower-cased fragments of the backends' errors for a peer that is gone or too slow. Anything else
# (a shape mismatch, a bad argument) is re-raised untouched: asking the store would only delay it.
_COMM_FAILURES = (
    "timed out",
    "timeout",
    "connection closed",
    "closed by peer",
    "connection reset",
    "pair closure",
    "broken pipe",
)

MAX_GRACE_S = 10.0
"""Longest wait for the other ranks to check in after a failure (shorter with short timeouts)."""

DEAD_PEER_GRACE_S = 2.0
"""The wait when a peer's connection was reset or closed: its process is gone, and the ranks
still alive hit the same error at once (a shorter wait, so a restart comes sooner). The
environment variable ``ZEROSHARD_DEAD_PEER_GRACE_S`` (seconds) overrides it."""
DEAD_PEER_GRACE_ENV = "ZEROSHARD_DEAD_PEER_GRACE_S"
_DEAD_PEER = ("closed by peer", "connection reset", "broken pipe")


class CollectiveTimeout(RuntimeError):
    """A collective did not complete: the message names the collective, the unit or label, this
    rank, and the ranks that did not arrive (or that issued another collective)."""

    exit_code = 4
    """Exit status for command-line tools (``zeroshard train``: 1 failed, 2 bad input,
    3 diverged)."""

    def __init__(self, message: str, *, report: TimeoutReport) -> None:
        super().__init__(message)
        self.report = report


class StartTimeout(RuntimeError):
    """The default process group did not form within its timeout: a rank never joined it."""

    exit_code = CollectiveTimeout.exit_code


@dataclass(frozen=True, kw_only=True)
class TimeoutReport:
    """What the ranks that failed found out together (``CollectiveTimeout.report``)."""

    op: str
    """The collective: "all_gather", "reduce_scatter", "all_reduce", "broadcast"."""
    label: str
    """What moved, as the engine labels it ("params", "grads", "norm", ...)."""
    unit: str | None
    """The unit (wrapped module) whose tensors moved, when the caller named it."""
    rank: int
    """This rank (global, as torchrun's RANK)."""
    group_ranks: tuple[int, ...]
    """Every rank of the collective's group (global ranks)."""
    missing: tuple[int, ...]
    """Ranks that never checked in: stopped, hung in other code, or dead."""
    elsewhere: dict[int, str]
    """Ranks that checked in from a different collective: rank -> "all_reduce of norm"."""
    timeout_s: float | None
    """The group's timeout in seconds (None when the backend does not say)."""
    backend_error: str
    """The backend's own message, without its source location."""
    ended: tuple[int, ...] = ()
    """Of ``missing``, the ranks on this host whose process has ended (``register_process``):
    the others are alive, still computing or blocked in another collective."""


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a backend's report of a peer that is gone or did not answer in time."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(f in text for f in _COMM_FAILURES)


def collective_failed(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a collective that failed or timed out (ours or the backend's): no
    further collective may be issued in cleaning up after it."""
    return isinstance(exc, CollectiveTimeout) or (exc is not None and is_comm_failure(exc))


@contextlib.contextmanager
def diagnosed(
    op: str, label: str, group: dist.ProcessGroup | None, *, unit: str | None = None
) -> Iterator[None]:
    """Turn a communication failure inside the block into ``CollectiveTimeout`` (see module
    docstring); other errors pass through unchanged."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, CollectiveTimeout) or not is_comm_failure(exc):
            raise
        raise diagnose(exc, op=op, label=label, group=group, unit=unit) from exc


def group_timeout_s(group: dist.ProcessGroup | None) -> float | None:
    """The timeout ``group``'s collectives run under, in seconds (None if the backend hides it)."""
    pg = group if group is not None else dist.group.WORLD
    try:
        device = torch.device("cpu") if dist.get_backend(pg) == "gloo" else None
        backend = pg._get_backend(device or dist.distributed_c10d._get_pg_default_device(pg))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return None


def inherit_timeout(*groups: dist.ProcessGroup | None) -> None:
    """Give ``groups`` the default group's collective timeout (the one ``Mesh.from_env`` set).

    ``dist.new_group`` and ``DeviceMesh`` make their groups with the backend's own default (30
    minutes on gloo, 10 on nccl), not the job's: without this, a rank stopped during a
    shard-group collective would hold the others for half an hour."""
    world_s = group_timeout_s(None)
    if world_s is None:
        return
    for group in groups:
        if group is not None and group_timeout_s(group) != world_s:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=world_s), group)


def diagnose(
    exc: BaseException,
    *,
    op: str,
    label: str,
    group: dist.ProcessGroup | None,
    unit: str | None = None,
    grace_s: float | None = None,
) -> CollectiveTimeout:
    """Find out with the other ranks which of them did not arrive at ``op`` (module docstring)
    and return the ``CollectiveTimeout`` to raise. Blocks up to ``grace_s`` (default: the
    group's timeout, at most ``MAX_GRACE_S``) when a rank does not check in."""
    pg = group if group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(pg))
    me = dist.get_rank()
    timeout_s = group_timeout_s(group)
    if grace_s is None:
        grace_s = min(timeout_s or MAX_GRACE_S, MAX_GRACE_S)
        if any(f in str(exc).lower() for f in _DEAD_PEER):
            grace_s = min(grace_s, dead_peer_grace_s())
    mine = _describe(op, label, unit)
    arrived = _check_in(f"zeroshard/watchdog/{pg.group_name}/", me, ranks, mine, grace_s)
    missing = tuple(r for r in ranks if arrived is not None and r not in arrived)
    report = TimeoutReport(
        op=op,
        label=label,
        unit=unit,
        rank=me,
        group_ranks=ranks,
        missing=missing,
        elsewhere={r: w for r, w in (arrived or {}).items() if w != mine},
        timeout_s=timeout_s,
        backend_error=_backend_error(exc),
        ended=_ended(missing),
    )
    return CollectiveTimeout(
        _after_earlier(pg, _message(report, store_answered=arrived is not None)), report=report
    )


_FAILED: weakref.WeakKeyDictionary[dist.ProcessGroup, str] = weakref.WeakKeyDictionary()
"""The first ``CollectiveTimeout`` message of each group in this process."""


def _after_earlier(pg: dist.ProcessGroup, message: str) -> str:
    """``message``, noted as ``pg``'s first failure, or with that earlier one added: a failure
    after a caught one is diagnosed among ranks out of step or a broken group, and its own
    diagnosis may name no one or blame the timeout (explorer)."""
    earlier = _FAILED.get(pg)
    if earlier is None:
        _FAILED[pg] = message
        return message
    return (
        f"{message} (after an earlier failure on this group on this rank: {earlier[:200]}; the "
        "ranks are out of step since, or the group broken: restart, from a checkpoint, rather "
        "than catch the error and carry on)"
    )


_PROCESS_KEY = "zeroshard/process/"
_registered: list[weakref.ref] = []  # the default group this process registered in


def register_process() -> None:
    """Note this rank's host and pid in the job's store, once per default group, so that a rank
    whose collective failed tells a peer whose process ended from one still running: with 3 or
    more ranks, a live rank blocked in a later collective checked in too late and was named with
    the dead one ("ranks 0, 2 did not arrive")."""
    if not dist.is_initialized():
        return
    group = dist.distributed_c10d._get_default_group()
    if _registered and _registered[0]() is group:
        return
    with contextlib.suppress(RuntimeError):  # (no store to tell: nothing to tell apart later)
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{_PROCESS_KEY}{dist.get_rank()}", f"{socket.gethostname()} {os.getpid()}")
        _registered[:] = [weakref.ref(group)]


def _ended(ranks: tuple[int, ...]) -> tuple[int, ...]:
    """Of ``ranks``, those registered on this host whose process no longer runs."""
    if not ranks:
        return ()
    store = dist.distributed_c10d._get_default_store()

    def ask() -> dict[int, str]:
        keys = {r: f"{_PROCESS_KEY}{r}" for r in ranks}
        return {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}

    registered = within(ask, 2.0) or {}
    host = socket.gethostname()
    return tuple(r for r, at in sorted(registered.items()) if _ended_here(at, host))


def _ended_here(registered: str, host: str) -> bool:
    """Whether ``registered`` ("host pid") names a process of this host that has ended (or is a
    zombie, not yet reaped by its launcher)."""
    where, _, pid = registered.rpartition(" ")
    if where != host or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # (another user's process: it runs)
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


def _backend_error(exc: BaseException) -> str:
    """The backend's own message: its first line, without its source location and without
    gloo's generic advice ("This is typically caused by ... GLHF!"), which the line replaces."""
    first = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip().splitlines()[0])
    return first.split(" This is typically caused by", 1)[0].strip()


def dead_peer_grace_s() -> float:
    """``DEAD_PEER_GRACE_S``, or the seconds in ``ZEROSHARD_DEAD_PEER_GRACE_S`` when set."""
    text = os.environ.get(DEAD_PEER_GRACE_ENV)
    if text is None:
        return DEAD_PEER_GRACE_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(
            f"{DEAD_PEER_GRACE_ENV}={text!r}: pass a number of seconds, 0 or more (e.g. 2)"
        )
    return value


def _describe(op: str, label: str, unit: str | None) -> str:
    return f"{op} of {label}" + (f" (unit {unit})" if unit else "")


def _check_in(
    prefix: str, me: int, ranks: tuple[int, ...], mine: str, grace_s: float
) -> dict[int, str] | None:
    """Write ``mine`` under ``prefix + me`` and wait up to ``grace_s`` for every rank of
    ``ranks`` to write theirs; rank -> what it was in, for those that did. None when the store
    itself does not answer (its host, rank 0 outside torchrun, may be the stopped rank)."""
    store = dist.distributed_c10d._get_default_store()
    if host_gone(store):
        return None
    return within(lambda: _ask_store(store, prefix, me, ranks, mine, grace_s), grace_s + 2.0)


def host_gone(store: dist.Store) -> bool:
    """Whether the process serving ``store`` (a TCPStore, maybe under PrefixStores) has ended:
    a new connection to its port is refused. Asked before the store itself, whose client logs
    a C++ warning with a dozen stack frames for each request to a dead server (the ranks' own
    store under ``--max-restarts``, hosted by rank 0, killed)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return False
    try:
        socket.create_connection((store.host, store.port), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    except OSError:  # (unreachable, slow: the store's own requests will tell)
        return False
    return False


def within(ask: Callable[[], T], seconds: float) -> T | None:
    """``ask()``'s result, or None when it raised or did not return within ``seconds``. For
    requests to a job's store: a TCPStore client waits for a stopped (not dead) server without
    any timeout on some requests (``add``), so they run in a daemon thread whose join is
    bounded, left blocked in that case (the job is failing anyway)."""
    found: list[T] = []

    def run() -> None:
        with contextlib.suppress(RuntimeError, OSError):  # DistStoreError, connection errors
            found.append(ask())

    worker = threading.Thread(target=run, name="zeroshard-watchdog", daemon=True)
    worker.start()
    worker.join(seconds)
    return found[0] if found else None


def _ask_store(
    store: dist.Store, prefix: str, me: int, ranks: tuple[int, ...], mine: str, grace_s: float
) -> dict[int, str] | None:
    """``_check_in``'s requests (run in its thread)."""
    # The store's own timeout is the group's (up to minutes): bound the requests that honour it
    # by the grace, and put it back after (the store outlives this failure: other groups).
    previous = store.timeout
    store.set_timeout(datetime.timedelta(seconds=max(grace_s, 1.0)))
    try:
        store.set(f"{prefix}{me}", mine)
        store.add(f"{prefix}count", 1)
        deadline = time.monotonic() + grace_s
        while store.add(f"{prefix}count", 0) < len(ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        return {
            r: store.get(f"{prefix}{r}").decode() for r in ranks if store.check([f"{prefix}{r}"])
        }
    except (RuntimeError, OSError):  # DistStoreError and connection errors
        return None
    finally:
        store.set_timeout(previous)


_own_loop = threading.local()


@contextlib.contextmanager
def same_steps_everywhere() -> Iterator[None]:
    """For a loop whose every rank runs the same steps and evaluations (``zeroshard.train``'s):
    a rank that ended early in it was killed or crashed, and the advice about uneven loops
    (``drop_last``, an evaluation on rank 0 alone) is left out of the message."""
    before = getattr(_own_loop, "on", False)
    _own_loop.on = True
    try:
        yield
    finally:
        _own_loop.on = before


def _ranks(ranks: tuple[int, ...] | list[int]) -> str:
    listed = ", ".join(str(r) for r in ranks)
    return f"rank {listed}" if len(ranks) == 1 else f"ranks {listed}"


def _message(r: TimeoutReport, *, store_answered: bool) -> str:
    """The one line ``CollectiveTimeout`` carries (no newlines: logs keep it whole)."""
    what = _describe(r.op, r.label, r.unit)
    timed_out = any(t in r.backend_error.lower() for t in ("timed out", "timeout"))
    after = f" after {r.timeout_s:g} s" if r.timeout_s is not None else ""
    head = (
        f"{what} timed out{after} on rank {r.rank}"
        if timed_out
        else f"{what} failed on rank {r.rank} ({r.backend_error})"
    )
    raise_it = "raise the timeout (Mesh.from_env(timeout_s=...), zeroshard train --timeout)"
    # A peer's connection that closed is a process that ended (killed, crashed, exited): no
    # timeout would have helped, so none is suggested. Which rank ended is not known: with
    # more ranks, live ones that are still computing or blocked elsewhere have not arrived yet.
    if timed_out:
        advice = f", or {raise_it} if it is only slow"
    else:
        advice = "; a connection closed: a rank ended, and the first error in its log says why"
    if not store_answered:
        return (
            f"{head}; the rendezvous store did not answer either, so its host (rank 0, or "
            f"torchrun's agent) is stopped, hung or dead; look at rank 0 first{advice}"
        )
    if r.ended:  # (no timeout would have helped)
        reached = [x for x in r.group_ranks if x not in r.missing]
        alive = [x for x in r.missing if x not in r.ended]
        also = (
            f"; {_ranks(alive)} did not arrive either, still running (in other code, or "
            "waiting on it)"
            if alive
            else ""
        )
        if getattr(_own_loop, "on", False):
            return (
                f"{head}: {_ranks(r.ended)} ended (process gone: killed or crashed){also}; "
                f"{_ranks(reached)} reached it. Look at {_ranks(r.ended)}: the first error in "
                "the log says why"
            )
        return (
            f"{head}: {_ranks(r.ended)} ended (process gone: killed or crashed, or its "
            f"program finished early, e.g. with a batch fewer){also}; {_ranks(reached)} reached "
            f"it. Look at {_ranks(r.ended)}: the first error in the log says why, or its loop "
            "ran fewer steps (give every rank the same number of batches: drop_last), or the "
            "others ran a forward alone (an evaluation under `if rank == 0:`: run it on every "
            "rank, or inside zeroshard.summon_full_params(model) there)"
        )
    if r.missing:
        reached = [x for x in r.group_ranks if x not in r.missing]
        return (
            f"{head}: {_ranks(r.missing)} did not arrive (stopped, hung in other code, or dead); "
            f"{_ranks(reached)} reached it. Look at {_ranks(r.missing)} (its log, py-spy "
            f"dump){advice}"
        )
    if r.elsewhere:
        where = "; ".join(f"rank {x} was in {w}" for x, w in sorted(r.elsewhere.items()))
        return (
            f"{head}: {where}. The ranks issued different collectives (one skipped or added "
            "one, e.g. in a branch taken on some ranks only: an evaluation or generate() under "
            "`if rank == 0:` gathers a sharded model's units alone; run it on every rank, or "
            "inside zeroshard.summon_full_params(model) there); compare the ranks' code paths"
        )
    return (
        f"{head}, yet every rank of the group ({', '.join(map(str, r.group_ranks))}) reached "
        f"it: one collective took longer than the timeout, or another group failed first; "
        f"{raise_it}"
    )


ARRIVAL_S = 60.0
"""How long a rank waits at a whole-model call (``checkpoint.save``, ``save_pretrained``) for
every other rank to call it too before it warns (the group's collective timeout ends the wait):
they come from the same training step, seconds apart. A rank alone (``if rank == 0: ...``, the
DDP habit) would otherwise wait silently, then fail inside the collective."""
_calls: dict[str, int] = {}  # this process's completed calls per op and group: the next number


def every_rank_calls(
    op: str, label: str, advice: str, group: dist.ProcessGroup | None = None
) -> None:
    """Each rank of ``group`` checks in at the job's store under the number of this call of
    ``op``; the last to come lets every one go on. One that waited ``ARRIVAL_S`` warns; at the
    group's collective timeout it raises ``CollectiveTimeout`` naming the ranks that did not
    come and ``advice``, and checks out again, so that a later call on every rank meets under
    the same number (a rank that never calls it is not waiting for anything). Without a store
    (torchrun's agent killed: the ranks' last save) it checks nothing."""
    pg = group if group is not None else dist.group.WORLD
    ranks, me = tuple(dist.get_process_group_ranks(pg)), dist.get_rank()
    if len(ranks) == 1:
        return
    name = f"{op}/{pg.group_name}"
    key = f"zeroshard/calls/{name}/{_calls.get(name, 0)}"
    if agent_gone():  # (its store may fail, after a C++ stack on stderr per rank): skipped
        # on every rank alike, so that none waits for another's check-in
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{key}/{me}", "1")
        if store.add(key, 1) == len(ranks):
            store.set(key + "/all", "1")
    except RuntimeError:  # no store (its host, torchrun's agent, is gone): the collective says
        return
    said = f"{op} is a collective: every rank calls it, not under `if rank == 0:` ({advice})"
    timeout_s = group_timeout_s(group) or ARRIVAL_S
    first_s = min(ARRIVAL_S, timeout_s)
    if not _all_came(store, key, first_s):
        if timeout_s > first_s:
            log.warning("rank %d has waited %.0f s for the other ranks: %s", me, first_s, said)
        if timeout_s <= first_s or not _all_came(store, key, timeout_s - first_s):
            missing = tuple(r for r in ranks if not store.check([f"{key}/{r}"]))
            store.delete_key(f"{key}/{me}")
            store.add(key, -1)
            report = TimeoutReport(
                op=op, label=label, unit=None, rank=me, group_ranks=ranks, missing=missing,
                elsewhere={}, timeout_s=timeout_s, backend_error="timed out",
            )  # fmt: skip
            message = _after_earlier(pg, f"{_message(report, store_answered=True)} ({said})")
            raise CollectiveTimeout(message, report=report)
    _calls[name] = _calls.get(name, 0) + 1


def _all_came(store: dist.Store, key: str, seconds: float) -> bool:
    """Whether ``key``'s last rank came within ``seconds`` (or the store is gone: the collective
    then says what happened)."""
    try:
        store.wait([key + "/all"], datetime.timedelta(seconds=max(seconds, 0.001)))
        return True
    except dist.DistNetworkError:
        return True
    except RuntimeError:  # (the store's timeout)
        return False
