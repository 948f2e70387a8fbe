"""torchrun's elastic agent, run in this process by ``zeroshard train --nproc N`` (or
``--nnodes``, ``--max-restarts``): it starts the ranks, stops them all when one fails or a
signal comes, and restarts them when asked.

Two things are added around torchrun's own ``main``:

- the agent's exit is turned into ours: a rank's bad input (2), divergence (3), collective
  timeout (4) or interrupt (130 / 143) keeps its status, and any other failure gets one line;
- a rank that stopped on bad input or divergence ends the run, not one restart of it: the
  restart would resume from the last checkpoint only to fail the same way; so do ranks that
  all stopped on a signal sent to one of them (a restart undid the interrupt they announced);
- no SIGINT or SIGTERM is lost while the agent starts. Until its ranks exist the agent has no
  handler of its own (Python's ``KeyboardInterrupt`` can be swallowed in its lazy imports) and,
  while it spawns them, a signal stops it before it has recorded which it started: they ran on,
  orphaned. So the two signals are only noted (``held_signals``) until the ranks are started,
  then handed to the agent, which stops them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroshard.cli.held_signals import held
from zeroshard.divergence import Diverged
from zeroshard.mesh import cpu_threads_per_rank
from zeroshard.watchdog import CollectiveTimeout

SHARED_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torchrun's switch that gives each restart of the ranks a store of its own."""
LAUNCHER_PID = "ZEROSHARD_LAUNCHER_PID"
"""Set for the ranks ``zeroshard train`` starts: its pid, the command that holds the output
folder (ranks of the user's own torchrun hold it themselves)."""
RESUME_NEWEST = "ZEROSHARD_RESUME_NEWEST"
"""Set ("1") for the ranks of a job that may start more than once: every start resumes from the
newest checkpoint of the job's folder (torchrun does not count a start after nodes joined or
left as a restart, and a node that joined late may have pinned a checkpoint pruned since)."""
HELD = (signal.SIGINT, signal.SIGTERM)
"""Held until the ranks are started; torchrun's agent handles only the others as it starts them."""
AGENT_SIGNALS = "SIGHUP,SIGQUIT"
RANKS_SAID_WHY = (2, Diverged.exit_code, CollectiveTimeout.exit_code, 129, 130, 143)
"""Exit statuses of ranks that printed their own line (bad input, divergence, timeout, signal)."""
STILL_STOPPING = (
    "zeroshard train: still stopping the ranks (each ends its step, then exits; killed after 30 s)"
)
"""Said to a second SIGINT or SIGTERM while the ranks stop (``_holding_agent``)."""
FINAL = (2, Diverged.exit_code)
"""Exit statuses that a restart would only repeat (bad input; divergence, which a resume from
the last checkpoint replays): the run ends at once, whatever ``--max-restarts`` has left."""
INTERRUPTED = (129, 130, 143)
"""Ranks that agreed to stop on a SIGINT or SIGTERM: when every failed rank says so (one of
them got the signal), a restart would undo the interrupt; the agent's own SIGTERM to the others
after a rank died also ends some with 143, and those are restarted."""


def _final(codes: list[int]) -> bool:
    """Whether failed ranks' exit statuses end the run rather than one attempt of it."""
    return any(c in FINAL for c in codes) or all(c in INTERRUPTED for c in codes)


def _said(failure: Any) -> str:
    """torchrun's message of a failed rank worth repeating (a signal's), else ''."""
    message = failure.message or ""
    return "" if message.startswith("To enable traceback") else message


