"""The progress display off a terminal, and the metrics sinks (metrics.jsonl, TensorBoard)."""

from __future__ import annotations

import importlib.util
import io
import json
import math

import pytest

import zeroshard.run_log as run_log
from zeroshard.run_log import MetricsLog, Progress


def test_progress_off_a_terminal_is_plain_lines_at_an_interval(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(run_log.time, "monotonic", lambda: clock[0])
    stream = io.StringIO()  # not a terminal
    bar = Progress(total=10, initial=0, desc="stage 3 x2", enabled=True, every_s=5, stream=stream)
    for _ in range(10):
        clock[0] += 2.0  # a step every 2 s: a line every third step (>= 5 s apart)
        bar.set_postfix(loss="1.234")
        bar.update(1)
    bar.close()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines == [
        "stage 3 x2: step 3/10 (30%) loss 1.234 [6 s]",
        "stage 3 x2: step 6/10 (60%) loss 1.234 [12 s]",
        "stage 3 x2: step 9/10 (90%) loss 1.234 [18 s]",
        "stage 3 x2: step 10/10 (100%) loss 1.234 [20 s]",  # the end, once
    ]


def test_progress_disabled_on_other_ranks():
    stream = io.StringIO()
    bar = Progress(total=3, initial=0, desc="x", enabled=False, every_s=0, stream=stream)
    bar.update(3)
    bar.close()
    assert stream.getvalue() == ""


class _FakeWriter:
    """Stands in for torch.utils.tensorboard.SummaryWriter (tensorboard may not be installed)."""

    def __init__(self, folder, purge_step=None):
        self.folder, self.scalars, self.closed = folder, [], False
        self.purge_step = purge_step

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        self.closed = True


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path, monkeypatch):
    monkeypatch.setattr(run_log, "_summary_writer", _FakeWriter)
    kept = [{"kind": "eval", "step": 0, "val_loss": 5.0}]  # from a resumed run
    log = MetricsLog(tmp_path, kept, write=True, tensorboard=True)
    log({"kind": "train", "step": 10, "loss": 4.0, "lr": 0.1, "grad_norm": None, "m": [1, 2]})
    log({"kind": "eval", "step": 10, "val_loss": 4.5})
    log({"kind": "train", "step": 11, "loss": float("nan"), "time": 1.7e9})  # a skipped step
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    lines = [json.loads(line, parse_constant=pytest.fail) for line in text.splitlines()]
    assert [r["step"] for r in lines] == [0, 10, 10, 11] and lines[1]["loss"] == 4.0
    assert lines[3]["loss"] is None  # strict JSON: null, not NaN
    assert log.writer.folder == tmp_path / "tensorboard" and log.writer.closed
    assert log.writer.purge_step == 1  # steps past the resumed records are dropped
    assert log.writer.scalars[:3] == [
        ("train/loss", 4.0, 10), ("train/lr", 0.1, 10), ("eval/val_loss", 4.5, 10)
    ]  # fmt: skip
    ((tag, value, step),) = log.writer.scalars[3:]  # no "time": TensorBoard keeps its own
    assert (tag, step) == ("train/loss", 11) and math.isnan(value)
    other_rank = MetricsLog(tmp_path / "none", [], write=False, tensorboard=True)
    other_rank({"kind": "eval", "step": 0, "val_loss": 1.0})
    assert other_rank.writer is None and not (tmp_path / "none").exists()


@pytest.mark.skipif(
    not importlib.util.find_spec("tensorboard"), reason="needs tensorboard (.[log])"
)
def test_tensorboard_event_files_hold_the_metrics(tmp_path):
    """The real SummaryWriter: its event files, read back by tensorboard, hold the scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path, [], write=True, tensorboard=True)
    log({"kind": "train", "step": 10, "loss": 4.0, "lr": 0.5, "grad_norm": None})
    log({"kind": "train", "step": 20, "loss": 3.5, "lr": 0.25, "grad_norm": 1.5})
    log({"kind": "eval", "step": 20, "val_loss": 3.75})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = {
        tag: [(s.step, s.value) for s in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    assert scalars["train/loss"] == [(10, 4.0), (20, 3.5)]
    assert scalars["train/lr"] == [(10, 0.5), (20, 0.25)]
    assert scalars["eval/val_loss"] == [(20, 3.75)]
    # A fresh run into the same folder: TensorBoard shows it alone, as metrics.jsonl does (it
    # kept the first run's points beside the second's).
    log = MetricsLog(tmp_path, [], write=True, tensorboard=True)
    log({"kind": "train", "step": 5, "loss": 2.0, "lr": 0.5, "grad_norm": None})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("train/loss")] == [(5, 2.0)]


def test_a_full_disk_names_the_file_and_leaves_the_summary_whole(tmp_path, monkeypatch):
    # A buffered write to a full disk said only "No space left on device", and summary.json
    # was left empty (written in place).
    import errno
    from pathlib import Path

    log = MetricsLog(tmp_path, [], write=True, tensorboard=False)
    summary = tmp_path / "summary.json"
    run_log.write_atomically(summary, '{"status": "done"}\n')

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    monkeypatch.setattr(Path, "open", full)
    with pytest.raises(OSError, match=r"No space left on device: '.*metrics.jsonl'"):
        log({"kind": "train", "step": 0, "loss": 1.0})
    with pytest.raises(OSError, match=r"No space left on device: '.*summary.json'"):
        run_log.write_atomically(summary, '{"status": "failed"}\n')
    monkeypatch.undo()
    assert json.loads(summary.read_text()) == {"status": "done"}
