"""Automatic recovery: ``zeroshard train --max-restarts N`` restarts every rank after one dies
(torchrun's elastic agent) and each restart resumes from the newest complete checkpoint, so the
run ends as an uninterrupted one does, loss for loss. Also the launcher flags' bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from unittest import mock

import pytest
from test_cli_train import _cmdline, _descendants, _expect_usage_error

from zeroshard import checkpoint
from zeroshard.cli.agent import Launch, _holding_agent
from zeroshard.cli.resume import resume_after_restart
from zeroshard.cli.train import load_config
from zeroshard.testing import free_port

# Wall-clock bounds and short timeouts: run by `make test` after the parallel tests, with the
# machine to itself (pyproject.toml's "alone" marker).
pytestmark = pytest.mark.alone

# Tiny on purpose (about 0.1 s a step on 2 shared cores): long enough to be killed mid-run.
STEPS = 30
RUN = ["--nproc", "2", "--preset", "nano", "--batch-size", "2", "--seq-len", "16"]
RUN += ["--steps", str(STEPS), "--log-every", "1", "--eval-every", "10", "--eval-batches", "1"]
RUN += ["--save-every", "2", "--keep", "2", "--max-restarts", "1"]
BOUND_S = 150
# c10d's defaults (a 30 s last call for more nodes; a node gone noticed after 3 missed 5 s
# heartbeats) would be most of the elastic test's time. Its node B starts long after node A's
# first round, and joins through a new round that completes at once with both nodes: the last
# call, paid at A's start and once B has left, need not wait for anyone.
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
# A survivor whose peer is gone waits this long for others to check in (2 s by default): no
# rank is left to, in these 1- and 2-rank runs.
ENV = {**os.environ, "ZEROSHARD_DEAD_PEER_GRACE_S": "0.5"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One corpus cache for the module's runs (building it reads 32 MiB)."""
    return tmp_path_factory.mktemp("corpus")


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks through /proc")
def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path, data_dir):
    killed, whole = tmp_path / "killed", tmp_path / "whole"

    def start(out):
        cmd = [sys.executable, "-m", "zeroshard.cli.main", "train", *RUN, "--out-dir", str(out)]
        cmd += ["--data-dir", str(data_dir)]
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
        )

    proc, reference = start(killed), start(whole)  # the same run, with the same checkpoints
    try:
        deadline = time.monotonic() + BOUND_S
        while not (killed / "ckpt" / "step-000006").is_dir():  # mid-run, checkpoints behind it
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.02)
        ranks = [p for p in _descendants(proc.pid) if "zeroshard.cli.main" in _cmdline(p)]
        assert len(ranks) == 2, ranks
        t_kill = time.time()
        os.kill(ranks[-1], signal.SIGKILL)
        out, err = proc.communicate(timeout=BOUND_S)
        ref_out, ref_err = reference.communicate(timeout=BOUND_S)
    finally:
        for p in (proc, reference):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert reference.returncode == 0, ref_err[-3000:]
    assert proc.returncode == 0, err[-3000:]
    restarts = [line for line in out.splitlines() if line.startswith("restart ")]
    assert len(restarts) == 1, out
    step = int(restarts[0].rsplit("(step ", 1)[1].rstrip(")"))
    assert restarts[0] == f"restart 1: resuming from {killed / 'ckpt' / f'step-{step:06d}'} " + (
        f"(step {step})"
    )
    assert 6 <= step < STEPS  # a real mid-run restart, not a fresh run nor a finished one
    got, want = _records(killed), _records(whole)
    # Every step after the resume, and the final validation, to the last bit.
    losses = [(r["kind"], r["step"], r.get("loss", r.get("val_loss"))) for r in got]
    assert losses == [(r["kind"], r["step"], r.get("loss", r.get("val_loss"))) for r in want]
    assert [r["step"] for r in got if r["kind"] == "train"] == list(range(1, STEPS + 1))
    assert json.loads((killed / "summary.json").read_text())["ranks"] == 2
    resumed = next(r for r in got if r["kind"] == "train" and r["step"] == step + 1)
    lost_s = resumed["time"] - t_kill
    print(f"\ntime lost: {lost_s:.1f} s from the kill -9 to step {step + 1}, the first resumed")
    assert 0 < lost_s < 60


