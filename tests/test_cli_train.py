"""``zeroshard`` CLI: help, a real 2-rank training run, and one-line errors for bad input."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from zeroshard.cli.main import UsageError, main
from zeroshard.cli.train import load_config
from zeroshard.cli.train_checks import hold_out_dir
from zeroshard.train import auxiliary_loss, lr_at


def _wait_for_first_step(proc: subprocess.Popen, out) -> None:
    """Until the run in ``out`` has logged a training step (its process still alive)."""
    deadline = time.monotonic() + 120
    while (
        not (out / "metrics.jsonl").exists() or "train" not in (out / "metrics.jsonl").read_text()
    ):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.2)


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zeroshard.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "train" in capsys.readouterr().out


def _check_metrics_and_plot(out, stage: int, precision: str) -> None:
    """What a finished 2-rank run of 8 steps (``NORMAL``) leaves in ``out``."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    assert [r["step"] for r in evals] == [0, 4, 8]
    assert all(len(r["rank_mem_mib"]) == 2 and r["tokens_per_s"] > 0 for r in train)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks"] == 2 and summary["stage"] == stage
    assert summary["precision"] == precision and summary["skipped_steps"] == 0


def test_the_loss_plot_leaves_the_user_s_matplotlib_as_it_was(tmp_path):
    """``train()`` called in a notebook: its plot switched the notebook's backend to Agg."""
    import matplotlib

    from zeroshard.train import plot

    records = [
        {"kind": "train", "step": 1, "loss": 5.0},
        {"kind": "eval", "step": 1, "val_loss": 4.0},
    ]
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # (a backend of the user's that is not Agg)
    try:
        plot(records, tmp_path / "loss.png")
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One corpus cache for the module's runs (building it reads 32 MiB)."""
    return tmp_path_factory.mktemp("corpus")


def _expect_usage_error(capsys, argv: list[str], *needles: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def test_unknown_preset(capsys, tmp_path):
    _expect_usage_error(
        capsys, ["train", "--preset", "huge", "--out-dir", str(tmp_path)], "huge", "tiny"
    )


def test_nproc_zero(capsys, tmp_path):
    _expect_usage_error(capsys, ["train", "--nproc", "0", "--out-dir", str(tmp_path)], "--nproc")


def test_batch_not_divisible(capsys, tmp_path):
    argv = ["train", "--nproc", "3", "--batch-size", "16", "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "16", "multiple of 3")


def test_output_folder_cannot_be_created(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    _expect_usage_error(capsys, ["train", "--out-dir", str(blocker / "run")], "--out-dir")


# 127.0.0.2: another address of this host (the check bound 127.0.0.1 alone, torchrun's store
# binds every address)
@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
def test_port_in_use(capsys, tmp_path, host):
    with socket.socket() as s:
        s.bind((host, 0))
        s.listen()
        port = s.getsockname()[1]
        argv = ["train", "--nproc", "2", "--port", str(port), "--out-dir", str(tmp_path)]
        _expect_usage_error(capsys, argv, str(port), "--port")


def _open_file_limits(monkeypatch, soft: int, hard: int) -> list[tuple[int, int]]:
    """This process's open-file limits seen as (soft, hard); the limits set, recorded."""
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, hard))
    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: set_to.append(limits))
    return set_to


def test_an_open_file_limit_too_low_for_the_ranks_is_named(capsys, tmp_path, monkeypatch, data_dir):
    # torch's store then refused the ranks' connections: each retried for 300 s, deaf to
    # Ctrl-C, then a C++ traceback.
    set_to = _open_file_limits(monkeypatch, 24, 24)
    argv = ["train", "--nproc", "4", "--out-dir", str(tmp_path / "run")]
    _expect_usage_error(capsys, argv, "open-file limit (ulimit -n) is 24", "ulimit -n 272")
    assert set_to == [] and not (tmp_path / "run").exists()
    # One process training alone (no torchrun store, no peers) ran at 16 here: not refused.
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "1", "--batch-size", "2"]
    assert main(["train", *flags, "--out-dir", str(tmp_path / "one")]) == 0, capsys.readouterr()


@pytest.mark.parametrize(
    "soft, hard, raised",
    [(24, 1 << 20, 264), (24, 100, 100), (1024, 1 << 20, None), (24, -1, 264)],
)
def test_the_soft_open_file_limit_is_raised_for_the_ranks(monkeypatch, soft, hard, raised):
    """Raised within the hard limit (-1: none) towards what a job of 2 ranks may hold, as the
    ranks inherit it; left as it is when it is enough (a real run: the "stage 1" ending)."""
    import resource

    from zeroshard.cli.train_checks import raise_open_file_limit

    hard = resource.RLIM_INFINITY if hard == -1 else hard
    set_to = _open_file_limits(monkeypatch, soft, hard)
    raise_open_file_limit(2)
    assert set_to == ([] if raised is None else [(raised, hard)])


