"""The NVMe tier's trust: corrupted, truncated and missing files, a full disk, bad folders."""

import errno
import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

import zeroshard.offload.nvme as nvme_mod
from zeroshard.offload import (
    OffloadConfig,
    OffloadError,
    OffloadSetupError,
    SwapIntegrityError,
    SwapSpaceError,
    TensorStore,
    Tier,
)

BLOCK = 8192


def config(folder: Path, **kw) -> OffloadConfig:
    return OffloadConfig(tier=Tier.NVME, folder=folder, block_bytes=BLOCK, **kw)


@pytest.fixture
def store(tmp_path):
    with TensorStore(config(tmp_path / "swap", num_buffers=2, num_io_threads=2)) as s:
        yield s


def swap_file(store: TensorStore, name: str) -> Path:
    return store._backend.entry(name).path


def test_files_are_aligned_and_use_direct_io(store):
    store.swap_out("w", torch.ones(3001)).wait()  # 12004 bytes: two blocks, padded to 12288
    assert swap_file(store, "w").stat().st_size == 12288
    assert store.stats()["direct_io"] is True  # /tmp here is ext4; tmpfs would fall back


def test_a_corrupted_byte_is_a_checksum_error(store):
    t = torch.randn(5000)  # 20000 bytes, 3 blocks
    store.swap_out("layers.0.w", t).wait()
    path = swap_file(store, "layers.0.w")
    with open(path, "r+b") as f:  # flip one bit in the second block
        f.seek(BLOCK + 123)
        byte = f.read(1)[0]
        f.seek(BLOCK + 123)
        f.write(bytes([byte ^ 0x10]))
    out = torch.zeros(5000)
    with pytest.raises(SwapIntegrityError, match=r"checksum mismatch.*layers\.0\.w.*block 1"):
        store.swap_in("layers.0.w", into=out).wait()
    with pytest.raises(SwapIntegrityError) as failure:
        store.swap_in("layers.0.w").wait()
    assert str(path) in str(failure.value)
    store.swap_out("layers.0.w", t).wait()  # rewriting heals it
    assert torch.equal(store.swap_in("layers.0.w").wait(), t)


def test_a_truncated_file_is_an_error_naming_it(store):
    store.swap_out("w", torch.randn(5000)).wait()
    path = swap_file(store, "w")
    os.truncate(path, BLOCK)
    with pytest.raises(SwapIntegrityError, match=f"{path}.*'w' is truncated: 8192 bytes"):
        store.swap_in("w").wait()


def test_a_missing_file_is_an_error_naming_it(store):
    store.swap_out("w", torch.randn(10)).wait()
    path = swap_file(store, "w")
    path.unlink()
    with pytest.raises(SwapIntegrityError, match=f"{path} of tensor 'w' is missing"):
        store.swap_in("w").wait()


def test_a_full_disk_fails_the_write_and_nothing_half_written_is_trusted(store, monkeypatch):
    old = torch.randn(5000)
    store.swap_out("w", old).wait()
    store.flush()
    calls = []

    def full_after_one_block(fd, buffers, offset):
        calls.append(offset)
        if len(calls) > 1:  # the first block lands, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)

    real_pwritev = os.pwritev
    monkeypatch.setattr(os, "pwritev", full_after_one_block)
    handle = store.swap_out("w", torch.randn(5000))
    with pytest.raises(SwapSpaceError, match=r"no space left.*swap file .*'w'"):
        handle.wait()
    monkeypatch.undo()
    # neither the half-written new tensor nor the overwritten old one is served
    with pytest.raises(OffloadError, match="'w' has no valid copy.*last swap_out failed"):
        store.swap_in("w").wait()
    store.flush()  # and the index no longer vouches for it
    index = json.loads((store._backend.folder / "index.json").read_text())
    assert "w" not in index["tensors"]


