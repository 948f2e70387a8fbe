"""Hybrid sharding (HSDP): stages 1-3 shard inside groups of k ranks and replicate across them.

On 4 gloo ranks as 2 shard groups of 2 ({0, 1} and {2, 3}): training parity against one process
trained in the same test, the per-scope ledger against the formulas, FSDP2's HSDP state-dict
layout, checkpoints resharded between hybrid and plain sharding, and the one-line errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from parity_models import batch, build, loss_of, param_groups

import zeroshard
from zeroshard import checkpoint
from zeroshard.collectives import REPLICATE, SHARD, WORLD, Ledger
from zeroshard.engine import ShardConfig
from zeroshard.mesh import HYBRID_DIMS
from zeroshard.testing import Workers

PER_RANK_BATCH = 2
K = 2  # ranks per shard group


def _hybrid(stage: int, how: str = "config", kind: str = "gpt", seed: int = 0):
    """A fresh ``kind`` model sharded at ``stage`` in groups of ``K`` (``how``: through
    ``ShardConfig(shard_group_size=K)`` or a 2-D DeviceMesh), and its unsharded copy."""
    torch.manual_seed(seed)
    ref, policy = build(kind)
    if how == "config":
        kwargs = dict(config=ShardConfig(shard_group_size=K))
    else:
        from torch.distributed.device_mesh import init_device_mesh

        dm = init_device_mesh(
            "cpu", (dist.get_world_size() // K, K), mesh_dim_names=("replicate", "shard")
        )
        kwargs = dict(mesh=dm)
    model = zeroshard.shard(copy.deepcopy(ref), stage=stage, wrap=policy, **kwargs)
    return model, ref


# ----------------------------------------------------------------------------- parity


def _parity(stage: int, how: str, kind: str, steps: int, clip: float) -> dict:
    """Train the hybrid-sharded model (this rank's rows) and the unsharded reference (the
    global batch) with clipping active; the largest loss, norm and parameter differences, and
    whether this rank's master shards equal those of its replica in the other group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = _hybrid(stage, how, kind)
    engine = zeroshard.engine_of(model)
    assert engine.mesh.shard_size == K and engine.mesh.num_replicas == world // K
    assert engine.mesh.shard_rank == rank % K  # groups of consecutive ranks
    opt = zeroshard.optimizer(model, torch.optim.AdamW, param_groups(model, 0.1), lr=1e-3)
    ref_opt = torch.optim.AdamW(param_groups(ref, 0.1), lr=1e-3)
    worst = {"loss": 0.0, "norm": 0.0}
    for step in range(steps):
        x, y = batch(kind, step, PER_RANK_BATCH * world)
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        loss = loss_of(kind, model, x[mine], y[mine])
        opt.backward(loss)
        norm = opt.clip_grad_norm(clip)
        opt.step()
        opt.zero_grad()
        ref_loss = loss_of(kind, ref, x, y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in ref.parameters() if p.requires_grad], clip
        )
        ref_opt.step()
        ref_opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        worst["loss"] = max(worst["loss"], abs(total.item() / world - ref_loss.item()))
        worst["norm"] = max(worst["norm"], abs(norm.item() - ref_norm.item()))
    # Replicas hold bit-identical shards: rank r's masters against rank (r + K) % world's.
    masters = torch.cat([f.master.reshape(-1) for f in engine.flat_params])
    every = [torch.empty_like(masters) for _ in range(world)]
    dist.all_gather(every, masters)
    replica_equal = torch.equal(masters, every[(rank + K) % world])
    with zeroshard.summon_full_params(model):
        pairs = zip(model.parameters(), ref.parameters())
        worst["param"] = max((a - b).abs().max().item() for a, b in pairs if a.numel())
    return {**worst, "replica_equal": replica_equal}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parity_two_groups_of_two(workers4, stage):
    for rank, r in enumerate(workers4.run(_parity, stage, "config", "gpt", 6, 0.5)):
        assert r["loss"] < 1e-5 and r["param"] < 1e-5 and r["norm"] < 1e-5, (rank, r)
        assert r["replica_equal"], rank