def test_unknown_config_key(capsys, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('preset = "nano"\nlearning_rate = 0.1\n')
    _expect_usage_error(
        capsys, ["train", "--config", str(config), "--out-dir", str(tmp_path)], "learning_rate"
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="a named pipe")
def test_a_config_from_a_pipe_is_read(capsys, tmp_path):
    """``--config /dev/stdin`` (or a shell's ``<(...)``) is a pipe, no regular file: it was said
    not to exist. A folder given as the file is said to be one."""
    import threading

    from zeroshard.cli.train import load_config

    pipe = tmp_path / "config"  # (no suffix, as /dev/stdin)
    os.mkfifo(pipe)

    def through_the_pipe(text: str, overrides: dict):
        writer = threading.Thread(target=pipe.write_text, args=(text,))
        writer.start()
        try:
            return load_config(pipe, overrides)
        finally:
            writer.join(timeout=10)

    cfg = through_the_pipe('preset = "nano"\nseq_len = 16\nsteps = 3\n', {"lr": "0.01"})
    assert (cfg.preset, cfg.steps, cfg.lr) == ("nano", 3, 0.01)
    # A pipe of JSON (no suffix to go by): it was read as TOML ("Invalid statement").
    cfg = through_the_pipe('{"preset": "nano", "seq_len": 16, "steps": 4}', {})
    assert cfg.steps == 4
    argv = ["train", "--config", str(tmp_path), "--out-dir", str(tmp_path / "run")]
    _expect_usage_error(capsys, argv, f"config file {tmp_path} is a folder")


def test_unknown_precision(capsys, tmp_path):
    argv = ["train", "--precision", "fp8", "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "fp8", "bf16")


@pytest.mark.parametrize("flag", ["--steps", "--seq-len"])
def test_non_positive_numbers(capsys, tmp_path, flag):
    argv = ["train", flag, "0", "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, f"{flag[2:].replace('-', '_')} = 0", ">= 1")


@pytest.mark.parametrize(
    "text,seconds", [("90", 90.0), ("60s", 60.0), ("5m", 300.0), ("1h", 3600.0)]
)
def test_timeout_takes_durations(text, seconds):
    assert load_config(None, {"timeout": text}).timeout == seconds


def test_a_flag_naming_the_model_replaces_the_file_s(tmp_path):
    # The file's hf with --model was refused as if both flags were given ("pass one of"), and
    # --preset was ignored beside it.
    path = tmp_path / "run.toml"
    path.write_text('hf = "llama.json"\nsteps = 7\n')
    cfg = load_config(path, {"model": "pkg.mod:factory"})
    assert (cfg.model, cfg.hf, cfg.steps) == ("pkg.mod:factory", None, 7)
    assert load_config(path, {"steps": "8"}).hf == "llama.json"
    cfg = load_config(path, {"preset": "small"})
    assert (cfg.preset, cfg.hf, cfg.model) == ("small", None, None)


def test_which_out_dir_is_the_resumed_run_s(tmp_path):
    """``--resume PATH`` into a folder holding metrics.jsonl: refused when they are another
    run's, taken when they are the checkpoint's run (in its ckpt folder, a copy of one of
    its checkpoints elsewhere) or the same command's (it failed before its first save)."""
    from zeroshard.cli.resume import _check_same_run

    def checkpoint_of(path: Path, run: str) -> Path:
        path.mkdir(parents=True)
        (path / "zeroshard.json").write_text(json.dumps({"run_id": run}))
        return path

    base = checkpoint_of(tmp_path / "base" / "ckpt" / "step-000004", "A")
    (tmp_path / "base" / "metrics.jsonl").write_text("{}\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("{}\n")

    def check(out: Path, path: Path) -> str:
        try:
            _check_same_run(argparse.Namespace(out_dir=str(out)), path)
        except UsageError as exc:
            return str(exc)
        return "taken"

    assert check(tmp_path / "base", base) == "taken"
    assert "holds another run's metrics.jsonl" in check(other, base)
    assert "its own run's folder" in check(other, base)
    copy = checkpoint_of(tmp_path / "archive" / "step-000004", "A")
    assert check(tmp_path / "base", copy) == "taken"
    (other / "config.json").write_text(json.dumps({"resume": str(base)}))
    assert check(other, base) == "taken"  # the same command again


@pytest.mark.parametrize(
    "text,shown", [("soon", "or a number with s, m or h"), ("0s", "timeout = 0.0")]
)
def test_bad_timeouts(capsys, tmp_path, text, shown):
    _expect_usage_error(capsys, ["train", "--timeout", text, "--out-dir", str(tmp_path)], shown)


def _wait_until_mapped(pid: int, library: str, timeout_s: float = 60.0) -> None:
    """Until process ``pid`` has ``library`` mapped (read from /proc: a shared library appears
    there as its import starts loading it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/maps") as maps:
            if library in maps.read():
                return
        time.sleep(0.005)
    raise AssertionError(f"{library} not loaded by process {pid} within {timeout_s} s")


_SLOW_FIRST_IMPORT = """
import importlib.abc, os, sys, time

class _Slow(importlib.abc.MetaPathFinder):  # the command's first stdlib import, on a busy machine
    def find_spec(self, name, path, target=None):
        if name == "argparse":
            sys.meta_path.remove(self)
            open(os.environ["ZEROSHARD_TEST_MARK"], "w").close()
            time.sleep(2)
        return None

sys.meta_path.insert(0, _Slow())
"""


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.alone  # (a signal sent at a moment; a bound in seconds)
def test_a_signal_during_the_command_s_first_imports_is_one_line(tmp_path):
    """A Ctrl-C as ``python -m zeroshard.cli.main`` imports its first modules (torchrun's
    agent forwards it to ranks just started): exit 130 with one line (a KeyboardInterrupt
    traceback before, from inside ``import argparse``)."""
    (tmp_path / "sitecustomize.py").write_text(_SLOW_FIRST_IMPORT)
    mark = tmp_path / "importing"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "zeroshard.cli.main", "plan", "--preset", "nano"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONPATH=path, ZEROSHARD_TEST_MARK=str(mark)),
        preexec_fn=_default_sigint,  # (a suite run in the background inherits SIGINT ignored)
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mark.exists(), "the command never imported argparse"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and out.strip() == "zeroshard: interrupted", out


@pytest.mark.parametrize(
    "delay_s, signum", [(0.0, signal.SIGINT), (0.4, signal.SIGINT), (0.4, signal.SIGTERM)]
)
@pytest.mark.alone  # (a signal sent at a moment; a bound in seconds)
def test_a_signal_while_starting_is_one_line(tmp_path, delay_s, signum):
    """SIGINT or SIGTERM while the command imports torch (``delay_s`` after torch's library is
    mapped: a fixed wall-clock delay from the start could fall, on a loaded machine, in the
    interpreter's own start-up, before any of our code runs): exit 128 + the signal, one line,
    no traceback."""
    argv = [sys.executable, "-m", "zeroshard.cli.main", "train", "--preset", "nano"]
    proc = subprocess.Popen(
        [*argv, "--steps", "3", "--out-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    _wait_until_mapped(proc.pid, "libtorch")
    time.sleep(delay_s)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum and "Traceback" not in out, out
    assert "interrupted" in out.strip().splitlines()[-1], out


@pytest.mark.alone  # (a signal sent at a moment)
def test_a_one_process_run_that_gives_up_in_set_up_lets_go_of_its_folder(tmp_path, model_module):
    """``--nproc 1``: a signal while the model is built, which outlasts the deadline
    (``StopOnSignal.GRACE_S``): the process ends at once (``os._exit``, no ``finally``), and
    left the folder it created holding its lock file and config.json, as if a run were there.
    It is gone now, as after any run that trained nothing."""
    out, marker = tmp_path / "new" / "run", tmp_path / "sleeping"
    argv = [sys.executable, "-m", "zeroshard.cli.main", "train", "--nproc", "1", "--model"]
    proc = subprocess.Popen(
        [*argv, f"{model_module}:build_sleeping", "--steps", "2", "--out-dir", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "ZS_SLEEPING": str(marker)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        said, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "still setting up after" in said, said
    assert not (tmp_path / "new").exists(), sorted(p.name for p in out.iterdir())


@pytest.mark.alone  # (a signal sent at a moment; a bound in seconds)
def test_a_signal_while_the_ranks_start_is_one_line(tmp_path):
    """SIGINT to the launcher once its ranks import torch: exit 130 and rank 0's one line (it
    exited silently: the ranks left the report to the launcher, which had none to give)."""
    argv = [sys.executable, "-m", "zeroshard.cli.main", "train", "--preset", "nano", "--nproc"]
    proc = subprocess.Popen(
        [*argv, "2", "--seq-len", "32", "--steps", "3", "--out-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(ranks := _descendants(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(ranks) >= 2, f"no ranks started within 60 s: {ranks}"
        _wait_until_mapped(ranks[0], "libtorch")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1].startswith("interrupted before training started"), out


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc), children first."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks through /proc")
def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# --------------------------------------------------------------------- checkpoints and resume


def _final_train_loss(out) -> float:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"][-1]["loss"]


def test_resume_continues_the_same_curve(tmp_path, capsys, data_dir):
    """In this process: one rank (2-rank resumes: tests/test_recovery.py, test_checkpoint.py)."""
    # Warm-up longer than the run: the learning rate of a step does not depend on --steps.
    common = ["--preset", "nano", "--batch-size", "4", "--seq-len", "32"]
    common += ["--eval-every", "4", "--eval-batches", "2", "--log-every", "2", "--stage", "3"]
    common += ["--warmup-steps", "10", "--data-dir", str(data_dir)]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(["train", *common, "--steps", "8", "--out-dir", str(whole)]) == 0
    argv = ["train", *common, "--steps", "4", "--save-every", "2", "--keep", "1"]
    assert main([*argv, "--out-dir", str(split)]) == 0
    assert sorted(p.name for p in (split / "ckpt").iterdir()) == ["step-000004"]
    capsys.readouterr()
    # An evaluation that a stop cut short (its record missing) runs on resume.
    lost = tmp_path / "lost"
    shutil.copytree(split, lost)
    lines = (lost / "metrics.jsonl").read_text().splitlines()
    (lost / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    assert json.loads(lines[-1]) | {"val_loss": 0} == {"kind": "eval", "step": 4, "val_loss": 0}
    argv = ["train", *common, "--steps", "8", "--resume", "auto", "--out-dir", str(lost)]
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    relogged = [json.loads(line) for line in (lost / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in relogged] == [0, 2, 4, 4, 6, 8, 8]
    assert relogged[3]["val_loss"] == json.loads(lines[-1])["val_loss"]
    argv = ["train", *common, "--steps", "8", "--resume", "auto", "--out-dir", str(split)]
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    said = capsys.readouterr().out
    assert f"resuming from {split / 'ckpt' / 'step-000004'} (step 4)" in said
    assert "other data" not in said  # (the same corpus)
    done = said.splitlines()[-1]  # its seconds are those of steps 5-8, trained by this command
    assert re.search(r"8 steps \(0 skipped\) in [\d.]+ s for steps 5-8, resumed at step 4 ", done)
    assert json.loads((split / "summary.json").read_text())["resumed_at_step"] == 4
    assert json.loads((whole / "summary.json").read_text())["resumed_at_step"] == 0
    assert _final_train_loss(split) == _final_train_loss(whole)
    steps = [
        json.loads(line)["step"] for line in (split / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 2, 4, 4, 6, 8, 8]  # evals at 0, 4, 8; no duplicated records
    assert main(["checkpoint", "info", str(split / "ckpt" / "step-000004"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "complete" in out and "step 4, world size 1, stage 3" in out, out
    assert "param dtype float32" in out and "parameters" in out and "bytes" in out, out
    assert "(reduce float32), optimizer AdamW" in out, out


def test_a_run_replacing_an_earlier_run_s_records_says_so(capsys, tmp_path, data_dir):
    """An earlier run that saved no checkpoint has nothing to continue, so a new run into its
    folder is not refused: it replaced that run's metrics and summary without a word."""
    flags = ["--data-dir", str(data_dir), *NANO, "--steps", "1", "--batch-size", "2"]
    code, err, _, _ = _train_in_process(capsys, tmp_path, *flags)
    assert code == 0, err
    assert main(["train", *flags, "--out-dir", str(tmp_path)]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert said == [
        f"note: --out-dir {tmp_path} holds an earlier run's metrics.jsonl and summary.json "
        "(status done at step 1) and no checkpoint: this run replaces them (pass another "
        "--out-dir to keep them)"
    ], said
    # A node joining a running elastic job before its first save: those are the job's own.
    from zeroshard.cli import agent
    from zeroshard.cli.resume import pin_resume
    from zeroshard.cli.train import load_config

    with socket.create_server(("127.0.0.1", 0)) as job:  # (the running job's rendezvous)
        endpoint = f"127.0.0.1:{job.getsockname()[1]}"
        launch = agent.Launch(nproc=1, port=0, max_nodes=2, rdzv_endpoint=endpoint)
        cfg = load_config(None, {"out_dir": str(tmp_path), "preset": "nano", "seq_len": "16"})
        assert pin_resume(cfg, launch) == (cfg, False)
    assert "note:" not in capsys.readouterr().out


def test_a_finished_run_s_folder_is_resumed_or_left_alone(capsys, tmp_path, data_dir):
    flags = ["--data-dir", str(data_dir), *NANO, "--steps", "2", "--batch-size", "2"]
    flags += ["--save-every", "2"]
    code, err, _, _ = _train_in_process(capsys, tmp_path, *flags)
    assert code == 0, err
    argv = ["train", *flags, "--resume", "auto", "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "at step 2 and --steps is 2", "pass --steps above 2")
    # The run's folder, or its ckpt folder, for a checkpoint: both ways to say it, named.
    for given in (tmp_path, tmp_path / "ckpt"):
        argv = ["train", *flags, "--resume", str(given), "--steps", "3"]
        _expect_usage_error(
            capsys, [*argv, "--out-dir", str(tmp_path / "other")],
            "holds checkpoints but is not one", f"--resume {tmp_path / 'ckpt' / 'step-000002'}",
            f"--resume auto --out-dir {tmp_path} ",
        )  # fmt: skip
        # ``checkpoint info`` of it: the wrong path (exit 2, as export says), not damage (1)
        assert main(["checkpoint", "info", str(given)]) == 2
        out = capsys.readouterr().out
        assert "holds checkpoints but is not one" in out and "bytes" not in out, out
    # A fresh run into the same folder would mix its checkpoints with those; one that saves
    # none would still rewrite that run's metrics, summary and config.json (resumes and exports
    # read them).
    argv = ["train", *flags, "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "holds checkpoints of an earlier run", "--resume auto")
    before = {n: (tmp_path / n).read_bytes() for n in ("metrics.jsonl", "config.json")}
    argv = ["train", *flags, "--save-every", "0", "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "holds checkpoints of an earlier run", "--resume auto")
    assert before == {n: (tmp_path / n).read_bytes() for n in before}
    # A resume refused (a checkpoint of another model) leaves the folder's config as it was.
    before = (tmp_path / "config.json").read_bytes()
    other = [*flags, "--resume", "auto", "--steps", "3", "--preset", "tiny"]
    assert main(["train", *other, "--out-dir", str(tmp_path)]) == 2
    assert "another model" in capsys.readouterr().err
    assert (tmp_path / "config.json").read_bytes() == before
    # Resumed with other settings: allowed, and said.
    more = [*flags, "--resume", "auto", "--steps", "3", "--lr", "0.01"]
    assert main(["train", *more, "--out-dir", str(tmp_path)]) == 0
    said = capsys.readouterr().out
    assert (
        "resuming with other settings than the saved run's: steps 2 -> 3, lr 0.003 -> 0.01" in said
    )
    # Compared with the settings of the run that saved the checkpoint (recorded in it), not
    # with the folder's config.json, which the run resumed above rewrote (3 steps, lr 0.01).
    for step, was in ((2, "steps 2 -> 3, lr 0.003 -> 0.02"), (3, "lr 0.01 -> 0.02")):
        other = [*flags, "--resume", str(tmp_path / "ckpt" / f"step-00000{step}")]
        other += ["--steps", "3" if step == 2 else "4", "--lr", "0.02"]
        if step == 3:
            was = "steps 3 -> 4, " + was
        assert main(["train", *other, "--out-dir", str(tmp_path / f"elsewhere{step}")]) == 0
        said_there = capsys.readouterr().out
        assert f"resuming with other settings than the saved run's: {was}" in said_there
    # The stretched schedule raises the rate of step 3 above the run's last: said, with both.
    cfg = load_config(None, {"steps": 3, "lr": 0.01})
    new, saved = lr_at(2, cfg), lr_at(2, dataclasses.replace(cfg, steps=2, lr=0.003))
    assert (
        f"the learning rate of step 3, the first resumed, is {new:.4g} (cosine schedule over 3 "
        f"steps); the saved run's schedule gave it {saved:.4g}"
    ) in said


def test_a_rolled_back_resume_new_weight_decay_and_a_torn_metrics_line(capsys, tmp_path, data_dir):
    flags = ["--data-dir", str(data_dir), *NANO, "--batch-size", "2", "--save-every", "2"]
    flags += ["--weight-decay", "0.5"]
    for name in ("a", "b"):
        code, err, _, _ = _train_in_process(capsys, tmp_path / name, *flags, "--steps", "4")
        assert code == 0, err
    # Resumed from step 2 beside step 4: a restart or --resume auto would continue step 4's run.
    ckpt = tmp_path / "a" / "ckpt"
    argv = ["train", *flags, "--steps", "6", "--resume", str(ckpt / "step-000002")]
    argv += ["--out-dir", str(tmp_path / "a")]
    _expect_usage_error(capsys, argv, "holds later checkpoints")
    # Without saving too: it cut the abandoned run's metrics past step 2, kept its step 4 for
    # a later --resume auto to continue, on records of both runs.
    no_save = [*argv, "--save-every", "0"]  # (the last value given counts)
    _expect_usage_error(capsys, no_save, "holds later checkpoints", "another --out-dir")
    # Into another run's folder: its records up to step 4 were kept before the resumed run's
    # (and its first validation loss in the summary), without a word.
    into_b = ["train", *flags, "--steps", "6", "--resume", str(ckpt / "step-000004")]
    into_b += ["--out-dir", str(tmp_path / "b")]
    _expect_usage_error(capsys, into_b, "holds another run's metrics.jsonl", "a new --out-dir")
    # A torn last metrics line (killed while writing it) does not block the resume, and a new
    # weight decay is the one trained with, not the checkpoint's.
    with open(tmp_path / "a" / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')
    losses = {}
    for name, decay in (("a", "0.0"), ("b", "0.5")):
        more = [*flags, "--steps", "6", "--resume", "auto", "--weight-decay", decay]
        code, err, records, _ = _train_in_process(capsys, tmp_path / name, *more)
        assert code == 0, err
        losses[name] = [r["loss"] for r in records if r["kind"] == "train" and r["step"] == 6]
    assert losses["a"] != losses["b"], losses


def test_resume_auto_without_checkpoints(capsys, tmp_path):
    argv = ["train", "--resume", "auto", "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "no complete checkpoint", "drop --resume")


def test_resume_from_a_missing_path(capsys, tmp_path):
    argv = ["train", "--resume", str(tmp_path / "nope"), "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "nope", "checkpoint folder")


def test_checkpoint_info_verify_of_a_damaged_checkpoint(capsys, tmp_path):
    """Every file there, one not as saved: "damaged", not "incomplete" (what a save that did
    not finish is)."""
    from zeroshard.checkpoint_info import FORMAT_VERSION, META_FILE

    (tmp_path / "rank-00000.pt").write_bytes(b"12345")
    files = {"rank-00000.pt": {"bytes": 5, "xxh3_64": "0"}}
    (tmp_path / META_FILE).write_text(
        json.dumps({"format_version": FORMAT_VERSION, "files": files})
    )
    assert main(["checkpoint", "info", str(tmp_path), "--verify"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path}: damaged: checkpoint file {tmp_path / 'rank-00000.pt'} is "
                          "corrupted (its xxh3_64"), out  # fmt: skip


def test_checkpoint_info_of_metadata_without_a_parameter_count(capsys, tmp_path):
    """A zeroshard.json made by hand (or by another tool) with its files, fields missing, null,
    of another type, or named as info's own: described, "unknown" where it says nothing usable
    (TypeErrors out of the formatting, the comparison of a null degree, info's arguments)."""
    from zeroshard.checkpoint_info import FORMAT_VERSION, META_FILE

    (tmp_path / "rank-00000.pt").write_bytes(b"12345")
    files = {"rank-00000.pt": {"bytes": 5, "xxh3_64": "0"}}
    meta = {"format_version": FORMAT_VERSION, "files": files, "step": 3, "world_size": "2"}
    meta |= {"tensor_parallel": None, "size_bytes": 9, "complete": False}
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    assert main(["checkpoint", "info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path}: complete" in out and "an unknown number of parameters" in out, out
    assert "step 3, world size unknown, stage unknown" in out, out


def test_checkpoint_info_of_an_incomplete_save(capsys, tmp_path):
    folder = tmp_path / "step-000010.tmp-1a2b"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"x" * 10)
    assert main(["checkpoint", "info", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "incomplete" in out and "10 bytes" in out, out
    _expect_usage_error(capsys, ["checkpoint", "info", str(tmp_path / "none")], "none")
    # Not a checkpoint at all (a run's folder of them is one such): the wrong path, exit 2 (as
    # export says), and no "(N bytes in its files)", which read as a damaged checkpoint.
    (tmp_path / "notes" / "sub").mkdir(parents=True)
    (tmp_path / "notes" / "loss.png").write_bytes(b"x" * 7)
    assert main(["checkpoint", "info", str(tmp_path / "notes")]) == 2
    out = capsys.readouterr().out
    assert "is not a zeroshard checkpoint" in out and "bytes" not in out, out
    # With --json, JSON for those too, on stdout (a plain line there, and the missing folder's
    # error on stderr: explorer226)
    for path, said in ((tmp_path / "notes", "is not a zeroshard"), (tmp_path / "none", "no ")):
        assert main(["checkpoint", "info", str(path), "--json"]) == 2
        found = json.loads(capsys.readouterr().out)
        assert found["path"] == str(path) and found["complete"] is False, found
        assert found["problem"].startswith(f"{path} {said}" if "not" in said else said), found


@pytest.mark.alone  # (a signal sent at a moment; a bound in seconds)
def test_a_killed_launcher_s_ranks_save_the_step_and_stop(tmp_path, capsys, data_dir):
    """SIGKILL of the launcher leaves the ranks without their agent, which they notice at the
    next step and take as a SIGTERM (SIGINT and SIGTERM: the runs of every ending below)."""
    out, data = tmp_path / "run", str(data_dir)
    common = ["--nproc", "2", "--preset", "nano", "--batch-size", "2", "--seq-len", "16"]
    common += ["--log-every", "1", "--save-every", "1000", "--data-dir", data]
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "train", *common, "--steps", "100000"]
    proc = subprocess.Popen(
        [*cmd, "--out-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for_first_step(proc, out)
        proc.kill()  # SIGKILL: the launcher cannot forward it
        stdout, stderr = proc.communicate(timeout=90)  # stdout's end: every rank has exited too
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "Broken pipe" not in stderr, stderr[-3000:]  # (the agent's store, gone: not used)
    saved = [line for line in stdout.splitlines() if line.startswith("interrupted at step ")]
    assert len(saved) == 1, stdout
    step = int(saved[0].split()[3])
    path = out / "ckpt" / f"step-{step:06d}"
    # Rank 0 names the agent's pid when it saw it go first, else the cause another rank saw.
    cause = rf"the loss of torchrun's agent( \(pid {proc.pid}\))?"
    where = re.escape(str(path))
    assert re.fullmatch(rf"interrupted at step {step} by {cause}; saved step {step} to {where}",
                        saved[0]), saved[0]  # fmt: skip
    assert main(["checkpoint", "info", str(path), "--verify"]) == 0
    capsys.readouterr()
    # Resumed in this process, one rank (the checkpoint reshards): no second launch to pay for.
    one = [*common[common.index("--preset") :], "--resume", "auto", "--steps", str(step + 2)]
    code = main(["train", *one, "--out-dir", str(out)])
    said = capsys.readouterr()
    assert code == 0, said.err
    assert f"resuming from {path} (step {step})" in said.out
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"][-2:] == [step + 1, step + 2]


# ------------------------------------------------- your own model and data, in one process


NANO = ["--preset", "nano", "--seq-len", "16", "--eval-batches", "1", "--log-every", "1"]


def _train_in_process(capsys, out, *flags: str) -> tuple[int, str, list[dict], dict]:
    """``zeroshard train`` in this process (one rank): exit status, stderr, metrics, summary."""
    code = main(["train", *flags, "--out-dir", str(out)])
    err = capsys.readouterr().err
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return code, err, [json.loads(line) for line in lines], summary


def _train_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r["kind"] == "train"]


def test_grad_accum_equals_the_whole_batch(capsys, tmp_path, data_dir):
    data = ["--data-dir", str(data_dir), *NANO, "--steps", "3", "--batch-size", "8"]
    runs = {}
    for accum in (1, 2, 4, "4u"):  # 4u: --accumulate-unreduced, one reduction per step
        flags = ["--grad-accum", str(accum).rstrip("u")]
        flags += ["--accumulate-unreduced", "true"] if accum == "4u" else []
        code, err, records, summary = _train_in_process(
            capsys, tmp_path / f"a{accum}", *data, *flags
        )
        assert code == 0, err
        assert summary["grad_accum"] == int(str(accum).rstrip("u"))
        # stage 3: ZeRO's partitioned gradients by default, as zeroshard plan counts them
        assert summary["reduce_every_micro_batch"] == (accum in (2, 4)), summary
        runs[accum] = records
    whole = _train_records(runs[1])
    for accum in (2, 4, "4u"):
        micro = _train_records(runs[accum])
        # The same sequences, so the same mean loss and gradient norm (before clipping) at every
        # step: a missing 1/N would multiply the norm by N (AdamW alone would hide it).
        for a, b in zip(whole, micro, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        val = [r["val_loss"] for r in runs[accum] if r["kind"] == "eval"]
        assert val == pytest.approx([r["val_loss"] for r in runs[1] if r["kind"] == "eval"])


@pytest.mark.parametrize("schedule", ["linear", "constant"])
def test_lr_schedule(capsys, tmp_path, schedule, data_dir):
    from zeroshard.schedule import lr_at

    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "6", "--batch-size", "2"]
    flags += ["--lr", "0.01", "--warmup-steps", "2", "--lr-schedule", schedule]
    code, err, records, _ = _train_in_process(capsys, tmp_path / "run", *flags)
    assert code == 0, err
    got = [r["lr"] for r in _train_records(records)]
    want = [
        lr_at(s, peak_lr=0.01, total_steps=6, warmup_steps=2, schedule=schedule) for s in range(6)
    ]
    assert got == pytest.approx(want)
    assert got[:2] == pytest.approx([0.005, 0.01])
    assert got[-1] == pytest.approx(0.01 if schedule == "constant" else 0.001)  # lr/10, last


def test_a_skipped_step_does_not_move_the_lr_schedule_on(capsys, tmp_path, model_module, data_dir):
    # Step 2's gradients are NaN: it is skipped, and step 3 gets the rate step 2 had (DeepSpeed
    # and Megatron step their schedulers only on applied updates).
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "5", "--batch-size", "2"]
    flags += ["--lr", "0.01", "--warmup-steps", "4", "--lr-schedule", "linear"]
    flags += ["--model", f"{model_module}:build_nan_in_step_2", "--wrap", "MyBlock"]
    code, err, records, summary = _train_in_process(capsys, tmp_path / "run", *flags)
    assert code == 0 and summary["skipped_steps"] == 1, err
    got = [r["lr"] for r in _train_records(records)]
    assert got == pytest.approx([0.0025, 0.005, 0.005, 0.0075, 0.01])
    # Resumed at step 3 with another peak: the rate said for step 4 is that of its third
    # applied step (the skipped one counted, it said the fourth's).
    flags[flags.index("--steps") + 1] = "3"
    code, err, _, _ = _train_in_process(capsys, tmp_path / "saved", *flags, "--save-every", "3")
    assert code == 0, err
    resumed = [*flags, "--save-every", "3", "--steps", "5", "--lr", "0.02"]
    resumed += ["--resume", str(tmp_path / "saved" / "ckpt" / "step-000003")]
    assert main(["train", *resumed, "--out-dir", str(tmp_path / "resumed")]) == 0
    said = "the learning rate of step 4, the first resumed, is 0.015 (linear schedule over 5 "
    assert said in capsys.readouterr().out


MODEL_FILE = '''
import torch
from torch import nn


class MyBlock(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class MyLM(nn.Module):
    """Token ids (B, T) -> logits (B, T, 256); not causal, which training does not check."""

    def __init__(self, nan_in_eval=False, crash_at_forward=0):
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.blocks = nn.ModuleList(MyBlock(16) for _ in range(3))
        self.head = nn.Linear(16, 256)
        self.nan_in_eval = nan_in_eval
        self.crash_at_forward, self.forwards = crash_at_forward, 0

    def forward(self, idx):
        self.forwards += 1
        if self.forwards == self.crash_at_forward:
            raise RuntimeError("my model crashed")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits * float("nan") if self.nan_in_eval and not self.training else logits


def build():
    return MyLM()


TRAINING_FORWARDS = []  # module.training at each forward with gradients (build_in_eval)


class RecordingLM(MyLM):
    def forward(self, idx):
        if torch.is_grad_enabled():
            TRAINING_FORWARDS.append(self.training)
        return super().forward(idx)


def build_in_eval():  # as from_pretrained returns models
    return RecordingLM().eval()


def build_unreached():  # its one trainable layer is not used
    model = MyLM().requires_grad_(False)
    model.spare = nn.Linear(16, 16)
    return model


def build_nan_in_eval():
    return MyLM(nan_in_eval=True)


def build_crashing():  # in the 3rd training forward (the 1st one evaluates)
    return MyLM(crash_at_forward=4)


def build_bad():
    raise ValueError("my factory: width must be even")


def build_broken():
    raise RuntimeError("my factory crashed")


def build_crashing_on_rank_1():  # its 3rd training forward, rank 1 only
    import os

    return MyLM(crash_at_forward=4 if os.environ.get("RANK") == "1" else 0)


def build_frozen():
    return MyLM().requires_grad_(False)


class SlowLM(MyLM):
    def forward(self, idx):
        import time

        slow = self.training and self.forwards >= 2  # (the first evaluates, the next trains)
        time.sleep(4.0 if slow else 0.0)  # a step that outlasts the two signals
        return super().forward(idx)


def build_slow():
    return SlowLM()


class SlowEvalLM(MyLM):
    trained = False

    def forward(self, idx):
        import time

        self.trained |= self.training
        time.sleep(2.0 if self.trained and not self.training else 0.0)  # after the first eval
        return super().forward(idx)


def build_slow_eval():
    return SlowEvalLM()


def build_sleeping():  # set-up longer than a signal's deadline
    import os
    import time

    open(os.environ["ZS_SLEEPING"], "w").close()
    time.sleep(60)


def build_sized(width):
    return MyLM()


def build_exiting():
    import sys

    sys.exit(3)


class MaskedLM(MyLM):
    def forward(self, idx, mask):  # a second argument that training does not pass
        return super().forward(idx)


class ReshapedLM(MyLM):
    def __init__(self, reshape):
        super().__init__()
        self.reshape = reshape

    def forward(self, idx):
        return self.reshape(super().forward(idx))


def build_needing_a_mask():
    return MaskedLM()


def _tiny_hf(model_type, cls, **more):
    import transformers

    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, d_model=32, d_ff=64, d_kv=16, num_layers=1, num_heads=2, **more
    )
    return getattr(transformers, cls)(config)


def build_t5():  # an encoder-decoder: its decoder needs ids of its own
    return _tiny_hf("t5", "T5ForConditionalGeneration")


def build_bert_mlm():  # attends both ways
    return _tiny_hf("bert", "BertForMaskedLM")


def build_bert_decoder():
    return _tiny_hf("bert", "BertLMHeadModel", is_decoder=True)


def build_distilbert_mlm():  # a masked LM without a causal-LM class of its family
    return _tiny_hf("distilbert", "DistilBertForMaskedLM", dim=32, hidden_dim=64, n_layers=1,
                    n_heads=2)


class T5Ids(nn.Module):  # the user's own module around T5: ids in, logits out
    def __init__(self):
        super().__init__()
        self.t5 = _tiny_hf("t5", "T5ForConditionalGeneration")
        self.config = self.t5.config  # (as Hugging Face-minded wrappers do)

    def forward(self, idx):
        return self.t5(input_ids=idx, decoder_input_ids=idx).logits


def build_t5_wrapper():
    return T5Ids()


def build_vocab_second():  # (B, V, T), as F.cross_entropy takes them
    return ReshapedLM(lambda logits: logits.transpose(1, 2))


def build_one_short():
    return ReshapedLM(lambda logits: logits[:, :-1])


class NaNStepLM(MyLM):
    def forward(self, idx):
        logits = super().forward(idx)
        self.trained = getattr(self, "trained", 0) + self.training
        return logits * float("nan") if self.training and self.trained == 2 else logits


def build_nan_in_step_2():
    return NaNStepLM()


class PositionalLM(MyLM):
    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(8, 16)  # 8 positions, for sequences of 16

    def forward(self, idx):
        self.pos(torch.arange(idx.size(1)))
        return super().forward(idx)


class ListBugLM(MyLM):
    def forward(self, idx):
        return [super().forward(idx)][1]  # a bug of its own, not an embedding's


def build_with_8_positions():
    return PositionalLM()


def build_with_a_list_bug():
    return ListBugLM()


def build_declaring_a_string():
    model = MyLM()
    model._no_split_modules = "MyBlock"  # a str, not a list of them
    return model
'''


@pytest.fixture
def model_module(tmp_path, monkeypatch):
    """A module ``my_models`` of factories, importable here and by subprocesses."""
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "my_models.py").write_text(MODEL_FILE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", f"{folder}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return "my_models"


def test_own_model_factory(capsys, tmp_path, model_module, data_dir):
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "4", "--batch-size", "4"]
    flags += ["--model", f"{model_module}:build"]
    code, err, records, summary = _train_in_process(
        capsys, tmp_path / "wrapped", *flags, "--wrap", "MyBlock"
    )
    assert code == 0, err
    assert summary["model"] == "my_models:build" and summary["num_units"] == 4  # root + 3
    assert summary["num_params"] == 256 * 16 + 3 * (2 * 16 + 16 * 16 + 16) + 16 * 256 + 256
    assert all(math.isfinite(r["loss"]) for r in _train_records(records))
    # The command's own warnings read as its errors do, without zeroshard's file and line.
    done = _cli("train", *flags, "--out-dir", str(tmp_path / "whole"))
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith(
        "zeroshard train: warning: my_models:build declares no _no_split_modules and no --wrap "
        "was given: the whole model is one unit"
    ), done.stderr
    assert "UserWarning" not in done.stderr and ".py:" not in done.stderr, done.stderr
    assert json.loads((tmp_path / "whole" / "summary.json").read_text())["num_units"] == 1
    code, err, _, _ = _train_in_process(
        capsys, tmp_path / "nomatch", *flags, "--wrap", "NoSuchBlock"
    )
    assert code == 2 and "NoSuchBlock" in err and "MyBlock" in err, err
    # Token ids beyond the model's embedding fail inside its forward: bad input, said so.
    import numpy as np

    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(4000, dtype=np.int64) % 1000)
    flags = [*NANO, "--steps", "2", "--batch-size", "4", "--model", f"{model_module}:build"]
    code, err, _, _ = _train_in_process(capsys, tmp_path / "oov", *flags, "--data", str(ids))
    assert code == 2 and "a vocabulary of at least 1000" in err and "Traceback" not in err, err


def test_a_loss_no_trainable_parameter_reaches_is_one_line(
    capsys, tmp_path, model_module, data_dir
):
    # torch's "element 0 of tensors does not require grad" traceback from every rank, exit 1.
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "1", "--batch-size", "2"]
    flags += ["--model", f"{model_module}:build_unreached", "--wrap", "MyBlock"]
    code, err, _, _ = _train_in_process(capsys, tmp_path / "run", *flags)
    assert code == 2 and "Traceback" not in err, err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "zeroshard train: error: the loss does not require grad: no parameter that trains"
        )
    ), err


def test_a_model_built_in_eval_mode_trains_in_train_mode_after_a_resume(
    capsys, tmp_path, model_module, data_dir
):
    # from_pretrained's models come in eval mode; the start's evaluation put them in train
    # mode, and a resume (whose start evaluation is done) trained with dropout off.
    import my_models

    flags = [*NANO, "--data-dir", str(data_dir), "--batch-size", "2", "--save-every", "2"]
    flags += ["--model", f"{model_module}:build_in_eval", "--wrap", "MyBlock"]
    code, err, _, _ = _train_in_process(capsys, tmp_path / "run", *flags, "--steps", "2")
    assert code == 0, err
    my_models.TRAINING_FORWARDS.clear()
    code, err, _, summary = _train_in_process(
        capsys, tmp_path / "run", *flags, "--steps", "4", "--resume", "auto"
    )
    assert code == 0 and summary["resumed_at_step"] == 2, err
    assert my_models.TRAINING_FORWARDS == [True, True], my_models.TRAINING_FORWARDS


@pytest.mark.parametrize(
    "factory, said",
    [
        ("build_t5", "T5ForConditionalGeneration is an encoder-decoder (its config's is_encoder"),
        ("build_bert_mlm", "BertForMaskedLM is a masked language model, whose encoder attends"),
        ("build_distilbert_mlm", "DistilBertForMaskedLM is a masked language model, whose"),
    ],
)
def test_hugging_face_models_next_token_training_does_not_fit(
    capsys, tmp_path, model_module, data_dir, factory, said
):
    """What ``--hf`` refuses, through ``--model``: T5 failed in its first forward with its
    decoder's message ("You must specify exactly one of input_ids or inputs_embeds"), BERT's
    masked LM trained without a word on positions that see the token they predict (an
    explorer), and so did DistilBERT's, whose family has no causal LM (another). A BERT built
    as a causal decoder trains, and so does the user's own module around T5 that takes the ids
    (it vouches for itself: it was refused for the config it shows)."""
    pytest.importorskip("transformers")
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "1", "--batch-size", "2"]
    code, err, _, _ = _train_in_process(
        capsys, tmp_path / "run", *flags, "--model", f"{model_module}:{factory}"
    )
    assert code == 2 and said in err and "Traceback" not in err, err
    for fits in ("build_bert_decoder", "build_t5_wrapper"):
        code, err, _, _ = _train_in_process(
            capsys, tmp_path / fits, *flags, "--model", f"{model_module}:{fits}"
        )
        assert code == 0, err


@pytest.mark.parametrize(
    "factory, wrap, said",
    [
        ("build_frozen", "MyBlock", "has no trainable parameter"),
        ("build_sized", "MyBlock", "needs some (missing a required argument: 'width')"),
        ("build_exiting", "MyBlock", "the factory exited (sys.exit(3))"),
        ("build", "MyBlock,Nope", "no submodule of MyLM is a Nope; classes of its submodules"),
        ("build", ",", "names no class"),
        ("build", "MyLM", "no submodule of MyLM is a MyLM"),
        ("build_needing_a_mask", "MyBlock", "its forward cannot take that (missing a required"),
    ],
)
def test_a_factory_s_mistakes_are_one_line(
    capsys, tmp_path, model_module, data_dir, factory, wrap, said
):
    # Tracebacks (exit 1), exit 3 (read as divergence), or a --wrap class ignored silently.
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "1", "--batch-size", "2"]
    flags += ["--model", f"{model_module}:{factory}", "--wrap", wrap]
    code, err, _, _ = _train_in_process(capsys, tmp_path / "run", *flags)
    assert code == 2 and said in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "source, said",
    [
        ("import torch\nraise RuntimeError('boom')\n", "raised RuntimeError: boom ({}, line 2)"),
        ("def build(:\n    pass\n", "raised SyntaxError: invalid syntax ({}, line 1)"),
    ],
)
def test_a_model_module_that_raises_as_it_is_imported_is_one_line(
    capsys, tmp_path, data_dir, monkeypatch, source, said
):
    # Anything but an ImportError was the launcher's traceback and exit 1 (explorer226).
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "raising.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "1", "--batch-size", "2"]
    code, err, _, _ = _train_in_process(capsys, tmp_path / "run", *flags, "--model", "raising:b")
    assert code == 2 and "Traceback" not in err, err
    said = "model = 'raising:b': importing raising " + said.format(folder / "raising.py")
    assert err.strip().splitlines() == [
        f"zeroshard train: error: {said}; fix the module (`python -c 'import raising'` shows "
        "the whole traceback)"
    ], err


@pytest.mark.parametrize(
    "factory, shape",
    [("build_vocab_second", "(2, 256, 16)"), ("build_one_short", "(2, 15, 256)")],
)
def test_logits_of_the_wrong_shape_are_named(
    capsys, tmp_path, model_module, data_dir, factory, shape
):
    # Swapped axes read as "a vocabulary of at least 256"; one position short, as torch's
    # "Expected input batch_size (30) to match target batch_size (32)".
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "1", "--batch-size", "2"]
    code, err, _, _ = _train_in_process(
        capsys, tmp_path / "run", *flags, "--model", f"{model_module}:{factory}"
    )
    said = f"the model returned logits of shape {shape} for token ids of shape (2, 16)"
    assert code == 2 and said in err and "Traceback" not in err, err


def test_an_index_error_is_named_only_when_an_embedding_raised_it(
    capsys, tmp_path, model_module, data_dir
):
    # Any IndexError was "give the model a vocabulary of at least 256", its traceback hidden.
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "1", "--batch-size", "2"]
    model = f"{model_module}:build_with_8_positions"
    code, err, _, _ = _train_in_process(capsys, tmp_path / "pos", *flags, "--model", model)
    assert code == 2 and "at least 16 positions (or lower --seq-len)" in err, err
    model = f"{model_module}:build_with_a_list_bug"
    with pytest.raises(IndexError, match="list index out of range"):  # (a crash: exit 1)
        _train_in_process(capsys, tmp_path / "bug", *flags, "--model", model)


def test_no_split_modules_given_as_one_string(capsys, tmp_path, model_module, data_dir):
    # Read letter by letter: "by_class(B, M, c, k, l, o, y) matches no submodule".
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "1", "--batch-size", "2"]
    flags += ["--model", f"{model_module}:build_declaring_a_string"]
    code, err, _, summary = _train_in_process(capsys, tmp_path / "run", *flags)
    assert code == 0 and summary["num_units"] == 4, err


_MOES = {
    "mixtral": {
        "model_type": "mixtral", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.5, "output_router_logits": True,
    },
    "jetmoe": {  # (its weight is named aux_loss_coef)
        "model_type": "jetmoe", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "kv_channels": 16,
        "num_local_experts": 4, "num_experts_per_tok": 2, "aux_loss_coef": 0.5,
        "output_router_logits": True,
    },
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(_MOES))
def test_a_mixture_of_experts_trains_with_its_router_loss(capsys, tmp_path, family):
    """Mixtral (JetMoE) with ``output_router_logits``: transformers adds
    ``router_aux_loss_coef`` (``aux_loss_coef``) x its routers' load-balancing loss to the loss
    it computes from labels; the command computes the loss from the logits and left it out
    (explorers: curves identical with and without it). Step 1's gradient norm is that of
    cross-entropy + 0.5 x aux on the same model and batch, computed here; the logged loss is
    the cross-entropy. An aux_loss without a weight of a known name is refused."""
    pytest.importorskip("transformers")
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers

    from zeroshard.data import BatchLoader
    from zeroshard.tokens import load_tokens

    config = _MOES[family]
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps(config))
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 256, 4000, dtype=np.int64))
    flags = ["--hf", str(tmp_path / "moe" / "config.json"), "--data", str(ids), "--steps", "1"]
    flags += ["--batch-size", "4", "--seq-len", "16", "--eval-batches", "1", "--log-every", "1"]
    code, err, records, _ = _train_in_process(capsys, tmp_path / "run", *flags)
    assert code == 0, err
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    loader = BatchLoader.from_global_batch(
        load_tokens(str(ids)).train, global_batch_size=4, seq_len=16, seed=cfg["seed"]
    )
    x, y = loader.batch(0)
    torch.manual_seed(cfg["seed"])
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config), dtype=torch.float32
    ).train()
    out = model(x)
    loss = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    (loss + 0.5 * out.aux_loss).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    (step,) = _train_records(records)
    assert step["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert step["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    # A model of one's own whose output has an aux_loss, and no weight for it (transformers'
    # configs always have theirs).
    with pytest.raises(ValueError, match="has an aux_loss .* but neither it nor its config"):
        auxiliary_loss(torch.nn.Linear(1, 1), types.SimpleNamespace(aux_loss=torch.ones(())))


def test_hf_config(capsys, tmp_path, data_dir, monkeypatch):
    pytest.importorskip("transformers")
    config = tmp_path / "llcfg" / "config.json"
    config.parent.mkdir()
    config.write_text(
        json.dumps(
            {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32,
             "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0}
        )
    )  # fmt: skip
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "3", "--batch-size", "4"]
    monkeypatch.chdir(tmp_path)  # a path relative to where it was trained
    code, err, records, summary = _train_in_process(
        capsys, tmp_path / "run", *flags, "--hf", "llcfg/config.json", "--stage", "3",
        "--save-every", "3",
    )  # fmt: skip
    assert code == 0, err
    assert summary["model"] == "gpt2" and summary["num_units"] == 3  # root + 2 GPT2Block
    assert abs(summary["val_loss_first"] - math.log(256)) < 0.5  # random init: ~uniform
    # Its export needs no --config, from any folder: the run recorded it (it wrote no
    # config.json, and the tied head twice, so from_pretrained could not load it)
    monkeypatch.chdir(tmp_path / "run")
    assert main(["export", "ckpt/step-000003", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "--config: the checkpoint's copy of the --hf config of the run" in out, out
    assert "lm_head.weight: tied to transformer.wte.weight, not stored" in out, out
    import transformers

    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").config.n_layer == 2
    # The run's folder's config.json rewritten (an older version let a run that saved nothing
    # start there): the checkpoint's own record of its settings still names the config.
    recorded = tmp_path / "run" / "config.json"
    recorded.write_text(json.dumps(json.loads(recorded.read_text()) | {"hf": "other.json"}))
    assert main(["export", "ckpt/step-000003", str(tmp_path / "hf1")]) == 0
    assert "the checkpoint's copy of the --hf config" in capsys.readouterr().out
    # The config edited after training (another activation, same shapes): the export and a
    # resume used the file, another model, without a word. The checkpoint's copy is exported,
    # and both say what changed.
    recorded.write_text(json.dumps(json.loads(recorded.read_text()) | {"hf": str(config)}))
    config.write_text(json.dumps(json.loads(config.read_text()) | {"activation_function": "relu"}))
    assert main(["export", "ckpt/step-000003", str(tmp_path / "hf2")]) == 0
    assert "activation_function None -> 'relu'" in capsys.readouterr().err  # (a default)
    exported = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert exported["activation_function"] == "gelu_new"
    resume = ["--hf", str(config), "--stage", "3", "--steps", "4", "--resume", "auto"]
    assert main(["train", *flags, *resume, "--out-dir", str(tmp_path / "run")]) == 0
    assert f"--hf {config} edited since the save (activation_function" in capsys.readouterr().out
    # Another file than the run's (it said "edited since the save" of a file never edited)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(json.loads(config.read_text()) | {"activation_function": "gelu"}))
    resume = ["--hf", str(other), "--stage", "3", "--steps", "5", "--resume", "auto"]
    assert main(["train", *flags, *resume, "--out-dir", str(tmp_path / "run")]) == 0
    said = capsys.readouterr().out
    assert f"--hf {other} another model's config (activation_function None -> 'gelu')" in said


@pytest.mark.parametrize(
    "config,said",
    [
        ({"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
          "num_key_value_heads": 3, "intermediate_size": 64, "num_hidden_layers": 1},
         "num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"),
        # Falcon's new decoder architecture groups by num_kv_heads (it failed in each rank)
        ({"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 3,
          "new_decoder_architecture": True, "num_hidden_layers": 1},
         "num_attention_heads = 4 is not a multiple of num_kv_heads = 3"),
        # (said as a wrap class that matches nothing)
        ({"model_type": "bart", "d_model": 32, "encoder_layers": 1, "decoder_layers": 0,
          "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 64,
          "decoder_ffn_dim": 64}, "decoder_layers = 0; it counts something"),
        ({"model_type": "llama", "hidden_size": 30, "num_attention_heads": 4,
          "intermediate_size": 64, "num_hidden_layers": 1},
         "hidden size (30) is not a multiple of the number of attention heads (4)"),
        ({"model_type": "t5", "d_model": 32, "num_heads": 2, "d_kv": 16, "d_ff": 64,
          "num_layers": 1}, "model_type 't5' is not a causal (decoder-only) language model"),
        # (it said "T5 and BART are encoder-decoders" of a vision model)
        ({"model_type": "vit", "hidden_size": 32, "num_attention_heads": 2,
          "intermediate_size": 64, "num_hidden_layers": 1},
         "model_type 'vit' is not a causal (decoder-only) language model, which --hf builds "
         "(AutoModelForCausalLM has no class for it"),
        # trained as GPT2LMHeadModel, its checkpoints' config named a classifier
        ({"model_type": "gpt2", "n_embd": 32, "n_head": 2, "n_layer": 1, "n_positions": 64,
          "bos_token_id": 0, "eos_token_id": 0,
          "architectures": ["GPT2ForSequenceClassification"]},
         "its architectures name GPT2ForSequenceClassification, but --hf trains the causal "
         "language model GPT2LMHeadModel"),
    ],
    ids=["kv-heads", "falcon-kv-heads", "no-layers", "width", "encoder-decoder", "vision",
         "classifier"],
)  # fmt: skip
def test_hf_configs_it_cannot_train_are_one_line(capsys, tmp_path, data_dir, config, said):
    """Configs transformers builds but that fail in the first forward, or that are not causal
    LMs: one line naming the setting, exit 2, before any work."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, "vocab_size": 256}))
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "1", "--batch-size", "2"]
    code, err, records, _ = _train_in_process(capsys, tmp_path / "run", *flags, "--hf", str(path))
    assert code == 2 and said in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and len(err) < 500, err
    assert not records


def test_an_hf_config_naming_its_backbone_trains(capsys, tmp_path, data_dir):
    """Hub configs often name the base model ("LlamaModel"): the causal LM built on it trains
    (only another head, a classifier, is refused)."""
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
        "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 256,
        "bos_token_id": 0, "eos_token_id": 0, "architectures": ["LlamaModel"],
    }))  # fmt: skip
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "1", "--batch-size", "2"]
    code, err, _, _ = _train_in_process(capsys, tmp_path / "run", *flags, "--hf", str(path))
    assert code == 0, err


def test_own_data_text_npy_and_tokenizer(capsys, tmp_path):
    import numpy as np
    from test_tokens import _local_tokenizer

    common = [*NANO, "--steps", "2", "--batch-size", "2", "--eval-every", "2"]
    (tmp_path / "texts").mkdir()
    for i in range(3):
        (tmp_path / "texts" / f"{i}.txt").write_text(f"file {i}: " + "the cat sat on the mat " * 40)
    texts = ["--data", str(tmp_path / "texts")]
    code, err, _, summary = _train_in_process(
        capsys, tmp_path / "bytes", *common, *texts, "--save-every", "2"
    )
    assert code == 0, err
    assert summary["vocab_size"] == 256 and summary["data"] == str(tmp_path / "texts")
    # Resumed on data changed since the save: said (it resumed without a word).
    shutil.copytree(tmp_path / "texts", tmp_path / "changed")
    (tmp_path / "changed" / "1.txt").write_text("file 1: " + "a dog sat on the log " * 40)
    more = [*common, "--data", str(tmp_path / "changed"), "--steps", "3", "--resume", "auto"]
    more += ["--out-dir"]
    assert main(["train", *more, str(tmp_path / "bytes")]) == 0
    said = capsys.readouterr().out
    assert re.search(
        r"resuming on other data than the saved run's: 2,\d+ tokens \(vocabulary "
        r"256\), CRC-32 \w{8} -> 2,\d+ tokens \(vocabulary 256\), CRC-32",
        said,
    )

    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 1000, 4000))
    code, err, _, summary = _train_in_process(
        capsys, tmp_path / "npy", *common, "--data", str(tmp_path / "ids.npy")
    )
    assert code == 0, err
    # The GPT preset takes the data's vocabulary; its first loss is that of a uniform guess.
    assert summary["vocab_size"] == 1000 and abs(summary["val_loss_first"] - math.log(1000)) < 0.5

    folder = _local_tokenizer(tmp_path / "tok")
    code, err, _, summary = _train_in_process(
        capsys, tmp_path / "tok-run", *common, "--data", str(tmp_path / "texts"),
        "--tokenizer", str(folder), "--seq-len", "8",
    )  # fmt: skip
    assert code == 0, err
    assert summary["vocab_size"] == 7 and abs(summary["val_loss_first"] - math.log(7)) < 0.5

    # text long enough to train on, whose validation tenth is too short: that split is named
    (tmp_path / "short.txt").write_text("the cat sat on the mat " * 35)  # 805 bytes
    code, err, _, _ = _train_in_process(
        capsys, tmp_path / "short", *common, "--data", str(tmp_path / "short.txt"),
        "--seq-len", "16", "--batch-size", "4",
    )  # fmt: skip
    assert code == 2 and "error: the validation split: the global batch of" in err, err


# --------------------------------------------------------------------------- divergence


@pytest.mark.parametrize(
    ("precision", "rule"), [("fp32", "10 consecutive"), ("fp16", "minimum fp16 loss scale")]
)
def test_divergence_is_an_error(capsys, tmp_path, precision, rule, data_dir):
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "100", "--batch-size", "2"]
    flags += ["--lr", "1e9", "--warmup-steps", "0", "--precision", precision]
    code, err, records, summary = _train_in_process(capsys, tmp_path / "run", *flags)
    assert code == 3, err
    line = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"zeroshard train: diverged at step \d+: \d+ consecutive non-finite gradient steps.*"
        r"\(last loss nan\); lower the learning rate \(--lr\).*",
        line,
    ), line
    assert rule in line and "Traceback" not in err
    assert summary["status"] == "diverged" and summary["error"] in line
    step = int(line.split("step ")[1].split(":")[0])
    assert step < 100 and summary["skipped_steps"] >= (10 if precision == "fp32" else 1)
    # the diverging step, skipped as those before it, is the summary's last and is logged
    train = [r for r in records if r["kind"] == "train"]
    assert summary["last_step"] == step == train[-1]["step"], (summary, train[-1])


@pytest.mark.parametrize("damage", ["cut short", "metadata lost"])
def test_a_damaged_checkpoint_is_said_when_resuming(capsys, tmp_path, data_dir, damage):
    """``--resume auto`` passes over a newest checkpoint cut short, or without its
    ``zeroshard.json`` (a copy of the run's folder cut short), and says so (it did without a
    word); one damaged at the same size is found by its checksum at load: one line, exit 2 (a
    rank file gave torch.load's OSError / UnicodeDecodeError)."""
    flags = [*NANO, "--data-dir", str(data_dir), "--batch-size", "2", "--save-every", "2"]
    code, err, _, _ = _train_in_process(capsys, tmp_path, *flags, "--steps", "4")
    assert code == 0, err
    newest = tmp_path / "ckpt" / "step-000004" / "rank-00000.pt"
    if damage == "cut short":
        newest.write_bytes(newest.read_bytes()[:100])
    else:
        (newest.parent / "zeroshard.json").unlink()
    code = main(["train", *flags, "--steps", "6", "--resume", "auto", "--out-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"--resume auto: passing over {newest.parent}, which is damaged" in out, out
    assert "resuming from" in out and "step-000002 (step 2)" in out, out
    if damage != "cut short":
        return  # (the checksum part below is the same for both)
    newest = tmp_path / "ckpt" / "step-000006" / "rank-00000.pt"
    raw = bytearray(newest.read_bytes())  # flipped in its middle
    raw[len(raw) // 2] ^= 0xFF
    newest.write_bytes(bytes(raw))
    for ckpt in ("auto", str(newest.parent)):
        code = main(["train", *flags, "--steps", "8", "--resume", ckpt, "--out-dir", str(tmp_path)])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        assert "rank-00000.pt is corrupted" in err and len(err.strip().splitlines()) == 1, err


def test_a_resume_inside_a_streak_of_skipped_steps_goes_on_counting_it(capsys, tmp_path, data_dir):
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "30", "--batch-size", "2"]
    flags += ["--lr", "1e9", "--warmup-steps", "0", "--save-every", "5"]
    code, err, _, _ = _train_in_process(capsys, tmp_path, *flags)
    assert code == 3 and "diverged at step 11: 10 consecutive" in err, err
    assert "lower the learning rate" in err, err
    # step-10's checkpoint was saved 9 skipped steps into the streak: the next one ends it,
    # with the same advice (its run took step 1: it said "so not the learning rate").
    code, err, _, _ = _train_in_process(capsys, tmp_path, *flags, "--resume", "auto")
    assert code == 3 and "diverged at step 11: 10 consecutive" in err, err
    assert "lower the learning rate" in err and "not the learning rate" not in err, err


def test_a_second_command_into_a_running_jobs_out_dir_is_refused(
    capsys, tmp_path, data_dir, monkeypatch
):
    """Two commands into one --out-dir mixed their metrics and checkpoints, and the first one's
    ranks (and every restart of them) read the settings the second wrote into config.json: a
    300-step job restarted as the second's 10-step one and ended "done". The folder is now held
    for the command's life, and the ranks read a copy of their own."""
    from zeroshard.cli import train as train_cli

    seen = {}
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "3", "--out-dir", str(tmp_path)]

    def ranks_running(launch, config, on_failure=None):  # while the first command's ranks train
        seen["config"], seen["settings"] = config, json.loads(config.read_text())
        seen["second"] = main(["train", *flags, "--seed", "1"])
        seen["err"] = capsys.readouterr().err
        return 0

    monkeypatch.setattr(train_cli, "run_agent", ranks_running)
    assert main(["train", "--nproc", "2", "--batch-size", "4", *flags]) == 0
    assert seen["second"] == 2, seen
    assert seen["err"] == (
        f"zeroshard train: error: --out-dir {tmp_path} is in use by another zeroshard train "
        f"(pid {os.getpid()}); wait for it to end, or pass another --out-dir\n"
    )
    assert seen["config"].name.startswith(".zeroshard-run-") and not seen["config"].exists()
    assert seen["settings"] == json.loads((tmp_path / "config.json").read_text())
    code, err, _, _ = _train_in_process(capsys, tmp_path, *flags[:-2], "--seed", "1")
    assert code == 0, err  # free again once the first command ended


def test_a_full_disk_while_logging_is_one_line_and_exit_2(capsys, tmp_path, data_dir, monkeypatch):
    """A full disk is the machine's state, not a bug: one line and exit 2, which a restart
    would only repeat (it was a traceback and exit 1, and --max-restarts retried it)."""
    import errno

    from zeroshard.run_log import MetricsLog

    def full(self, record):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    monkeypatch.setattr(MetricsLog, "__call__", full)
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "3", "--batch-size", "2"]
    code, err, _, _ = _train_in_process(capsys, tmp_path, *flags)
    assert code == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (  # after the progress line
        f"zeroshard train: error: [Errno 28] No space left on device: '{tmp_path}/metrics.jsonl'"
        "; free space on that file system, or write elsewhere (e.g. --out-dir)"
    )


@pytest.mark.parametrize("during", [False, True])
@pytest.mark.alone  # (a signal sent at a moment; a bound in seconds)
def test_a_signal_at_the_last_step_ends_the_run_as_done(
    capsys, tmp_path, data_dir, monkeypatch, during
):
    """The run is over: its summary is written, and it exits 0 (it said "interrupted" and
    exited 130 without one, and a resume found nothing left to train). A signal that came
    while the last step trained is seen first by the final evaluation, which it cuts short:
    the summary's last validation loss is then the one before (it failed with a KeyError
    traceback, exit 1, and no summary)."""
    import signal as signals

    from zeroshard.signals import StopOnSignal

    calls, came = [], []  # the loop's questions after each step; the signal, once it came

    def at_the_last(self):
        import sys

        pending = bool(came)  # (asked before each evaluation batch too)
        if sys._getframe(1).f_code.co_name == "_run":
            calls.append(1)
            if len(calls) == 3 - during:
                came.append(1)  # after the final evaluation, or just after step 2's question
                pending = not during
        return signals.SIGINT if pending else 0

    monkeypatch.setattr(StopOnSignal, "agreed", at_the_last)
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "3", "--batch-size", "2"]
    code, err, _, summary = _train_in_process(capsys, tmp_path, *flags, "--save-every", "3")
    assert code == 0 and summary["status"] == "done", err
    assert (tmp_path / "ckpt" / "step-000003").is_dir()
    assert summary["val_loss_last_step"] == (0 if during else 3), summary
    from zeroshard.cli.train import _cut

    said = _cut(summary)  # in the line that ends the run
    assert said == (" (at step 0: a signal cut the last one short)" if during else ""), said


def test_a_signal_during_a_save_stops_at_that_save(capsys, tmp_path, data_dir, monkeypatch):
    """The stop is asked before each step's save; a signal that came during the save was seen
    after the next step, which was trained and saved again (explorer226): it is asked again
    once the save is done, which then serves the stop."""
    import signal as signals

    from zeroshard.signals import StopOnSignal

    calls = []

    def during_the_second_save(self):
        import sys

        if sys._getframe(1).f_code.co_name == "_run":
            calls.append(1)  # after step 1, after step 2 (due to save), after step 2's save
        return signals.SIGINT if len(calls) >= 3 else 0

    monkeypatch.setattr(StopOnSignal, "agreed", during_the_second_save)
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "6", "--batch-size", "2"]
    code, err, _, summary = _train_in_process(capsys, tmp_path, *flags, "--save-every", "2")
    assert code == 130 and summary["status"] == "interrupted", err
    assert summary["last_step"] == 2, summary
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000002"]


def test_non_finite_validation_loss_is_divergence(capsys, tmp_path, model_module, data_dir):
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "5", "--batch-size", "2"]
    flags += ["--model", f"{model_module}:build_nan_in_eval", "--wrap", "MyBlock"]
    code, err, _, summary = _train_in_process(capsys, tmp_path / "run", *flags)
    assert code == 3, err
    assert "diverged at step 0: validation loss nan" in err, err
    assert summary["status"] == "diverged"


def test_a_run_that_fails_says_so_in_its_summary(capsys, tmp_path, model_module, data_dir):
    """A run that ends early writes summary.json too (status, the error's line, the last step
    updated): a crash in step 3 left metrics.jsonl without a word of why it stopped."""
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "5", "--batch-size", "2"]
    flags += ["--model", f"{model_module}:build_crashing", "--wrap", "MyBlock"]
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="my model crashed"):  # in process: raised, as a bug
        main(["train", *flags, "--out-dir", str(out)])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in _train_records(records)] == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["last_step"] == 2, summary
    assert summary["error"] == "RuntimeError: my model crashed", summary
    assert (out / "loss.png").exists()