@dataclass(frozen=True, kw_only=True)
class Launch:
    """How ``zeroshard train`` starts its ranks: here, or through torchrun's elastic agent."""

    nproc: int
    """Ranks on this node."""
    port: int
    """Rendezvous port on this machine (0: a free one); single-node jobs only."""
    max_restarts: int = 0
    """Restarts of every rank after one fails; each resumes from the newest checkpoint."""
    min_nodes: int = 1
    """Fewest nodes the job runs on (a node leaving below this ends the run)."""
    max_nodes: int = 1
    """Most nodes the job runs on."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the c10d rendezvous every node meets at (multi-node jobs)."""
    rdzv_conf: tuple[tuple[str, int], ...] = ()
    """torchrun's ``--rdzv-conf`` settings of the c10d rendezvous (see ``RDZV_CONF``)."""

    @property
    def elastic(self) -> bool:
        """Whether the ranks run under torchrun's agent (else this process trains alone)."""
        return self.nproc > 1 or self.max_restarts > 0 or self.max_nodes > 1

    @property
    def restarts(self) -> bool:
        """Whether the agent may start the ranks more than once."""
        return self.max_restarts > 0 or self.min_nodes < self.max_nodes

    def joins_running_job(self) -> bool:
        """Whether this node joins an elastic job that is already running: something answers
        at its rendezvous endpoint (the store that the first node's agent hosts)."""
        if self.min_nodes == self.max_nodes or not self.rdzv_endpoint:
            return False
        host, _, port = self.rdzv_endpoint.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except OSError:
            return False

    def worlds(self) -> list[int]:
        """Every world size the job may run at, smallest first."""
        return [self.nproc * n for n in range(self.min_nodes, self.max_nodes + 1)]

    def torchrun_argv(self, config: Path) -> list[str]:
        if self.rdzv_endpoint:
            nodes = f"{self.min_nodes}:{self.max_nodes}"
            rdzv = ["--nnodes", nodes, "--rdzv-backend", "c10d"]
            rdzv += ["--rdzv-endpoint", self.rdzv_endpoint]
            if self.rdzv_conf:
                rdzv += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in self.rdzv_conf)]
        else:
            rdzv = ["--standalone"] if not self.port else ["--master-port", str(self.port)]
        argv = [*rdzv, "--nproc-per-node", str(self.nproc)]
        argv += ["--max-restarts", str(self.max_restarts), "-m", "zeroshard.cli.main"]
        return [*argv, "train", "--config", str(config)]


def run_agent(
    launch: Launch, config: Path, on_failure: Callable[[int, int], None] | None = None
) -> int:
    """``torchrun --nproc-per-node N [--max-restarts R] -m zeroshard.cli.main train --config
    CONFIG`` in this process; the exit status is the ranks' when they reported why they
    stopped, else 1 with one line naming the failed rank (and ``on_failure(rank, exit code)``
    of the rank that failed first)."""
    with held(HELD) as noted:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous.api import RendezvousError
        from torch.distributed.run import main as torchrun

        if noted:
            print("zeroshard train: interrupted before the ranks started", file=sys.stderr)
            return 128 + noted[0]
        # The agent's own reports of forwarded signals and failed ranks would follow ours.
        for name in ("multiprocessing.api", "agent.server.api"):
            logging.getLogger(f"torch.distributed.elastic.{name}").setLevel(logging.CRITICAL)
        stopping: list[int] = []
        ended: list[int | None] = []  # the ranks' exit codes once the agent stopped them
        _quiet_timer_teardown()
        try:
            with _agent_env(launch, noted, stopping, ended):
                torchrun(_holding_argv(launch.torchrun_argv(config)))
        except SignalException as exc:  # forwarded to the ranks, which stopped and reported
            if noted and not stopping:  # (before any rank: while the nodes met, or as they
                name = signal.Signals(int(exc.sigval)).name  # were about to start)
                print(f"zeroshard train: interrupted by {name} before the ranks started",
                      file=sys.stderr)  # fmt: skip
            if ended and all(code == 0 for code in ended):
                return 0  # on the last step: the ranks ended the run as done, and said so
            return 128 + int(exc.sigval)
        except RendezvousError as exc:  # e.g. the node hosting it ended the job, or left
            print(f"zeroshard train: {_rendezvous_failed(launch, exc)}", file=sys.stderr)
            return 1
        except ChildFailedError as exc:
            rank, first = exc.get_first_failure()
            if first.exitcode in RANKS_SAID_WHY:
                return first.exitcode
            after = f" after {launch.max_restarts} restart(s)" if launch.max_restarts else ""
            print(
                f"zeroshard train: rank {rank} failed (exit code {first.exitcode}){after}; the "
                f"other ranks were stopped. {_said(first)}".rstrip(),
                file=sys.stderr,
            )
            if on_failure is not None:
                on_failure(rank, first.exitcode)
            return 1
        except Exception:
            # The agent's SignalException, raised by the handler between two lines of torch's
            # code, can be replaced there (an UnboundLocalError in its metrics' ``finally``):
            # the ranks got the signal all the same (``first_stops``), stopped and reported.
            if stopping:
                return 128 + stopping[0]
            raise
    return 0


