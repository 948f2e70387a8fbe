"""Activation checkpoints partitioned over tensor-parallel ranks (Pa) and offloaded (Pa+cpu,
+nvme) on 4 gloo ranks (dp 2 x tp 2): parity with single-process training, bytes per rank
against the planner, the all-gathers Pa adds, padding of sizes that do not split."""

from __future__ import annotations

import math

import pytest
import torch
from parity_models import train_tp_both

import zeroshard
from zeroshard import collectives as C
from zeroshard import tensor_parallel
from zeroshard.models.gpt import GPT, Block, GPTConfig
from zeroshard.planner.describe import from_gpt
from zeroshard.planner.memory import MemoryConfig, Placement, plan_memory
from zeroshard.residual_states.partitioned import CheckpointKeeper

CFG = GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=16)
SEQ = 15  # odd: a checkpoint's (B, T, C) split in 2 pieces is not a split along T
PER_RANK = 2
STEPS = 3


def _run(stage: int, partition: bool, where: str | None, folder: str | None) -> dict:
    config = zeroshard.ShardConfig(checkpoint_every=1, partition_activations=partition)
    offload = None
    if where:
        offload = zeroshard.Offload(activations=where, folder=folder if where == "nvme" else None)
    r = train_tp_both(
        CFG,
        stage=stage,
        seq_len=SEQ,
        per_rank=PER_RANK,
        steps=STEPS,
        config=config,
        offload=offload,
    )
    engine = r["engine"]
    keeper = engine.checkpointing.keeper
    key = (C.TENSOR, "all_gather", "activations")
    steps = [*engine.ledger.scoped_steps, engine.ledger.scoped]
    gathers = [s[key] for s in steps if key in s]
    return {
        "loss": r["loss"],
        "param": r["param"],
        "peak": dict(keeper.bytes.peak),
        "held": dict(keeper.bytes.held),
        "spans": engine.checkpointing.num_spans,
        "gathers": (sum(g.calls for g in gathers), sum(g.bytes for g in gathers)),
    }