# ----------------------------------------------- how 2-rank runs end: ten runs, every ending

TWO_RANKS = ["--nproc", "2", "--batch-size", "4", *NANO]
NORMAL = ["--steps", "8", "--seq-len", "32", "--eval-every", "4", "--eval-batches", "2"]
NORMAL += ["--log-every", "2"]
ENDINGS = [  # (name, flags, exit status); --steps 100000 runs until the signal
    ("stage 1, ulimit -Sn 24", [*NORMAL, "--stage", "1"], 0),  # (the soft limit, raised)
    (
        "stage 2, grad-accum 2 unreduced, bf16",
        [
            *NORMAL,
            "--stage",
            "2",
            "--precision",
            "bf16",
            "--grad-accum",
            "2",
            "--accumulate-unreduced",
            "true",
        ],
        0,
    ),  # fmt: skip
    ("stage 3", [*NORMAL, "--stage", "3"], 0),
    ("stage 3, grad-accum 2", [*NORMAL, "--stage", "3", "--grad-accum", "2"], 0),
    (  # not restarted: a restart would resume from the last save and diverge again there
        "diverged, restarts",
        ["--lr", "1e9", "--warmup-steps", "0", "--steps", "100", "--max-restarts", "2"]
        + ["--save-every", "2"],
        3,
    ),
    ("diverged fp16", ["--lr", "1e9", "--warmup-steps", "0", "--precision", "fp16"], 3),
    ("Ctrl-C", ["--steps", "100000"], 130),
    ("SIGTERM", ["--steps", "100000", "--save-every", "1000"], 143),
    ("bad input in a rank", ["--model", "my_models:build_bad", "--wrap", "MyBlock"], 2),
    (  # not restarted; each start of the ranks has a store of its own, none before the group
        "bad input in a rank, restarts",
        ["--model", "my_models:build_bad", "--max-restarts", "1", "--save-every", "4"],
        2,
    ),
    ("crash in a rank", ["--model", "my_models:build_crashing_on_rank_1", "--wrap", "MyBlock"], 1),
    ("kill -9 of rank 0", ["--steps", "100000"], -9),
]
"""(name, flags, exit status; -9: rank 0 is killed after the first step, the run exits 1)."""