JOIN_TIMEOUT_S = 600
"""torchrun's c10d rendezvous join timeout when ``--rdzv-conf join_timeout`` does not set it."""


def _rendezvous_failed(launch: Launch, exc: Exception) -> str:
    """Why the rendezvous failed, in one line: torch raises its timeout and closed errors
    without a message ("RendezvousTimeoutError: ;")."""
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousTimeoutError,
    )

    at = f"the rendezvous at {launch.rdzv_endpoint}"
    if isinstance(exc, RendezvousTimeoutError) and not str(exc):
        join_s = dict(launch.rdzv_conf).get("join_timeout", JOIN_TIMEOUT_S)
        return (
            f"{at} timed out: fewer than the {launch.min_nodes} node(s) that --nnodes asks "
            f"for joined within its join timeout ({join_s} s); start the other nodes with the "
            "same --nnodes and --rdzv-endpoint, or give them longer with --rdzv-conf "
            "join_timeout=SECONDS"
        )
    if isinstance(exc, RendezvousClosedError) and not str(exc):
        return f"{at} was closed: the job ended on another node (its output says why)"
    return (
        f"{at} failed: {type(exc).__name__}: {exc}; the job ended on another node (its output "
        "says why), or the node hosting the rendezvous left"
    )


def _quiet_timer_teardown() -> None:
    """Keep torch's rendezvous keep-alive timer quiet when it is collected on its own thread as
    a signal stops the agent: its finalizer's ``thread.join()`` raises "cannot join current
    thread", which Python prints as "Exception ignored in: <finalize object ...>" with a
    traceback after the job's one line (harmless: the thread is ending anyway). Every other
    unraisable exception goes to the hook there was."""
    previous = sys.unraisablehook
    if getattr(previous, "_zeroshard", False):
        return

    def hook(unraisable: Any) -> None:
        if not _timer_joining_itself(unraisable):
            previous(unraisable)

    hook._zeroshard = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _timer_joining_itself(unraisable: Any) -> bool:
    exc = unraisable.exc_value
    if not isinstance(exc, RuntimeError) or str(exc) != "cannot join current thread":
        return False
    tb = unraisable.exc_traceback
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "_stop_thread" and "rendezvous" in code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _holding_argv(argv: list[str]) -> list[str]:
    """torchrun's ``argv``, with its agent told to leave ``HELD`` alone as it starts the ranks
    (``--signals-to-handle``; with an older torch that lacks the flag, the moment while it
    spawns them stays uncovered)."""
    from torch.distributed.run import get_args_parser

    flags = {s for action in get_args_parser()._actions for s in action.option_strings}
    if "--signals-to-handle" not in flags:
        return argv
    return ["--signals-to-handle", _agent_signals(), *argv]


def _agent_signals() -> str:
    """``AGENT_SIGNALS`` less those ignored as the command starts: under ``nohup`` the agent's
    handler replaced SIGHUP's ignore, and its ranks, no longer ignoring it either, died at
    the hangup nohup was there to survive."""
    names = AGENT_SIGNALS.split(",")
    kept = [n for n in names if signal.getsignal(getattr(signal, n)) != signal.SIG_IGN]
    return ",".join(kept) or "SIGQUIT"


