"""A rank that stops answering makes the others fail within the timeout, with one line naming the
collective, the unit and the rank (``zeroshard.watchdog``), never a silent hang.

Every multi-rank test runs under a 1 s collective timeout (the ranks start to join the group
together, once every one has imported torch) and a bound on the whole run from the test process
(``Workers(timeout_s=...)``, ``Connection.poll``), so that a regression fails the test instead of
hanging it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard import collectives as C
from zeroshard.mesh import Mesh
from zeroshard.testing import Workers, free_port, process_context
from zeroshard.watchdog import (
    DEAD_PEER_GRACE_ENV,
    DEAD_PEER_GRACE_S,
    CollectiveTimeout,
    TimeoutReport,
    _message,
    dead_peer_grace_s,
    group_timeout_s,
    is_comm_failure,
)

# Wall-clock bounds and short timeouts: run by `make test` after the parallel tests, with the
# machine to itself (pyproject.toml's "alone" marker).
pytestmark = pytest.mark.alone

TIMEOUT_S = 1.0
# The timeout, then up to the timeout again for the other ranks to check in (grace), plus slack
# for a loaded 2-core machine.
DEADLINE_S = 2 * TIMEOUT_S + 6.0


def _caught(fn, *args) -> tuple[str, str, float] | str:
    """``fn(*args)``: ("timeout", message, seconds) if it raised ``CollectiveTimeout``."""
    start = time.monotonic()
    try:
        fn(*args)
    except CollectiveTimeout as exc:
        return ("timeout", str(exc), time.monotonic() - start)
    return "completed"


def _gather(unit: str | None) -> None:
    out = torch.zeros(2 * 4)  # 1D, full, all ranks
    C.all_gather(out, torch.ones(4), group=None, ledger=C.Ledger(), unit=unit).wait()


def _skip_on_rank_1() -> tuple[str, str, float] | str:
    if dist.get_rank() == 1:
        return "skipped"  # a deadlock injected in one rank: it never issues the all-gather
    return _caught(_gather, "blocks.3")


def _different_collectives() -> tuple[str, str, float] | str:
    if dist.get_rank() == 0:
        return _caught(_gather, None)
    # Synchronous (async_op=False): the path without a Handle.
    norm = torch.zeros(1)
    return _caught(
        lambda: C.all_reduce(norm, group=None, ledger=C.Ledger(), label="norm", async_op=False)
    )


def _assert_one_line(message: str) -> None:
    assert "\n" not in message and len(message) < 500, message


def test_a_rank_that_skips_a_collective_is_named():
    with Workers(2, timeout_s=60, collective_timeout_s=TIMEOUT_S) as workers:
        first, second = workers.run(_skip_on_rank_1)
    assert second == "skipped"
    kind, message, seconds = first
    assert kind == "timeout", first
    _assert_one_line(message)
    head = f"all_gather of params (unit blocks.3) timed out after {TIMEOUT_S:g} s on rank 0"
    assert message.startswith(head), message
    assert "rank 1 did not arrive" in message and "Look at rank 1" in message, message
    assert "--timeout" in message, message
    assert TIMEOUT_S <= seconds < DEADLINE_S, seconds


def _checkpoint_skipped_on_rank_1(folder: str, op: str) -> tuple[str, str, float] | str:
    """Every rank saves (and, for ``op == "load"``, loads) a checkpoint but rank 1 skips the
    ``op``: rank 0's ``CollectiveTimeout`` names it, not DCP's or gloo's error."""
    from zeroshard import checkpoint

    torch.manual_seed(0)
    model = zeroshard.shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), stage=3)
    opt = zeroshard.optimizer(model, torch.optim.AdamW)
    path = os.path.join(folder, "ckpt")
    if op == "load":
        checkpoint.save(path, model, opt)
    if op == "async save" and dist.get_rank() == 1:
        # Rank 1 takes part in the save's first exchanges, then its background thread skips
        # the writing: rank 0's thread times out there, and its handle's wait() says so.
        checkpoint._write_and_publish = lambda *args: None
        checkpoint.save(path + "-2", model, opt, async_save=True).wait()
        return "skipped"
    if dist.get_rank() == 1:
        return "skipped"
    run = {"save": checkpoint.save, "async save": _async_save, "load": checkpoint.load}[op]
    return _caught(run, path if op == "load" else path + "-2", model, opt)


def _async_save(path: str, model, opt) -> None:
    from zeroshard import checkpoint

    checkpoint.save(path, model, opt, async_save=True).wait()


