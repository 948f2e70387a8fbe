"""Your own training data (``zeroshard train --data PATH``): text or token ids, as training and
validation token arrays that ``zeroshard.data.BatchLoader`` cuts into batches.

Rules (``load_tokens``):

* ``PATH`` ending in ``.npy``: a 1D array of non-negative integer token ids, memory-mapped and used
  as is; the vocabulary is the tokenizer's when one is given, else ``max(id) + 1``.
* A text file: its bytes. A folder: every regular file below it whose name does not start with
  ``.`` (hidden files and folders are skipped), sorted by path relative to the folder, in that
  order.
* Byte-level by default: every byte is a token (vocabulary 256). With ``tokenizer``: each file is
  decoded as UTF-8 (undecodable bytes replaced) and encoded by that Hugging Face tokenizer, which
  must be installed locally (``AutoTokenizer.from_pretrained(name, local_files_only=True)``: a
  name in the Hugging Face cache or a folder); files are joined by its end-of-text token when it
  has one. Every rank tokenizes the text itself: for large corpora save a ``.npy`` once.
* Split: the last ``val_fraction`` of the tokens (a tenth by default) is validation, the rest
  training (nanoGPT's rule); small files therefore need ``2 * seq_len + 1`` tokens in the tenth.
* Dtype: uint8 for bytes, uint16 for vocabularies up to 65,536 tokens, else int32.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BYTE_VOCAB_SIZE = 256


@dataclass(frozen=True, eq=False)
class TokenData:
    """Training and validation tokens of one run."""

    train: np.ndarray  # 1D integer token ids, same on all ranks
    val: np.ndarray  # 1D integer token ids, same on all ranks
    vocab_size: int
    """Number of distinct token ids the model must cover (ids are ``< vocab_size``)."""
    source: str
    """Where the tokens came from, for messages."""

    def fingerprint(self) -> str:
        """What tells these tokens from others, for a resume to compare (``train``): their count,
        vocabulary and a CRC-32 of both splits' ids (whatever dtype holds them), read in windows
        of 2**20 ids: every one up to 2**26 ids, else 64 spread over each split (a large corpus
        costs no full read)."""
        crc, window = 0, 1 << 20
        dtype = _smallest_dtype(self.vocab_size)
        for part in (self.train, self.val):
            if part.size <= 64 * window:
                starts = range(0, part.size, window)
            else:
                starts = np.linspace(0, part.size - window, 64).astype(np.int64).tolist()
            for i in starts:
                crc = zlib.crc32(np.ascontiguousarray(part[i : i + window], dtype=dtype), crc)
        ids = self.train.size + self.val.size
        return f"{ids:,} tokens (vocabulary {self.vocab_size}), CRC-32 {crc:08x}"


MAX_VOCAB_SIZE = 2**24
"""Token ids from a .npy without a tokenizer: the vocabulary is the highest id + 1, so one stray
id past this (16.7M, 64x the largest vocabularies in use) is refused, not an embedding of
billions of rows."""


def text_files(path: Path) -> list[Path]:
    """``path`` itself when it is a file, else the non-hidden regular files below it, sorted
    (named pipes, sockets, devices and dangling links are not text: left out, not read).
    Links to folders are followed as links to files are (a folder of data shards linked in
    was left out without a word); a folder reached twice (a link back up) is read once."""
    if path.is_file():
        return [path]
    found, seen = [], set()
    for folder, dirnames, filenames in os.walk(path, followlinks=True):
        st = os.stat(folder)
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [Path(folder, n) for n in filenames if not n.startswith(".")]
    found = [f for f in found if f.is_file()]
    ids = [f for f in found if _is_npy(f)]
    if ids:
        raise ValueError(
            f"data = {str(path)!r} is a folder of text files but holds token ids "
            f"({ids[0].name}): read as text, their bytes would be the training data; pass the "
            ".npy itself (one file of all the ids), or move it out of the folder"
        )
    return sorted(found, key=lambda p: p.relative_to(path).as_posix())


def _is_npy(path: Path) -> bool:
    return path.suffix.lower() == ".npy"


def check_data_path(path: str | os.PathLike) -> None:
    """A ValueError (one line, with the fix) unless ``path`` is usable as ``--data``."""
    p = Path(path)
    if not p.exists():
        where = "" if p.is_absolute() else f" (from the working directory {Path.cwd()})"
        raise ValueError(
            f"data = {str(path)!r} does not exist{where}; pass a text file, folder or .npy"
        )
    if _is_npy(p) and p.is_file():
        return
    if not p.is_file() and not p.is_dir():  # (it was read as an empty folder)
        raise ValueError(
            f"data = {str(path)!r} is not a regular file or folder (a named pipe, socket or "
            "device): every rank reads the data on its own; write it to a file and pass that"
        )
    if p.is_dir() and not text_files(p):
        raise ValueError(f"data = {str(path)!r} is a folder without files; add text files")


def load_tokenizer(name: str) -> Any:
    """A Hugging Face tokenizer installed locally (never downloaded); a ValueError otherwise."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ValueError(
            f"tokenizer = {name!r} needs transformers ({exc}); pip install transformers, or "
            "drop --tokenizer for byte-level tokens"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as exc:  # OSError, ValueError, ...: transformers' many ways to say "absent"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if os.path.isdir(name):  # (not a name "not installed": transformers' line says little)
            raise ValueError(
                f"tokenizer = {name!r} is a folder without a tokenizer transformers can load "
                "(a tokenizer.json, or a tokenizer_config.json with its vocabulary); pass the "
                "folder a tokenizer was saved to (tokenizer.save_pretrained(folder)), or drop "
                "--tokenizer for byte-level tokens"
            ) from None
        raise ValueError(
            f"tokenizer = {name!r} is not installed locally ({first}); download it once "
            "(e.g. AutoTokenizer.from_pretrained(name).save_pretrained(folder)) and pass the "
            "folder, or drop --tokenizer for byte-level tokens"
        ) from None
    if not tokenizer("hello world", add_special_tokens=False)["input_ids"]:  # no vocabulary
        raise ValueError(  # (a folder of only config.json loads one; the data was then blamed)
            f"tokenizer = {name!r} encodes text to no tokens ({len(tokenizer)} entries): its "
            "vocabulary files are missing; pass a folder a tokenizer was saved to "
            "(tokenizer.save_pretrained(folder)), or drop --tokenizer for byte-level tokens"
        )
    return tokenizer