def test_free_space_is_checked_before_writing(store, monkeypatch):
    monkeypatch.setattr(nvme_mod, "free_bytes", lambda folder: 10_000)
    with pytest.raises(SwapSpaceError, match=r"needs 20480 bytes .* only 10000 bytes"):
        store.swap_out("w", torch.zeros(5000))  # raised by the call itself, before any I/O
    assert "w" not in store and not list(store._backend.folder.glob("*.swp"))


def test_a_failed_allocation_is_a_space_error(store, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(SwapSpaceError, match="needs 20480 more bytes"):
        store.swap_out("w", torch.zeros(5000)).wait()


def test_an_unusable_folder_fails_at_construction(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    for where in (not_a_dir, not_a_dir / "swap"):  # said "Not a directory", "File exists"
        with pytest.raises(OffloadError, match=r"not usable \(it, or a folder above it, is a "):
            TensorStore(config(where))


def test_a_dangling_link_as_the_folder_is_named_as_such(tmp_path):
    # "it, or a folder above it, is a file": mkdir's FileExistsError for a link to nowhere
    link = tmp_path / "swap"
    link.symlink_to(tmp_path / "not-made-yet" / "swap")
    for where in (link, link / "rank0"):
        with pytest.raises(OffloadSetupError, match=r"swap is a symbolic link to .*not-made-yet"):
            TensorStore(config(where))


def test_a_crashed_run_s_files_on_a_read_only_disk_are_a_setup_error(tmp_path, monkeypatch):
    # The LOCK of a crashed run's folder opened for writing on a disk remounted read-only
    # (ext4's errors=remount-ro): a bare OSError on every rank.
    from zeroshard.offload import folder as folder_mod

    swap = tmp_path / "swap"
    swap.mkdir()
    (swap / folder_mod.LOCK_NAME).write_text("1")
    (swap / "w-0123456789ab.swp").write_bytes(b"x")
    real_open = os.open

    def read_only(path, flags, *args):
        if flags & (os.O_RDWR | os.O_WRONLY):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    said = r"swap folder .*swap is not usable \(holds a crashed run's swap files, not discarded: "
    with pytest.raises(OffloadSetupError, match=said + r"Read-only file system\); pass folder="):
        folder_mod.clear_crashed(swap)


def test_swap_files_without_a_lock_are_refused_in_one_line(tmp_path):
    """A live run's folder whose LOCK a /tmp cleaner deleted: the next run was refused with a
    bare OffloadError, "holds no store", a traceback and exit 1 (an explorer); it is bad input
    naming the two causes and the fix, and the files are left alone."""
    from zeroshard.offload import folder as folder_mod

    swap = tmp_path / "swap"
    swap.mkdir()
    (swap / "w-0123456789ab.swp").write_bytes(b"x")
    said = r"swap folder .*swap holds swap files but no LOCK or index.json: a run using it whose"
    with pytest.raises(OffloadSetupError, match=said):
        folder_mod.clear_crashed(swap)
    assert (swap / "w-0123456789ab.swp").exists()


@pytest.mark.parametrize("call", ["pwritev", "pwrite"])
def test_a_full_disk_at_construction_names_the_folder_and_its_free_bytes(
    tmp_path, monkeypatch, call
):
    # The probe's page (pwritev, O_DIRECT) and the lock's pid (pwrite) on a disk just filled
    # (by the masters' store, an explorer's tmpfs): a bare OSError naming no folder.
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, call, full)
    said = r"swap folder .*swap is not usable \(No space left on device\); \d+ bytes are free there"
    with pytest.raises(OffloadSetupError, match=said):
        TensorStore(config(tmp_path / "swap", direct_io=None if call == "pwritev" else False))
    monkeypatch.undo()
    with TensorStore(config(tmp_path / "swap")):  # nothing left held (the lock's fd closed)
        pass


def test_without_o_direct_it_falls_back_and_warns_once(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with caplog.at_level(logging.WARNING, logger="zeroshard.offload"):
        with TensorStore(config(tmp_path / "swap")) as store:
            t = torch.randn(3000)
            store.swap_out("w", t).wait()
            assert torch.equal(store.swap_in("w").wait(), t)
            assert store.stats()["direct_io"] is False
        with pytest.raises(OffloadError, match="does not support O_DIRECT"):
            TensorStore(config(tmp_path / "swap2", direct_io=True))
    warnings = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1 and "buffered" in warnings[0].getMessage()


def test_the_index_is_replaced_atomically(store, monkeypatch):
    store.swap_out("a", torch.ones(10)).wait()
    store.flush()
    index = store._backend.folder / "index.json"
    before = index.read_text()
    store.swap_out("b", torch.ones(10)).wait()

    def crash_midway(obj, f):
        f.write('{"format": "zeroshard.off')  # a partial write, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        store.flush()
    monkeypatch.undo()
    assert index.read_text() == before  # readers still see the complete old index
    store.flush()
    assert set(json.loads(index.read_text())["tensors"]) == {"a", "b"}


def test_a_folder_in_ram_is_reported_once(tmp_path, monkeypatch, caplog):
    assert nvme_mod.filesystem_type(tmp_path) not in ("", "?")
    monkeypatch.setattr(nvme_mod, "filesystem_type", lambda path: "tmpfs")
    logs = caplog.at_level(logging.WARNING, logger="zeroshard.offload")
    with logs, TensorStore(config(tmp_path / "swap")) as store:
        store.swap_out("w", torch.ones(10)).wait()
        assert store.stats()["filesystem"] == "tmpfs"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "tmpfs, which is RAM" in warnings[0]


def test_pending_writes_reserve_their_space(store, monkeypatch):
    monkeypatch.setattr(nvme_mod, "free_bytes", lambda folder: 30_000)  # a constant probe
    gate = threading.Event()
    real_open_for_write = store._backend._open_for_write

    def slow_open(meta):
        gate.wait(10)  # hold the first write before it allocates
        return real_open_for_write(meta)

    monkeypatch.setattr(store._backend, "_open_for_write", slow_open)
    first = store.swap_out("a", torch.zeros(5000))  # 20480 bytes, reserved, not yet allocated
    with pytest.raises(SwapSpaceError, match="only 9520 bytes"):
        store.swap_out("b", torch.zeros(5000))  # fits the disk alone, not with "a" pending
    gate.set()
    first.wait()
    assert store._backend._reserved_bytes == 0  # released once allocated


def test_corruption_is_caught_when_reading_in_place(store):
    t = store.empty_host((2 * BLOCK // 4,), torch.float32)  # aligned: read with no staging
    t.copy_(torch.randn(t.numel()))
    store.swap_out("w", t).wait()
    with open(swap_file(store, "w"), "r+b") as f:
        f.seek(5)
        f.write(b"\x00\x01")
    with pytest.raises(SwapIntegrityError, match="checksum mismatch.*'w', block 0"):
        store.swap_in("w", into=store.empty_host(t.shape, t.dtype)).wait()


def test_blocks_are_read_in_chunks_and_checked_whole(store, monkeypatch):
    store._backend.read_chunk_bytes = 4096  # BLOCK is 8192: two requests per full block
    t = torch.randn(5000)  # 20000 bytes: blocks of 8192, 8192 and 3616 (read as 4096)
    store.swap_out("w", t).wait()
    sizes = []
    real_preadv = os.preadv

    def recording_preadv(fd, buffers, offset):
        sizes.append((offset, sum(len(b) for b in buffers)))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(nvme_mod.os, "preadv", recording_preadv)
    out = torch.zeros(5000)
    store.swap_in("w", into=out).wait()
    assert torch.equal(out, t)
    assert sorted(sizes) == [(0, 4096), (4096, 4096), (8192, 4096), (12288, 4096), (16384, 4096)]


def test_a_short_chunk_is_a_truncation_error(store, monkeypatch):
    store._backend.read_chunk_bytes = 4096
    store.swap_out("w", torch.randn(4096)).wait()  # 16384 bytes: two blocks of two chunks
    real_preadv = os.preadv

    def short_second_chunk(fd, buffers, offset):
        n = real_preadv(fd, buffers, offset)
        return 1000 if offset == BLOCK + 4096 else n  # the file shrank under the read

    monkeypatch.setattr(nvme_mod.os, "preadv", short_second_chunk)
    with pytest.raises(SwapIntegrityError, match=r"'w' is truncated: block 1 .* 5096 of 8192"):
        store.swap_in("w", into=torch.zeros(4096)).wait()


# --------------------------------------------------------------------- index and folder modules


def test_the_index_round_trips_and_refuses_what_it_cannot_vouch_for(tmp_path):
    from zeroshard.offload.index import IndexEntry, read_index, write_index
    from zeroshard.offload.tiers import TensorMeta

    meta = TensorMeta(name="a/b", dtype=torch.bfloat16, shape=(3, 5))
    entry = IndexEntry(meta=meta, file="a_b-0.swp", checksums=[1, 2**64 - 1])
    write_index(tmp_path, block_bytes=BLOCK, created_folder=True, entries=[entry])
    assert not (tmp_path / "index.json.tmp").exists()  # renamed into place
    assert read_index(tmp_path, block_bytes=BLOCK) == (True, [entry])
    with pytest.raises(ValueError, match=f"OffloadConfig\\(block_bytes={BLOCK}\\)"):
        read_index(tmp_path, block_bytes=2 * BLOCK)
    (tmp_path / "index.json").write_text('{"format": "other/9"}')
    with pytest.raises(OffloadError, match="format 'other/9'"):
        read_index(tmp_path, block_bytes=BLOCK)
    (tmp_path / "index.json").write_text("{")
    with pytest.raises(SwapIntegrityError, match="not valid JSON"):
        read_index(tmp_path, block_bytes=BLOCK)
    (tmp_path / "index.json").unlink()
    with pytest.raises(OffloadError, match="nothing to resume"):
        read_index(tmp_path, block_bytes=BLOCK)


def test_a_folder_lock_names_its_holder(tmp_path):
    from zeroshard.offload.folder import take_lock

    fd = take_lock(tmp_path)
    try:
        # a ValueError: bad input, which the command line reports in one line (exit 2)
        pid = os.getpid()
        held = (
            f"in use by a live store \\(pid {pid}, this process: another model .* \\(a teacher "
            "and a student\\) each need a folder of their own: Offload\\(folder=...\\) apart; .* "
            "del loss, model, opt\\)$"  # (and no other process's fix after it)
        )
        with pytest.raises(OffloadSetupError, match=held):
            take_lock(tmp_path)
    finally:
        os.close(fd)
    os.close(take_lock(tmp_path))  # free again once the holder closed it


def test_a_folder_removed_as_its_lock_is_taken_is_made_again(tmp_path, monkeypatch):
    """A finished store of this process empties and removes its folder from a finalizer that
    may run late, between a new store's making of the folder and its lock: the lock failed
    with FileNotFoundError (a flaky failure of the suite); the folder is made again."""
    from zeroshard.offload import folder

    where = tmp_path / "rank00000"
    where.mkdir()
    lock = folder.pid_lock
    calls = []

    def removed_first(path, *args):
        calls.append(path)
        if len(calls) == 1:
            where.rmdir()  # the late finalizer
        return lock(path, *args)

    monkeypatch.setattr(folder, "pid_lock", removed_first)
    fd = folder.take_lock(where)
    try:
        assert len(calls) == 2 and (where / folder.LOCK_NAME).exists()
    finally:
        os.close(fd)


def test_a_lock_file_deleted_as_it_is_taken_is_not_held(tmp_path, monkeypatch):
    """Its holder deleted the lock file (with the folder's contents) after this process opened
    it and before it locked it: the lock of a deleted file excludes nobody, so the file now at
    the path is locked instead."""
    import fcntl

    from zeroshard.offload import folder

    path = tmp_path / "LOCK"
    real = fcntl.flock
    calls = []

    def flock(fd, op):
        if not calls:
            path.unlink()  # the holder, between our open and our flock
        calls.append(op)
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    fd = folder.pid_lock(path)
    try:
        assert len(calls) == 2 and os.path.samestat(os.fstat(fd), os.stat(path))
        assert path.read_text() == str(os.getpid())
    finally:
        os.close(fd)


def test_a_store_of_this_process_left_to_the_cycle_collector_gives_its_folder_back(tmp_path):
    """``del model, opt`` leaves a model and its optimizer (which refer to each other) to the
    cycle collector: a new store in their folder does not wait for it (it was refused, telling
    the user to call ``gc.collect()``). The old store is collected before the new one prepares
    the folder, whose lock then still excludes every other store."""
    import gc

    from zeroshard.offload.store import OffloadConfig, TensorStore

    folder = tmp_path / "swap"
    config = OffloadConfig(tier="nvme", folder=str(folder))
    gc.disable()
    try:
        old = TensorStore(config)
        old.swap_out("x", torch.ones(1000)).wait()
        old.cycle = old  # unreachable once deleted, freed only by the collector
        del old
        new = TensorStore(config)
        new.swap_out("y", torch.ones(1000)).wait()  # the folder is still there
        assert (folder / "LOCK").exists()
        with pytest.raises(OffloadSetupError, match="in use by a live store"):
            TensorStore(config)  # the live one still holds it
        new.close()
    finally:
        gc.enable()


def test_a_store_closed_late_leaves_a_new_store_s_files_in_its_old_folder(tmp_path):
    """A model's store collected late (a reference cycle: after the folder was deleted and
    a new model's store made it again) deleted the new store's swap files, which carry the
    same names, and its lock: the new model's next read failed "swap file ... is missing"."""
    import shutil

    folder = tmp_path / "swap"
    old = TensorStore(config(folder))
    old.swap_out("w", torch.ones(100)).wait()
    shutil.rmtree(folder)  # the user's clean start
    with TensorStore(config(folder)) as new:
        new.swap_out("w", torch.full((100,), 2.0)).wait()
        old.close()
        assert torch.equal(new.swap_in("w").wait(), torch.full((100,), 2.0))
        assert (folder / nvme_mod.LOCK_NAME).exists()


def test_a_store_whose_lock_file_was_deleted_still_cleans_up_and_keeps(tmp_path):
    folder = tmp_path / "swap"
    store = TensorStore(config(folder))
    store.swap_out("w", torch.ones(100)).wait()
    (folder / nvme_mod.LOCK_NAME).unlink()  # by hand; the folder is still the store's
    store.close(keep=True)
    with TensorStore.reopen(folder) as again:
        assert torch.equal(again.swap_in("w").wait(), torch.ones(100))


_DIES_WITH_A_WORKER = """
import os, sys, time, torch
from zeroshard.offload import OffloadConfig, TensorStore, Tier
s = TensorStore(OffloadConfig(tier=Tier.NVME, folder=sys.argv[1], block_bytes=8192))
s.swap_out("w", torch.ones(10)).wait()
if os.fork() == 0:  # a DataLoader worker, forked after the store opened
    time.sleep(5)
    os._exit(0)
os.kill(os.getpid(), 9)  # the rank dies (OOM killer, scheduler); its worker lives on
"""


def test_a_dead_rank_s_forked_worker_does_not_hold_its_folder(tmp_path):
    """flock belongs to the open file, which fork shares: the worker held the dead rank's
    folder until it exited, and a restart there was refused as "in use by a live store"."""
    import subprocess
    import sys

    folder = tmp_path / "swap"
    done = subprocess.run([sys.executable, "-c", _DIES_WITH_A_WORKER, str(folder)], timeout=60)
    assert done.returncode == -9
    TensorStore.discard(folder)  # refused while a live store, or a copy of its lock, holds it
    assert not any(folder.glob("*.swp"))
