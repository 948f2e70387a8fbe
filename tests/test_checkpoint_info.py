"""``zeroshard.checkpoint_info``: what a checkpoint folder holds, and one line for what is wrong
with it (single process; whole checkpoints are tested in ``test_checkpoint.py``)."""

from __future__ import annotations

import json

import pytest

from zeroshard import checkpoint_info
from zeroshard.checkpoint_info import FORMAT_VERSION, META_FILE


@pytest.mark.parametrize("entry", [{"xxh3_64": "0"}, 5, {"bytes": "12", "xxh3_64": "0"}])
def test_a_file_list_without_sizes_is_a_damaged_metadata_file(tmp_path, entry):
    # Valid JSON whose list of files lacks a size: KeyError / TypeError tracebacks out of info().
    meta = {"format_version": FORMAT_VERSION, "files": {"rank-00000.pt": entry}}
    (tmp_path / META_FILE).write_text(json.dumps(meta))
    found = checkpoint_info.info(tmp_path)
    assert not found.complete
    assert f"{META_FILE} is damaged (the entry of rank-00000.pt has no size" in found.problem
    with pytest.raises(checkpoint_info.CheckpointError, match="is damaged"):
        checkpoint_info.verify(tmp_path)


def test_info_on_a_checkpoint_left_under_its_old_name_says_to_rename_it(tmp_path):
    # A save stopped while replacing step-000002: info said only "no checkpoint folder at".
    (tmp_path / "step-000002.old-1234abcd").mkdir()
    with pytest.raises(FileNotFoundError, match=r"step-000002\.old-1234abcd holds the one a save"):
        checkpoint_info.info(tmp_path / "step-000002")
    with pytest.raises(FileNotFoundError, match="no checkpoint folder at"):
        checkpoint_info.info(tmp_path / "nowhere")
