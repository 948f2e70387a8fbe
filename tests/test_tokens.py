"""Your own data: text files, folders, .npy token ids, and a locally installed tokenizer."""

from __future__ import annotations

import os

import numpy as np
import pytest

from zeroshard.tokens import check_data_path, load_tokenizer, load_tokens


def test_text_file_is_bytes_split_at_the_last_tenth(tmp_path):
    blob = bytes(range(256)) * 4  # 1024 bytes
    (tmp_path / "a.txt").write_bytes(blob)
    data = load_tokens(tmp_path / "a.txt")
    assert data.vocab_size == 256 and data.train.dtype == np.uint8
    assert data.val.size == 102 and data.train.size == 1024 - 102
    assert bytes(data.train) + bytes(data.val) == blob


def test_folder_is_its_visible_files_in_path_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_bytes(b"B" * 50)
    (tmp_path / "a.txt").write_bytes(b"A" * 50)
    (tmp_path / ".hidden").write_bytes(b"H" * 50)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x").write_bytes(b"G" * 50)
    data = load_tokens(tmp_path)
    assert bytes(data.train) + bytes(data.val) == b"A" * 50 + b"B" * 50
    # Not text: a named pipe is left out (reading it would block forever)...
    os.mkfifo(tmp_path / "pipe")
    data = load_tokens(tmp_path)
    assert bytes(data.train) + bytes(data.val) == b"A" * 50 + b"B" * 50
    # ... and token ids are refused (their bytes would be trained on as text), any case.
    with open(tmp_path / "b" / "IDS.NPY", "wb") as f:  # np.save would append ".npy"
        np.save(f, np.arange(100))
    with pytest.raises(ValueError, match="holds token ids \\(IDS.NPY\\)"):
        load_tokens(tmp_path)


def test_a_linked_folder_is_read_once(tmp_path):
    """A link to a folder of shards is read, as a link to a file is (it was left out without
    a word); a link back up does not loop, and no folder is read twice."""
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "s.txt").write_bytes(b"S" * 50)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(b"A" * 50)
    (corpus / "linked").symlink_to(shards)
    (shards / "up").symlink_to(corpus)  # a cycle: corpus/linked/up is corpus again
    data = load_tokens(corpus)
    assert bytes(data.train) + bytes(data.val) == b"A" * 50 + b"S" * 50


def test_npy_token_ids(tmp_path):
    ids = np.arange(3000, dtype=np.int32) % 1000
    np.save(tmp_path / "ids.npy", ids)
    data = load_tokens(tmp_path / "ids.npy")
    assert data.vocab_size == 1000  # max id + 1
    assert np.array_equal(np.concatenate([data.train, data.val]), ids)
    np.save(tmp_path / "bad.npy", np.zeros((4, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="1D integer array"):
        load_tokens(tmp_path / "bad.npy")
    np.save(tmp_path / "neg.npy", np.array([1, -2, 3] * 10))
    with pytest.raises(ValueError, match="token id -2"):
        load_tokens(tmp_path / "neg.npy")
    np.save(tmp_path / "stray.npy", np.array([1, 2_000_000_000, 3] * 10))  # one bad id
    with pytest.raises(ValueError, match="vocabulary of 2,000,000,001"):
        load_tokens(tmp_path / "stray.npy")
    with open(tmp_path / "UPPER.NPY", "wb") as f:
        np.save(f, ids)
    assert load_tokens(tmp_path / "UPPER.NPY").vocab_size == 1000
    np.save(tmp_path / "small.npy", ids % 100)  # below 256 too (it gave 256: too large a model)
    assert load_tokens(tmp_path / "small.npy").vocab_size == 100


def _local_tokenizer(folder):
    """A word-level tokenizer saved as a transformers folder (no download)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["<eos>", "<unk>", "the", "cat", "sat", "on", "mat"]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)
    return folder


def test_tokenizer_installed_locally(tmp_path):
    folder = _local_tokenizer(tmp_path / "tok")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "1.txt").write_text("the cat sat on the mat " * 10)
    (tmp_path / "d" / "2.txt").write_text("the dog " * 5)
    data = load_tokens(tmp_path / "d", tokenizer=str(folder))
    assert data.vocab_size == 7 and data.train.dtype == np.uint8
    ids = np.concatenate([data.train, data.val]).tolist()
    # File 1's 60 words, <eos> between files, then file 2: "the" and unknown "dog".
    assert ids == [2, 3, 4, 5, 2, 6] * 10 + [0] + [2, 1] * 5


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="not installed locally.*drop --tokenizer"):
        load_tokenizer(str(tmp_path / "no-such-tokenizer"))
    (tmp_path / "config-only").mkdir()  # transformers loads a tokenizer of no vocabulary
    (tmp_path / "config-only" / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="encodes text to no tokens .* vocabulary files"):
        load_tokenizer(str(tmp_path / "config-only"))
    (tmp_path / "empty").mkdir()  # a folder: said to hold no tokenizer, not "not installed"
    with pytest.raises(ValueError, match="is a folder without a tokenizer.*save_pretrained"):
        load_tokenizer(str(tmp_path / "empty"))


def test_a_named_pipe_is_not_data(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # was called "a folder without files"
    with pytest.raises(ValueError, match="is not a regular file or folder .a named pipe"):
        check_data_path(tmp_path / "fifo")


def test_too_little_data(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"abc")
    with pytest.raises(ValueError, match="too few to split off a validation tenth"):
        load_tokens(tmp_path / "t.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="folder without files"):
        load_tokens(tmp_path / "empty")