@contextmanager
def _agent_env(
    launch: Launch, noted: list[int], stopping: list[int], ended: list[int | None]
) -> Iterator[None]:
    """torchrun's settings and agent class for this job, put back after."""
    import torch.distributed.launcher.api as launcher

    env = {LAUNCHER_PID: str(os.getpid())}
    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun would set 1 and print a banner saying so; the ranks' share of the cores is
        # what Mesh.share_cpu_threads gives them anyway.
        env["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(launch.nproc))
    if launch.restarts:
        # The agent's store, shared with the ranks by default, keeps the first attempt's keys:
        # restarted gloo ranks read their dead predecessors' addresses and wait forever in
        # connectFullMesh (pytorch/pytorch#135712). Unshared, rank 0 hosts a fresh store per
        # attempt.
        env[SHARED_STORE_OFF] = "1"
        env[RESUME_NEWEST] = "1"
    before = {name: os.environ.get(name) for name in env}
    agent = launcher.LocalElasticAgent
    launcher.LocalElasticAgent = _holding_agent(agent, noted, stopping, ended)
    os.environ.update(env)
    try:
        yield
    finally:
        launcher.LocalElasticAgent = agent
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _holding_agent(
    base: type, noted: list[int], stopping: list[int], ended: list[int | None]
) -> type:
    """``base`` (torchrun's LocalElasticAgent), which installs its own handler for ``HELD``
    only once its ranks are started (``--signals-to-handle`` leaves them out of its start),
    and then acts on a signal ``noted`` meanwhile (none is started when it came earlier); it
    restarts no rank that failed with a ``FINAL`` status. A signal that came once they were
    started is sent to them at once and put in ``stopping``; the ranks' exit codes once it
    stopped them are put in ``ended`` (0 for each: they had finished the run)."""
    workers: list[int] = []  # the ranks' pids
    from torch.distributed.elastic.multiprocessing.api import (
        SignalException,
        _terminate_process_handler,
    )

    def stop_if_noted() -> None:
        if noted:
            sigval = signal.Signals(noted[0])
            raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)

    def first_stops(signum: int, frame: Any) -> None:
        # The agent then stops the ranks (the signal, up to 30 s, then SIGKILL): a second
        # signal raised inside that wait, the agent exited at once and the ranks ran on,
        # orphaned, writing into a folder no longer locked. Later ones are only answered.
        said = (STILL_STOPPING + "\n").encode()  # (os.write: print can re-enter stderr)
        for sig in HELD:
            signal.signal(sig, lambda *_: os.write(2, said))
        stopping.append(signum)
        for pid in workers:  # the agent's own forwarding may be lost (``run_agent``)
            with suppress(OSError):
                os.kill(pid, signum)
        _terminate_process_handler(signum, frame)

    def stop_now(signum: int, frame: Any) -> None:
        noted.append(signum)  # (also seen at the start, should this be swallowed)
        sigval = signal.Signals(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)

    class HoldingAgent(base):  # type: ignore[misc, valid-type]
        def _rendezvous(self, worker_group: Any) -> Any:
            # No rank exists while the nodes meet: a signal acts at once (held, it waited for
            # the rendezvous's own timeout, 600 s by default, while nodes never came).
            before = {sig: signal.signal(sig, stop_now) for sig in HELD}
            try:
                stop_if_noted()
                return super()._rendezvous(worker_group)
            finally:
                for sig, old in before.items():
                    signal.signal(sig, old)

        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            stop_if_noted()
            pids = super()._start_workers(worker_group)
            workers[:] = pids.values()
            for sig in HELD:
                signal.signal(sig, first_stops)
            stop_if_noted()
            return pids

        def _stop_workers(self, *args: Any, **kwargs: Any) -> None:
            workers.clear()  # (stopped: their pids may be another process's)
            super()._stop_workers(*args, **kwargs)

        def _shutdown(self, *args: Any, **kwargs: Any) -> None:
            # On a signal torchrun raises its SignalException whatever the ranks did with it:
            # one on the last step, they end the run as done and exit 0 (it exited 130 / 143,
            # and a scheduler requeueing on 143 resumed a finished run).
            context = self._pcontext
            try:
                super()._shutdown(*args, **kwargs)
            finally:
                handlers = getattr(context, "subprocess_handlers", None) or {}
                ended[:] = [h.proc.poll() for h in handlers.values()]

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if not result.is_failed():
                return result
            if _final([failure.exitcode for failure in result.failures.values()]):
                self._remaining_restarts = 0
            elif self._remaining_restarts > 0:  # (torch's own report of it is silenced)
                rank, first = min(result.failures.items(), key=lambda kv: kv[1].timestamp)
                print(
                    f"zeroshard train: rank {rank} failed (exit code {first.exitcode}); "
                    "restarting every rank from the newest checkpoint "
                    f"({self._remaining_restarts - 1} restart(s) left). {_said(first)}".rstrip(),
                    file=sys.stderr,
                )
            return result

    return HoldingAgent
