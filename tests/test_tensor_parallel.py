"""Tensor parallelism beside ZeRO on a 2-D mesh (dp x tp): parity with single-process training,
how the layers are split, what is refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parity_models import train_tp_both

import zeroshard
from zeroshard import checkpoint, tensor_parallel
from zeroshard.checkpoint_files import CheckpointError
from zeroshard.models.gpt import GPT, GPTConfig
from zeroshard.train_config import TrainConfig

CFG = GPTConfig(n_layer=3, n_embd=32, n_head=4, block_size=16)


def _parity(stage: int, clip: float) -> dict:
    r = train_tp_both(CFG, stage=stage, clip=clip)
    mesh = r["engine"].mesh
    # Split pieces differ across the tensor-parallel group; replicated parameters agree.
    model = r["model"]
    with zeroshard.summon_full_params(model):
        qkv = model.blocks[0].attn.qkv.weight.detach().clone()
        ln = model.blocks[0].ln_1.weight.detach().clone()
    pieces = [torch.empty_like(qkv) for _ in range(mesh.tp_size)]
    dist.all_gather(pieces, qkv, group=mesh.tp_group)
    lns = [torch.empty_like(ln) for _ in range(mesh.tp_size)]
    dist.all_gather(lns, ln, group=mesh.tp_group)
    return {
        "loss": r["loss"],
        "param": r["param"],
        "qkv_shape": tuple(qkv.shape),
        "pieces_differ": not torch.equal(pieces[0], pieces[1]),
        "ln_equal": all(torch.equal(lns[0], x) for x in lns),
        "dp": (mesh.rank, mesh.world_size),
        "tp": (mesh.tp_rank, mesh.tp_size),
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tp2_dp2_matches_single_process_training(workers4, stage):
    for rank, r in enumerate(workers4.run(_parity, stage, 0.0)):
        assert r["loss"] < 1e-5 and r["param"] < 1e-5, r
        assert r["qkv_shape"] == (3 * CFG.n_embd // 2, CFG.n_embd), r
        assert r["pieces_differ"] and r["ln_equal"], r
        # Ranks [2d, 2d+1] split layers together (tp inner); data is split by d.
        assert r["dp"] == (rank // 2, 2) and r["tp"] == (rank % 2, 2), r


def test_gradient_clipping_counts_split_and_replicated_parameters_once(workers4):
    # A small clip so that it binds every step: the norm must be the unsplit model's.
    for r in workers4.run(_parity, 3, 0.05):
        assert r["loss"] < 1e-5 and r["param"] < 1e-5, r


def _qkv_rows() -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    whole = model.blocks[1].attn.qkv.weight.detach().clone()
    device_mesh, mesh = tensor_parallel.mesh_2d(2)
    tensor_parallel.parallelize(model, device_mesh)
    local = model.blocks[1].attn.qkv.weight.detach()
    c, r = CFG.n_embd, mesh.tp_rank
    half = c // 2
    # Rank r holds heads [r * H/2, (r+1) * H/2) of each of q, k and v.
    expect = torch.cat([whole[g * c + r * half : g * c + (r + 1) * half] for g in range(3)])
    fc = model.blocks[1].mlp.fc.weight
    proj = model.blocks[1].mlp.proj.weight
    return {
        "qkv": torch.equal(local, expect),
        "fc": tuple(fc.shape),
        "proj": tuple(proj.shape),
        "plain": all(type(p) is torch.nn.Parameter for p in model.parameters()),
        "is_tp": tensor_parallel.is_tensor_parallel(model),
    }


def test_layers_split_by_heads_and_features_into_plain_parameters(workers4):
    for r in workers4.run(_qkv_rows):
        assert r["qkv"] and r["plain"] and r["is_tp"], r
        assert r["fc"] == (2 * CFG.n_embd, CFG.n_embd), r  # column-parallel: outputs split
        assert r["proj"] == (CFG.n_embd, 2 * CFG.n_embd), r  # row-parallel: inputs split


def _refusals(folder: str) -> dict:
    out = {}
    device_mesh, mesh = tensor_parallel.mesh_2d(2)
    for name, fn in {
        "heads": lambda: tensor_parallel.parallelize(
            GPT(GPTConfig(n_layer=1, n_embd=24, n_head=3, block_size=8)), device_mesh
        ),
        "divides": lambda: tensor_parallel.mesh_2d(3),
        "meta": lambda: tensor_parallel.parallelize(_meta_gpt(), device_mesh),
        "hybrid": lambda: zeroshard.shard(
            GPT(CFG), mesh=mesh, config=zeroshard.ShardConfig(shard_group_size=1)
        ),
        "pa_without_tp": lambda: zeroshard.shard(
            GPT(CFG), config=zeroshard.ShardConfig(checkpoint_every=1, partition_activations=True)
        ),
    }.items():
        try:
            fn()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    model = GPT(CFG)
    tensor_parallel.parallelize(model, device_mesh)
    try:
        zeroshard.shard(model)  # the world's mesh: no tensor-parallel dim
        out["world_mesh"] = "no error"
    except ValueError as e:
        out["world_mesh"] = str(e)
    model = zeroshard.shard(model, mesh=mesh)
    opt = zeroshard.optimizer(model, torch.optim.AdamW)
    try:
        checkpoint.save(folder, model, opt)
        out["save"] = "no error"
    except CheckpointError as e:
        out["save"] = str(e)
    return out


def _meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(CFG)


def test_what_tensor_parallelism_cannot_do_is_refused_with_the_fix(workers4, tmp_path):
    for r in workers4.run(_refusals, str(tmp_path / "ckpt")):
        assert "n_head=3 does not split in tp=2" in r["heads"], r
        assert "tp=3 does not divide the world size 4" in r["divides"], r
        assert "needs materialized parameters" in r["meta"], r
        assert "hybrid sharding (shard_group_size) with tensor parallelism" in r["hybrid"], r
        assert "there are none (tp=1)" in r["pa_without_tp"], r
        assert "tensor-parallel models (tp=2) are not supported yet" in r["save"], r
        assert "split tensor-parallel, and the mesh has no tensor-parallel dim" in r["world_mesh"]
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tp": 0}, "tp = 0: tp must be >= 1"),
        ({"tp": 2, "hf": "cfg.json"}, "no tensor-parallel plan yet"),
        ({"tp": 2, "save_every": 5}, "checkpoints of tensor-parallel models"),
        ({"partition_activations": True, "checkpoint_every": 1}, "pass --tp 2 or more"),
        ({"tp": 2, "partition_activations": True}, "pass --checkpoint-every 1"),
        ({"offload_activations": "cpu"}, "pass --checkpoint-every 1"),
        ({"partition_activations": "yes"}, "must be a boolean"),
    ],
)
def test_train_config_checks_tensor_parallel_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**fields)
