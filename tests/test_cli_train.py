"""``zeroshard`` CLI: help, a real 2-rank training run, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from zeroshard.cli.main import main


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


def test_help_lists_subcommands():
    result = _cli("--help")
    assert result.returncode == 0
    assert "train" in result.stdout


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "bf16"), (3, "fp32")])
def test_train_two_ranks_writes_metrics_and_plot(tmp_path, stage, precision):
    out = tmp_path / "run"
    result = _cli(
        "train", "--nproc", "2", "--preset", "nano", "--steps", "8", "--batch-size", "4",
        "--seq-len", "32", "--eval-every", "4", "--eval-batches", "2", "--log-every", "2",
        "--stage", str(stage), "--precision", precision, "--out-dir", str(out),
        "--data-dir", str(tmp_path / "data"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
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


def test_port_in_use(capsys, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = ["train", "--nproc", "2", "--port", str(port), "--out-dir", str(tmp_path)]
        _expect_usage_error(capsys, argv, str(port), "--port")


def test_unknown_config_key(capsys, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('preset = "nano"\nlearning_rate = 0.1\n')
    _expect_usage_error(
        capsys, ["train", "--config", str(config), "--out-dir", str(tmp_path)], "learning_rate"
    )


def test_unknown_precision(capsys, tmp_path):
    argv = ["train", "--precision", "fp8", "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "fp8", "bf16")


@pytest.mark.parametrize("flag", ["--steps", "--seq-len"])
def test_non_positive_numbers(capsys, tmp_path, flag):
    _expect_usage_error(capsys, ["train", flag, "0", "--out-dir", str(tmp_path)], "positive")


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
def test_a_crashed_rank_stops_the_others_with_a_clear_message(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "train", "--nproc", "2", "--preset", "nano"]
    cmd += ["--steps", "100000", "--batch-size", "2", "--seq-len", "16", "--log-every", "1"]
    cmd += ["--out-dir", str(out), "--data-dir", str(tmp_path / "data")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_first_step(proc, out)
        ranks = [p for p in _descendants(proc.pid) if "zeroshard.cli.main" in _cmdline(p)]
        assert len(ranks) >= 2, ranks
        os.kill(ranks[-1], signal.SIGKILL)  # one rank dies mid-training
        _, err = proc.communicate(timeout=90)  # the others must not hang
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert "failed" in last and "the other ranks were stopped" in last, err[-2000:]


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


def test_resume_continues_the_same_curve(tmp_path, capsys):
    # Warm-up longer than the run: the learning rate of a step does not depend on --steps.
    common = ["--nproc", "2", "--preset", "nano", "--batch-size", "4", "--seq-len", "32"]
    common += ["--eval-every", "4", "--eval-batches", "2", "--log-every", "2", "--stage", "3"]
    common += ["--warmup-steps", "10", "--data-dir", str(tmp_path / "data")]
    whole, split = tmp_path / "whole", tmp_path / "split"
    result = _cli("train", *common, "--steps", "8", "--out-dir", str(whole))
    assert result.returncode == 0, result.stderr[-3000:]
    result = _cli(
        "train", *common, "--steps", "4", "--save-every", "2", "--keep", "1",
        "--out-dir", str(split),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (split / "ckpt").iterdir()) == ["step-000004"]
    result = _cli("train", *common, "--steps", "8", "--resume", "auto", "--out-dir", str(split))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {split / 'ckpt' / 'step-000004'} (step 4)" in result.stdout
    assert _final_train_loss(split) == _final_train_loss(whole)
    steps = [
        json.loads(line)["step"] for line in (split / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 2, 4, 4, 6, 8, 8]  # evals at 0, 4, 8; no duplicated records
    assert main(["checkpoint", "info", str(split / "ckpt" / "step-000004"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "complete" in out and "step 4, world size 2, stage 3" in out, out
    assert "param dtype float32" in out and "parameters" in out and "bytes" in out, out


def test_resume_auto_without_checkpoints(capsys, tmp_path):
    argv = ["train", "--resume", "auto", "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "no complete checkpoint", "drop --resume")


def test_resume_from_a_missing_path(capsys, tmp_path):
    argv = ["train", "--resume", str(tmp_path / "nope"), "--out-dir", str(tmp_path)]
    _expect_usage_error(capsys, argv, "nope", "checkpoint folder")


def test_checkpoint_info_of_an_incomplete_save(capsys, tmp_path):
    folder = tmp_path / "step-000010.tmp-1a2b"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"x" * 10)
    assert main(["checkpoint", "info", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "incomplete" in out and "10 bytes" in out, out
    _expect_usage_error(capsys, ["checkpoint", "info", str(tmp_path / "none")], "none")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_the_step_and_stops(tmp_path, sig):
    out, data = tmp_path / "run", str(tmp_path / "data")
    common = ["--nproc", "2", "--preset", "nano", "--batch-size", "2", "--seq-len", "16"]
    common += ["--log-every", "1", "--save-every", "1000", "--data-dir", data]
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "train", *common, "--steps", "100000"]
    proc = subprocess.Popen(
        [*cmd, "--out-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for_first_step(proc, out)
        proc.send_signal(sig)  # to the launcher, which forwards it to the ranks
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    saved = [line for line in stdout.splitlines() if line.startswith("saved step ")]
    assert len(saved) == 1, stdout
    step = int(saved[0].split()[2])
    path = out / "ckpt" / f"step-{step:06d}"
    assert saved[0] == f"saved step {step} to {path}"
    assert main(["checkpoint", "info", str(path), "--verify"]) == 0
    result = _cli(
        "train", *common, "--steps", str(step + 2), "--resume", "auto", "--out-dir", str(out)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {path} (step {step})" in result.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"][-2:] == [step + 1, step + 2]