CASES = {
    "plain": (False, None),
    "pa": (True, None),
    "pa+cpu": (True, "cpu"),
    "pa+nvme": (True, "nvme"),
    "cpu": (False, "cpu"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoints_anywhere_train_like_a_single_process(workers4, tmp_path, case, stage):
    partition, where = CASES[case]
    for r in workers4.run(_run, stage, partition, where, str(tmp_path)):
        assert r["loss"] < 1e-5 and r["param"] < 1e-5, r
        assert r["held"] == {"device": 0, "cpu": 0, "nvme": 0}, r  # all freed after backward


def _planned(partition: bool, offload: bool | str) -> dict:
    """What ``zeroshard plan`` predicts for this configuration (fp32 activations), per tier."""
    config = MemoryConfig(
        stage=3,
        num_dp_ranks=2,
        num_mp_ranks=2,
        placement=Placement(),
        micro_batch_size=PER_RANK,
        seq_len=SEQ,
        num_layers_per_checkpoint=1,
        partition_activations=partition,
        offload_activations=offload,
        activation_bytes=4,
    )
    memory = plan_memory(from_gpt(CFG), config)
    return {tier: memory.on(tier)["activation_checkpoints"] for tier in ("device", "cpu", "nvme")}


def test_checkpoint_bytes_per_rank_are_split_by_tp_and_leave_the_device(workers4, tmp_path):
    plain = workers4.run(_run, 3, False, None, None)[0]["peak"]
    pa = workers4.run(_run, 3, True, None, None)[0]["peak"]
    pa_cpu = workers4.run(_run, 3, True, "cpu", None)[0]["peak"]
    numel = PER_RANK * SEQ * CFG.n_embd  # one checkpoint: a block's input (B, T, C)
    assert plain["device"] == CFG.n_layer * numel * 4
    assert pa["device"] == CFG.n_layer * math.ceil(numel / 2) * 4  # 1/tp each, padded
    assert pa_cpu["device"] == 0 and pa_cpu["cpu"] == pa["device"]
    for measured, (partition, offload) in ((plain, (False, False)), (pa, (True, False))):
        planned = _planned(partition, offload)["device"]
        assert abs(measured["device"] - planned) <= 0.1 * planned, (measured, planned)
    planned = _planned(True, True)
    assert planned["device"] == planned["nvme"] == 0
    assert abs(pa_cpu["cpu"] - planned["cpu"]) <= 0.1 * planned["cpu"], (pa_cpu, planned)
    # On NVMe: the same bytes, in the swap files (planned there, not in CPU memory).
    pa_nvme = workers4.run(_run, 3, True, "nvme", str(tmp_path))[0]["peak"]
    assert pa_nvme["device"] == pa_nvme["cpu"] == 0 and pa_nvme["nvme"] == pa["device"]
    planned = _planned(True, "nvme")
    assert planned["device"] == planned["cpu"] == 0
    assert abs(pa_nvme["nvme"] - planned["nvme"]) <= 0.1 * planned["nvme"], (pa_nvme, planned)


def test_pa_adds_one_all_gather_per_checkpoint_per_recomputation(workers4):
    for r in workers4.run(_run, 3, True, None, None):
        checkpoints = r["spans"]  # one saved input per span, every step
        assert checkpoints == STEPS * CFG.n_layer, r
        numel = PER_RANK * SEQ * CFG.n_embd
        assert r["gathers"] == (checkpoints, checkpoints * 2 * math.ceil(numel / 2) * 4), r
    for r in workers4.run(_run, 3, False, None, None):
        assert r["gathers"] == (0, 0), r


def _round_trip(shape: tuple[int, ...], where: str | None) -> dict:
    """A tensor saved through the keeper's hooks comes back whole on every rank."""
    _, mesh = tensor_parallel.mesh_2d(2)
    keeper = CheckpointKeeper(
        device=mesh.device,
        ledger=C.Ledger(),
        tp_group=mesh.tp_group,
        partition=True,
        offload=where,
    )
    torch.manual_seed(0)  # the same tensor on every rank, as a tensor-parallel group has
    x = torch.randn(shape, requires_grad=True)
    with keeper.hooks():
        y = x.sin()  # sin saves its input
    held = dict(keeper.bytes.held)
    y.sum().backward()
    expect = x.detach().cos()
    return {"ok": torch.equal(x.grad, expect), "held": held}


@pytest.mark.parametrize("shape", [(3, 5), (1,), (7, 1, 3)])
@pytest.mark.parametrize("where", [None, "cpu"])
def test_sizes_that_do_not_split_are_padded(workers4, shape, where):
    numel = math.prod(shape)
    for r in workers4.run(_round_trip, shape, where):
        assert r["ok"], r
        tier = where or "device"
        assert r["held"][tier] == math.ceil(numel / 2) * 4, r


def test_activations_offload_needs_checkpointing(lone_process):
    with pytest.raises(ValueError, match="set ShardConfig\\(checkpoint_every=k\\)"):
        zeroshard.shard(torch.nn.Linear(2, 2), offload=zeroshard.Offload(activations="cpu"))
    with pytest.raises(ValueError, match="set checkpoint_every"):
        zeroshard.ShardConfig(partition_activations=True)


def test_offloaded_checkpoints_are_read_back_one_ahead_of_their_use():
    keeper = CheckpointKeeper(device=torch.device("cpu"), ledger=C.Ledger(), offload="cpu")
    events: list[tuple[str, str]] = []
    start_read, unpack = keeper._start_read, keeper._unpack

    def spy_read(packed):
        events.append(("read", packed.name))
        return start_read(packed)

    def spy_unpack(packed):
        events.append(("use", packed.name))
        return unpack(packed)

    keeper._start_read, keeper._unpack = spy_read, spy_unpack
    x = torch.randn(4, 3, requires_grad=True)
    with keeper.hooks():
        y = x.sin().sin().sin()  # each sin saves its input: 3 checkpoints, used last first
    assert keeper.bytes.held == {"device": 0, "cpu": 3 * 12 * 4, "nvme": 0}
    y.sum().backward()
    a, b, c = (f"activation{i}" for i in range(3))
    # Using c starts reading b (the next one backward needs) before reading c itself; b was
    # read ahead, so using it only starts a; every checkpoint is read once.
    assert events == [("use", c), ("read", b), ("read", c), ("use", b), ("read", a), ("use", a)]
    expect = torch.cos(x) * torch.cos(x.sin()) * torch.cos(x.sin().sin())
    assert torch.allclose(x.grad, expect.detach())
    assert keeper.bytes.held == {"device": 0, "cpu": 0, "nvme": 0}
    keeper.store.synchronize()
    assert keeper.store.names() == []  # released from the store


def test_checkpoints_the_garbage_collector_frees_inside_the_store_s_lock():
    """An offloaded checkpoint's release is a finalizer (its graph dropped unused: an
    interrupted step's, held in a reference cycle by its exception); the garbage collector may
    run it on a thread inside one of the store's locked blocks (an allocation there), where a
    plain lock blocked that thread for good."""
    import gc
    import threading

    keeper = CheckpointKeeper(device=torch.device("cpu"), ledger=C.Ledger(), offload="cpu")
    x = torch.randn(4, 3, requires_grad=True)
    with keeper.hooks():
        y = x.sin().sin()

    class Frame:  # (the interrupted frame: freed by the cyclic collector only)
        pass

    frame = Frame()
    frame.cycle, frame.graph = frame, y
    del frame, y
    store, done = keeper.store, threading.Event()

    def collect_inside_the_store() -> None:
        with store._lock:
            gc.collect()
        done.set()

    threading.Thread(target=collect_inside_the_store, daemon=True).start()
    assert done.wait(10), "a checkpoint's release blocked on the store's lock its thread held"
    store.synchronize()
    assert store.names() == [] and keeper.bytes.held["cpu"] == 0


def _span_inputs_alive() -> list[bool]:
    """After a forward with Pa, whether each block's whole input is still alive (it must not
    be: only this rank's piece is kept)."""
    import gc
    import weakref

    from zeroshard.models.gpt import GPT, Block

    torch.manual_seed(0)
    model = GPT(CFG)
    device_mesh, mesh = tensor_parallel.mesh_2d(2)
    tensor_parallel.parallelize(model, device_mesh)
    config = zeroshard.ShardConfig(checkpoint_every=1, partition_activations=True)
    model = zeroshard.shard(
        model, stage=3, mesh=mesh, wrap=zeroshard.wrap.by_class(Block), config=config
    )
    inputs: list[weakref.ref] = []  # each span's input, as the checkpointing gets it
    checkpointing = zeroshard.engine_of(model).checkpointing
    enter = checkpointing.enter

    def spy(module, args, kwargs, *rest, **more):
        inputs.append(weakref.ref(args[0]))
        enter(module, args, kwargs, *rest, **more)

    checkpointing.enter = spy
    x = torch.randint(0, CFG.vocab_size, (PER_RANK, SEQ))
    loss = model(x, x.roll(-1, 1))
    gc.collect()
    alive = [r() is not None for r in inputs]
    loss.backward()
    return alive


def test_pa_frees_the_whole_span_input(workers4):
    for alive in workers4.run(_span_inputs_alive):
        assert alive == [False] * CFG.n_layer, alive


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _SplitBetweenUnits(torch.nn.Module):
    """A column-parallel / row-parallel pair in two units: the row-parallel unit's input is
    each tensor-parallel rank's own slice, not a replicated tensor."""

    tp_plan = {"mlps.*.up": "colwise", "mlps.*.down": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.mlps = torch.nn.ModuleList(_Mlp() for _ in range(2))

    def forward(self, x):
        for mlp in self.mlps:
            x = mlp(x)
        return x.square().mean()


def _split_input_with_pa() -> str:
    _, mesh = tensor_parallel.mesh_2d(2)
    torch.manual_seed(0)
    model = _SplitBetweenUnits()
    tensor_parallel.parallelize(model, tensor_parallel.mesh_2d(2)[0])
    config = zeroshard.ShardConfig(checkpoint_every=1, partition_activations=True)
    model = zeroshard.shard(
        model, stage=3, mesh=mesh, wrap=zeroshard.wrap.by_class(torch.nn.Linear), config=config
    )
    try:
        model(torch.randn(2, 5, 16))
    except ValueError as exc:
        return str(exc)
    return "trained"


def test_pa_refuses_a_span_input_split_over_tensor_parallel_ranks(workers4):
    for message in workers4.run(_split_input_with_pa):
        assert "differs across the tensor-parallel ranks" in message, message
        assert "wrap whole blocks" in message and "seed the tensor-parallel ranks alike" in message


def _swap_traffic(folder: str) -> dict:
    """Two steps with every block's checkpoint on NVMe (no tensor parallelism): the swap
    traffic ``offload_stats`` and ``zeroshard train``'s records count per step."""
    from zeroshard.disk_traffic import DiskTraffic

    torch.manual_seed(0)
    model = zeroshard.shard(
        GPT(CFG),
        stage=2,
        wrap=zeroshard.wrap.by_class(Block),
        config=zeroshard.ShardConfig(checkpoint_every=1),
        offload=zeroshard.Offload(activations="nvme", folder=folder),
    )
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    traffic = DiskTraffic(opt)
    for _ in range(2):
        x = torch.randint(0, CFG.vocab_size, (PER_RANK, SEQ))
        opt.backward(model(x, x))
        opt.step()
        opt.zero_grad()
        stats = opt.offload_stats()
    return {"offloaded": traffic.offloaded, "stats": stats}


def test_activation_swap_traffic_is_counted(workers2, tmp_path):
    """Checkpoints on NVMe are disk traffic like the model states' (``zeroshard train``'s
    records left them out, and had no disk fields at all with only activations on NVMe)."""
    numel = PER_RANK * SEQ * CFG.n_embd
    for r in workers2.run(_swap_traffic, str(tmp_path)):
        assert r["offloaded"], r
        stats = r["stats"]
        assert stats["activation_write_bytes"] == CFG.n_layer * numel * 4, r
        assert stats["activation_read_bytes"] == CFG.n_layer * numel * 4, r
        assert stats["activation_wait_s"] >= 0.0, r
