"""The multi-rank test harness: run a function on N real gloo processes, reuse them across tests.

    with Workers(2) as workers:
        results = workers.run(fn, *args)   # fn(*args) on every rank; list of per-rank results

``fn`` must be importable (a module-level function). Each worker initializes the default gloo
group once, with torchrun's variables set, so ``Mesh.from_env()`` and ``zeroshard.shard`` see a
normal job. If any rank raises, ``run`` raises ``WorkerError`` with that rank's traceback at once
and kills the pool (its peers may be stuck in a collective); the next ``run`` starts a new pool.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

_RAN_KEPT = 40
"""How many of the functions a pool's processes ran last a death report names."""


class WorkerError(AssertionError):
    """A rank raised (or died, or timed out); the message carries its traceback."""


def free_port() -> int:
    """A TCP port that was free a moment ago on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "zeroshard.engine",
            "zeroshard.model_states.optimizer"]  # fmt: skip
"""Imported once by the fork server that the workers are forked from: a worker then starts in
a fraction of a second instead of importing torch (and dynamo, which torch's optimizers import)
for about 5 s of CPU each."""


def process_context() -> Any:
    """The multiprocessing context of the workers: a fork server that preloads ``_PRELOAD``
    where the platform has one (Linux, macOS), else spawn. Neither copies the test process's
    threads or gloo state."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


@contextlib.contextmanager
def impatient(arrival_s: float = 0.25, timeout_s: float = 0.5) -> Any:
    """Whole-model calls (``zeroshard.watchdog.every_rank_calls``) warn after ``arrival_s``
    and give up after ``timeout_s`` instead of the group's collective timeout."""
    from unittest import mock

    from zeroshard import watchdog

    with (
        mock.patch.object(watchdog, "ARRIVAL_S", arrival_s),
        mock.patch.object(watchdog, "group_timeout_s", lambda group: timeout_s),
    ):
        yield


def _by_value(reply: Any) -> bytes:
    """``reply`` pickled with the standard pickler, tensors copied into the bytes.
    ``Connection.send`` pickles with multiprocessing's, for which torch registers reducers
    that move a CPU tensor's storage into shared memory in place and free its heap memory: a
    result that is a live tensor of the test (a parameter, a gradient) had its memory changed
    under the library, in the process that runs the next tests."""
    return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    conn: Connection,
    collective_timeout_s: float = 120.0,
    environ: dict[str, str] | None = None,
    path: list[str] | None = None,
    fault_log: str | None = None,
) -> None:
    if fault_log is not None:  # a crash (SIGSEGV, abort) leaves its Python stack where the
        # parent reads it: this process's stderr belongs to whichever test started the pool
        faulthandler.enable(open(fault_log, "w"))  # noqa: SIM115 (open until the process ends)
    if environ is not None:  # the test process's environment and import path now, not the
        os.environ.clear()  # fork server's (from when it started)
        os.environ.update(environ)
    if path is not None:
        sys.path[:] = path
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    from zeroshard.mesh import Mesh

    # One compute thread per rank: the ranks of a test share the machine's cores. Set here, in
    # the worker, because it is process-wide (Mesh.from_env leaves it alone).
    torch.set_num_threads(1)
    # Joining waits up to the collective timeout for the other ranks: every rank starts to join
    # when all have imported torch (seconds, and not at the same time on a loaded machine), so
    # that a timeout of a second is enough.
    conn.send(("imported", None))
    if conn.recv() is None:
        return
    Mesh.from_env(backend="gloo", timeout_s=collective_timeout_s, device="cpu")
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            reply = ("ok", fn(*args, **kwargs))
        except BaseException:  # report everything, including assertion failures
            reply = ("error", traceback.format_exc())
        try:
            data = _by_value(reply)
        except Exception:  # a result that does not pickle
            data = _by_value(("error", traceback.format_exc()))
        conn.send_bytes(data)
    # The interpreter's last garbage collections walk every object torch made (most of a
    # second); frozen, the worker exits at once.
    gc.freeze()


class Workers:
    """A pool of ``world_size`` processes forming one gloo job (see the module docstring).

    ``timeout_s`` bounds each ``run`` as seen from this process; ``collective_timeout_s`` is the
    ranks' own process-group timeout, after which a collective that a rank never joins raises
    ``CollectiveTimeout`` on the others (``zeroshard.watchdog``)."""

    def __init__(
        self, world_size: int, *, timeout_s: float = 300.0, collective_timeout_s: float = 120.0
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout_s = world_size, timeout_s
        self.collective_timeout_s = collective_timeout_s
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self._ran: collections.deque[str] = collections.deque(maxlen=_RAN_KEPT)
        """The functions the current processes ran last, named when one dies: a crash (a heap
        corrupted by a write after free) may come from an earlier test in the same process."""
        self._logs = tempfile.TemporaryDirectory(prefix="zeroshard-workers-")

    def _start(self) -> None:
        """Start the ranks and wait until every one has joined the group; a start that fails
        (another process took the free port meanwhile) is retried on a new port, twice."""
        for _ in range(3):
            self._spawn(free_port())
            if self._joined():  # every rank imported torch
                for conn in self._conns:
                    conn.send("join")
                if self._joined():  # every rank joined the group
                    return
            self.close()
        raise WorkerError(f"{self.world_size} worker ranks could not start a gloo group")

    def _joined(self) -> bool:
        """Whether every rank reported (``imported``, then ``ready``; False as soon as one
        died)."""
        deadline = time.monotonic() + self.timeout_s
        pending = list(self._conns)
        while pending:
            ready = wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return False
            for conn in ready:
                try:
                    conn.recv()
                except EOFError:  # the rank died while joining
                    return False
                pending.remove(conn)
        return True

    def _spawn(self, port: int) -> None:
        ctx = process_context()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, child, self.collective_timeout_s),
                kwargs={
                    "environ": dict(os.environ),
                    "path": list(sys.path),
                    "fault_log": self._fault_log(rank),
                },
                daemon=True,
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the per-rank results, rank 0 first."""
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        self._ran.append(f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}")
        results: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        pending = dict(enumerate(self._conns))
        while pending:
            ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self.close()
                raise WorkerError(
                    f"{fn.__name__} timed out after {self.timeout_s:.0f}s on ranks "
                    f"{sorted(pending)} (a deadlock: ranks issuing different collectives?)"
                )
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    how = self._death(rank)
                    self.close()
                    raise WorkerError(f"rank {rank} died running {fn.__name__}{how}") from None
                if status == "error":
                    self.close()
                    raise WorkerError(f"rank {rank} failed in {fn.__name__}:\n{value}")
                results[rank] = value
                del pending[rank]
        return [results[r] for r in range(self.world_size)]

    def _fault_log(self, rank: int) -> str:
        return os.path.join(self._logs.name, f"rank{rank}.fault")

    def _death(self, rank: int) -> str:
        """How rank ``rank`` ended (its exit code or signal) and the Python stack that the
        fault handler wrote, if any."""
        p = self._procs[rank]
        p.join(timeout=5)
        code = p.exitcode
        how = f" ({signal.Signals(-code).name})" if code and code < 0 else f" (exit code {code})"
        with contextlib.suppress(OSError), open(self._fault_log(rank)) as f:
            stack = f.read().strip()
            if stack:
                how += f":\n{stack}"
        earlier = list(self._ran)[-_RAN_KEPT:-1]
        if earlier:
            how += "\nthe same processes ran before it (oldest first): " + ", ".join(earlier)
        return how

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs, self._conns = [], []
        self._ran.clear()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
