"""Real training data with no download: a byte-level corpus of the Python standard library.

Every Python installation carries its standard library as ``.py`` source, so the reference
training loop (``zeroshard train``) can train a byte-level language model (vocab 256) on real
text anywhere, offline, with nothing fetched.

Corpus rules (``Corpus.build``):

* Source: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, walked recursively,
  skipping ``site-packages``, ``dist-packages`` and ``__pycache__`` folders. Test suites
  (``test/``, ``idlelib/idle_test/``, ``lib2to3/tests/``) are included: they are about half the
  standard library's source and are ordinary Python. Distributions that strip them simply give a
  smaller corpus (with its own cache key).
* Order: files sorted by their path relative to the stdlib folder (``/``-separated), so the
  corpus is the same on every run of a given Python installation.
* Cap: the files are concatenated, in that order, byte for byte (no separator), and the stream is
  cut at ``max_bytes``; the last file kept may be cut short.
* Split: by file. File number ``i`` of the sorted list (counting from 0) goes to validation when
  ``i % val_every == val_every - 1``, every other file to training. With the default
  ``val_every=20`` about 5% of the bytes are validation. Splitting by file keeps validation
  windows from straddling training text and spreads validation over the whole library.
* Cache: ``<cache_dir>/corpus-py<X.Y.Z>-<key>/`` holding ``train.npy`` and ``val.npy`` (1D
  uint8) and ``meta.json``, where ``cache_dir`` defaults to ``~/.cache/zeroshard`` and ``key``
  hashes the kept files' relative paths and sizes, ``max_bytes``, ``val_every`` and the format
  version. Each file is written to a temporary name in the same folder and renamed with
  ``os.replace``, so a rank never reads a half-written file; ``meta.json`` is written last and
  marks the folder complete. Two ranks that build at once write identical bytes. Arrays are loaded
  with ``np.load(mmap_mode="r")``, so every rank shares the page cache instead of a copy.

Batch rules (``BatchLoader``): see its docstring. In short, the global batch at step ``s`` is drawn
from ``numpy.random.default_rng([seed, s])`` as ``W * B`` distinct windows of ``seq_len + 1``
bytes, and rank ``r`` takes rows ``[r * B, (r + 1) * B)``. So the global batch of ``W`` ranks equals
the batch of one process with ``batch_size = W * B``, which is what parity tests compare.

Shape legend: ``B`` per-rank batch (sequences), ``T`` sequence length (bytes), ``N`` tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, ClassVar

import numpy as np
import torch

# Bump when the corpus rules above change, so old caches are not reused.
FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 32 * 2**20
DEFAULT_VAL_EVERY = 20
# Folders under the stdlib folder that are not the standard library itself.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def default_cache_dir() -> Path:
    """``~/.cache/zeroshard``: the folder under which each corpus gets its own sub-folder."""
    return Path.home() / ".cache" / "zeroshard"


def stdlib_sources(stdlib_dir: Path | None = None) -> list[tuple[str, int]]:
    """The standard library's ``.py`` files as ``(relative path, size in bytes)``, sorted by path.

    ``stdlib_dir`` defaults to ``sysconfig.get_paths()["stdlib"]``; ``site-packages``,
    ``dist-packages`` and ``__pycache__`` folders are skipped.
    """
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    sources: list[tuple[str, int]] = []
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(folder, name)
                sources.append((path.relative_to(root).as_posix(), path.stat().st_size))
    sources.sort()
    return sources


def _keep_until(sources: list[tuple[str, int]], max_bytes: int) -> list[tuple[str, int]]:
    """The leading files of ``sources`` whose bytes reach into the first ``max_bytes``."""
    kept, total_bytes = [], 0
    for rel, size_bytes in sources:
        if total_bytes >= max_bytes:
            break
        kept.append((rel, size_bytes))
        total_bytes += size_bytes
    return kept


def _read_corpus(
    root: Path, kept: list[tuple[str, int]], *, max_bytes: int, val_every: int
) -> tuple[np.ndarray, np.ndarray]:
    """Reads ``kept`` files in order and returns ``(train_N, val_N)`` uint8 arrays.

    The stream is cut at ``max_bytes``; file ``i`` goes to validation when
    ``i % val_every == val_every - 1``.
    """
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    left_bytes = max_bytes
    for i, (rel, _) in enumerate(kept):
        data = (root / rel).read_bytes()[:left_bytes]
        left_bytes -= len(data)
        (val_parts if i % val_every == val_every - 1 else train_parts).append(data)
        if left_bytes <= 0:
            break
    train_N = np.frombuffer(b"".join(train_parts), dtype=np.uint8)  # 1D, bytes
    val_N = np.frombuffer(b"".join(val_parts), dtype=np.uint8)  # 1D, bytes
    return train_N, val_N


def _write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Writes ``path`` through ``write(file)`` into a temporary file, then ``os.replace``.

    A reader sees either no file or the complete one, never a partial write; on any error the
    temporary file is removed.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@dataclass(frozen=True, eq=False)
class Corpus:
    """A byte-level corpus: the standard library's Python source split into train and validation.

    Build it with ``Corpus.build``; the rules are in this module's docstring.
    """

    train: np.ndarray  # 1D uint8, bytes; read-only memory map, same on all ranks
    val: np.ndarray  # 1D uint8, bytes; read-only memory map, same on all ranks
    path: Path
    """The cache folder holding ``train.npy``, ``val.npy`` and ``meta.json``."""
    vocab_size: ClassVar[int] = 256

    @classmethod
    def build(
        cls,
        *,
        cache_dir: str | os.PathLike | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        val_every: int = DEFAULT_VAL_EVERY,
    ) -> Corpus:
        """Loads the corpus from its cache folder, building it there first if it is missing.

        Args:
            cache_dir: folder under which ``corpus-py<version>-<key>/`` is made; defaults to
                ``~/.cache/zeroshard`` (the CLI passes ``--data-dir``).
            max_bytes: cap on the corpus size in bytes (train + validation); the first
                ``max_bytes`` of the sorted, concatenated files are kept.
            val_every: every ``val_every``-th file goes to validation (about ``1 / val_every``
                of the bytes).
        """
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(
                f"max_bytes must be a positive number of bytes, got {max_bytes!r}; "
                f"pass e.g. max_bytes={DEFAULT_MAX_BYTES} (32 MiB)"
            )
        if isinstance(val_every, bool) or not isinstance(val_every, int) or val_every < 2:
            raise ValueError(
                f"val_every must be an int >= 2 (every val_every-th file is validation), "
                f"got {val_every!r}; pass e.g. val_every={DEFAULT_VAL_EVERY} for about 5%"
            )
        root = Path(sysconfig.get_paths()["stdlib"])
        kept = _keep_until(stdlib_sources(root), max_bytes)
        key = hashlib.sha256(
            json.dumps([FORMAT_VERSION, max_bytes, val_every, kept]).encode()
        ).hexdigest()[:16]
        version = ".".join(str(v) for v in sys.version_info[:3])
        base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        path = base / f"corpus-py{version}-{key}"
        if not (path / "meta.json").is_file():
            cls._build_into(path, root, kept, max_bytes=max_bytes, val_every=val_every)
        return cls(
            train=np.load(path / "train.npy", mmap_mode="r"),
            val=np.load(path / "val.npy", mmap_mode="r"),
            path=path,
        )

    @staticmethod
    def _build_into(
        path: Path, root: Path, kept: list[tuple[str, int]], *, max_bytes: int, val_every: int
    ) -> None:
        """Reads the files and writes ``train.npy``, ``val.npy``, then ``meta.json``, atomically."""
        try:
            path.mkdir(parents=True, exist_ok=True)
            # Probe before reading 30 MiB, so an unwritable folder fails fast and clearly.
            # One probe name per process and thread: ranks (or threads) building the same
            # cache at once must not remove each other's probe.
            probe = path / f".probe-{os.getpid()}-{threading.get_ident()}"
            _write_atomic(probe, lambda f: None)
            os.unlink(probe)
        except OSError as exc:
            raise ValueError(
                f"cannot write the corpus cache folder {path} ({exc.strerror or exc}); "
                f"pass a writable cache_dir (--data-dir on the command line)"
            ) from exc
        train_N, val_N = _read_corpus(root, kept, max_bytes=max_bytes, val_every=val_every)
        if train_N.size == 0 or val_N.size == 0:
            raise ValueError(
                f"max_bytes={max_bytes} keeps {len(kept)} file(s) of the standard library in "
                f"{root}, giving {train_N.size} training and {val_N.size} validation bytes; "
                f"raise max_bytes or lower val_every so both splits get a file"
            )
        meta = {
            "format_version": FORMAT_VERSION,
            "python": sys.version,
            "stdlib": str(root),
            "max_bytes": max_bytes,
            "val_every": val_every,
            "train_bytes": int(train_N.size),
            "val_bytes": int(val_N.size),
            "files": [rel for rel, _ in kept],
        }
        _write_atomic(path / "train.npy", lambda f: np.save(f, train_N))
        _write_atomic(path / "val.npy", lambda f: np.save(f, val_N))
        # Written last: its presence marks a complete folder.
        _write_atomic(path / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))


def _check_positive_int(name: str, value: object, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}; pass e.g. {example}")


class BatchLoader:
    """Seeded, resumable batches of token windows, disjoint across data-parallel ranks.

    The token array is cut into ``num_windows`` non-overlapping windows of ``seq_len + 1`` tokens,
    all shifted by one offset in ``[0, seq_len]`` drawn per step (so window boundaries differ
    between steps). At step ``s`` a generator ``numpy.random.default_rng([seed, s])`` draws the
    shift and then ``world_size * batch_size`` distinct windows without replacement: the global
    batch. Rank ``r`` takes rows ``[r * batch_size, (r + 1) * batch_size)``.

    Consequences, which tests check:

    * Each step depends only on ``(seed, step)``: ``batch(s)`` is the same whenever it is called,
      so resuming at step ``s`` needs no saved loader state.
    * Within one step no two rows, on any ranks, share a byte of input.
    * The concatenation over ranks of ``batch(s)`` equals ``batch(s)`` of a single-process loader
      with ``batch_size = world_size * batch_size`` and the same seed.

    Args:
        tokens_N: 1D integer token array, e.g. ``Corpus.train`` (uint8 bytes) or
            ``zeroshard.tokens.TokenData.train`` (a memory map is fine).
        batch_size: sequences per rank per step (``B``).
        seq_len: input length in tokens (``T``); each window holds ``T + 1`` tokens.
        rank: this rank's index in the data-parallel group, ``0 <= rank < world_size``.
        world_size: number of data-parallel ranks (``W``).
        seed: non-negative int; different seeds give different batches.
    """

    def __init__(
        self,
        tokens_N: np.ndarray,
        *,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        if (
            not isinstance(tokens_N, np.ndarray)
            or tokens_N.ndim != 1
            or tokens_N.dtype.kind not in "iu"
        ):
            raise TypeError(
                "tokens_N must be a 1D numpy integer array of token ids (e.g. Corpus.train), got "
                f"{type(tokens_N).__name__} {getattr(tokens_N, 'dtype', '')} "
                f"{getattr(tokens_N, 'shape', '')}"
            )
        _check_positive_int("batch_size", batch_size, "batch_size=8 (sequences per rank)")
        _check_positive_int("seq_len", seq_len, "seq_len=128 (bytes)")
        _check_positive_int("world_size", world_size, "world_size=1")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(
                f"rank must be an int in [0, world_size={world_size}), got {rank!r}; "
                f"pass this process's data-parallel rank"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}; pass e.g. seed=0")
        # The shift is at most seq_len, so windows must fit in the array after seq_len bytes.
        num_windows = (tokens_N.size - seq_len) // (seq_len + 1)
        if num_windows < 1:
            raise ValueError(
                f"seq_len={seq_len} is too long for a split of {tokens_N.size} tokens (it needs "
                f"at least 2 * seq_len + 1 = {2 * seq_len + 1}); lower seq_len (train: "
                f"--seq-len) or use more data"
            )
        global_batch_size = world_size * batch_size
        if global_batch_size > num_windows:
            raise ValueError(
                f"the global batch of {world_size} rank(s) x {batch_size} = {global_batch_size} "
                f"sequences needs that many disjoint windows of seq_len + 1 = {seq_len + 1} "
                f"tokens, but the split of {tokens_N.size} tokens has {num_windows}; lower the "
                "batch size or seq_len (train: --batch-size, --seq-len), or use more data"
            )
        self.tokens_N = tokens_N  # 1D token ids, whole split, same on all ranks
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.num_windows = num_windows
        self.global_batch_size = global_batch_size

    @classmethod
    def from_global_batch(
        cls,
        tokens_N: np.ndarray,
        *,
        global_batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> BatchLoader:
        """A loader whose per-rank batch is ``global_batch_size // world_size``.

        Raises ValueError unless ``world_size`` divides ``global_batch_size``.
        """
        _check_positive_int("global_batch_size", global_batch_size, "global_batch_size=32")
        _check_positive_int("world_size", world_size, "world_size=1")
        if global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by world_size="
                f"{world_size}; pick a global batch that is a multiple of the number of ranks, "
                f"e.g. {world_size * max(1, global_batch_size // world_size)}"
            )
        return cls(
            tokens_N,
            batch_size=global_batch_size // world_size,
            seq_len=seq_len,
            rank=rank,
            world_size=world_size,
            seed=seed,
        )

    def _windows(self, offsets_B: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``(x_BT, y_BT)``, int64, for windows starting at ``offsets_B``."""
        index_BT1 = offsets_B[:, None] + np.arange(self.seq_len + 1)  # (B, T + 1)
        window_BT1 = torch.from_numpy(self.tokens_N[index_BT1].astype(np.int64))  # (B, T + 1)
        return window_BT1[:, :-1].contiguous(), window_BT1[:, 1:].contiguous()

    def global_offsets(self, step: int) -> np.ndarray:
        """Start offsets in bytes of the global batch at ``step``, shape ``(W * B,)``, int64.

        The same on every rank; rank ``r`` uses rows ``[r * B, (r + 1) * B)``.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        rng = np.random.default_rng([self.seed, step])
        shift = int(rng.integers(0, self.seq_len + 1))
        windows = rng.choice(self.num_windows, size=self.global_batch_size, replace=False)
        return shift + windows.astype(np.int64) * (self.seq_len + 1)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch at ``step``: ``(x_BT, y_BT)``, int64 CPU tensors of token ids.

        ``y_BT[:, t] == x_BT[:, t + 1]`` and ``y_BT[:, -1]`` is the byte after the window.
        """
        offsets = self.global_offsets(step)
        lo = self.rank * self.batch_size
        return self._windows(offsets[lo : lo + self.batch_size])

    def iter(
        self, start_step: int = 0, num_steps: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yields ``batch(s)`` for ``s = start_step, start_step + 1, ...``.

        Endless unless ``num_steps`` is given. Resuming a run at step ``s`` is
        ``iter(start_step=s)``: step ``s`` gets exactly the batch it would have got.
        """
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be a non-negative int, got {start_step!r}")
        if num_steps is not None and (
            isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0
        ):
            raise ValueError(f"num_steps must be None or a non-negative int, got {num_steps!r}")
        step = start_step
        while num_steps is None or step < start_step + num_steps:
            yield self.batch(step)
            step += 1

    def eval_batches(self, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed list of ``num_batches`` batches ``(x_BT, y_BT)`` for evaluation.

        Independent of ``seed`` and of the step, so every run and every evaluation sees the same
        bytes: ``num_batches * W * B`` disjoint windows spread evenly over the array (no shift),
        global batch ``i`` holding windows ``[i * W * B, (i + 1) * W * B)`` of them and rank
        ``r`` taking its rows as in ``batch``. Average the loss over ranks to get the global
        figure; the union over ranks equals a single-process loader's with ``W * B``.
        """
        _check_positive_int("num_batches", num_batches, "num_batches=8")
        num_rows = num_batches * self.global_batch_size
        if num_rows > self.num_windows:
            raise ValueError(
                f"{num_batches} eval batches of {self.global_batch_size} sequences need "
                f"{num_rows} disjoint windows, but the split has {self.num_windows}; lower "
                "num_batches, the batch size or seq_len (train: --eval-batches, --batch-size, "
                "--seq-len), or use more data"
            )
        windows = np.arange(num_rows, dtype=np.int64) * self.num_windows // num_rows
        offsets = windows * (self.seq_len + 1)  # (num_batches * W * B,), bytes
        batches = []
        for i in range(num_batches):
            lo = i * self.global_batch_size + self.rank * self.batch_size
            batches.append(self._windows(offsets[lo : lo + self.batch_size]))
        return batches