def test_a_node_joining_with_other_settings_is_refused_on_its_own(tmp_path):
    """Joined, its ranks would fail the settings check on every rank of the running job (a bad
    input: the whole job ended); refused before it joins, naming the setting, and the job's
    config.json left as it is."""
    from zeroshard.cli.resume import _check_joins_the_same_job
    from zeroshard.train import save_config

    job = load_config(None, {"out_dir": str(tmp_path), "save_every": "2", "lr": "3e-4"})
    save_config(job, tmp_path / "config.json")
    launch = Launch(nproc=1, port=0, max_restarts=1, max_nodes=2, rdzv_endpoint="h:29500")
    same = load_config(None, {"out_dir": str(tmp_path), "save_every": "2", "lr": "3e-4"})
    _check_joins_the_same_job(dataclasses.replace(same, data_dir="/elsewhere"), launch)
    typo = load_config(None, {"out_dir": str(tmp_path), "save_every": "2", "lr": "3e-3"})
    with pytest.raises(ValueError, match=r"started with other settings \(lr 0\.0003 vs 0\.003\)"):
        _check_joins_the_same_job(typo, launch)


def test_an_elastic_start_resumes_from_the_newest_checkpoint_if_later(tmp_path):
    """Restart count 0: the ranks of an elastic job, maybe started anew as nodes joined."""
    folder = tmp_path / "ckpt"
    for step in (4, 6):
        (folder / f"step-{step:06d}").mkdir(parents=True)
    found = {f"step-{s:06d}": s for s in (4, 6)}

    def info(path):
        return types.SimpleNamespace(step=found[Path(path).name])

    with mock.patch.object(checkpoint, "latest", lambda _: folder / "step-000006"), \
            mock.patch.object(checkpoint, "info", info):  # fmt: skip
        base = {"out_dir": str(tmp_path), "save_every": "2"}
        for resume in (None, str(folder / "step-000004"), str(tmp_path / "pruned")):
            cfg, line = resume_after_restart(load_config(None, {**base, "resume": resume}), 0)
            assert cfg.resume == str(folder / "step-000006")
            assert line == f"the job's nodes changed: resuming from {cfg.resume} (step 6)"
        pinned = load_config(None, {**base, "resume": str(folder / "step-000006")})
        assert resume_after_restart(pinned, 0) == (pinned, None)


def test_a_restart_resumes_from_the_newest_checkpoint_or_says_why_not(tmp_path):
    cfg = load_config(None, {"out_dir": str(tmp_path), "save_every": "2"})
    same, line = resume_after_restart(cfg, 1)
    assert same == cfg
    folder = tmp_path / "ckpt"
    assert line == f"restart 1: no complete checkpoint in {folder} yet; training again from step 0"
    unsaved = load_config(None, {"out_dir": str(tmp_path)})
    assert resume_after_restart(unsaved, 2)[1] == (
        "restart 2: save_every = 0; training again from step 0"
    )


@pytest.mark.parametrize(
    ("code", "restarts_left"),
    [(2, 0), (3, 0), (130, 0), (143, 0), (1, 2), (4, 2), (-9, 2), ((-9, 143), 2), ((143, 2), 0)],
)
def test_the_agent_restarts_only_what_a_restart_can_mend(code, restarts_left, capsys):
    """(A rank killed, the others stopped by the agent's SIGTERM with 143: restarted; every
    rank stopped on a signal sent to one of them: not.)"""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    codes = code if isinstance(code, tuple) else (code,)

    class Agent:  # torchrun's LocalElasticAgent, as far as the holding agent uses it
        _remaining_restarts = 2

        def _monitor_workers(self, worker_group):
            failed = {
                1 + r: ProcessFailure(local_rank=1 + r, pid=1 + r, exitcode=c, error_file="")
                for r, c in enumerate(codes)
            }
            return RunResult(state=WorkerState.FAILED, failures=failed)

    agent = _holding_agent(Agent, [], [], [])()
    assert agent._monitor_workers(None).is_failed()
    assert agent._remaining_restarts == restarts_left
    said = capsys.readouterr().err
    if restarts_left:  # the one line saying which rank failed, before the restart's own
        assert said.startswith(f"zeroshard train: rank 1 failed (exit code {codes[0]}); restart")
        assert "(1 restart(s) left)" in said and said.count("\n") == 1, said
        assert "To enable traceback" not in said  # (torchrun's advice on exits >= 0)
    else:
        assert not said


