"""TensorStore: exact round trips on every tier, ordering, prefetch through a tiny pool, lifetime.

Blocks are 8 KiB here so tensors of a few KiB already span several blocks and every path (split,
last partial block, padding) runs in milliseconds.
"""

import gc
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from zeroshard.offload import (
    OffloadConfig,
    OffloadError,
    SwapIntegrityError,
    TensorStore,
    Tier,
)

BLOCK = 8192
ODD_SHAPES = [(), (0,), (1,), (7, 13), (4097,), (3, 5, 401)]  # 401*15*8 B spans several blocks
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def sample(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, shape, generator=g, dtype=torch.int64)
    return (torch.randn(shape, generator=g) * 1e3).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal would call -0.0 == 0.0 and fail on NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = BITS.get(a.dtype)
    return torch.equal(a.view(bits), b.view(bits)) if bits else torch.equal(a, b)


def nvme(folder: Path, **kw) -> OffloadConfig:
    return OffloadConfig(tier=Tier.NVME, folder=folder, block_bytes=BLOCK, **kw)


@pytest.fixture(params=["device", "cpu", "nvme"])
def store(request, tmp_path):
    if request.param == "nvme":
        config = nvme(tmp_path / "swap", num_buffers=3, num_io_threads=3)
    else:
        config = OffloadConfig(tier=request.param, block_bytes=BLOCK)
    with TensorStore(config) as s:
        yield s


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_exact(store, dtype):
    tensors = {f"w.{i}": sample(shape, dtype, i) for i, shape in enumerate(ODD_SHAPES)}
    handles = [store.swap_out(name, t) for name, t in tensors.items()]
    for h in handles:
        assert h.wait() is None
    outs = {name: store.swap_in(name) for name in tensors}  # all in flight at once
    for name, h in outs.items():
        assert same_bits(h.wait(), tensors[name]), name
    into = torch.empty_like(tensors["w.5"])
    assert store.swap_in("w.5", into=into).wait() is into and same_bits(into, tensors["w.5"])


def test_same_name_operations_run_in_call_order(store):
    old, new = sample((5000,), torch.float32, 1), sample((777,), torch.bfloat16, 2)
    store.swap_out("p", old)
    store.swap_out("p", new)  # replaces, with another size and dtype, without waiting
    got = store.swap_in("p").wait()  # must see the second write, whole
    assert same_bits(got, new)
    store.release("p")
    assert "p" not in store
    with pytest.raises(KeyError, match="swap_out it first"):
        store.swap_in("p")


def test_into_must_match(store):
    store.swap_out("p", torch.zeros(10)).wait()
    with pytest.raises(ValueError, match="contiguous torch.float32 tensor of 10 elements"):
        store.swap_in("p", into=torch.zeros(11))
    with pytest.raises(ValueError, match="not contiguous"):
        store.swap_in("p", into=torch.zeros(2, 5).t())


