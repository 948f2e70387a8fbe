"""Unit tests of the stdlib byte corpus and the data-parallel batch loader (CPU, no processes)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

import zeroshard.data as data
from zeroshard.data import BatchLoader, Corpus

MAX_BYTES = 2**20  # 1 MiB: a few dozen stdlib files, built in well under a second
VAL_EVERY = 5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return Corpus.build(
        cache_dir=tmp_path_factory.mktemp("cache"), max_bytes=MAX_BYTES, val_every=VAL_EVERY
    )


def _loader(corpus: Corpus, **kwargs) -> BatchLoader:
    args = dict(batch_size=4, seq_len=64, rank=0, world_size=1, seed=0) | kwargs
    return BatchLoader(corpus.train, **args)


# ---- corpus ---------------------------------------------------------------------------------


def test_corpus_is_the_capped_stdlib_split_by_file(corpus: Corpus) -> None:
    assert corpus.vocab_size == 256
    assert corpus.train.dtype == np.uint8 and corpus.train.ndim == 1
    assert corpus.val.dtype == np.uint8 and corpus.val.ndim == 1
    assert corpus.train.size > 0 and corpus.val.size > 0
    assert corpus.train.size + corpus.val.size == MAX_BYTES
    assert isinstance(corpus.train, np.memmap)  # loaded with mmap_mode="r"
    assert corpus.path.name.startswith("corpus-py")

    # The split is by file: reassemble both splits from the file list the cache records.
    kept = data._keep_until(data.stdlib_sources(), MAX_BYTES)
    root = Path(data.sysconfig.get_paths()["stdlib"])
    blobs = [(root / rel).read_bytes() for rel, _ in kept]
    stream = b"".join(blobs)[:MAX_BYTES]
    is_val = [i % VAL_EVERY == VAL_EVERY - 1 for i in range(len(blobs))]
    ends = np.cumsum([len(b) for b in blobs])
    train, val = bytearray(), bytearray()
    for i, end in enumerate(ends):
        start = end - len(blobs[i])
        (val if is_val[i] else train).extend(stream[start:end])
    assert bytes(corpus.train) == bytes(train)
    assert bytes(corpus.val) == bytes(val)
    assert not any("site-packages" in rel for rel, _ in data.stdlib_sources())


def test_cache_is_reused_without_rebuilding(
    corpus: Corpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    mtimes = {p.name: p.stat().st_mtime_ns for p in corpus.path.iterdir()}

    def fail(*args, **kwargs):
        raise AssertionError("the corpus was rebuilt although its cache exists")

    monkeypatch.setattr(data, "_read_corpus", fail)
    again = Corpus.build(cache_dir=corpus.path.parent, max_bytes=MAX_BYTES, val_every=VAL_EVERY)
    assert again.path == corpus.path
    assert {p.name: p.stat().st_mtime_ns for p in corpus.path.iterdir()} == mtimes
    np.testing.assert_array_equal(again.train, corpus.train)


def test_cache_key_depends_on_cap_and_split(corpus: Corpus) -> None:
    other = Corpus.build(
        cache_dir=corpus.path.parent, max_bytes=MAX_BYTES // 2 * 3, val_every=VAL_EVERY
    )
    assert other.path != corpus.path and other.path.parent == corpus.path.parent
    assert other.train.size + other.val.size == MAX_BYTES // 2 * 3


def test_atomic_writes_leave_no_temporary_files(
    tmp_path: Path, corpus: Corpus, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert sorted(p.name for p in corpus.path.iterdir()) == ["meta.json", "train.npy", "val.npy"]

    # A write that fails half-way leaves neither a temporary file nor an incomplete cache.
    def broken_save(file, array) -> None:
        file.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(data.np, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        Corpus.build(cache_dir=tmp_path, max_bytes=MAX_BYTES, val_every=VAL_EVERY)
    (folder,) = tmp_path.iterdir()
    assert list(folder.iterdir()) == []

    # The next build completes and is not fooled by the failed attempt.
    monkeypatch.undo()
    rebuilt = Corpus.build(cache_dir=tmp_path, max_bytes=MAX_BYTES, val_every=VAL_EVERY)
    np.testing.assert_array_equal(rebuilt.train, corpus.train)


def test_concurrent_builds_agree(tmp_path: Path, corpus: Corpus) -> None:
    # Two "ranks" building the same missing cache at once both succeed with the same bytes.
    barrier = threading.Barrier(2)

    def build() -> Corpus:
        barrier.wait()
        return Corpus.build(cache_dir=tmp_path, max_bytes=MAX_BYTES, val_every=VAL_EVERY)

    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(lambda _: build(), range(2)))
    for other in built:
        np.testing.assert_array_equal(other.train, corpus.train)
        np.testing.assert_array_equal(other.val, corpus.val)
    assert sorted(p.name for p in built[0].path.iterdir()) == ["meta.json", "train.npy", "val.npy"]


def test_corpus_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes must be a positive"):
        Corpus.build(cache_dir=tmp_path, max_bytes=0)
    with pytest.raises(ValueError, match="val_every must be an int >= 2"):
        Corpus.build(cache_dir=tmp_path, max_bytes=MAX_BYTES, val_every=1)
    with pytest.raises(ValueError, match="raise max_bytes or lower val_every"):
        Corpus.build(cache_dir=tmp_path, max_bytes=1000, val_every=VAL_EVERY)
    # A file where a folder should be: unwritable even for root.
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="pass a writable cache_dir"):
        Corpus.build(cache_dir=blocker, max_bytes=MAX_BYTES, val_every=VAL_EVERY)


# ---- batches --------------------------------------------------------------------------------


def test_batch_shapes_and_targets_are_inputs_shifted_by_one(corpus: Corpus) -> None:
    loader = _loader(corpus, batch_size=3, seq_len=32)
    x_BT, y_BT = loader.batch(7)
    assert x_BT.shape == y_BT.shape == (3, 32)
    assert x_BT.dtype == y_BT.dtype == torch.int64
    assert torch.equal(x_BT[:, 1:], y_BT[:, :-1])
    tokens = torch.from_numpy(np.asarray(corpus.train, dtype=np.int64))
    for b, offset in enumerate(loader.global_offsets(7)):
        assert torch.equal(x_BT[b], tokens[offset : offset + 32])
        assert torch.equal(y_BT[b], tokens[offset + 1 : offset + 33])
    assert int(x_BT.min()) >= 0 and int(x_BT.max()) < corpus.vocab_size


def test_same_seed_same_batches_different_seeds_differ(corpus: Corpus) -> None:
    a, b, c = _loader(corpus, seed=0), _loader(corpus, seed=0), _loader(corpus, seed=1)
    for step in (0, 1, 1000):
        assert all(torch.equal(u, v) for u, v in zip(a.batch(step), b.batch(step)))
        assert not torch.equal(a.batch(step)[0], c.batch(step)[0])
    assert not torch.equal(a.batch(0)[0], a.batch(1)[0])


@pytest.mark.parametrize("world_size", [2, 4])
def test_global_batch_equals_single_process_batch(corpus: Corpus, world_size: int) -> None:
    batch_size, seq_len, seed = 3, 48, 5
    single = _loader(corpus, batch_size=world_size * batch_size, seq_len=seq_len, seed=seed)
    ranks = [
        _loader(
            corpus,
            batch_size=batch_size,
            seq_len=seq_len,
            rank=r,
            world_size=world_size,
            seed=seed,
        )
        for r in range(world_size)
    ]
    for step in (0, 3, 250):
        x_ref, y_ref = single.batch(step)
        per_rank = [loader.batch(step) for loader in ranks]
        assert torch.equal(torch.cat([x for x, _ in per_rank]), x_ref)
        assert torch.equal(torch.cat([y for _, y in per_rank]), y_ref)
    # Evaluation batches shard the same way.
    ref_eval = single.eval_batches(2)
    rank_evals = [loader.eval_batches(2) for loader in ranks]
    for i, (x_ref, y_ref) in enumerate(ref_eval):
        assert torch.equal(torch.cat([ev[i][0] for ev in rank_evals]), x_ref)
        assert torch.equal(torch.cat([ev[i][1] for ev in rank_evals]), y_ref)


def test_ranks_get_disjoint_windows(corpus: Corpus) -> None:
    seq_len, world_size = 16, 4
    # A small split and a big global batch, so an overlap would be likely if sampling allowed it.
    tokens = np.ascontiguousarray(corpus.train[: 40 * (seq_len + 1)])
    loaders = [
        BatchLoader(tokens, batch_size=8, seq_len=seq_len, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    for step in range(50):
        offsets = loaders[0].global_offsets(step)
        assert all(np.array_equal(offsets, ld.global_offsets(step)) for ld in loaders)
        starts = np.sort(offsets)
        # Windows of seq_len + 1 bytes (inputs and targets) never share a byte.
        assert np.all(np.diff(starts) >= seq_len + 1)
        assert starts[-1] + seq_len + 1 <= tokens.size


def test_resume_from_a_step(corpus: Corpus) -> None:
    loader = _loader(corpus, seed=3)
    run = list(loader.iter(num_steps=8))
    resumed = list(_loader(corpus, seed=3).iter(start_step=5, num_steps=3))
    assert len(run) == 8 and len(resumed) == 3
    for (x, y), (rx, ry) in zip(run[5:], resumed):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    x100, _ = next(loader.iter(start_step=100))
    assert torch.equal(x100, loader.batch(100)[0])


def test_eval_batches_are_fixed(corpus: Corpus) -> None:
    a = BatchLoader(corpus.val, batch_size=2, seq_len=32, seed=0).eval_batches(3)
    b = BatchLoader(corpus.val, batch_size=2, seq_len=32, seed=9).eval_batches(3)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.shape == (2, 32) and torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    rows = torch.cat([x for x, _ in a])
    assert len({tuple(r.tolist()) for r in rows}) == rows.shape[0]


def test_from_global_batch(corpus: Corpus) -> None:
    loader = BatchLoader.from_global_batch(
        corpus.train, global_batch_size=8, seq_len=16, rank=1, world_size=4
    )
    assert loader.batch_size == 2 and loader.global_batch_size == 8
    with pytest.raises(ValueError, match="not divisible by world_size=3"):
        BatchLoader.from_global_batch(corpus.train, global_batch_size=8, seq_len=16, world_size=3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(batch_size=0), "batch_size must be a positive int"),
        (dict(seq_len=-1), "seq_len must be a positive int"),
        (dict(world_size=0), "world_size must be a positive int"),
        (dict(rank=2, world_size=2), r"rank must be an int in \[0, world_size=2\)"),
        (dict(seed=-1), "seed must be a non-negative int"),
        (dict(seq_len=10**9), "too long for a split"),
        (dict(batch_size=10**6, seq_len=64), r"1 rank\(s\) x 1000000 = 1000000 sequences"),
    ],
)
def test_loader_bad_input(corpus: Corpus, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _loader(corpus, **kwargs)


def test_loader_bad_step_and_tokens(corpus: Corpus) -> None:
    loader = _loader(corpus)
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        loader.batch(-1)
    with pytest.raises(ValueError, match="start_step must be a non-negative int"):
        next(loader.iter(start_step=-2))
    with pytest.raises(ValueError, match="lower num_batches"):
        loader.eval_batches(10**6)
    with pytest.raises(TypeError, match="1D numpy integer array"):
        BatchLoader(np.zeros(1000, dtype=np.float32), batch_size=1, seq_len=8)