def test_parity_through_a_device_mesh_with_frozen_and_odd_parameters(workers4):
    for kind in ("frozen_mlp", "odd"):
        for rank, r in enumerate(workers4.run(_parity, 3, "mesh", kind, 5, 0.05)):
            assert r["loss"] < 1e-5 and r["param"] < 1e-5 and r["norm"] < 1e-4, (kind, rank, r)
            assert r["replica_equal"], (kind, rank)


def _hybrid_in_a_sub_mesh(stage: int) -> dict:
    """Shard groups of one rank inside each data-parallel group of a (dp, tp) DeviceMesh's
    "dp" dim ({0, 2} and {1, 3}), the model not split: each group trains its own copy."""
    from zeroshard import tensor_parallel

    dp = tensor_parallel.mesh_2d(2)[0]["dp"]
    ranks = dist.get_process_group_ranks(dp.get_group())
    torch.manual_seed(0)
    ref, policy = build("gpt")
    model = zeroshard.shard(
        copy.deepcopy(ref), stage=stage, wrap=policy, mesh=dp,
        config=ShardConfig(shard_group_size=1),
    )  # fmt: skip
    mesh = zeroshard.engine_of(model).mesh
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    i = ranks.index(dist.get_rank())
    for step in range(3):
        x, y = batch("gpt", step, PER_RANK_BATCH * len(ranks))
        mine = slice(i * PER_RANK_BATCH, (i + 1) * PER_RANK_BATCH)
        opt.backward(loss_of("gpt", model, x[mine], y[mine]))
        opt.step()
        opt.zero_grad()
        loss_of("gpt", ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with zeroshard.summon_full_params(model):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"diff": diff, "shard_size": mesh.shard_size, "replicas": mesh.num_replicas}


@pytest.mark.parametrize("stage", [1, 3])
def test_shard_groups_inside_a_sub_mesh(workers4, stage):
    # Each data-parallel group made its DeviceMesh alone: new_group is a collective of the
    # whole world, and every rank waited in it for ever.
    for r in workers4.run(_hybrid_in_a_sub_mesh, stage):
        assert r["diff"] < 1e-5 and r["shard_size"] == 1 and r["replicas"] == 2, r


def _split_model_on_a_sub_mesh() -> str:
    from zeroshard import tensor_parallel
    from zeroshard.models.gpt import GPT, Block, GPTConfig

    dm, _ = tensor_parallel.mesh_2d(2)
    model = tensor_parallel.parallelize(GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4)), dm)
    try:
        zeroshard.shard(
            model, stage=3, mesh=dm["dp"], wrap=zeroshard.wrap.by_class(Block),
            config=ShardConfig(shard_group_size=1),
        )  # fmt: skip
    except ValueError as exc:
        return str(exc)
    return "sharded"


def test_a_split_model_on_a_sub_mesh_is_refused_on_every_rank(workers4):
    # The refusal came after the shard groups were made: a rank that got past them waited.
    for said in workers4.run(_split_model_on_a_sub_mesh):
        assert "split tensor-parallel, and the mesh has no tensor-parallel dim" in said, said


# ----------------------------------------------------------------------------- ledger