ELASTIC = ["--max-restarts", "1", "--save-every", "2"]


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--max-restarts", "-1"], ["--max-restarts -1", "0 or more"]),
        (["--max-restarts", "two"], ["--max-restarts 'two'", "integer"]),
        (["--max-restarts", "1"], ["without --save-every", "pass --save-every N"]),
        (["--nnodes", "2:1"], ["--nnodes '2:1'", "1 <= MIN <= MAX"]),
        (["--nnodes", "x"], ["--nnodes 'x'", "MIN:MAX"]),
        (["--nnodes", "1:2", *ELASTIC], ["needs --rdzv-endpoint HOST:PORT"]),
        (["--nnodes", "2", "--rdzv-endpoint", "host"], ["--rdzv-endpoint 'host'", "HOST:PORT"]),
        (["--nnodes", "1:2", *ELASTIC, "--rdzv-endpoint", "h:1", "--port", "5"], ["drop --port"]),
        (
            ["--nproc", "2", "--nnodes", "1:2", *ELASTIC, "--rdzv-endpoint", "h:1"]
            + ["--batch-size", "6"],
            ["divide across 4 ranks", "multiple of 4"],
        ),
        (["--rdzv-conf", "last_call_timeout=5"], ["--rdzv-conf", "drop --rdzv-conf"]),
        # (taken without a word: a single node runs its own rendezvous)
        (["--rdzv-endpoint", "localhost:29555"], ["only a multi-node job", "pass --nnodes"]),
        (
            ["--nnodes", "1:2", *ELASTIC, "--rdzv-endpoint", "h:1", "--rdzv-conf", "last_call=5"],
            ["unknown setting 'last_call'", "last_call_timeout"],
        ),
        (
            ["--nnodes", "1:2", *ELASTIC, "--rdzv-endpoint", "h:1"]
            + ["--rdzv-conf", "join_timeout=0"],
            ["join_timeout must be a whole number of 1 or more"],
        ),
        (["--nnodes", "1:2", "--rdzv-endpoint", "h:1"], ["is elastic", "--max-restarts N"]),
    ],
)
def test_launcher_flags_bad_input(capsys, tmp_path, flags, needles):
    _expect_usage_error(capsys, ["train", *flags, "--out-dir", str(tmp_path)], *needles)


def test_rdzv_conf_reaches_torchrun():
    launch = Launch(
        nproc=1, port=0, max_restarts=1, max_nodes=2, rdzv_endpoint="h:1",
        rdzv_conf=(("last_call_timeout", 5), ("keep_alive_interval", 1)),
    )  # fmt: skip
    argv = launch.torchrun_argv(Path("c.json"))
    assert argv[argv.index("--rdzv-conf") + 1] == "last_call_timeout=5,keep_alive_interval=1"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _node(cmd: list[str]) -> subprocess.Popen:
    """One "node" of an elastic job on this machine: its launcher, output merged."""
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV
    )


