"""``StopOnSignal``: a signal is only noted; a rank that cannot agree in time exits anyway."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from zeroshard.signals import StopOnSignal, Stopped

# Wall-clock bounds and short timeouts: run by `make test` after the parallel tests, with the
# machine to itself (pyproject.toml's "alone" marker).
pytestmark = pytest.mark.alone

STUCK = """
import sys, time, torch
from zeroshard.offload import OffloadConfig, Tier, TensorStore
from zeroshard.signals import StopOnSignal
store = TensorStore(OffloadConfig(tier=Tier.NVME, folder=sys.argv[1]))
store.swap_out("master", torch.ones(1 << 16)).wait()
StopOnSignal.GRACE_S = 0.5  # the deadline before training: the run's own (30 s) is not waited
training = sys.argv[2] == "training"
with StopOnSignal(torch.device("cpu"), grace_s=0.5 if training else 30) as stopper:
    stopper.training = training
    print("ready", flush=True)
    time.sleep(30)  # stuck: never reaches agreed()
print("not reached", flush=True)
"""


def test_a_rank_that_cannot_agree_exits_after_the_grace(tmp_path):
    """Stuck in a step, or still setting up (building the model, writing its NVMe masters),
    the rank exits anyway, saying which, and before training without waiting out a deadline
    meant for a save; the swap files of its stores go with it (no finalizer runs past
    ``os._exit``: a signal while a run wrote its masters left gigabytes of them)."""
    procs = {
        when: subprocess.Popen(
            [sys.executable, "-c", STUCK, str(tmp_path / when), when],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for when in ("training", "setting up")
    }
    try:
        for when, proc in procs.items():
            assert proc.stdout.readline().strip() == "ready", proc.communicate()[1]
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=20)
            waited = time.monotonic() - t0
            assert proc.returncode == 143 and 0.4 < waited < 5, (proc.returncode, waited, err)
            assert "not reached" not in out and "Traceback" not in err
            said = "stopped without saving" if when == "training" else "before training started"
            assert "interrupted by SIGTERM" in err and said in err, err
            assert not list((tmp_path / when).glob("*.swp")), list((tmp_path / when).iterdir())
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


def test_the_signal_is_noted_and_handlers_restored():
    before = signal.getsignal(signal.SIGINT)
    with StopOnSignal(torch.device("cpu"), grace_s=60) as stopper:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: only noted
        time.sleep(0.05)
        assert stopper.signum == signal.SIGINT and stopper._deadline is not None
    assert stopper._deadline is None  # disarmed on exit
    assert signal.getsignal(signal.SIGINT) is before


def test_a_hangup_stops_as_sigterm_does_unless_nohup_ignores_it():
    """SIGHUP (the terminal closed) ended a rank at once, with no save and no word; under
    ``nohup`` (ignored as the rank starts) it stays ignored."""
    before = signal.getsignal(signal.SIGHUP)
    try:
        with StopOnSignal(torch.device("cpu"), grace_s=60) as stopper:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
            assert stopper.signum == signal.SIGHUP
        assert Stopped(signal.SIGHUP, 3, None).exit_code == 129
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with StopOnSignal(torch.device("cpu"), grace_s=60) as stopper:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
            assert stopper.signum == 0 and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_the_agent_leaves_an_ignored_hangup_ignored():
    from zeroshard.cli import agent

    before = signal.getsignal(signal.SIGHUP)
    try:
        assert agent._agent_signals() == "SIGHUP,SIGQUIT"
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
        assert agent._agent_signals() == "SIGQUIT"
        assert 129 in agent.INTERRUPTED and agent._final([129, 143])  # no restart undoes it
    finally:
        signal.signal(signal.SIGHUP, before)


def test_stopped_says_where_it_saved():
    assert str(Stopped(signal.SIGINT, 7, None)) == (
        "interrupted at step 7 by SIGINT; no checkpoint saved (--save-every N keeps progress)"
    )
    assert str(Stopped(signal.SIGTERM, 8, "ck/step-000008")).endswith(
        "by SIGTERM; saved step 8 to ck/step-000008"
    )
    assert Stopped(signal.SIGTERM, 8, None).exit_code == 143
    # Before this run's first step (its first evaluation): --save-every was no remedy.
    assert str(Stopped(signal.SIGINT, 20, None, started=False)).endswith(
        "step 20 by SIGINT; nothing trained in this run yet: no checkpoint saved"
    )


def _one_rank_loses_its_agent() -> tuple[int, str, bool]:
    import torch.distributed as dist

    import zeroshard.signals

    stopper = StopOnSignal(torch.device("cpu"), grace_s=60)
    kept = zeroshard.signals.AGENT_PID
    if dist.get_rank() == 1:  # not its parent: as if its agent had died and it was reparented
        zeroshard.signals.AGENT_PID = -1
    try:
        agreed = stopper.agreed(), stopper.cause
        return *agreed, zeroshard.signals.agent_gone()  # (every rank: the store check-in off)
    finally:  # (the worker process serves later tests)
        zeroshard.signals.AGENT_PID, zeroshard.signals._agent_gone = kept, False


def test_every_rank_names_an_agent_that_only_one_rank_saw_go(workers2):
    """The rank that speaks (rank 0) says why even when only another rank saw the cause."""
    (sig0, cause0, gone0), (sig1, cause1, gone1) = workers2.run(_one_rank_loses_its_agent)
    assert gone0 and gone1
    assert sig0 == sig1 == signal.SIGTERM
    assert cause0 == "the loss of torchrun's agent"
    assert cause1 == "the loss of torchrun's agent (pid -1)"
    assert str(Stopped(sig0, 3, None, cause0)).startswith(
        "interrupted at step 3 by the loss of torchrun's agent; "
    )


def _ctrl_c_then_the_agent_s_sigterm() -> int:
    import torch.distributed as dist

    stopper = StopOnSignal(torch.device("cpu"), grace_s=60)
    # Ctrl-C: every rank gets SIGINT, and the agent follows with SIGTERM, which one rank
    # noted first here.
    stopper._note(signal.SIGTERM if dist.get_rank() == 0 else signal.SIGINT, None)
    return stopper.agreed()


def test_ranks_agree_on_the_first_signal_of_a_ctrl_c(workers2):
    """The launcher exits 130 after Ctrl-C: the line the ranks print says SIGINT too."""
    assert workers2.run(_ctrl_c_then_the_agent_s_sigterm) == [signal.SIGINT, signal.SIGINT]


DEFERRED = """
import os, signal, threading, time
from zeroshard.signals import deferred
ready = threading.Event()
def other_thread():  # as gloo's: the OS may deliver a process-wide signal to it
    ready.set()
    time.sleep(30)
threading.Thread(target=other_thread, daemon=True).start()
ready.wait()
seen = []
signal.signal(signal.SIGUSR1, lambda s, f: seen.append("usr1"))
for i in range(200):
    done = []
    try:
        with deferred():
            os.kill(os.getpid(), signal.SIGINT)  # (the process: either thread takes it)
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(1000):
                pass
            done.append(1)
    except KeyboardInterrupt:
        pass
    assert done == [1], i
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
assert len(seen) == 200, len(seen)
print("ok", flush=True)
"""


def test_deferred_signals_run_their_handlers_after_the_block():
    """A KeyboardInterrupt inside ``deferred`` is raised once the block is done, also when the
    OS hands the signal to another thread (a mask on the main thread did not hold it back:
    the interrupt came inside the block 19 times in 20 with gloo's threads running)."""
    out = subprocess.run([sys.executable, "-c", DEFERRED], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