def _smallest_dtype(vocab_size: int) -> np.dtype:
    if vocab_size <= 2**8:
        return np.dtype(np.uint8)
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def _npy_tokens(path: Path, tokenizer: Any) -> tuple[np.ndarray, int]:
    try:
        ids_N = np.load(path, mmap_mode="r")  # 1D token ids
    except (ValueError, OSError) as exc:
        raise ValueError(f"data = {str(path)!r} is not a readable .npy file ({exc})") from None
    if ids_N.ndim != 1 or ids_N.dtype.kind not in "iu" or ids_N.size == 0:
        raise ValueError(
            f"data = {str(path)!r} holds a {ids_N.dtype} array of shape {ids_N.shape}; a .npy "
            "must hold a non-empty 1D integer array of token ids"
        )
    lowest, highest = int(ids_N.min()), int(ids_N.max())
    if lowest < 0:
        raise ValueError(f"data = {str(path)!r} holds token id {lowest}; ids must be >= 0")
    if tokenizer is None and highest >= MAX_VOCAB_SIZE:
        raise ValueError(
            f"data = {str(path)!r} holds token id {highest}: the model would need a vocabulary "
            f"of {highest + 1:,} (largest known: about 260,000); check the ids, or pass the "
            "--tokenizer that made them"
        )
    # Without a tokenizer the ids are all that is known: a model of highest + 1 entries fits.
    vocab = len(tokenizer) if tokenizer is not None else highest + 1
    if highest >= vocab:
        raise ValueError(
            f"data = {str(path)!r} holds token id {highest}, outside the tokenizer's vocabulary "
            f"of {vocab}; pass the tokenizer that made the ids"
        )
    return ids_N, vocab


def _text_tokens(files: list[Path], tokenizer: Any) -> tuple[np.ndarray, int]:
    if tokenizer is None:
        return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8), 256
    vocab = len(tokenizer)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for i, f in enumerate(files):
        text = f.read_bytes().decode("utf-8", errors="replace")
        ids += (eos if i else []) + list(tokenizer.encode(text, add_special_tokens=False))
    return np.asarray(ids, dtype=_smallest_dtype(vocab)), vocab


def load_tokens(
    path: str | os.PathLike, *, tokenizer: str | None = None, val_fraction: float = 0.1
) -> TokenData:
    """The tokens of ``path`` split into training and validation (rules in the module
    docstring); ``val_fraction`` of the tokens, at the end, are validation."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    check_data_path(path)
    p = Path(path)
    tok = load_tokenizer(tokenizer) if tokenizer else None
    if _is_npy(p) and p.is_file():
        ids_N, vocab = _npy_tokens(p, tok)
    else:
        ids_N, vocab = _text_tokens(text_files(p), tok)
    num_val = int(ids_N.size * val_fraction)
    if num_val < 1 or num_val == ids_N.size:
        raise ValueError(
            f"data = {str(path)!r} gives {ids_N.size} token(s), too few to split off a "
            "validation tenth; pass more text"
        )
    cut = ids_N.size - num_val
    return TokenData(train=ids_N[:cut], val=ids_N[cut:], vocab_size=vocab, source=str(path))