def _kill_left(*nodes: subprocess.Popen | None) -> None:
    """Kill what a failed test left running."""
    for p in nodes:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def _newest_step(folder: Path) -> int:
    """The step of the newest complete checkpoint in ``folder`` (-1: none, or pruned while
    read)."""
    newest = checkpoint.latest(folder)
    try:
        return checkpoint.info(newest).step if newest is not None else -1
    except FileNotFoundError:
        return -1


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks through /proc")
def test_a_node_joins_a_running_job_then_leaves_and_the_job_goes_on(tmp_path, data_dir):
    """Two one-rank nodes of one elastic job (``--nnodes 1:2``, c10d rendezvous on 127.0.0.1).
    Node A trains alone; node B, started after A's step 2 with the same command, is not
    refused for the job's own checkpoints: A's agent starts its ranks anew with B's (not a
    restart to torchrun: no restart count) and both resume from the newest checkpoint. Once
    they saved one together, node B (agent and rank) is killed: node A restarts and finishes
    alone from the newest checkpoint (saved at world size 2, loaded at 1). With c10d's
    defaults the leave takes about 50 s (15 s before the node gone is noticed, then a 30 s last
    call for more nodes); ``RDZV_CONF`` shortens both."""
    out, port = tmp_path / "run", free_port()
    # A must still train when B has joined and left: B's start (imports, input checks,
    # rendezvous) took 10-20 of A's steps here, and once 60 (A's steps 0.04 s with torch's
    # threads waiting asleep, as the test suite has them: A finished first with 60 steps).
    # Saving every 4 steps, not 2: its steps alone after B left cost less.
    steps = 120
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "train", *RUN, "--out-dir", str(out)]
    cmd += ["--data-dir", str(data_dir), "--nproc", "1", "--nnodes", "1:2", "--steps", str(steps)]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", RDZV_CONF, "--save-every", "4"]
    node_a = _node(cmd)
    node_b = None
    deadline = time.monotonic() + BOUND_S

    def wait_for(done) -> None:
        while not done():
            assert node_a.poll() is None and time.monotonic() < deadline, node_a.stdout.read()
            time.sleep(0.02)

    def together() -> int | None:
        """The first step the two nodes trained together, once they saved a checkpoint after
        it (None before)."""
        metrics = out / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        steps_of_two = [
            r["step"]
            for r in map(json.loads, lines[:-1])  # the last may be half written
            if r["kind"] == "train" and len(r["rank_mem_mib"]) == 2
        ]
        return steps_of_two[0] if steps_of_two else None

    try:
        wait_for(lambda: (out / "ckpt" / "step-000004").is_dir())
        with open(tmp_path / "b.log", "w") as log_b:
            node_b = subprocess.Popen(cmd, stdout=log_b, stderr=subprocess.STDOUT, env=ENV)
        wait_for(lambda: together() is not None)
        first = together()  # a step after a save: the next save is at most 3 steps later
        wait_for(lambda: _newest_step(out / "ckpt") > first)
        for pid in [node_b.pid, *_descendants(node_b.pid)]:  # the whole node: agent and rank
            os.kill(pid, signal.SIGKILL)
        log_a = node_a.communicate(timeout=BOUND_S)[0]
    finally:
        _kill_left(node_a, node_b)
    log_b = (tmp_path / "b.log").read_text()
    assert node_a.returncode == 0, log_a[-3000:]
    assert f"joining the job running at 127.0.0.1:{port}" in log_b, log_b[-3000:]
    joined = [line for line in log_a.splitlines() if line.startswith("the job's nodes changed")]
    restarts = [line for line in log_a.splitlines() if line.startswith("restart ")]
    assert len(joined) == 1, log_a[-3000:]
    assert len(restarts) == 1 and restarts[0].startswith("restart 1: resuming from "), log_a
    join, leave = (int(line.rsplit("(step ", 1)[1].rstrip(")")) for line in (*joined, *restarts))
    print(f"\nnode B joined at step {join} and left at step {leave} of {steps}")
    records = _records(out)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    ranks = [len(r["rank_mem_mib"]) for r in train]
    assert ranks == [1] * join + [2] * (leave - join) + [1] * (steps - leave), ranks
    assert json.loads((out / "summary.json").read_text())["ranks"] == 1
    evals = [r["val_loss"] for r in records if r["kind"] == "eval"]
    assert evals[-1] < evals[0]