@pytest.mark.parametrize("op", ["save", "async save", "load"])
def test_a_rank_that_skips_a_checkpoint_is_named(op, tmp_path):
    with Workers(2, timeout_s=60, collective_timeout_s=TIMEOUT_S) as workers:
        first, second = workers.run(_checkpoint_skipped_on_rank_1, str(tmp_path), op)
    assert second == "skipped"
    kind, message, seconds = first
    assert kind == "timeout", first
    _assert_one_line(message)
    head = f"{op.split()[-1]} of checkpoint ckpt"
    assert message.startswith(head) and f"timed out after {TIMEOUT_S:g} s" in message, message
    assert "rank 1 did not arrive" in message, message
    assert seconds < DEADLINE_S, seconds


def _called_on_rank_0_alone(op: str) -> tuple[str, str, float] | str:
    """Rank 0 alone calls a collective that was not watched: gloo's raw "Timed out waiting
    ... for send operation" (opt.state_dict(), under `if rank == 0:` as with DDP), or in
    ``zeroshard train`` a peer stalled in an evaluation while rank 0 asked whether to stop."""
    from zeroshard.signals import StopOnSignal

    torch.manual_seed(0)
    model = zeroshard.shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), stage=3)
    opt = zeroshard.optimizer(model, torch.optim.AdamW)
    opt.backward(model(torch.randn(2, 8)).square().mean())
    opt.step()
    if dist.get_rank() == 1:
        return "skipped"
    run = {"optimizer state dict": opt.state_dict, "stop agreement": StopOnSignal(
        torch.device("cpu")).agreed}[op]  # fmt: skip
    return _caught(run)


@pytest.mark.parametrize("op", ["optimizer state dict", "stop agreement"])
def test_a_collective_called_on_one_rank_is_named(op):
    with Workers(2, timeout_s=60, collective_timeout_s=TIMEOUT_S) as workers:
        first, second = workers.run(_called_on_rank_0_alone, op)
    assert second == "skipped"
    kind, message, seconds = first
    assert kind == "timeout", first
    _assert_one_line(message)
    head = {"optimizer state dict": "all_gather of the state dict", "stop agreement":
            "all_reduce of the stop agreement"}[op]  # fmt: skip
    assert message.startswith(head) and "rank 1 did not arrive" in message, message
    assert seconds < DEADLINE_S, seconds


def test_ranks_in_different_collectives_say_so():
    with Workers(2, timeout_s=60, collective_timeout_s=TIMEOUT_S) as workers:
        first, second = workers.run(_different_collectives)
    for (kind, message, seconds), mine, theirs in (
        (first, "all_gather of params", "rank 1 was in all_reduce of norm"),
        (second, "all_reduce of norm", "rank 0 was in all_gather of params"),
    ):
        assert kind == "timeout", (first, second)
        _assert_one_line(message)
        assert message.startswith(mine) and theirs in message, message
        assert "different collectives" in message and "did not arrive" not in message, message
        assert "under `if rank == 0:`" in message and "summon_full_params" in message, message
        assert seconds < DEADLINE_S, seconds


def _hybrid_group_timeouts() -> tuple[float | None, float | None]:
    mesh = Mesh.current().hybrid_sharded(1)  # 2 ranks: shard groups of 1, replicated twice
    return group_timeout_s(mesh.shard_group), group_timeout_s(mesh.replicate_group)


def test_groups_made_for_hybrid_sharding_keep_the_job_s_timeout():
    # dist.new_group and DeviceMesh would give them gloo's default, 30 minutes.
    with Workers(2, timeout_s=60, collective_timeout_s=TIMEOUT_S) as workers:
        assert workers.run(_hybrid_group_timeouts) == [(TIMEOUT_S, TIMEOUT_S)] * 2


# ------------------------------------------------------------ SIGSTOP inside a sharded model


