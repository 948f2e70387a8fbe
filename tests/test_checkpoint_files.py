"""A checkpoint folder's life on disk without a process group: publishing and pruning cut
short at any moment leave every complete checkpoint whole under a name that ``latest`` and
``load`` understand, and the next save's prune removes what is left over."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from unittest import mock

import pytest
import xxhash

from zeroshard import checkpoint
from zeroshard.checkpoint_files import (
    GONE,
    LEGACY_RUN,
    META_FILE,
    OLD,
    TMP,
    CheckpointError,
    hash_with_chunks,
    prune,
    publish,
    replace_problem,
)
from zeroshard.checkpoint_info import FORMAT_VERSION, read_meta

RUN = "0123456789abcdef"


def _complete(folder: Path, step: int, run: str | None = RUN) -> Path:
    """A complete checkpoint of ``run`` as ``info`` sees one: metadata listing one data file."""
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x" * step)
    meta = {"format_version": FORMAT_VERSION, "step": step, "run_id": run}
    meta["files"] = {"__0_0.distcp": {"bytes": step, "xxh3_64": "unchecked"}}
    (folder / META_FILE).write_text(json.dumps(meta))
    return folder


def test_a_save_stopped_between_its_renames_keeps_the_replaced_checkpoint_found(tmp_path):
    _complete(tmp_path / "step-000001", 1)
    target = _complete(tmp_path / "step-000002", 2)
    tmp = _complete(tmp_path / f"step-000002{TMP}{RUN[:8]}abcd", 2)
    real = os.replace

    def the_first_only(src, dst):  # the process dies after the first rename
        if not (tmp_path / f"step-000002{OLD}{RUN[:8]}abcd").exists():
            return real(src, dst)
        raise KeyboardInterrupt

    with mock.patch("os.replace", the_first_only), pytest.raises(KeyboardInterrupt):
        publish(tmp, target)
    aside = tmp_path / f"step-000002{OLD}{RUN[:8]}abcd"
    assert not target.exists() and aside.is_dir()
    assert checkpoint.latest(tmp_path) == aside  # not step 1
    assert checkpoint.info(aside).step == 2
    # The run goes on from it; its next save prunes the replaced one with the others.
    prune(_complete(tmp_path / "step-000003", 3), keep=1, run_id=RUN)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003"]


def test_a_rename_that_failed_puts_the_replaced_checkpoint_back(tmp_path):
    target = _complete(tmp_path / "step-000002", 2)
    tmp = _complete(tmp_path / f"step-000002{TMP}{RUN[:8]}abcd", 3)
    real = os.replace

    def refused(src, dst):
        if Path(src) == tmp:
            raise PermissionError(13, "Permission denied", str(src))
        return real(src, dst)

    with mock.patch("os.replace", refused), pytest.raises(PermissionError):
        publish(tmp, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, tmp.name])
    assert checkpoint.info(target).step == 2


def test_the_replaced_checkpoint_left_beside_its_replacement_is_removed(tmp_path):
    new = _complete(tmp_path / "step-000002", 2)
    _complete(tmp_path / f"step-000002{OLD}abcd", 1)  # the save stopped before removing it
    assert checkpoint.latest(tmp_path) == new
    prune(new, keep=3, run_id=RUN)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]


def test_a_prune_cut_short_leaves_no_half_checkpoint_under_its_name(tmp_path):
    for step in (1, 2, 3):
        _complete(tmp_path / f"step-00000{step}", step)

    def cut_short(path, *args, **kwargs):  # deletes the metadata, then the process dies
        (Path(path) / META_FILE).unlink()
        raise KeyboardInterrupt

    with mock.patch.object(shutil, "rmtree", cut_short), pytest.raises(KeyboardInterrupt):
        prune(tmp_path / "step-000003", keep=1, run_id=RUN)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0].startswith("step-000001" + GONE) and names[1:] == ["step-000002", "step-000003"]
    assert checkpoint.latest(tmp_path) == tmp_path / "step-000003"
    prune(_complete(tmp_path / "step-000004", 4), keep=2, run_id=RUN)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]


def test_a_replaced_checkpoint_cut_short_in_its_removal_is_not_a_checkpoint(tmp_path):
    """``step-N.old-X`` renamed ``.gone-`` by a prune that was then killed: being removed, it is
    neither found nor kept (it counted as a replaced checkpoint)."""
    _complete(tmp_path / "step-000001", 1)
    _complete(tmp_path / f"step-000009{OLD}ab{GONE}cd", 9)
    assert checkpoint.latest(tmp_path) == tmp_path / "step-000001"
    prune(_complete(tmp_path / "step-000002", 2), keep=2, run_id=RUN)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002"]


def test_prune_keeps_other_series_and_logs_what_it_removes(tmp_path, caplog):
    """``keep`` counts the checkpoints of one name with its number stripped: ``best-epoch2``
    never removes ``epoch*``, and each removal is logged."""
    for n in range(1, 4):
        _complete(tmp_path / f"epoch{n}", n)
    best = _complete(tmp_path / "best-epoch2", 2)
    with caplog.at_level("INFO", logger="zeroshard.checkpoint_files"):
        prune(best, keep=1, run_id=RUN)
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "best-epoch2", "epoch1", "epoch2", "epoch3"
        ]  # fmt: skip
        prune(tmp_path / "epoch3", keep=2, run_id=RUN)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-epoch2", "epoch2", "epoch3"]
    assert [r.getMessage() for r in caplog.records] == [
        f"removing checkpoint {tmp_path / 'epoch1'}: keep=2 keeps the newest of epoch*"
    ]


def test_prune_keeps_the_checkpoints_of_other_runs(tmp_path, caplog):
    """``seed1`` ... ``seed4``: one prefix, four runs; a run's ``keep`` counts its own only
    (one saved before runs were recorded is kept too)."""
    for n in range(1, 4):
        _complete(tmp_path / f"seed{n}", 100, run=f"run{n}")
    _complete(tmp_path / "seed0", 100, run=None)
    mine = [_complete(tmp_path / f"seed{n}", 100) for n in (4, 5, 6)]
    (tmp_path / f"seed7{TMP}run2abcd").mkdir()  # another run's save in flight
    (tmp_path / f"seed7{TMP}{RUN[:8]}abcd").mkdir()  # this run's, left by a killed save
    with caplog.at_level("INFO", logger="zeroshard.checkpoint_files"):
        prune(mine[-1], keep=1, run_id=RUN)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["seed0", "seed1", "seed2", "seed3", "seed6", f"seed7{TMP}run2abcd"]
    assert "4 of other runs kept (seed0, seed1, seed2)" in caplog.text
    # A run resumed from a checkpoint saved before runs were recorded continues that run.
    prune(_complete(tmp_path / "seed9", 100, run=LEGACY_RUN), keep=1, run_id=LEGACY_RUN)
    assert not (tmp_path / "seed0").exists() and (tmp_path / "seed1").exists()


def test_a_damaged_checkpoint_takes_no_place_among_those_kept(tmp_path):
    """A run resumed below a damaged checkpoint (``step-000012``, a file cut short, which
    ``latest`` passes over) keeps the newest ``keep`` complete ones: the damaged one counted
    as complete, and each later save removed a good one (keep=3 left 2 loadable)."""
    for step in (4, 8, 12):
        _complete(tmp_path / f"step-{step:06d}", step)
    os.truncate(tmp_path / "step-000012" / "__0_0.distcp", 3)
    assert checkpoint.latest(tmp_path) == tmp_path / "step-000008"
    for step in (9, 10):
        prune(_complete(tmp_path / f"step-{step:06d}", step), keep=3, run_id=RUN)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-000008", "step-000009", "step-000010", "step-000012"]
    # Older than every kept one, a damaged checkpoint goes with the rest.
    os.truncate(tmp_path / "step-000008" / "__0_0.distcp", 3)
    prune(_complete(tmp_path / "step-000011", 11), keep=2, run_id=RUN)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-000010", "step-000011", "step-000012"]


def test_a_file_on_the_way_to_the_path_is_named(tmp_path):
    (tmp_path / "afile").write_text("mine")
    said = replace_problem(tmp_path / "afile" / "sub" / "step-1")
    assert said.startswith(f"{tmp_path / 'afile'} is a file, and the checkpoint"), said


def test_a_folder_of_other_files_is_not_called_an_incomplete_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"is not a zeroshard checkpoint \(none of a"):
        read_meta(tmp_path)
    (tmp_path / "rank-00000.pt").write_bytes(b"x")  # a save that stopped before its metadata
    with pytest.raises(CheckpointError, match=r"is incomplete \(no zeroshard.json"):
        read_meta(tmp_path)


@pytest.mark.parametrize("read_bytes", [1000, 2**20, 64 * 2**20])
def test_chunk_checksums_in_one_pass_equal_each_chunk_s_own(tmp_path, monkeypatch, read_bytes):
    """The file's checksum and each chunk's (gaps between them, empty ones, chunks spanning
    several reads or inside one) from a single pass, whatever the read size."""
    from zeroshard import checkpoint_files

    monkeypatch.setattr(checkpoint_files, "_CHUNK_BYTES", read_bytes)
    rng = random.Random(0)
    data = rng.randbytes(3 * 2**20 + 12_345)
    (tmp_path / "f").write_bytes(data)
    bounds, pos = [], 0
    while True:
        gap, n = rng.randint(0, 5000), rng.choice([0, 7, rng.randint(1, 300_000)])
        if pos + gap + n > len(data):
            break
        bounds.append((pos + gap, n))
        pos += gap + n
    whole, parts = hash_with_chunks(tmp_path / "f", bounds)
    assert whole == xxhash.xxh3_64(data).hexdigest()
    assert parts == [xxhash.xxh3_64(data[o : o + n]).hexdigest() for o, n in bounds]