def test_a_block_is_read_by_the_job_that_opened_its_file(tmp_path, monkeypatch):
    """One worker job per one-block tensor; a tensor of n blocks submits n - 1 more."""
    with TensorStore(nvme(tmp_path / "swap", num_io_threads=2)) as store:
        small, large = sample((100,), torch.float32, 0), sample((3 * BLOCK // 4,), torch.float32, 1)
        store.swap_out("small", small)
        store.swap_out("large", large).wait()
        executor, jobs = store._executor(), []

        def submit(fn, *args):
            jobs.append(fn)
            return type(executor).submit(executor, fn, *args)

        monkeypatch.setattr(executor, "submit", submit)
        assert same_bits(store.swap_in("small").wait(), small)
        assert len(jobs) == 1
        assert same_bits(store.swap_in("large").wait(), large)  # 24 KiB: three 8 KiB blocks
        assert len(jobs) == 1 + 3  # the small tensor's job, then one per block of the large


def test_files_are_opened_on_workers_even_behind_a_finished_operation(tmp_path, monkeypatch):
    """Opening (and posix_fallocate) never stalls the caller, whatever the previous op's state."""
    from zeroshard.offload.nvme import NvmeBackend

    threads = []
    for method in ("begin_read", "begin_write"):
        real = getattr(NvmeBackend, method)

        def spy(self, *args, real=real):
            threads.append(threading.current_thread())
            return real(self, *args)

        monkeypatch.setattr(NvmeBackend, method, spy)
    t = sample((1000,), torch.float32, 0)
    with TensorStore(nvme(tmp_path / "swap", num_io_threads=2)) as store:
        for _ in range(20):  # chained on a pending or a finished previous op, by timing
            store.swap_out("p", t)
            store.swap_in("p")
        assert same_bits(store.swap_in("p").wait(), t)
    assert len(threads) == 41 and threading.main_thread() not in threads


def test_many_concurrent_prefetches_through_two_buffers(tmp_path):
    tensors = {f"layer{i}": sample((3 * BLOCK // 4 + i,), torch.float32, i) for i in range(24)}
    with TensorStore(nvme(tmp_path / "swap", num_buffers=2, num_io_threads=4)) as store:
        for name, t in tensors.items():
            store.swap_out(name, t)
        prefetches = store.prefetch(list(tensors))  # 24 tensors x 4 blocks into 2 buffers
        store.swap_out("layer3", tensors["layer3"] + 1)  # a prefetched block must not leak back
        ins = {name: store.swap_in(name) for name in tensors}
        for name, h in ins.items():
            want = tensors[name] + 1 if name == "layer3" else tensors[name]
            assert same_bits(h.wait(timeout=30), want), name
        for h in prefetches:
            h.wait(timeout=30)
        stats = store.stats()
        assert stats["pool_bytes"] == 2 * BLOCK  # memory stayed at the pool's size
        assert stats["max_buffers_in_use"] <= 2
        assert store.pool.num_free() == 2  # every buffer came back


def test_prefetched_blocks_are_used(tmp_path):
    t = sample((2 * BLOCK // 4,), torch.float32, 0)  # 2 blocks
    with TensorStore(nvme(tmp_path / "swap", num_buffers=4)) as store:
        store.swap_out("p", t)
        store.prefetch(["p"])[0].wait()
        assert store.pool.num_cached() == 2
        assert same_bits(store.swap_in("p").wait(), t)
        assert store.pool.num_cached() == 0


def test_config_errors_say_the_fix():
    with pytest.raises(ValueError, match="needs folder="):
        OffloadConfig(tier=Tier.NVME)
    with pytest.raises(ValueError, match="multiple of 4096"):
        OffloadConfig(tier="cpu", block_bytes=1000)
    with pytest.raises(ValueError, match="num_buffers"):
        OffloadConfig(tier="cpu", num_buffers=0)
    with pytest.raises(ValueError, match="num_io_threads"):
        OffloadConfig(tier="cpu", num_io_threads=0)
    with pytest.raises(ValueError, match="not one of"):
        OffloadConfig(tier="disk")
    with pytest.raises(ValueError, match="only used by Tier.NVME"):
        OffloadConfig(tier="cpu", folder="/tmp/x")
    assert OffloadConfig(tier="cpu").tier is Tier.CPU


def test_close_leaves_no_files(tmp_path):
    folder = tmp_path / "swap"
    with TensorStore(nvme(folder)) as store:
        store.swap_out("a", torch.ones(3000))
        store.swap_out("b/c", torch.ones(5)).wait()
        store.synchronize()
        assert len(list(folder.glob("*.swp"))) == 2
        store.flush()
        assert (folder / "index.json").exists()
    assert not folder.exists()
    with pytest.raises(OffloadError, match="closed"):
        store.swap_out("a", torch.ones(1))


def test_second_store_on_a_live_folder_is_refused(tmp_path):
    with TensorStore(nvme(tmp_path / "swap")), pytest.raises(OffloadError, match="in use"):
        TensorStore(nvme(tmp_path / "swap"))


# A child process that swaps out, flushes, writes more, then dies (os._exit skips all cleanup) or
# exits normally without closing the store.
CHILD = textwrap.dedent(
    """
    import os, sys, torch
    from zeroshard.offload import OffloadConfig, TensorStore, Tier
    folder, how = sys.argv[1], sys.argv[2]
    store = TensorStore(OffloadConfig(tier=Tier.NVME, folder=folder, block_bytes=8192))
    store.swap_out("kept", torch.arange(5000, dtype=torch.int64))
    store.swap_out("rewritten", torch.full((3000,), 1.5))
    store.flush()
    store.swap_out("rewritten", torch.full((3000,), 2.5)).wait()  # after the flush
    store.swap_out("new", torch.ones(10)).wait()  # never indexed
    if how == "crash":
        os._exit(1)
    """
)


def run_child(folder: Path, how: str) -> None:
    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), how], check=how != "crash", cwd=root, timeout=60
    )


def test_reopen_after_crash_then_discard(tmp_path):
    folder = tmp_path / "swap"
    run_child(folder, "crash")
    with pytest.raises(OffloadError, match="reopen"):
        TensorStore(nvme(folder))  # a plain constructor refuses a leftover folder
    store = TensorStore.reopen(folder)  # the block size comes from the index
    assert store.config.block_bytes == BLOCK
    assert sorted(store.names()) == ["kept", "rewritten"]  # "new" came after the last flush
    assert torch.equal(store.swap_in("kept").wait(), torch.arange(5000, dtype=torch.int64))
    with pytest.raises(SwapIntegrityError, match="checksum mismatch.*'rewritten'"):
        store.swap_in("rewritten").wait()  # changed after the index: detected, not returned
    store.close(keep=True)
    TensorStore.discard(folder)
    assert not folder.exists()
    run_child(folder, "crash")
    TensorStore.reopen(folder).close()  # resumed, then closed: the folder goes as well
    assert not folder.exists()


def test_a_users_own_swp_files_are_never_taken_for_the_stores(tmp_path):
    # an editor's swap file in the folder made the store refuse it as "an earlier run's", and
    # discard, the advised fix, deleted it
    folder = tmp_path / "swap"
    folder.mkdir()
    mine = {folder / "model.swp": b"vim", folder / ".train.py.swp": b"vim too"}
    for path, data in mine.items():
        path.write_bytes(data)
    with TensorStore(nvme(folder)) as store:
        store.swap_out("a", torch.ones(3000)).wait()
    run_child(folder, "crash")
    TensorStore.discard(folder)
    assert {p: p.read_bytes() for p in folder.iterdir()} == mine


def test_normal_exit_without_close_cleans_up(tmp_path):
    folder = tmp_path / "swap"
    run_child(folder, "exit")
    assert not folder.exists()


def test_an_unclosed_store_cleans_up_when_collected(tmp_path):
    folder = tmp_path / "swap"
    store = TensorStore(nvme(folder))
    store.swap_out("a", torch.ones(3000)).wait()
    del store  # the last reference may die on an I/O thread: its finalizer must not join itself
    gc.collect()
    deadline = time.monotonic() + 5
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not folder.exists()


def test_empty_host_tensors_swap_without_staging(tmp_path):
    with TensorStore(nvme(tmp_path / "swap", num_buffers=2)) as store:
        full = store.empty_host((3, 4096), torch.float32)  # 48 KiB: six full 8 KiB blocks
        full.copy_(sample((3, 4096), torch.float32, 0))
        store.swap_out("full", full).wait()
        back = store.swap_in("full", into=store.empty_host((3, 4096), torch.float32)).wait()
        assert same_bits(back, full)
        assert store.pool.allocated_bytes == 0  # the disk read and wrote the tensors' own pages
        odd = store.empty_host((4097,), torch.bfloat16)  # a partial last block: staged
        odd.copy_(sample((4097,), torch.bfloat16, 1))
        store.swap_out("odd", odd).wait()
        assert same_bits(
            store.swap_in("odd", into=store.empty_host((4097,), torch.bfloat16)).wait(), odd
        )
        assert store.pool.allocated_bytes == 2 * BLOCK
        # Swapping in place leaves the storages resizable: swapped parameter masters are freed
        # and refilled by resizing theirs (tensor.numpy() used to mark them not resizable).
        for t in (full, back):
            t.untyped_storage().resize_(0)
            t.untyped_storage().resize_(3 * 4096 * 4)


def test_a_forked_child_leaves_the_parent_s_files(tmp_path):
    """A child made by ``os.fork`` that exits normally ran the store's exit clean-up, deleting
    the parent's swap files and lock under it (the parent's next read: "swap file ... is
    missing")."""
    store = TensorStore(nvme(tmp_path / "swap"))
    store.swap_out("a", torch.arange(3000.0)).wait()
    code = textwrap.dedent(
        f"""
        import os, sys, torch
        from zeroshard.offload import OffloadConfig, TensorStore, Tier
        store = TensorStore(OffloadConfig(tier=Tier.NVME, folder={str(tmp_path / "child")!r}))
        store.swap_out("a", torch.ones(10)).wait()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: atexit and finalizers run in the child
        os.waitpid(pid, 0)
        assert torch.equal(store.swap_in("a").wait(), torch.ones(10))
        print("kept")
        """
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, timeout=60, capture_output=True, text=True
    )
    assert done.stdout.strip() == "kept", done.stderr[-2000:]
    assert not (tmp_path / "child").exists()  # the parent's own exit still cleans up
    assert torch.equal(store.swap_in("a").wait(), torch.arange(3000.0))
    store.close()


def test_a_child_forked_while_a_read_is_in_flight_exits(tmp_path):
    """``close_with``'s finalizer ran in a forked child's exit too and waited for the parent's
    read in flight, which no thread of the child runs: the child never exited."""
    code = textwrap.dedent(
        f"""
        import os, sys, time, torch
        from zeroshard.offload import OffloadConfig, TensorStore, Tier
        from zeroshard.offload.nvme import NvmeBackend
        class Swapper:  # the owner a swapper is
            pass
        owner = Swapper()
        store = TensorStore(OffloadConfig(tier=Tier.NVME, folder={str(tmp_path / "swap")!r}))
        store.close_with(owner)
        store.swap_out("a", torch.ones(10)).wait()
        pread = NvmeBackend._pread
        def slow(self, *args):
            time.sleep(1.0)
            return pread(self, *args)
        NvmeBackend._pread = slow
        handle = store.swap_in("a")  # in flight during the fork
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: atexit and finalizers run in the child
        for _ in range(100):
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, 9)
            print("the child hung")
            sys.exit(1)
        assert torch.equal(handle.wait(), torch.ones(10))
        print("exited")
        """
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, timeout=60, capture_output=True, text=True
    )
    assert done.stdout.strip() == "exited", (done.stdout, done.stderr[-2000:])


def test_a_folder_under_the_home_folder(tmp_path, monkeypatch):
    """``~`` as Offload(folder=) and checkpoints take it (the swap files went to a literal "~"
    folder under the working directory)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    s = TensorStore(OffloadConfig(tier=Tier.NVME, folder="~/swap", block_bytes=BLOCK))
    s.swap_out("w", torch.ones(10)).wait()
    assert (tmp_path / "swap" / "LOCK").exists() and not (tmp_path / "~").exists()
    s.close()


def test_prefetch_of_one_name_is_a_type_error(tmp_path):
    """A bare name was read letter by letter ("no tensor 'l' in the store")."""
    s = TensorStore(OffloadConfig(tier=Tier.NVME, folder=tmp_path / "s", block_bytes=BLOCK))
    s.swap_out("layer", torch.ones(10)).wait()
    with pytest.raises(TypeError, match="a list of names"):
        s.prefetch("layer")
    s.close()


def _collect_in(handle, *, after_set: bool) -> None:
    """Run the garbage collector where ``_finish`` may allocate: holding the handle's lock, or
    right after its event is set."""
    if not after_set:
        with handle._lock:
            gc.collect()
        return
    event, real = handle._event, handle._event.set

    class Setting:
        def set(self) -> None:
            real()
            gc.collect()

        def __getattr__(self, name):
            return getattr(event, name)

    handle._event = Setting()


@pytest.mark.parametrize("after_set", [False, True])
def test_a_callback_a_finalizer_adds_inside_the_handle_s_lock_runs(after_set):
    """An activation checkpoint's release, chained onto the swap that wrote it, runs in a
    finalizer: the garbage collector may run it on an I/O thread inside the handle's locked
    block (``_finish``'s allocations), where a plain lock blocked the thread for good (an
    explorer); added as the handle finishes, the callback must run, not be dropped."""
    from zeroshard.offload import SwapHandle

    handle, ran = SwapHandle("swap_out", "x"), []

    class Packed:  # (in a reference cycle: freed by the collector only)
        pass

    packed = Packed()
    packed.cycle = packed
    weakref.finalize(packed, handle.add_done_callback, lambda h: ran.append(h.name))
    del packed
    done = threading.Event()

    def io_thread() -> None:
        _collect_in(handle, after_set=after_set)
        handle.start(0)  # (finishes at once)
        done.set()

    threading.Thread(target=io_thread, daemon=True).start()
    assert done.wait(10), "the finalizer blocked on the lock its thread held"
    assert ran == ["x"]


def test_a_raising_done_callback_leaves_the_others_to_run(caplog):
    # The store chains the next operation on a name as a done-callback of the last one: a
    # user's callback that raised before it stopped it, and everything after on that name hung.
    from zeroshard.offload import SwapHandle

    handle, ran = SwapHandle("swap_out", "w"), []
    handle.add_done_callback(lambda h: 1 / 0)
    handle.add_done_callback(lambda h: ran.append(h.name))
    handle.start(0)
    assert ran == ["w"] and handle.done()
    assert "ZeroDivisionError" in caplog.text


def test_a_signal_as_an_operation_is_chained_still_starts_it(tmp_path, monkeypatch):
    # A Ctrl-C between a handle's registration as the name's last operation and its start
    # left it pending for good: every later operation on the name, and close(), hung (an
    # explorer). It lands once the operation has started.
    import signal

    with TensorStore(OffloadConfig(tier=Tier.NVME, folder=tmp_path, block_bytes=BLOCK)) as store:
        store.swap_out("w", torch.zeros(4)).wait(timeout=10)
        real, calls = TensorStore._executor, []

        def executor(self):
            calls.append(1)
            if len(calls) == 1:
                signal.raise_signal(signal.SIGINT)  # (Python's handler: a KeyboardInterrupt)
            return real(self)

        monkeypatch.setattr(TensorStore, "_executor", executor)
        with pytest.raises(KeyboardInterrupt):
            store.swap_out("w", torch.ones(4))
        assert calls, "the operation never asked for a worker"
        assert torch.equal(store.swap_in("w").wait(timeout=10), torch.ones(4))