def _stopped_rank_main(rank: int, port: int, conn, stopped: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    conn.send("imported")  # then joins with the other rank (see the module docstring)
    conn.recv()
    Mesh.from_env(backend="gloo", device="cpu", timeout_s=TIMEOUT_S)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model = zeroshard.shard(model, stage=3, wrap=zeroshard.wrap.by_class(nn.Linear))
    conn.send("sharded")
    if rank == stopped:
        os.kill(os.getpid(), signal.SIGSTOP)  # stops answering, as a rank stuck in the kernel
    conn.send(_caught(lambda: model(torch.randn(2, 8)).sum().backward()))


@pytest.mark.parametrize("stopped", [1, 0])
def test_a_stopped_rank_is_named_by_the_engine_s_collective(stopped):
    """Rank 1 stopped: rank 0 names it. Rank 0 stopped: outside torchrun it also hosts the
    rendezvous store, which stops with it; rank 1 still fails within the bound and says so."""
    ctx = process_context()  # the workers' (forked from a server that imported torch)
    alive = 1 - stopped
    port = free_port()
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [
        ctx.Process(target=_stopped_rank_main, args=(r, port, pipes[r][1], stopped), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        for parent, _ in pipes:
            assert parent.poll(90) and parent.recv() == "imported"
        for parent, _ in pipes:
            parent.send("join")
        conn = pipes[alive][0]
        assert conn.poll(90) and conn.recv() == "sharded"
        assert conn.poll(DEADLINE_S + 10), f"rank {alive} hung: no CollectiveTimeout"
        kind, message, seconds = conn.recv()
        # The stopped rank really was stopped ('T' in /proc), not finished or dead.
        if os.path.exists(f"/proc/{procs[stopped].pid}/stat"):
            with open(f"/proc/{procs[stopped].pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] == "T"
    finally:
        for p in procs:
            p.kill()  # SIGKILL ends a stopped process too
            p.join(10)
    assert kind == "timeout"
    _assert_one_line(message)
    head = rf"all_gather of params \(unit [01]\) timed out after {TIMEOUT_S:g} s on rank {alive}"
    assert re.match(head, message), message  # the unit: the engine names its FlatParam
    if stopped == 1:
        assert "rank 1 did not arrive" in message, message
    else:
        assert "rendezvous store did not answer" in message and "rank 0" in message, message
    assert TIMEOUT_S <= seconds < DEADLINE_S, seconds


# ------------------------------------------------------------ pure: messages and errors


def _report(**kw) -> TimeoutReport:
    base = dict(
        op="reduce_scatter", label="grads", unit=None, rank=0, group_ranks=(0, 1, 2, 3),
        missing=(), elsewhere={}, timeout_s=60.0,
        backend_error="Timed out waiting 60000ms for recv operation to complete",
    )  # fmt: skip
    return TimeoutReport(**{**base, **kw})


def test_message_names_several_missing_ranks():
    message = _message(_report(missing=(2, 3)), store_answered=True)
    assert message.startswith("reduce_scatter of grads timed out after 60 s on rank 0: ranks 2, 3")
    assert "ranks 0, 1 reached it" in message, message
    _assert_one_line(message)


def test_message_when_every_rank_arrived_or_the_store_is_gone():
    slow = _message(_report(), store_answered=True)
    assert "every rank of the group (0, 1, 2, 3) reached it" in slow and "raise the timeout" in slow
    gone = _message(_report(), store_answered=False)
    assert "rendezvous store did not answer" in gone and "rank 0" in gone
    closed = _message(
        _report(backend_error="Connection closed by peer [127.0.0.1]:1234", missing=(1,)),
        store_answered=True,
    )
    assert "failed on rank 0 (Connection closed by peer" in closed and "rank 1 did not" in closed
    assert "a connection closed: a rank ended" in closed and "timeout" not in closed, closed
    assert "raise the timeout" in _message(_report(missing=(1,)), store_answered=True)
    closed = _message(_report(backend_error="Connection reset by peer"), store_answered=False)
    assert "look at rank 0 first; a connection closed: a rank ended" in closed, closed
    assert "timeout" not in closed, closed  # none would help


def test_the_backend_s_message_loses_its_location_and_gloo_s_generic_advice():
    from zeroshard.watchdog import _backend_error

    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:27877: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs "
        "in the application. Check the logs of the remote worker before reporting an error. "
        "GLHF! \U0001f3d6\ufe0f\nmore"
    )
    assert _backend_error(gloo) == "Read error [127.0.0.1]:27877: Connection reset by peer."
    plain = RuntimeError("[x.cc:78] Timed out waiting 3000ms for recv operation to complete")
    assert _backend_error(plain) == "Timed out waiting 3000ms for recv operation to complete"


def test_only_communication_failures_are_diagnosed():
    assert is_comm_failure(RuntimeError("[x.cc:78] Timed out waiting 3000ms for recv operation"))
    assert is_comm_failure(RuntimeError("Connection closed by peer [127.0.0.1]:5000"))
    assert not is_comm_failure(RuntimeError("output tensor size must be equal to world_size"))
    assert not is_comm_failure(ValueError("timeout"))


def test_the_dead_peer_grace_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(DEAD_PEER_GRACE_ENV, raising=False)
    assert dead_peer_grace_s() == DEAD_PEER_GRACE_S
    monkeypatch.setenv(DEAD_PEER_GRACE_ENV, "0.5")
    assert dead_peer_grace_s() == 0.5
    monkeypatch.setenv(DEAD_PEER_GRACE_ENV, "soon")
    with pytest.raises(ValueError, match="ZEROSHARD_DEAD_PEER_GRACE_S='soon'"):
        dead_peer_grace_s()


@pytest.mark.parametrize("bad", [0, -5.0])
def test_timeout_must_be_positive(bad):
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        Mesh.from_env(timeout_s=bad, device="cpu")


_DEAD_HOST = """
import datetime, gc, sys
import torch.distributed as dist
from zeroshard import watchdog
from zeroshard.testing import free_port
port, t = free_port(), datetime.timedelta(seconds=5)
server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=t, wait_for_workers=False)
client = dist.PrefixStore("job/", dist.TCPStore("127.0.0.1", port, 2, False, timeout=t))
assert not watchdog.host_gone(client)
del server
gc.collect()
assert watchdog.host_gone(client)
dist.distributed_c10d._get_default_store = lambda: client
print(watchdog._check_in("w/", 1, (0, 1), "in all_reduce", 1.0))
"""


def test_a_store_whose_host_died_is_not_asked():
    # Under --max-restarts rank 0 hosts the ranks' store: rank 0 killed, each of the survivor's
    # check-ins made the store's client log a C++ warning with a dozen stack frames.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _DEAD_HOST], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
    assert "frame #" not in done.stderr and "sendBytes" not in done.stderr, done.stderr


def test_a_rank_whose_process_ended_is_told_from_one_still_running(lone_process):
    # 3 ranks, rank 2 killed: a live rank blocked in a later collective checked in after the
    # grace and was named with the dead one ("ranks 0, 2 did not arrive"), 1 run in 5.
    import socket
    import subprocess
    import sys

    from zeroshard.watchdog import TimeoutReport, _ended, _message

    Mesh.from_env()  # registers this process (rank 0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    store = dist.distributed_c10d._get_default_store()
    store.set("zeroshard/process/2", f"{socket.gethostname()} {dead.pid}")
    store.set("zeroshard/process/3", f"another-host {dead.pid}")  # (unknown: not ended)
    assert _ended((0, 1, 2, 3)) == (2,)
    report = TimeoutReport(
        op="all_reduce", label="norm", unit=None, rank=1, group_ranks=(0, 1, 2), missing=(0, 2),
        elsewhere={}, timeout_s=300.0, backend_error="Connection reset by peer", ended=(2,),
    )  # fmt: skip
    said = _message(report, store_answered=True)
    # (a rank whose loop ran a batch fewer exits normally: it was said to have crashed)
    assert "rank 2 ended (process gone: killed or crashed, or its program finished early" in said
    assert "e.g. with a batch fewer); rank 0 did not arrive" in said
    assert said.endswith(
        "rank 1 reached it. Look at rank 2: the first error in the log says why, or its loop ran "
        "fewer steps (give every rank the same number of batches: drop_last), or the others "
        "ran a forward alone (an evaluation under `if rank == 0:`: run it on every rank, or "
        "inside zeroshard.summon_full_params(model) there)"
    )
    timed_out = dataclasses.replace(report, backend_error="Timed out", ended=(0, 2))
    said = _message(timed_out, store_answered=True)  # (no timeout would have helped)
    assert "ranks 0, 2 ended" in said and "timeout" not in said.split("on rank 1")[1], said
    # In zeroshard train's loop every rank runs the same steps: an early end is a kill or crash
    # (a survivor under --max-restarts printed the drop_last advice before the restart line).
    from zeroshard.watchdog import same_steps_everywhere

    with same_steps_everywhere():
        said = _message(report, store_answered=True)
    assert said.endswith(
        "rank 2 ended (process gone: killed or crashed); rank 0 did not arrive either, still "
        "running (in other code, or waiting on it); rank 1 reached it. Look at rank 2: the first "
        "error in the log says why"
    ), said
    assert "drop_last" in _message(report, store_answered=True)  # (outside it again)


def _caught_then_carried_on() -> list[str]:
    """Rank 0 catches the timeout of a whole-model call that rank 1 skipped, and goes on to a
    collective that rank 1 skips too: its second failure says it came after the first."""
    from zeroshard.watchdog import every_rank_calls

    if dist.get_rank() == 1:
        return []
    said = []
    try:
        every_rank_calls("save", "checkpoint ck", "every rank saves")
    except CollectiveTimeout as exc:
        said.append(str(exc))
    caught = _caught(_gather, "blocks.0")
    return said + ([] if caught == "completed" else [caught[1]])


def test_a_failure_after_a_caught_one_names_the_first():
    """After a caught timeout the next failure was diagnosed on its own (explorer: "every rank
    of the group reached it ... raise the timeout", though the ranks were out of step)."""
    with Workers(2, timeout_s=60, collective_timeout_s=TIMEOUT_S) as workers:
        said, _ = workers.run(_caught_then_carried_on)
    assert len(said) == 2 and "save of checkpoint ck timed out" in said[0], said
    assert "(after an earlier failure on this group on this rank: save of checkpoint" in said[1]
    assert "restart, from a checkpoint, rather than catch the error" in said[1]
    assert "after an earlier" not in said[0]
