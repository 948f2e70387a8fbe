"""zeroshard.checkpoint_reader.Reader in one process (no process group): whole chunks read into
the destination, ranges of chunks (resharding), dtype changes, bytes entries, several threads
and read sizes; checksums verified from the bytes read (a flipped byte, a short file, a missing
file: each a CheckpointError naming the file); which rank verifies which file."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlan

from zeroshard import checkpoint_reader
from zeroshard.checkpoint_files import CheckpointError, data_files, file_record
from zeroshard.checkpoint_planner import LoadPlanner
from zeroshard.checkpoint_reader import Reader, read
from zeroshard.flat_range import FlatRange

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _saved(path: Path) -> tuple[dict, dict]:
    """A DCP checkpoint at ``path`` (several data files) and its ``{name: {bytes, xxh3_64}}``."""
    gen = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(64, 33, generator=gen),  # 8 KiB: read straight into the destination
        "h": torch.randn(1000, generator=gen).to(torch.bfloat16),
        "i": torch.arange(7, dtype=torch.int64),  # smaller than a chunk's first read
        "big": torch.randn(3, 40_000, generator=gen),
        "e": torch.empty(0, 5),
        "n": {"step": 3, "name": "x"},  # bytes entries
    }
    saved = dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=2))
    files = {n: file_record(path, n, saved.storage_data) for n in data_files(path)}
    return state, files


def _fresh(state: dict) -> dict:
    out = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    out["n"] = {"step": 0, "name": ""}
    return out


@pytest.mark.parametrize("threads,chunk", [(1, 64 * 2**20), (4, 64 * 2**20), (3, 1000)])
def test_reads_every_entry_with_threads_and_read_sizes(tmp_path, monkeypatch, threads, chunk):
    monkeypatch.setattr(checkpoint_reader, "_CHUNK_BYTES", chunk)
    direct, slow = [], []
    into = checkpoint_reader._File._direct
    monkeypatch.setattr(
        checkpoint_reader._File, "_direct", lambda *a: direct.append(into(*a)) or direct[-1]
    )
    layout = checkpoint_reader._layout  # None: torch.load's fallback
    monkeypatch.setattr(
        checkpoint_reader, "_layout", lambda *a: slow.append(layout(*a) is None) or layout(*a)
    )
    state, files = _saved(tmp_path / "c")
    assert len([n for n in files if n.endswith(".distcp")]) == 2
    for verify in (files, None):
        got = _fresh(state)
        read(got, Reader(tmp_path / "c", verify, threads=threads), DefaultLoadPlanner(), None)
        for k, v in state.items():
            assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
    assert direct == [True] * 4 and not any(slow)  # w and big, twice: into the destination


def test_reads_ranges_and_converts_dtypes(tmp_path):
    """FlatRange entries want parts of the saved chunks (as a resharded load does); a float64
    destination gets the float32 values converted."""
    state, files = _saved(tmp_path / "c")
    w, big = state["w"].flatten(), state["big"].flatten()
    got = {
        "w": FlatRange(state["w"].shape, torch.float32, 100, torch.zeros(1000)),
        "big": FlatRange(state["big"].shape, torch.float32, 39_990, torch.zeros(50_000)),
        "h": torch.zeros(1000, dtype=torch.float64),
    }
    read(got, Reader(tmp_path / "c", files), LoadPlanner(), None)
    assert torch.equal(got["w"].data, w[100:1100])
    assert torch.equal(got["big"].data, big[39_990:89_990])
    assert torch.equal(got["h"], state["h"].double())


def _damage(path: Path, how: str, at: int, length: int) -> None:
    """Damage the chunk at ``at`` (``length`` bytes) of the file at ``path``."""
    raw = bytearray(path.read_bytes())
    if how == "flip":
        raw[at + length // 2] ^= 0x01
    elif how == "header":  # a global's name in the chunk's pickle: it no longer parses
        raw[raw.index(b"_rebuild_tensor_v2", at)] ^= 0x01
    elif how == "short":
        del raw[at + length // 2 :]
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["flip", "header", "short"])
def test_a_damaged_file_is_named(tmp_path, how):
    """With the tensors the damage reaches: the chunk's own (a flipped byte: by the chunks'
    checksums), and every one stored past the cut of a file cut short."""
    state, files = _saved(tmp_path / "c")
    storage = Reader(tmp_path / "c").read_metadata().storage_data
    info = next(v for k, v in storage.items() if k.fqn == "w")
    victim = info.relative_path
    _damage(tmp_path / "c" / victim, how, info.offset, info.length)
    cut = [  # (a file cut short: w and the ones after it in that file)
        k.fqn
        for k, v in sorted(storage.items(), key=lambda kv: kv[1].offset)
        if v.relative_path == victim and v.offset >= info.offset
    ]
    more = f" and {len(cut) - 3} more" if len(cut) > 3 else ""
    named = (
        "tensor 'w'"
        if how != "short" or len(cut) == 1
        else re.escape("tensors " + ", ".join(repr(n) for n in cut[:3]) + more)
    )
    # The fix, named: a run refuses to resume from an earlier one while this one lies beside it.
    fix = f"move c out of {tmp_path} \\(e.g. to c-damaged\\), then use the one before"
    with pytest.raises(
        CheckpointError, match=rf"{victim} is corrupted .*; damaged: {named}\); use another .*{fix}"
    ):
        read(_fresh(state), Reader(tmp_path / "c", files), DefaultLoadPlanner(), None)
    if how == "short":  # unverified: the short read itself is caught
        with pytest.raises(CheckpointError, match=rf"{victim} is corrupted"):
            read(_fresh(state), Reader(tmp_path / "c"), DefaultLoadPlanner(), None)


def test_a_missing_or_damaged_unread_file_is_named(tmp_path):
    state, files = _saved(tmp_path / "c")
    files["extra.pt"] = {"bytes": 4, "xxh3_64": "0"}  # listed, never read by DCP
    with pytest.raises(CheckpointError, match=r"lacks its file extra\.pt"):
        read(_fresh(state), Reader(tmp_path / "c", files), DefaultLoadPlanner(), None)
    (tmp_path / "c" / "extra.pt").write_bytes(b"abcd")
    with pytest.raises(CheckpointError, match=r"extra\.pt is corrupted"):
        read(_fresh(state), Reader(tmp_path / "c", files), DefaultLoadPlanner(), None)


def test_each_file_is_verified_by_the_rank_reading_most_of_it(tmp_path):
    sizes = {"a": 100, "b": 100, "c": 50, "d": 10, "e": 10}
    reader = Reader(tmp_path, {n: {"bytes": b, "xxh3_64": ""} for n, b in sizes.items()})
    reader.storage_data = {
        i: _StorageInfo(name, 0, length)
        for i, (name, length) in enumerate([("a", 60), ("a", 40), ("b", 100), ("c", 50)])
    }
    item = types.SimpleNamespace
    plans = [
        LoadPlan([item(storage_index=0), item(storage_index=2)]),  # a: 60, b: 100
        LoadPlan([item(storage_index=1), item(storage_index=3)]),  # a: 40, c: 50
    ]
    mine = [p.storage_data for p in reader.prepare_global_plan(plans)]
    assert mine == [["a", "b"], ["c", "d", "e"]]
    assert Reader(tmp_path).prepare_global_plan(plans) == plans  # nothing to verify