def _traffic(stage: int, k: int) -> dict:
    """Elements this rank moved in the last of two steps, per scope (``k`` 0: no hybrid), and
    Psi, the padded parameter count."""
    torch.manual_seed(0)
    model, policy = build("gpt")
    config = ShardConfig(shard_group_size=k, reshard_root_after_forward=True)
    model = zeroshard.shard(model, stage=stage, wrap=policy, config=config)
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    rank = dist.get_rank()
    for step in range(2):
        x, y = batch("gpt", step, 2 * dist.get_world_size())
        opt.backward(model(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
    ledger = zeroshard.ledger(model)
    engine = zeroshard.engine_of(model)
    last = ledger.scoped_steps[-1]
    per_scope: dict[str, int] = {}
    for (scope, _, label), e in last.items():
        if label in ("params", "grads"):
            per_scope[scope] = per_scope.get(scope, 0) + e.numel
    return {
        "scopes": per_scope,
        "bytes": ledger.by_scope(-1),
        "psi": sum(f.padded_numel for f in engine.flat_params),
        "element_bytes": 4,
    }


@pytest.mark.parametrize("stage,factor", [(1, 2), (2, 2), (3, 3)])
def test_inter_group_traffic_is_the_all_reduce_of_a_one_kth_shard(workers4, stage, factor):
    for r in workers4.run(_traffic, stage, K):
        psi = r["psi"]  # padded to a multiple of K
        # Inside a group: the stage's usual volume over the group; across groups: the ring
        # all-reduce (2n) of this rank's 1/K gradient shard, once per step.
        assert r["scopes"] == {SHARD: factor * psi, REPLICATE: 2 * psi // K}, r
        assert r["bytes"][REPLICATE]["bytes"] == 4 * 2 * psi // K
        assert r["bytes"][WORLD]["numel"] > 0  # the found_inf agreement, over every rank
    for r in workers4.run(_traffic, stage, 0):  # no hybrid: every rank is one shard group
        assert r["scopes"] == {SHARD: factor * r["psi"]}, r
        assert set(r["bytes"]) == {SHARD}


# ----------------------------------------------------------------------------- state dicts


def _state_dicts(stage: int) -> bool:
    """model.state_dict() is FSDP2's HSDP layout, round trips, and matches full_state_dict."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    model, _ = _hybrid(stage, "config")
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch("gpt", 0, 2 * world)
    opt.backward(model(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
    opt.step()
    opt.zero_grad()
    sd = model.state_dict()
    full = zeroshard.full_state_dict(model, rank0_only=False, cpu_offload=False)
    for name, value in sd.items():
        if not isinstance(value, DTensor):
            continue
        assert value.device_mesh.mesh_dim_names == ("replicate", "shard"), name
        assert tuple(value.placements) == (Replicate(), Shard(0)), (name, value.placements)
        rows = torch.chunk(full[name], K, dim=0)
        want = rows[rank % K] if rank % K < len(rows) else full[name][:0]
        assert torch.equal(value.to_local(), want), name
        assert torch.equal(value.full_tensor(), full[name]), name
    osd = opt.state_dict()
    exp_avg = osd["state"]["blocks.0.attn.qkv.weight"]["exp_avg"]
    assert tuple(exp_avg.placements) == (Replicate(), Shard(0))
    # Load into a differently seeded hybrid model: the same full state afterwards.
    other, _ = _hybrid(stage, "config", seed=1)
    other.load_state_dict(sd)
    again = zeroshard.full_state_dict(other, rank0_only=False, cpu_offload=False)
    return all(torch.equal(full[k], again[k]) for k in full)


@pytest.mark.parametrize("stage", [1, 3])
def test_state_dicts_are_fsdp2_hsdp_dtensors(workers4, stage):
    assert all(workers4.run(_state_dicts, stage))


def _full_state(model, opt) -> dict:
    """Rank 0's full model and optimizer state (every rank calls it: collectives)."""
    sd = zeroshard.full_state_dict(model)
    osd = opt.state_dict()
    optim = {
        f"{name}.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v
        for name, st in osd["state"].items()
        for k, v in st.items()
    }
    return {**sd, **{f"optim.{k}": v for k, v in optim.items()}} if dist.get_rank() == 0 else {}


def _save(path: str, hybrid: bool) -> dict:
    """Train 3 steps (hybrid stage 2 in groups of K, or plain stage 3), save, return the state."""
    stage = 2 if hybrid else 3
    model, _ = _hybrid(stage, "config") if hybrid else (_plain(stage), None)
    opt = zeroshard.optimizer(model, torch.optim.AdamW, param_groups(model, 0.1), lr=3e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    per = 12 // world
    for step in range(3):
        x, y = batch("gpt", step, 12)
        opt.backward(model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, model, opt, {"step": 3})
    return _full_state(model, opt)


def _plain(stage: int, seed: int = 5):
    torch.manual_seed(seed)
    model, policy = build("gpt")
    return zeroshard.shard(model, stage=stage, wrap=policy)


def _load(path: str, hybrid: bool) -> dict:
    """A fresh, differently initialized model (hybrid stage 3 in groups of K, or plain stage
    3), loaded from ``path``: its full state."""
    model = _hybrid(3, "config", seed=7)[0] if hybrid else _plain(3)
    opt = zeroshard.optimizer(model, torch.optim.AdamW, param_groups(model, 0.1), lr=3e-3)
    assert checkpoint.load(path, model, opt) == {"step": 3}
    return _full_state(model, opt)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _chunks_cover_each_tensor_once(path) -> None:
    """Every saved tensor's chunks add up to its size exactly: replicas' identical ranges were
    written once (DCP's dedup by name and offsets), and nothing is missing."""
    import math

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {k: v for k, v in metadata.items() if isinstance(v, TensorStorageMetadata)}
    assert any(k.startswith("optim.") for k in tensors)
    for name, md in tensors.items():
        written = sum(math.prod(c.sizes) for c in md.chunks)
        assert written == math.prod(md.size), (name, written, tuple(md.size))


def test_checkpoints_reshard_between_hybrid_and_plain_sharding(workers2, workers4, tmp_path):
    # Hybrid on 4 ranks (replicas write each range once: DCP dedups) -> plain stage 3 on 2.
    saved = workers4.run(_save, str(tmp_path / "hybrid"), True)[0]
    _chunks_cover_each_tensor_once(tmp_path / "hybrid")
    _same(saved, workers2.run(_load, str(tmp_path / "hybrid"), False)[0])
    # Plain stage 3 on 2 ranks -> hybrid on 4.
    saved = workers2.run(_save, str(tmp_path / "plain"), False)[0]
    _same(saved, workers4.run(_load, str(tmp_path / "plain"), True)[0])


# ----------------------------------------------------------------------------- errors


def _bad_inputs() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn import Linear

    messages = []
    for k, match in ((3, "does not divide the world size 4"), (8, "larger than the world size 4")):
        with pytest.raises(ValueError, match=match) as err:
            zeroshard.shard(Linear(2, 2), stage=3, config=ShardConfig(shard_group_size=k))
        assert "use a divisor of 4 (1, 2, 4)" in str(err.value)
        messages.append(str(err.value))
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"needs dims \('replicate', 'shard'\)") as err:
        zeroshard.shard(Linear(2, 2), stage=3, mesh=dm)
    assert "init_device_mesh" in str(err.value)
    messages.append(str(err.value))
    good = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError, match="pass one of the two"):
        zeroshard.shard(Linear(2, 2), stage=3, mesh=good, config=ShardConfig(shard_group_size=4))
    with pytest.warns(UserWarning, match="ignored at stage 0"):
        model = zeroshard.shard(Linear(2, 2), stage=0, config=ShardConfig(shard_group_size=2))
    assert zeroshard.engine_of(model).mesh.hybrid is None
    # Beside tensor parallelism the groups split the data-parallel ranks, not the world (the
    # error named "the world size 2": explorer228)
    from zeroshard.tensor_parallel import mesh_2d

    _, dp = mesh_2d(2)
    with pytest.raises(ValueError, match="larger than the 2 data-parallel ranks; use a divisor"):
        zeroshard.shard(Linear(2, 2), stage=3, mesh=dp, config=ShardConfig(shard_group_size=4))
    return messages


def test_bad_input_is_a_one_line_error(workers4):
    for message in workers4.run(_bad_inputs)[0]:
        assert "\n" not in message
    with pytest.raises(ValueError, match="shard_group_size must be >= 0"):
        ShardConfig(shard_group_size=-1)


def test_ledger_splits_counts_by_scope():
    ledger = Ledger()
    ledger.record("reduce_scatter", "grads", 100, 4)
    ledger.record("all_reduce", "grads", 100, 4, REPLICATE)
    ledger.record("all_reduce", "found_inf", 3, 4, WORLD)
    assert ledger.numel() == 200 and ledger.numel(scope=REPLICATE) == 100
    assert ledger.bytes(scope=SHARD) == 400
    ledger.end_step()
    assert ledger.steps[-1][("all_reduce", "grads")].numel == 100  # totals keep (op, label)
    assert ledger.by_scope(-1) == {
        REPLICATE: {"calls": 1, "numel": 100, "bytes": 400},
        SHARD: {"calls": 1, "numel": 100, "bytes": 400},
        WORLD: {"calls": 1, "numel": 3, "bytes": 12},
    }
    assert ledger.by_scope() == {}


def _refusal(**kwargs) -> str:
    """What ``shard()`` of a Linear at stage 3 with ``kwargs`` raises (or "sharded")."""
    try:
        zeroshard.shard(torch.nn.Linear(8, 8), stage=3, **kwargs)
    except ValueError as e:
        return str(e)
    return "sharded"


def _shard_group_size_on_half_the_ranks() -> str:
    """Ranks 2 and 3 ask for shard groups of 2, ranks 0 and 1 for none."""
    return _refusal(config=ShardConfig(shard_group_size=2 if dist.get_rank() >= 2 else 0))


def _a_device_mesh_on_some_ranks_only() -> str:
    """Every rank builds the same 2 x 2 (replicate, shard) mesh; rank 3 does not pass it."""
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return _refusal(mesh=None if dist.get_rank() == 3 else dm)


@pytest.mark.parametrize(
    "asked, setting, ranks",
    [
        # The shard groups were made first (a collective): ranks 0-1 timed out naming 2-3 as
        # hung, and 2-3 waited in new_group past the job's timeout.
        (_shard_group_size_on_half_the_ranks, "ShardConfig.shard_group_size", "[2, 3]"),
        # Hybrid on ranks 0-2, plain on rank 3: shard() returned, and the first step waited for
        # the collective timeout, each rank blaming another.
        (_a_device_mesh_on_some_ranks_only, "mesh's shard group size", "[3]"),
    ],
)
def test_shard_groups_asked_on_some_ranks_only_are_the_settings_error(
    workers4, asked, setting, ranks
):
    want = f"zeroshard.shard() was called with another {setting} on ranks {ranks} than on rank 0"
    for said in workers4.run(asked):
        assert said.startswith(want), said


def _stages_of_two_sizes() -> float:
    """Two data-parallel jobs in one world, ranks [0, 1, 2] and [3] (pipeline stages of other
    widths), each its own model in shard groups of one rank, as the README asks of sub-meshes;
    then a collective of the whole world. Against plain torch on each job's batch."""
    jobs = [[0, 1, 2], [3]]
    groups = [dist.new_group(ranks) for ranks in jobs]
    job = 0 if dist.get_rank() < 3 else 1
    ranks = jobs[job]
    torch.manual_seed(job)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = zeroshard.shard(
        copy.deepcopy(ref), stage=3, mesh=groups[job], config=ShardConfig(shard_group_size=1)
    )
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(2 * len(ranks), 8, generator=torch.Generator().manual_seed(job))
    mine = x[2 * ranks.index(dist.get_rank()) :][:2]
    for _ in range(2):
        opt.backward(model(mine).square().mean())
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    dist.barrier()
    with zeroshard.summon_full_params(model):
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


def test_stages_of_two_sizes_in_shard_groups_of_one_size():
    # The stage whose ranks are one shard group returned at once, skipping the collective of
    # the whole world in which the other stage's ranks waited (gloo's raw "Timed out waiting").
    # Ranks of their own: after a DeviceMesh that leaves rank 3 out, torch's new_group with
    # use_local_synchronization ([2, 3]) waits for ever, and the shared pool's later tests
    # would.
    with Workers(4) as workers:
        for diff in workers.run(_stages_of_two_sizes):
            assert diff < 1e-6, diff


def _groups_after_models_on_a_two_d_sub_mesh() -> list[int]:
    """Three models sharded in turn (and dropped) on the (replicate, shard) sub-mesh of a 3-D
    (pp, replicate, shard) mesh: the process groups there are, after each."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", *HYBRID_DIMS))
    counts = []
    for _ in range(3):
        model = zeroshard.shard(torch.nn.Linear(8, 8), stage=3, mesh=dm[HYBRID_DIMS])
        del model
        gc.collect()
        counts.append(len(dist.distributed_c10d._world.pg_map))
    return counts


def test_models_on_a_sub_mesh_share_its_group(workers4):
    # Each shard() made a process group of the sub-mesh's ranks, never freed: one group and
    # five sockets per model.
    for counts in workers4.run(_groups_after_models_on_a_two_d_sub_mesh):
        assert counts[0] == counts[1] == counts[2], counts
