"""``zeroshard.collectives`` on gloo: all-gathers and reduce-scatters by sends and receives give
what gloo's own collectives give, with several in flight and waited in any order, need no
temporary as large as their output, and train exactly as gloo's own."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from parity_models import batch, build

import zeroshard
import zeroshard.collectives as C
from zeroshard.residual_states.host_heap import resident_bytes


def _with_gloo_s_own(fn, *args):
    """``fn(*args)`` with gloo's own all-gather and reduce-scatter (the reference), on one rank
    too."""
    saved = C._point_to_point, C._alone
    C._point_to_point = lambda group, tensor: False  # the workers are reused: restored below
    C._alone = lambda group, tensor: False
    try:
        return fn(*args)
    finally:
        C._point_to_point, C._alone = saved


def _inputs(n: int, i: int) -> torch.Tensor:
    """Rank-specific values for collective ``i`` (n elements, seeded)."""
    g = torch.Generator().manual_seed(1000 * i + dist.get_rank())
    return torch.randn(n, generator=g)


def _interleaved() -> list[torch.Tensor]:
    """Two reduce-scatters (the second in place: into its input's own slice) and two all-gathers
    of odd sizes in flight at once, waited in the reverse order of issue: their messages must
    not cross."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ledger = C.Ledger()
    fulls = [_inputs(world * n, i) for i, n in enumerate((1001, 7))]
    shards = [_inputs(n, 2 + i) for i, n in enumerate((13, 2049))]
    n = fulls[1].numel() // world
    outs = [torch.empty(fulls[0].numel() // world), fulls[1][rank * n : (rank + 1) * n]]
    gathered = [torch.full((world * s.numel(),), float("nan")) for s in shards]
    handles = []
    for k in range(2):
        handles.append(C.reduce_scatter(outs[k], fulls[k], group=None, ledger=ledger))
        handles.append(C.all_gather(gathered[k], shards[k], group=None, ledger=ledger))
    for handle in reversed(handles):
        handle.wait()
    return [t.clone() for t in outs + gathered]


def _in_messages_of(nbytes: int, fn, *args):
    """``fn(*args)`` with reduce-scatters sent in messages of at most ``nbytes``."""
    saved = C.REDUCE_CHUNK_BYTES
    C.REDUCE_CHUNK_BYTES = nbytes  # the workers are reused: restored below
    try:
        return fn(*args)
    finally:
        C.REDUCE_CHUNK_BYTES = saved


@pytest.mark.parametrize("message_bytes", [C.REDUCE_CHUNK_BYTES, 1000])
@pytest.mark.parametrize("pool", ["workers1", "workers2", "workers4"])
def test_exchanges_match_gloo_s_own_collectives(pool, message_bytes, request):
    """One rank: copies (none in place), where gloo's own stage a copy of the input."""
    workers = request.getfixturevalue(pool)
    ours = workers.run(_in_messages_of, message_bytes, _interleaved)  # 1000: 2 messages a slice
    theirs = workers.run(_with_gloo_s_own, _interleaved)
    for mine, reference in zip(ours, theirs, strict=True):
        for a, b in zip(mine, reference, strict=True):
            # Gathers are copies: exact. Sums over 4 ranks may associate differently.
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            if len(ours) <= 2:
                assert torch.equal(a, b)  # two ranks: one addition, the same either way


def _train_stage3() -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model, policy = build("gpt")
    model = zeroshard.shard(model, stage=3, wrap=policy)
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-2)
    losses = []
    for step in range(3):
        x, y = batch("gpt", step, 2)
        loss = model(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with zeroshard.summon_full_params(model, writeback=False):
        return losses, [p.detach().clone() for p in model.parameters()]


def test_training_by_exchanges_is_bitwise_gloo_s_own(workers2):
    ours = workers2.run(_train_stage3)
    theirs = workers2.run(_with_gloo_s_own, _train_stage3)
    for (losses_a, params_a), (losses_b, params_b) in zip(ours, theirs, strict=True):
        assert losses_a == losses_b
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))


def _gather_128_mib() -> dict:
    """Gather 128 MiB; the most the process grew meanwhile."""
    world, rank = dist.get_world_size(), dist.get_rank()
    n = (128 << 20) // 4
    output = torch.full((n,), float("nan"))  # touched: its pages are resident before
    shard = torch.arange(n // world, dtype=torch.float32) + rank * (n // world)
    grown = _grown_by(
        lambda: C.all_gather(output, shard, group=None, ledger=C.Ledger(), async_op=False)
    )
    return {"exact": torch.equal(output, torch.arange(n, dtype=torch.float32)), "grown": grown}


def _grown_by(fn) -> int:
    """The most the process grew while ``fn()`` ran (resident pages sampled every ms: workers
    are reused, so their high-water mark may predate the test)."""
    before, peak, done = resident_bytes(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes() or 0)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return peak[0] - (before or 0)


def _allocated_by(fn) -> int:
    """The most bytes of tensors that ``fn()`` allocated in this thread alive at once (torch's
    allocations, seen as they are made and freed: the process's resident size, sampled, missed
    a buffer alive for a few ms on a busy machine)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    alive, peak = {}, [0]

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}  # fmt: skip
            for t in tree_leaves(out):
                storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
                if storage is None or storage.data_ptr() in inputs or id(storage) in alive:
                    continue
                alive[id(storage)] = storage.nbytes()
                weakref.finalize(storage, alive.pop, id(storage), None)
            peak[0] = max(peak[0], sum(alive.values()))
            return out

    with Allocations():
        fn()
    return peak[0]


def _reduce_128_mib_in_place() -> dict:
    """Reduce-scatter 128 MiB of ones into the input's own slice."""
    world, rank = dist.get_world_size(), dist.get_rank()
    full = torch.ones((128 << 20) // 4)
    n = full.numel() // world
    own = full[rank * n : (rank + 1) * n]
    grown = _allocated_by(
        lambda: C.reduce_scatter(own, full, group=None, ledger=C.Ledger(), async_op=False)
    )
    return {"exact": bool((own == world).all()), "grown": grown}


def test_an_in_place_reduction_receives_through_one_message_sized_buffer(workers2):
    for r in workers2.run(_reduce_128_mib_in_place):
        assert r["exact"], r
        assert r["grown"] <= C.REDUCE_CHUNK_BYTES + (1 << 20), r  # a shard would be 64 MiB
    for r in workers2.run(_in_messages_of, 1 << 40, _reduce_128_mib_in_place):
        assert r["exact"] and r["grown"] >= 64 << 20, r  # one message: a shard-sized buffer


def test_a_large_gather_needs_no_temporary(workers2):
    for r in workers2.run(_gather_128_mib):
        assert r["exact"], r
        assert r["grown"] < 32 << 20, r  # gloo's own gather: +128 MiB
    for r in workers2.run(_with_gloo_s_own, _gather_128_mib):
        assert r["exact"] and r["grown"] > 96 << 20, r  # what the test would see without it


def _drop_then_continue() -> dict:
    """Start a gather and an in-place reduce-scatter, drop their handles unwaited (a model freed
    with collectives in flight), then run the interleaved collectives: they must be right, and
    nothing may stay in flight once they are waited."""
    world, rank = dist.get_world_size(), dist.get_rank()
    full = _inputs(world * 999, 7)
    n = full.numel() // world
    C.reduce_scatter(full[rank * n : (rank + 1) * n], full, group=None, ledger=C.Ledger())
    C.all_gather(torch.empty(world * 5), _inputs(5, 8), group=None, ledger=C.Ledger())
    gc.collect()
    results = _interleaved()
    return {"results": results, "left": len(C._IN_FLIGHT)}


@pytest.mark.parametrize("pool", ["workers2", "workers4"])
def test_collectives_dropped_unwaited_are_finished_by_the_next(pool, request):
    workers = request.getfixturevalue(pool)
    dropped = workers.run(_in_messages_of, 1000, _drop_then_continue)
    reference = workers.run(_with_gloo_s_own, _interleaved)
    for mine, theirs in zip(dropped, reference, strict=True):
        assert mine["left"] == 0, mine["left"]
        for a, b in zip(mine["results"], theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _interrupted_wait_then_continue() -> dict:
    """A synchronous gather whose wait raises on rank 0 (a Ctrl-C while rank 1 is late): its
    receives stay posted, so it is finished at the next collective's start, as a dropped
    handle's is, and its output gets the late rank's shard; nothing stays in flight."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = torch.zeros(world * 5)
    raised = False
    if rank == 0:
        real = C._Exchange.wait
        with mock.patch.object(C._Exchange, "wait", side_effect=KeyboardInterrupt):
            try:
                C.all_gather(out, _inputs(5, 3), group=None, ledger=C.Ledger(), async_op=False)
            except KeyboardInterrupt:
                raised = True
        assert C._Exchange.wait is real
    else:
        time.sleep(0.2)
        C.all_gather(out, _inputs(5, 3), group=None, ledger=C.Ledger(), async_op=False)
    results = _interleaved()
    return {"raised": raised, "out": out, "left": len(C._IN_FLIGHT), "results": results}


def test_a_synchronous_collective_whose_wait_raised_is_finished_by_the_next(workers2):
    first, second = workers2.run(_interrupted_wait_then_continue)
    assert first["raised"] and not second["raised"]
    reference = workers2.run(_with_gloo_s_own, _interleaved)
    for mine, theirs in zip((first, second), reference, strict=True):
        assert mine["left"] == 0, mine["left"]  # it stayed in flight for good
        torch.testing.assert_close(mine["out"], second["out"], rtol=0, atol=0)
        for a, b in zip(mine["results"], theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _signal_right_after_a_message_is_added() -> dict:
    """An in-place reduce-scatter in messages of 1000 bytes whose wait on rank 0 gets a SIGINT
    while it adds the second message (sent from inside the call that posts the next receive,
    which follows the addition): Python raised the KeyboardInterrupt before the bookkeeping
    that marks the message added, and the wait taken up again added it twice."""
    world, rank = dist.get_world_size(), dist.get_rank()
    full = _inputs(world * 999, 9)
    n = full.numel() // world
    expected = full[rank * n : (rank + 1) * n].clone()
    C.reduce_scatter(expected, full.clone(), group=None, ledger=C.Ledger(), async_op=False)
    own = full[rank * n : (rank + 1) * n]
    handle = C.reduce_scatter(own, full, group=None, ledger=C.Ledger())
    raised = False
    if rank == 0:
        real, calls = C._ReduceExchange._post_next, []

        def post_next(self):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGINT)
            return real(self)

        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with mock.patch.object(C._ReduceExchange, "_post_next", post_next):
                handle.wait()
        except KeyboardInterrupt:
            raised = True
        finally:
            signal.signal(signal.SIGINT, previous)
    handle.wait()  # taken up where it was
    return {
        "raised": raised,
        "diff": (own - expected).abs().max().item(),
        "left": len(C._IN_FLIGHT),
    }


def test_a_signal_during_a_message_s_addition_does_not_add_it_twice(workers2):
    first, second = workers2.run(_in_messages_of, 1000, _signal_right_after_a_message_is_added)
    assert first["raised"] and not second["raised"]
    for r in (first, second):
        assert r["diff"] == 0 and r["left"] == 0, r


def _backend_failure_not_waited_again() -> dict:
    """A synchronous gather whose wait failed in the backend (a timeout, a closed pair): the
    group is broken, and it is dropped, not waited again at every later collective's start
    (each another error under that collective's name, or another timeout)."""
    world = dist.get_world_size()
    failing = mock.patch.object(C._Exchange, "wait", side_effect=RuntimeError("pair closed"))
    with failing, contextlib.suppress(RuntimeError):
        C.all_gather(torch.zeros(world * 5), _inputs(5, 4), group=None, ledger=C.Ledger(),
                     async_op=False)  # fmt: skip
    return {"left": len(C._IN_FLIGHT)}


def test_a_collective_that_failed_in_the_backend_is_not_waited_again():
    from zeroshard.testing import Workers

    with Workers(2, timeout_s=60) as workers:  # (its own: the posted messages are left)
        for r in workers.run(_backend_failure_not_waited_again):
            assert r["left"] == 0, r


def test_a_handle_the_garbage_collector_frees_inside_the_lock_does_not_block():
    """A Ctrl-C in ``step()``'s refresh left its last handle in a reference cycle (the
    interrupted frame's exception holds the frame); a collection that freed it while the same
    thread held ``_IN_FLIGHT_LOCK`` (an allocation in ``_wait_orphans``) ran the handle's
    finalizer, which took that lock again: the rank blocked for good, its peers timing out in
    the next collective (a test of the Ctrl-C hung in file order). The finalizer takes no lock;
    the exchange is finished by the next one's start, as any orphan."""
    exchange = C._Exchange([], [])
    handle = C.Handle(exchange, torch.zeros(1))
    handle.cycle = handle  # (only the cyclic collector frees it)
    del handle
    done = threading.Event()

    def collect_holding_the_lock() -> None:
        with C._IN_FLIGHT_LOCK:
            gc.collect()
        done.set()

    try:
        threading.Thread(target=collect_holding_the_lock, daemon=True).start()
        assert done.wait(10), "the handle's finalizer blocked on the lock its thread held"
        assert exchange.orphaned
    finally:
        C._IN_FLIGHT.discard(exchange)


def _mismatched() -> str:
    try:
        C.all_gather(torch.empty(7), torch.ones(2), group=None, ledger=C.Ledger())
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_mismatched_buffers_are_an_error_not_a_hang(workers2):
    for message in workers2.run(_mismatched):
        assert "do not match" in message, message


def _strided_buffers_synced(stage: int) -> dict:
    rank = dist.get_rank()

    class Strided(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            gen = torch.Generator().manual_seed(100 + rank)  # values differ by rank
            self.register_buffer("every_other", torch.randn(4, 8, generator=gen)[:, ::2])
            self.register_buffer("narrowed", torch.randn(4, 8, generator=gen)[:, :4])
            self.register_buffer("transposed", torch.randn(4, 6, generator=gen).t())
            self.register_buffer("expanded", torch.randn(1, 4, generator=gen).expand(3, 4))
            self.register_buffer("counts", torch.arange(8)[::2] + rank)  # (int: the same path)

    model = zeroshard.shard(Strided(), stage=stage)
    out = {}
    for name, buf in model.named_buffers():
        every = [torch.empty_like(buf.contiguous()) for _ in range(dist.get_world_size())]
        dist.all_gather(every, buf.contiguous())
        out[name] = all(torch.equal(e, every[0]) for e in every)
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_strided_buffers_are_synced_whole(workers2, stage):
    # A strided buffer was broadcast in place: gloo moved numel() elements from its first one,
    # half of rank 0's slice landed beside it (8 of 16 elements differing on rank 1), and an
    # expanded one (stride 0) was read and written past its memory (a large one aborted).
    for r in workers2.run(_strided_buffers_synced, stage):
        assert r == dict.fromkeys(
            ("every_other", "narrowed", "transposed", "expanded", "counts"), True
        )


def _in_different_collectives() -> str:
    """Rank 0 gathers a unit while rank 1 reduce-scatters one of the same size (a rank with a
    batch fewer evaluating while the other is in its backward)."""
    from zeroshard.watchdog import CollectiveTimeout

    world, ledger = dist.get_world_size(), C.Ledger()
    out = torch.zeros(world * 4)
    try:
        if dist.get_rank() == 0:
            C.all_gather(out, torch.full((4,), 1.0), group=None, ledger=ledger, unit="blocks.0",
                         async_op=False)  # fmt: skip
        else:
            C.reduce_scatter(torch.zeros(4), torch.ones(world * 4), group=None, ledger=ledger,
                             unit="blocks.0", async_op=False)  # fmt: skip
    except CollectiveTimeout as exc:
        return str(exc)
    return f"completed with {out.tolist()}"


@pytest.mark.alone  # (a 1 s collective timeout that the first collectives must meet)
def test_a_gather_and_a_reduce_scatter_of_one_size_time_out():
    """Point-to-point collectives were told apart by a count alone: a gather took a
    reduce-scatter's messages of the same size, and the rank computed with gradients as weights
    without a word (explorer: a rank with a batch fewer evaluated on wrong weights). Gathers of
    two units of one size still pair: the step's order digest refuses them
    (``tests/test_engine_use.py``), and training goes on."""
    from zeroshard.testing import Workers

    with Workers(2, timeout_s=60, collective_timeout_s=1.0) as workers:
        for message in workers.run(_in_different_collectives):
            assert "The ranks issued different collectives" in message, message