CONCURRENT_RUNS = 3


def _folder(name: str) -> str:
    return name.replace(" ", "-").replace(",", "")


def _end_two_ranks(
    tmp_path, data_dir, name: str, flags: list[str], code: int
) -> tuple[str, str, float]:
    """One 2-rank run to its end (signalled, or rank 0 killed, after its first step when
    ``code`` says so): stdout, stderr and the seconds from the signal to the launcher's exit."""
    out = tmp_path / _folder(name)
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "train", *TWO_RANKS, *flags]
    cmd += ["--data-dir", str(data_dir), "--out-dir", str(out)]
    if "ulimit -Sn 24" in name:  # (by the shell: a preexec_fn is unsafe beside other threads)
        cmd = ["sh", "-c", 'ulimit -Sn 24 && exec "$@"', "sh", *cmd]
    # The survivor's wait for its peer to check in (zeroshard.watchdog): the peer is dead.
    env = {**os.environ, "ZEROSHARD_DEAD_PEER_GRACE_S": "0.5"}
    env.pop("OMP_NUM_THREADS", None)  # unset, torchrun prints a banner unless we set it
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=env,
    )  # fmt: skip
    waited = 0.0
    try:
        if code in (130, 143, -9):
            _wait_for_first_step(proc, out)
            t0 = time.monotonic()
            if code == 130:  # Ctrl-C: the terminal signals the launcher and every rank
                os.killpg(proc.pid, signal.SIGINT)
            elif code == 143:  # a job scheduler's SIGTERM, to the launcher only
                proc.send_signal(signal.SIGTERM)
            else:  # rank 0 dies mid-training (it hosts no store here: torchrun's agent does)
                os.kill(_rank_pids(proc.pid)[0], signal.SIGKILL)
                code = 1
            stdout, stderr = proc.communicate(timeout=60)
            waited = time.monotonic() - t0
        else:
            stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, f"{name}: {stderr[-3000:]}"
    return stdout, stderr, waited


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="signals a process group")
@pytest.mark.alone  # (a signal sent at a moment; a bound in seconds)
def test_a_second_ctrl_c_while_the_ranks_stop_leaves_no_rank_running(
    tmp_path, data_dir, model_module
):
    # The second signal raised inside the agent's wait for its ranks: it exited at once, and
    # the ranks ran on without it, orphaned (and the output folder was unlocked under them).
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "train", *TWO_RANKS, "--steps", "100000"]
    cmd += [
        "--save-every",
        "1000",
        "--model",
        "my_models:build_slow",
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(out),
    ]
    env, ranks = {**os.environ, "OMP_NUM_THREADS": "1"}, []
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=env,
    )  # fmt: skip
    try:
        _wait_for_first_step(proc, out)
        ranks = list(_rank_pids(proc.pid).values())
        assert len(ranks) == 2, ranks
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, twice: the terminal signals the group
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        alive = [pid for pid in ranks if _running(pid)]  # none outlived the command
        stderr = proc.stderr.read()
    finally:
        for pid in [proc.pid, *ranks]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not alive, f"ranks {alive} outlived the command: {stderr[-3000:]}"
    assert proc.returncode == 130, stderr[-3000:]
    assert "still stopping the ranks" in stderr and "Traceback" not in stderr, stderr[-3000:]


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="signals a process group")
@pytest.mark.alone  # (a signal sent at a moment; a bound in seconds)
def test_ctrl_c_during_an_evaluation_stops_it(tmp_path, data_dir, model_module):
    # The evaluation (here 100 s) ran to its end before the stop was agreed; past the ranks' 4 s
    # deadline they exited "did not reach a step boundary ... stopped without saving".
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "train", *TWO_RANKS, "--steps", "100000"]
    cmd += ["--eval-every", "2", "--eval-batches", "50", "--log-every", "1"]
    cmd += ["--model", "my_models:build_slow_eval", "--data-dir", str(data_dir)]
    proc = subprocess.Popen(
        [*cmd, "--out-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        metrics = out / "metrics.jsonl"
        while not metrics.is_file() or '"step": 2' not in metrics.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        time.sleep(1.0)  # inside the step-2 evaluation
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        waited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr[-3000:]
    assert "interrupted at step 2 by SIGINT" in stdout and waited < 5, (waited, stdout, stderr)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["last_step"] == 2, summary


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rank_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the ranks below the ``launcher`` process (their RANK, read from /proc)."""
    ranks = {}
    for pid in _descendants(launcher):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"RANK" in env and "zeroshard.cli.main" in _cmdline(pid):
            ranks[int(env[b"RANK"])] = pid
    return ranks


def _say_twice(token: str) -> tuple[bool, bool]:
    """Every rank reports the same line, then one of its own."""
    import torch.distributed as dist

    from zeroshard.cli.train import _first_to_say

    return _first_to_say(f"same error {token}"), _first_to_say(f"rank {dist.get_rank()} {token}")


def test_an_error_every_rank_meets_is_reported_by_one(workers2, lone_process):
    """However the ranks race, an error line is printed once per job; a rank's own error is
    printed by that rank; with no job store to ask, the line is printed."""
    from zeroshard.cli.train import _first_to_say

    token = str(time.monotonic_ns())
    (same0, own0), (same1, own1) = workers2.run(_say_twice, token)
    assert same0 + same1 == 1, (same0, same1)
    assert own0 and own1
    assert _first_to_say("no store here") and _first_to_say("no store here")


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="signals a process group")
@pytest.mark.alone  # (a signal sent at a moment; a bound in seconds)
def test_every_way_a_two_rank_run_ends(tmp_path, data_dir, model_module):
    """Every way a 2-rank run ends (twelve runs): the right status, one line saying why, never
    gloo's "terminate called without an active exception", no carriage returns off a
    terminal."""
    # Three runs at a time: most of a run is start-up and teardown, not training.
    with ThreadPoolExecutor(max_workers=CONCURRENT_RUNS) as pool:
        ended = [
            pool.submit(_end_two_ranks, tmp_path, data_dir, name, flags, code)
            for name, flags, code in ENDINGS
        ]
    for (name, _, code), future in zip(ENDINGS, ended):
        stdout, stderr, waited = future.result()
        assert "terminate called" not in stderr, f"{name}: {stderr[-3000:]}"
        assert "\r" not in stderr, name
        assert "OMP_NUM_THREADS" not in stderr, f"{name}: torchrun's banner: {stderr[:600]}"
        if code != 1:  # a crash is a bug: its traceback is wanted
            assert "Traceback" not in stderr, f"{name}: {stderr[-3000:]}"
        ours = [line for line in stderr.splitlines() if line.startswith("zeroshard train:")]
        if code == 0:
            assert stdout.splitlines()[-1].startswith("done: nano"), stdout
            stage, precision = int(name.split()[1].strip(",")), name.split()[-1]
            precision = "bf16" if precision == "bf16" else "fp32"
            _check_metrics_and_plot(tmp_path / _folder(name), stage, precision)
        elif code == 3:
            assert len(ours) == 1 and "diverged at step" in ours[0], stderr[-3000:]
            assert not [line for line in stdout.splitlines() if line.startswith("restart ")]
        elif code in (130, 143):
            lines = [line for line in stdout.splitlines() if line.startswith("interrupted at")]
            sig = "SIGINT" if code == 130 else "SIGTERM"
            saved = r"no checkpoint saved \(.*\)" if code == 130 else r"saved step \d+ to .*"
            first = "nothing trained in this run yet: .*"  # (the signal in the first evaluation)
            assert len(lines) == 1 and re.fullmatch(
                rf"interrupted at step (\d+) by {sig}; ({saved}|{first})", lines[0]
            ), stdout
            step = int(lines[0].split()[3])
            summary = json.loads((tmp_path / _folder(name) / "summary.json").read_text())
            assert summary["status"] == "interrupted" and summary["last_step"] == step, summary
            assert summary["error"] == lines[0], summary
            if code == 143:  # the step it stopped at, saved: a checkpoint that verifies
                path = tmp_path / _folder(name) / "ckpt" / f"step-{step:06d}"
                assert lines[0].endswith(f"saved step {step} to {path}"), lines[0]
                assert main(["checkpoint", "info", str(path), "--verify"]) == 0
            print(f"\n{name}: {waited:.1f} s from the signal to the exit")
            assert waited < 5, f"{name}: {waited:.1f} s from the signal to the exit"
        elif code == 2:
            said = "model = 'my_models:build_bad': my factory: width must be even"
            assert ours == [f"zeroshard train: error: {said}"], stderr
        elif code == -9:  # the agent names the dead rank; the survivor (if it said anything
            # before it was stopped) names it too, and suggests no timeout: none would help
            assert ours[-1].startswith("zeroshard train: rank 0 failed (exit code -9); the other")
            assert len(ours) <= 2 and all("timeout" not in line for line in ours), ours
            assert all("rank 0" in line for line in ours), ours
            assert "Traceback" not in stderr, stderr[-3000:]
        else:  # rank 1 crashed mid-run: the agent names it, and so does the summary, which
            # rank 0 wrote saying what it saw (its peer gone)
            assert ours[-1].startswith("zeroshard train: rank 1 failed (exit code 1)"), stderr
            assert len(ours) <= 2 and "my model crashed" in stderr, stderr[-3000:]
            summary = json.loads((tmp_path / _folder(name) / "summary.json").read_text())
            assert summary["error"].startswith("rank 1 failed first (exit code 1"), summary
    # Accumulation over 2 ranks: the same curve, and gradients reduce-scattered every
    # micro-batch (ZeRO-3's partitioned gradients: no whole gradient kept between them).
    runs = {}
    for name in ("stage 3", "stage 3, grad-accum 2"):
        folder = tmp_path / _folder(name)
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        runs[name] = (
            _train_records([json.loads(line) for line in lines]),
            json.loads((folder / "summary.json").read_text()),
        )
    (whole, whole_summary), (micro, micro_summary) = runs.values()
    assert [r["loss"] for r in micro] == pytest.approx([r["loss"] for r in whole], rel=1e-5)
    assert [r["grad_norm"] for r in micro] == pytest.approx([r["grad_norm"] for r in whole])
    micro_bytes = micro_summary["comm_bytes_per_step_by_label"]
    whole_bytes = whole_summary["comm_bytes_per_step_by_label"]
    assert micro_bytes["grads"] == 2 * whole_bytes["grads"] > 0, (micro_bytes, whole_bytes)
    unreduced = json.loads((tmp_path / _folder(ENDINGS[1][0]) / "summary.json").read_text())
    assert unreduced["reduce_every_micro_batch"] is False, unreduced
    assert micro_bytes["params"] > whole_bytes["params"]  # stage 3 gathers per micro-batch


def test_offload_nvme_without_a_folder(capsys, tmp_path):
    argv = ["train", "--offload-optimizer", "nvme", "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "offload_optimizer", "--offload-folder")


def test_offload_folder_not_writable(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    argv = ["train", "--offload-params", "nvme", "--offload-folder", str(blocker / "swap")]
    _expect_usage_error(capsys, [*argv, "--out-dir", str(tmp_path)], "--offload-folder")


def test_offload_folder_inside_the_checkpoints(capsys, tmp_path):
    # A save at step 2 found it as its step folder and failed there, after training.
    inside = tmp_path / "ckpt" / "step-000002"
    argv = ["train", "--offload-optimizer", "nvme", "--offload-folder", str(inside)]
    _expect_usage_error(capsys, [*argv, "--out-dir", str(tmp_path)], "inside", "swap")


def test_what_the_run_writes_is_outside_its_data_folder(capsys, tmp_path):
    # Its config.json was trained on at once; on resume its checkpoints and metrics too.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text to train on " * 200)
    argv = ["train", "--data", str(corpus)]
    _expect_usage_error(capsys, [*argv, "--out-dir", str(corpus / "run")], "--out-dir", "inside")
    swap = ["--offload-optimizer", "nvme", "--offload-folder", str(corpus / "swap")]
    _expect_usage_error(
        capsys, [*argv, *swap, "--out-dir", str(tmp_path / "run")], "--offload-folder", "inside"
    )


def test_a_killed_launcher_s_private_config_is_removed_by_the_next_run(tmp_path, data_dir):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs
    host = socket.gethostname()
    dead = tmp_path / f".zeroshard-run-{host}-{gone.pid}.json"
    live = tmp_path / f".zeroshard-run-{host}-{os.getpid()}.json"
    other = tmp_path / f".zeroshard-run-elsewhere-{gone.pid}.json"
    for path in (dead, live, other):
        path.write_text("{}")
    flags = [*NANO, "--steps", "1", "--data-dir", str(data_dir)]
    assert main(["train", *flags, "--out-dir", str(tmp_path)]) == 0
    assert not dead.exists() and live.exists() and other.exists()


def test_a_refused_run_leaves_no_output_folder(capsys, tmp_path, data_dir, model_module):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    bad = ["--offload-params", "nvme", "--offload-folder", str(blocker / "swap")]
    out = tmp_path / "runs" / "first"
    # (It said "not writable (Not a directory)" for a file in the way.)
    why = "a folder above it, is a file"
    _expect_usage_error(capsys, ["train", *bad, "--out-dir", str(out)], "--offload-folder", why)
    assert not (tmp_path / "runs").exists()  # made for the run, then removed with its parent
    (tmp_path / "mine").mkdir()  # a folder the user made is theirs: kept, as it was (the
    # lock the command took in it is gone again)
    _expect_usage_error(capsys, ["train", *bad, "--out-dir", str(tmp_path / "mine")], "offload")
    assert list((tmp_path / "mine").iterdir()) == []
    bad_out = ["--out-dir", str(blocker)]
    _expect_usage_error(capsys, ["train", *bad_out], "cannot create output folder", "is a file")
    # A folder that cannot be made (its name too long): the parents made for it go too.
    too_long = tmp_path / "parent" / ("x" * 300)
    _expect_usage_error(capsys, ["train", "--out-dir", str(too_long)], "cannot create output")
    assert not (tmp_path / "parent").exists()
    dotted = ["--out-dir", str(tmp_path / "new" / ".." / "mine" / "run")]
    _expect_usage_error(capsys, ["train", *bad, *dotted], "offload")
    assert not (tmp_path / "new").exists() and (tmp_path / "mine").is_dir()
    # Refused as the rank builds the model, after the launcher wrote its settings: removed too.
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "1"]
    flags += ["--model", "my_models:build_bad", "--wrap", "MyBlock"]
    assert main(["train", *flags, "--out-dir", str(out)]) == 2
    assert "width must be even" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists(), list((tmp_path / "runs").rglob("*"))
    # The same in a folder that existed: the settings it wrote go again, and a run's folder
    # keeps the config.json of the run it holds.
    assert main(["train", *flags, "--out-dir", str(tmp_path / "mine")]) == 2
    assert list((tmp_path / "mine").iterdir()) == []
    run = tmp_path / "run"
    good = [*NANO, "--data-dir", str(data_dir), "--steps", "1"]
    assert main(["train", *good, "--out-dir", str(run)]) == 0
    assert not (run / ".zeroshard.lock").exists()
    before = (run / "config.json").read_bytes()
    assert main(["train", *flags, "--out-dir", str(run)]) == 2
    assert (run / "config.json").read_bytes() == before
    # Refused by a rank at the first step (the model's logits one position short), after rank 0
    # wrote its metrics, summary and plot: nothing trained, so nothing kept (they stayed, with
    # the parents made for them), and a run's folder keeps its run's files.
    short = [*good, "--model", "my_models:build_one_short"]
    assert main(["train", *short, "--out-dir", str(out)]) == 2
    assert not (tmp_path / "runs").exists(), list((tmp_path / "runs").rglob("*"))
    if importlib.util.find_spec("tensorboard"):  # (its event file stayed, so did the folder)
        assert main(["train", *short, "--log", "tensorboard", "--out-dir", str(out)]) == 2
        assert not (tmp_path / "runs").exists(), list((tmp_path / "runs").rglob("*"))
    files = {p.name: p.read_bytes() for p in run.iterdir()}
    assert main(["train", *short, "--out-dir", str(run)]) == 2
    assert {p.name: p.read_bytes() for p in run.iterdir()} == files
    # Resumed, then refused at its first step: the failed summary lacked resumed_at_step, so
    # the resumed step counted as trained and the run's files were not put back.
    saved = tmp_path / "saved"
    mine = [*good, "--model", "my_models:build", "--save-every", "1"]
    assert main(["train", *mine, "--out-dir", str(saved)]) == 0
    files = {p.name: p.read_bytes() for p in saved.iterdir() if p.is_file()}
    resumed = [*good, "--model", "my_models:build_one_short", "--steps", "2", "--resume", "auto"]
    assert main(["train", *resumed, "--out-dir", str(saved)]) == 2
    assert {p.name: p.read_bytes() for p in saved.iterdir() if p.is_file()} == files
    capsys.readouterr()
    # A second command into a folder that a first one created and holds: refused, deleting
    # nothing of the first's, which removes the folder at its end (its run left nothing).
    held = tmp_path / "held" / "run"
    with hold_out_dir(str(held), lock=True):
        (held / "config.json").write_text("{}")
        _expect_usage_error(capsys, ["train", "--out-dir", str(held)], "in use by another")
        assert sorted(p.name for p in held.iterdir()) == [".zeroshard.lock", "config.json"]
    assert not (tmp_path / "held").exists()


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_offload_params_below_stage_3(capsys, tmp_path, where):
    argv = ["train", "--stage", "2", "--offload-params", where, "--out-dir", str(tmp_path)]
    if where == "nvme":
        argv += ["--offload-folder", str(tmp_path / "swap")]
    _expect_usage_error(capsys, argv, "stage 2", "--stage 3")


def test_offload_everything_to_nvme_trains_as_in_memory(capsys, tmp_path, data_dir):
    import gc

    flags = ["--data-dir", str(data_dir), *NANO, "--steps", "3", "--batch-size", "4"]
    swap = tmp_path / "swap"
    offload = [
        "--offload-optimizer", "nvme", "--offload-gradients", "nvme", "--offload-params", "nvme",
        "--offload-folder", str(swap),
    ]  # fmt: skip
    runs, summaries = {}, {}
    for name, extra in (("memory", []), ("nvme", offload)):
        code, err, records, summary = _train_in_process(capsys, tmp_path / name, *flags, *extra)
        assert code == 0, err
        runs[name] = [r["loss"] for r in _train_records(records)]
        summaries[name] = summary
    assert len(runs["nvme"]) == 3 and runs["nvme"] == runs["memory"], runs
    # Every step moves the FP32 masters (fwd, bwd, step), Adam's m and v and the gradient shard.
    model_bytes = 4 * summaries["nvme"]["num_params"]
    assert summaries["nvme"]["disk_write_gb_per_step"] * 1e9 >= 4 * model_bytes * 0.99
    assert summaries["nvme"]["disk_read_gb_per_step"] * 1e9 >= 6 * model_bytes * 0.99
    assert "disk_read_gb_per_step" not in summaries["memory"]
    assert all(m > 0 for m in summaries["nvme"]["peak_rss_mib"])
    gc.collect()  # the model and optimizer own the stores: their swap files go with them
    assert not swap.exists() or not any(p.suffix == ".swp" for p in swap.rglob("*"))


@pytest.mark.parametrize(
    "extra,shown",
    [
        (["--stage", "1", "--grad-clip", "0"], "stage 2 or 3"),
        (["--stage", "3"], "--grad-clip 0"),
        (["--stage", "3", "--grad-clip", "0", "--precision", "fp16"], "fp16"),
    ],
)
def test_optimizer_step_in_backward_refuses_what_it_cannot_do(capsys, tmp_path, extra, shown):
    argv = ["train", "--optimizer-step", "in_backward", *extra, "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "optimizer_step", shown)


def test_optimizer_step_in_backward_trains_as_after_it(capsys, tmp_path, data_dir):
    flags = ["--data-dir", str(data_dir), *NANO, "--steps", "3", "--batch-size", "4"]
    flags += ["--grad-clip", "0"]
    runs = {}
    for when in ("after_backward", "in_backward"):
        code, err, records, _ = _train_in_process(
            capsys, tmp_path / when, *flags, "--optimizer-step", when
        )
        assert code == 0, err
        runs[when] = [r["loss"] for r in _train_records(records)]
    assert len(runs["in_backward"]) == 3 and runs["in_backward"] == runs["after_backward"], runs


def test_tp_that_does_not_divide_the_ranks(capsys, tmp_path):
    argv = ["train", "--nproc", "3", "--tp", "2", "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "--tp 2 does not divide the 3 ranks")
    argv = ["train", "--nproc", "4", "--tp", "2", "--batch-size", "3", "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "does not divide across 2 data-parallel ranks", "of 2")


def test_shard_group_size_must_divide_the_data_parallel_ranks(capsys, tmp_path):
    base = ["train", *NANO, "--steps", "1", "--out-dir", str(tmp_path), "--shard-group-size"]
    _expect_usage_error(capsys, [*base, "3", "--nproc", "4"], "--shard-group-size 3", "of 4")
    argv = [*base, "2", "--nproc", "6", "--tp", "2", "--batch-size", "6"]
    _expect_usage_error(capsys, argv, "does not divide the 3 data-parallel ranks")
    _expect_usage_error(capsys, [*base, "2", "--stage", "0"], "shard_group_size = 2 at stage 0")
    _expect_usage_error(capsys, [*base, "-1"], "shard_group_size")


def test_tensor_parallel_run_follows_the_data_parallel_one(capsys, tmp_path, data_dir):
    """``--nproc 4 --tp 2`` (2 data-parallel ranks, each layer split in 2, checkpoints split and
    on the CPU), hybrid-sharded in groups of 1 (each data-parallel rank a replica of the whole
    states), trains the same curve as one process with the same global batch: the logged loss
    and gradient norm are the global batch's, whatever the ranks. Its checkpoints hold the
    unsplit model: one process resumes from them on the same curve."""
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "4", "--batch-size", "4"]
    flags += ["--log-every", "1", "--eval-every", "4", "--checkpoint-every", "1"]
    code, err, records, _ = _train_in_process(capsys, tmp_path / "one", *flags)
    assert code == 0, err
    one = _train_records(records)
    tp_flags = ["--nproc", "4", "--tp", "2", "--partition-activations", "true"]
    tp_flags += ["--offload-activations", "cpu", "--save-every", "2", "--keep", "2"]
    tp_flags += ["--shard-group-size", "1"]
    result = _cli("train", *flags, *tp_flags, "--out-dir", str(tmp_path / "tp"))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "tp" / "metrics.jsonl").read_text().splitlines()
    tp = _train_records([json.loads(line) for line in lines])
    assert [r["step"] for r in tp] == [1, 2, 3, 4]
    for a, c in zip(one, tp, strict=True):
        assert c["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert c["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    summary = json.loads((tmp_path / "tp" / "summary.json").read_text())
    assert summary["ranks"] == 4 and summary["tp"] == 2 and summary["shard_group_size"] == 1
    done = "on 4 rank(s) (tp 2 x dp 2), sharded in groups of 1, 4 steps"
    assert done in result.stdout.splitlines()[-1], result.stdout
    saved = tmp_path / "tp" / "ckpt" / "step-000002"
    assert main(["checkpoint", "info", str(saved), "--verify"]) == 0
    assert "world size 4 (tensor-parallel 2), stage 3" in capsys.readouterr().out
    code, err, records, _ = _train_in_process(
        capsys, tmp_path / "resumed", *flags, "--resume", str(saved)
    )
    assert code == 0, err
    resumed = _train_records(records)
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(one[2:], resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)


def test_meta_init_builds_one_unit_at_a_time_and_trains(capsys, tmp_path, data_dir):
    flags = ["--data-dir", str(data_dir), *NANO, "--steps", "6", "--batch-size", "4"]
    code, err, records, summary = _train_in_process(capsys, tmp_path, *flags, "--meta-init", "true")
    assert code == 0, err
    evals = [r["val_loss"] for r in records if r["kind"] == "eval"]
    assert math.isfinite(evals[0]) and evals[-1] < evals[0], evals
    assert summary["num_params"] > 0


def test_meta_init_refuses_hf_and_tp(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 256, "n_positions": 64}))
    base = ["train", "--meta-init", "true", "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, [*base, "--hf", str(config)], "meta_init", "hf =")
    _expect_usage_error(capsys, [*base, "--tp", "2", "--nproc", "2"], "meta_init", "--tp 1")


def test_a_preset_too_big_to_build_in_full_asks_for_meta_init(
    capsys, tmp_path, monkeypatch, data_dir
):
    import zeroshard.cli.train_checks as checks

    monkeypatch.setattr(checks, "memory_available_bytes", lambda: 10**4)  # < nano
    monkeypatch.setattr(checks, "_check_states_fit", lambda *a: None)  # (a check of its own)
    flags = ["--data-dir", str(data_dir), *NANO, "--steps", "1", "--batch-size", "2"]
    argv = ["train", *flags, "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "preset 'nano'", "--meta-init true")
    code, err, _, _ = _train_in_process(capsys, tmp_path / "meta", *flags, "--meta-init", "true")
    assert code == 0, err


def test_precision_auto_says_what_it_chose(capsys, tmp_path, data_dir):
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "1", "--batch-size", "2"]
    code, err, _, summary = _train_in_process(capsys, tmp_path, *flags, "--precision", "auto")
    assert code == 0, err
    assert summary["precision"] in ("bf16 (auto)", "fp32 (auto)"), summary


def test_fp32_modules_keep_the_named_classes_in_fp32(capsys, tmp_path, data_dir):
    """``--fp32-modules LayerNorm`` under bf16: the norms compute in FP32 (``unit_precision``),
    the rest in BF16; a class the model lacks is bad input (exit 2) listing its classes."""
    flags = [*NANO, "--data-dir", str(data_dir), "--steps", "2", "--batch-size", "2"]
    flags += ["--precision", "bf16"]
    code, err, records, _ = _train_in_process(
        capsys, tmp_path / "ok", *flags, "--fp32-modules", "LayerNorm"
    )
    assert code == 0, err
    assert len(_train_records(records)) == 2
    code, err, _, _ = _train_in_process(capsys, tmp_path / "bad", *flags, "--fp32-modules", "Norm")
    assert code == 2 and "fp32_modules = 'Norm': nano has no Norm module" in err, err
    assert "LayerNorm" in err
    # The tied embedding computes in the head's unit: refused in the command line's words
    # (shard's own advice, "unit_precision" and untying, is not the user's to follow here).
    code, err, _, _ = _train_in_process(
        capsys, tmp_path / "tied", *flags, "--fp32-modules", "Embedding"
    )
    said = "fp32_modules = 'Embedding': wte (Embedding): its weight is shared with a module outside"
    assert code == 2 and said in err, err
    assert "leave its class out of --fp32-modules" in err and "unit_precision" not in err, err


def _compare_configs(steps_per_rank: list[int], out_dirs: list[str]) -> str:
    import torch.distributed as dist

    from zeroshard.train import TrainConfig, _check_same_config

    rank = dist.get_rank()
    cfg = TrainConfig(steps=steps_per_rank[rank], out_dir=out_dirs[rank])
    try:
        _check_same_config(cfg)
    except ValueError as exc:
        return str(exc)
    return "same"


def test_nodes_launched_with_other_settings_are_refused(workers2):
    """A multi-node job whose nodes got other flags (a typo on one) would wait in mismatched
    collectives until the timeout: refused at start, naming the setting. Paths may differ."""
    assert workers2.run(_compare_configs, [4, 4], ["a", "b"]) == ["same", "same"]
    for said in workers2.run(_compare_configs, [4, 6], ["a", "a"]):
        assert said.startswith("rank 1 was launched with other settings than rank 0 (steps 4 vs 6)")


def test_throughput_counts_the_steps_this_process_trained():
    """A resumed run's first record covers the steps since the resume, not since the last
    record of the run it resumed (which another process trained: twice the tokens/s)."""
    from zeroshard.train import _steps_since

    records = [{"kind": "eval", "step": 0}, {"kind": "train", "step": 10}]
    assert _steps_since(20, records, start=15) == 5  # resumed at 15
    assert _steps_since(20, records, start=0) == 10
    assert _steps_since(4, [{"kind": "eval", "step": 0}], start=0) == 4


def test_hf_weights_beside_the_config_are_said_to_be_unread(tmp_path):
    """A pretrained model's folder given to --hf trained from random weights without a word."""
    import warnings

    from zeroshard.cli.train_checks import check_inputs
    from zeroshard.train_config import TrainConfig

    pytest.importorskip("transformers")
    folder = tmp_path / "pretrained"
    folder.mkdir()
    config = dict(model_type="gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=300)
    (folder / "config.json").write_text(json.dumps(config | {"n_positions": 64}))
    cfg = TrainConfig(hf=str(folder), seq_len=32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_inputs(cfg, 1)
        assert not [w for w in caught if "is not read" in str(w.message)]
        (folder / "model.safetensors").write_bytes(b"")
        check_inputs(cfg, 1)
    said = [str(w.message) for w in caught if "is not read" in str(w.message)]
    assert len(said) == 1 and "model.safetensors is not read" in said[0], said
    assert "from_pretrained(folder)" in said[0]


def test_launching_from_a_rank_s_environment_is_refused(tmp_path):
    """RANK and MASTER_ADDR left in the shell made `--nproc 2` a rank of a job that does not
    exist (it waited out the timeout, then a traceback), or with RANK=0 WORLD_SIZE=1 a run on
    one rank without a word."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    argv = ["train", "--nproc", "2", "--preset", "nano", "--steps", "1", "--out-dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "zeroshard.cli.main", *argv],
        capture_output=True, text=True, timeout=120, env={**env, "MASTER_PORT": "29999"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "already one rank of a job launched elsewhere (RANK=0" in done.stderr, done.stderr
    assert "unset RANK and MASTER_ADDR" in done.stderr and not (tmp_path / "metrics.jsonl").exists()


def test_a_rank_of_your_own_torchrun_holds_the_out_dir(tmp_path, monkeypatch):
    """Two jobs of your own `torchrun -m zeroshard.cli.main train` into one folder interleaved
    their metrics and replaced each other's checkpoints: its local rank 0 holds the folder now,
    as zeroshard train's launcher does (whose ranks, marked, leave it to the launcher)."""
    from zeroshard.cli import agent
    from zeroshard.cli import train as train_cli
    from zeroshard.cli.train_checks import hold_out_dir

    env = {"LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(agent.LAUNCHER_PID, raising=False)
    monkeypatch.setattr(train_cli, "_HELD", [])
    train_cli._hold_for_own_torchrun(tmp_path)
    try:
        assert len(train_cli._HELD) == 1
        with (
            pytest.raises(
                UsageError, match=rf"in use by another zeroshard train \(pid {os.getpid()}"
            ),
            hold_out_dir(str(tmp_path), lock=True),
        ):
            pass
    finally:
        os.close(train_cli._HELD.pop())
    for name, value in ((agent.LAUNCHER_PID, "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "4")):
        with monkeypatch.context() as m:
            m.setenv(name, value)  # launched by zeroshard train, another local rank, two nodes
            train_cli._hold_for_own_torchrun(tmp_path)
            assert train_cli._HELD == [], name
    launch = agent.Launch(nproc=2, port=0)
    with agent._agent_env(launch, [], [], []):
        assert os.environ[agent.LAUNCHER_PID] == str(os.getpid())


def test_a_reader_that_leaves_does_not_end_the_run(tmp_path, data_dir):
    """`zeroshard train ... | head -1`, or a `tee` killed at logout: the next progress line
    raised BrokenPipeError and the run failed (status "failed"); its output is progress."""
    argv = ["train", *NANO, "--steps", "3", "--batch-size", "2"]
    argv += ["--data-dir", str(data_dir), "--out-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "zeroshard.cli.main", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    proc.stdout.close()  # the reader is gone before the first line
    assert proc.wait(timeout=240) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "done" and summary["steps"] == 3, summary
