"""zeroshard.checkpoint: exact resume in every precision, resharding to other world sizes and
stages, FSDP2 reading and writing the same DCP checkpoints, atomic publishing, keep, and
one-line errors for bad checkpoints."""

from __future__ import annotations

import json
import os
import random
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from parity_models import batch, build, loss_of, param_groups

import zeroshard
from zeroshard import checkpoint, checkpoint_async, checkpoint_checks, checkpoint_files
from zeroshard.checkpoint_files import STALE_TMP_S
from zeroshard.models.gpt import GPT, GPTConfig
from zeroshard.testing import Workers, impatient
from zeroshard.watchdog import CollectiveTimeout, group_timeout_s

GLOBAL_BATCH = 12  # divides across 1, 2, 3 and 4 ranks


def _model(stage: int, precision: str, seed: int = 0):
    torch.manual_seed(seed)
    model, policy = build("gpt")
    return zeroshard.shard(model, stage=stage, wrap=policy, mixed_precision=precision)


def _opt(model, precision: str):
    scaler = None
    if precision == "fp16":  # grows every 2 clean steps: its state changes during the test
        scaler = zeroshard.DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
    return zeroshard.optimizer(
        model, torch.optim.AdamW, param_groups(model, 0.1), lr=3e-3, loss_scaler=scaler
    )


def _train(model, opt, steps: range) -> list[float]:
    """Global-batch steps, this rank taking its rows; the mean losses over ranks. ``opt`` is a
    zeroshard optimizer, or a plain torch one over an FSDP2 model."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    ours = isinstance(opt, zeroshard.ShardedOptimizer)
    losses = []
    for step in steps:
        x, y = batch("gpt", step, GLOBAL_BATCH)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = loss_of("gpt", model, x[mine], y[mine])
        if ours:
            opt.backward(loss)
            opt.clip_grad_norm(1.0)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        # the loss after the step, on the batch of the step: every rank's rows
        with torch.no_grad():
            loss = loss_of("gpt", model, x[mine], y[mine]).float()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


def _draws() -> tuple:
    """One draw from every RNG a checkpoint restores."""
    return torch.rand(3).tolist(), float(np.random.rand()), random.random()


def _path(base: str, name: str) -> str:
    return os.path.join(base, name)


# --------------------------------------------------------------------- exact resume


def _exact_resume(base: str, stage: int, precision: str, n: int) -> bool:
    path = _path(base, f"resume-{stage}-{precision}/step-{n:06d}")
    model = _model(stage, precision)
    opt = _opt(model, precision)
    first = _train(model, opt, range(n))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    checkpoint.save(path, model, opt, {"step": n, "sched": sched, "note": "hi"})
    scaler_then = opt.loss_scaler.state_dict()
    draws = _draws()
    reference = _train(model, opt, range(n, 2 * n))
    ref_params = zeroshard.full_state_dict(model, rank0_only=False)

    fresh = _model(stage, precision, seed=7)
    fresh_opt = _opt(fresh, precision)
    extra = checkpoint.load(path, fresh, fresh_opt)
    assert extra["step"] == n and extra["note"] == "hi", extra
    assert extra["sched"] == sched.state_dict()
    assert fresh_opt.loss_scaler.state_dict() == scaler_then
    if precision == "fp16":
        assert scaler_then["scale"] != 2.0**10  # it moved: restoring it mattered
    assert _draws() == draws  # torch, numpy and python RNGs restored
    resumed = _train(fresh, fresh_opt, range(extra["step"], 2 * n))
    assert resumed == reference, (first, reference, resumed)
    for k, v in zeroshard.full_state_dict(fresh, rank0_only=False).items():
        assert torch.equal(v, ref_params[k]), k
    return True


@pytest.mark.parametrize(
    "stage,precision", [(3, "fp32"), (1, "fp32"), (3, "bf16"), (2, "bf16"), (3, "fp16")]
)
def test_exact_resume_is_bit_identical(workers2, tmp_path, stage, precision):
    assert all(workers2.run(_exact_resume, str(tmp_path), stage, precision, 3))


# --------------------------------------------------------------------- resharding


def _save_then_continue(path: str, stage: int) -> dict:
    model = _model(stage, "fp32")
    opt = _opt(model, "fp32")
    _train(model, opt, range(3))
    checkpoint.save(path, model, opt, {"step": 3})
    losses = _train(model, opt, range(3, 6))
    return {"losses": losses, "params": zeroshard.full_state_dict(model, rank0_only=False)}


def _load_then_continue(path: str, stage: int) -> dict:
    """Load, save again at once (into ``path-again-<world>-<stage>``: the resharding must be
    lossless), then train on."""
    model = _model(stage, "fp32", seed=9)
    opt = _opt(model, "fp32")
    step = checkpoint.load(path, model, opt)["step"]
    checkpoint.save(f"{path}-again-{dist.get_world_size()}-{stage}", model, opt, {"step": step})
    losses = _train(model, opt, range(step, 6))
    return {"losses": losses, "params": zeroshard.full_state_dict(model, rank0_only=False)}


def _as_saved(path: str, tmp: Path) -> dict:
    """A DCP checkpoint as one plain dict of full tensors (torch's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / (Path(path).name + ".pt")
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def _same_state(path: str, tmp: Path) -> None:
    """Every checkpoint loaded from ``path`` and saved again at once, at any world size and
    stage, holds ``path``'s tensors bit for bit: model, optimizer states and steps."""
    want = _as_saved(path, tmp)
    again = sorted(
        p for p in Path(path).parent.iterdir() if p.name.startswith(f"{Path(path).name}-again")
    )
    assert again
    for other in again:
        got = _as_saved(str(other), tmp)
        assert got.keys() == want.keys()
        flat_want, flat_got = _flat(want), _flat(got)
        assert any(k.endswith("exp_avg_sq") for k in flat_want)  # optimizer states compared too
        assert flat_want.keys() == flat_got.keys(), other.name
        for k, v in flat_want.items():
            same = torch.equal(v, flat_got[k]) if torch.is_tensor(v) else v == flat_got[k]
            assert same, (other.name, k)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _close(a: dict, b: dict) -> None:
    """Losses within 1e-6; parameters within 1e-5. The state loaded is the saved one bit for bit
    (``_same_state``); after it, another world size sums gradients in another order, and Adam
    divides such last-bit differences of tiny gradients by their own size (about 2e-6 on a bias
    after 3 steps here)."""
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)) < 1e-6, (a, b)
    for k, v in a["params"].items():
        assert (v - b["params"][k]).abs().max().item() < 1e-5, k


def test_reshards_to_one_three_and_four_ranks(workers1, workers2, workers4, tmp_path):
    path = str(tmp_path / "ckpt")
    reference = workers2.run(_save_then_continue, path, 3)[0]
    for r in workers1.run(_load_then_continue, path, 3):
        _close(reference, r)
    with Workers(3) as three:
        for r in three.run(_load_then_continue, path, 3):
            _close(reference, r)
    for r in workers4.run(_load_then_continue, path, 3):
        _close(reference, r)
    _same_state(path, tmp_path)


def test_reshards_across_stages(workers2, workers4, tmp_path):
    reference = workers2.run(_save_then_continue, str(tmp_path / "s3"), 3)[0]
    for r in workers2.run(_load_then_continue, str(tmp_path / "s3"), 1):  # 3 -> 1
        _close(reference, r)
    reference = workers2.run(_save_then_continue, str(tmp_path / "s1"), 1)[0]
    for r in workers4.run(_load_then_continue, str(tmp_path / "s1"), 3):  # 1 -> 3, 2 -> 4 ranks
        _close(reference, r)
    _same_state(str(tmp_path / "s3"), tmp_path)
    _same_state(str(tmp_path / "s1"), tmp_path)


# --------------------------------------------------------------------- FSDP2 interop


def _fsdp2_gpt():
    """The seed-0 nano GPT under torch's fully_shard: one unit per Block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from zeroshard.models.gpt import Block

    torch.manual_seed(0)
    model, _ = build("gpt")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in model.modules():
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh)
    model = fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)


def _ours_to_fsdp2(path: str) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    reference = _save_then_continue(path, 3)
    model, opt = _fsdp2_gpt()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = _train(model, opt, range(3, 6))
    assert max(abs(a - b) for a, b in zip(losses, reference["losses"])) < 1e-5
    return True


def _fsdp2_to_ours(path: str) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _fsdp2_gpt()
    _train(model, opt, range(3))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    reference = _train(model, opt, range(3, 6))
    ours = _model(3, "fp32", seed=5)
    our_opt = _opt(ours, "fp32")
    with pytest.raises(checkpoint.CheckpointError, match=r"FSDP2's dcp.save writes these"):
        checkpoint.load(path, ours, our_opt)  # (it said "incomplete": the save did not finish)
    state = {"model": ours.state_dict(), "optim": our_opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    ours.load_state_dict(state["model"])
    our_opt.load_state_dict(state["optim"])
    losses = _train(ours, our_opt, range(3, 6))
    assert max(abs(a - b) for a, b in zip(losses, reference)) < 1e-5, (losses, reference)
    return True


def test_fsdp2_reads_our_checkpoints(workers2, tmp_path):
    assert all(workers2.run(_ours_to_fsdp2, str(tmp_path / "ours")))


def test_we_read_fsdp2_checkpoints(workers2, tmp_path):
    assert all(workers2.run(_fsdp2_to_ours, str(tmp_path / "theirs")))


def _plain_dcp_reads_ours(base: str) -> bool:
    """The multi-threaded writer's files (several per rank) load with DCP's default reader, and a
    flipped byte in any of them fails our checksum check."""
    import json

    import torch.distributed.checkpoint as dcp

    path = Path(base) / "step-000003"
    model = _model(3, "fp32")
    opt = _opt(model, "fp32")
    _train(model, opt, range(3))
    checkpoint.save(path, model, opt, {"step": 3})
    files = json.loads((path / checkpoint.META_FILE).read_text())["files"]
    for r in range(dist.get_world_size()):
        mine = [n for n in files if n.startswith(f"__{r}_") and n.endswith(".distcp")]
        assert len(mine) == checkpoint._WRITE_THREADS, sorted(files)
    assert sorted(files) == checkpoint_files.data_files(path)
    fresh = _model(3, "fp32", seed=7)
    fresh_opt = _opt(fresh, "fp32")
    state = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    want = zeroshard.full_state_dict(model, rank0_only=False)
    got = zeroshard.full_state_dict(fresh, rank0_only=False)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert _train(fresh, fresh_opt, range(3, 5)) == _train(model, opt, range(3, 5))
    dist.barrier()
    last = sorted(n for n in files if n.endswith(".distcp"))[-1]
    if dist.get_rank() == 0:
        data = bytearray((path / last).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (path / last).write_bytes(bytes(data))
    dist.barrier()
    with pytest.raises(checkpoint.CheckpointError, match=rf"{last} is corrupted"):
        checkpoint.load(path, fresh, fresh_opt)
    return True


def test_plain_dcp_reads_our_multithreaded_checkpoints(workers2, tmp_path):
    assert all(workers2.run(_plain_dcp_reads_ours, str(tmp_path)))


# --------------------------------------------------------------------- publishing and keep


def _publishing(base: str) -> bool:
    model = _model(3, "fp32")
    opt = _opt(model, "fp32")
    folder = Path(base) / "ckpt"
    if dist.get_rank() == 0:  # what a save killed before its rename leaves: removed by the next
        (folder / "step-000000.tmp-dead").mkdir(parents=True)  # (another run's, untouched)
        os.utime(folder / "step-000000.tmp-dead", (0, time.time() - STALE_TMP_S - 1))
    dist.barrier()
    for step in range(1, 5):
        _train(model, opt, range(step - 1, step))
        checkpoint.save(checkpoint.step_path(folder, step), model, opt, {"step": step}, keep=2)
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["step-000003", "step-000004"], names  # no temp or old folders left
    assert checkpoint.latest(folder) == folder / "step-000004"
    found = checkpoint.info(folder / "step-000004")
    assert found.complete and found.step == 4 and found.world_size == 2 and found.stage == 3
    assert found.param_dtype == "float32" and found.size_bytes > 0
    assert found.num_params == sum(p.numel() for p in model.parameters())
    files = sorted(os.listdir(folder / "step-000004"))
    assert {"zeroshard.json", ".metadata", "rank-00000.pt", "rank-00001.pt"} <= set(files)
    # Saving again at an existing path replaces it whole.
    _train(model, opt, range(4, 5))
    again = str(folder / "step-000004")
    checkpoint.save(again, model, opt, {"step": 5})
    assert checkpoint.info(again).step == 5
    assert sorted(p.name for p in folder.iterdir()) == names
    fresh = _model(3, "fp32", seed=3)
    assert checkpoint.load(again, fresh, _opt(fresh, "fp32"))["step"] == 5
    for k, v in zeroshard.full_state_dict(fresh, rank0_only=False).items():
        assert torch.equal(v, zeroshard.full_state_dict(model, rank0_only=False)[k]), k
    # Too little space: nothing is written, the shortfall is in bytes.
    tiny_disk = mock.patch.object(checkpoint_checks, "free_bytes", return_value=1000)
    with tiny_disk, pytest.raises(checkpoint.CheckpointError, match=r"bytes short"):
        checkpoint.save(str(folder / "step-000009"), model, opt, {"step": 9})
    dist.barrier()
    assert not any("000009" in p.name for p in folder.iterdir())
    # The estimate covers what is written, headers included (a small model's are a large part):
    # a disk one byte short of a checkpoint's size refuses the next one.
    written = sum(p.stat().st_size for p in Path(again).iterdir())
    short_disk = mock.patch.object(checkpoint_checks, "free_bytes", return_value=written - 1)
    with short_disk, pytest.raises(checkpoint.CheckpointError, match=r"bytes short"):
        checkpoint.save(str(folder / "step-000009"), model, opt, {"step": 9})
    return True


def test_publishing_keep_overwrite_and_space(workers2, tmp_path):
    assert all(workers2.run(_publishing, str(tmp_path)))


def _folder_and_prune_failures(base: str) -> bool:
    """A checkpoint folder one rank cannot make stops every rank with its reason (that rank
    raised a bare PermissionError alone, the others waited for it in a collective); an old
    checkpoint that ``keep`` cannot remove is a warning, the new one saved (it was "could not
    publish" the new one, which was in place, and ``zeroshard train`` stopped with exit 2)."""
    import warnings

    model = _model(3, "fp32")
    opt = _opt(model, "fp32")
    _train(model, opt, range(1))
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if "denied" in str(self) and dist.get_rank() == 1:
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    with mock.patch.object(Path, "mkdir", mkdir), pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.save(Path(base) / "denied" / "step-000001", model, opt, {"step": 1})
    assert "Permission denied" in str(e.value) and "every rank can write" in str(e.value)
    folder = Path(base) / "ckpt"
    checkpoint.save(checkpoint.step_path(folder, 1), model, opt, {"step": 1}, keep=1)

    def prune(*args):
        raise PermissionError(1, "Operation not permitted", str(folder / "step-000001"))

    with mock.patch.object(checkpoint, "prune", prune), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        saved = checkpoint.save(checkpoint.step_path(folder, 2), model, opt, {"step": 2}, keep=1)
    assert saved == checkpoint.step_path(folder, 2).absolute()
    assert checkpoint.latest(folder) == checkpoint.step_path(folder, 2)
    said = [str(x.message) for x in w if "could not be removed" in str(x.message)]
    assert len(said) == (dist.get_rank() == 0), said  # rank 0 prunes
    with pytest.raises(TypeError, match="extra is a dict of your own values"):
        checkpoint.save(checkpoint.step_path(folder, 3), model, opt, 5)
    import types  # any mapping is one

    checkpoint.save(folder / "mapped", model, opt, types.MappingProxyType({"step": 3}))
    return True


def test_a_folder_or_an_old_checkpoint_a_rank_cannot_touch(workers2, tmp_path):
    assert all(workers2.run(_folder_and_prune_failures, str(tmp_path)))


def _compiled(base: str) -> dict:
    """A checkpoint of ``torch.compile(model)`` holds the model's own names (every key was
    ``_orig_mod.``-prefixed: refused by the uncompiled model, exported as weights no model has),
    and loads into the uncompiled model, which then trains on as the compiled one does."""
    model = _model(3, "fp32")
    compiled = torch.compile(model, backend="eager")
    opt = _opt(compiled, "fp32")
    _train(compiled, opt, range(2))
    names = list(zeroshard.full_state_dict(compiled, rank0_only=False))
    checkpoint.save(base, compiled, opt, {"step": 2})
    straight = _train(compiled, opt, range(2, 4))
    fresh = _model(3, "fp32", seed=5)
    again = _opt(fresh, "fp32")
    assert checkpoint.load(base, fresh, again)["step"] == 2
    same = _train(fresh, again, range(2, 4)) == straight
    # as an earlier version saved it: every model key behind "_orig_mod."
    with mock.patch("zeroshard.state_dict.uncompiled", lambda m: m):
        checkpoint.save(base + "-old", compiled, opt, {"step": 4})
    old = _model(3, "fp32", seed=7)
    assert checkpoint.load(base + "-old", old, _opt(old, "fp32"))["step"] == 4
    later = zeroshard.full_state_dict(old, rank0_only=False)
    now = zeroshard.full_state_dict(compiled, rank0_only=False)
    return {"names": names, "same": same, "old": all(torch.equal(now[k], later[k]) for k in now)}


def test_a_compiled_model_s_checkpoint_has_the_model_s_names(workers2, tmp_path):
    from zeroshard.export import export_safetensors

    for r in workers2.run(_compiled, str(tmp_path / "ckpt")):
        assert r["names"] and not [n for n in r["names"] if "_orig_mod" in n], r["names"][:3]
        assert r["same"] and r["old"], r
    exported = export_safetensors(tmp_path / "ckpt-old", tmp_path / "out")
    assert set(exported.weight_map) <= set(r["names"]), list(exported.weight_map)[:3]


def _compiled_blocks(base: str) -> dict:
    """Blocks compiled inside the model (``torch.compile(block)``): ``full_state_dict`` gives
    the model's own names, as torch's ``get_state_dict`` does (``_orig_mod.`` was inside every
    block's keys: save_pretrained and export wrote weights no model has); a checkpoint that
    differs from the model only by that level is refused naming it and the fix."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _model(3, "fp32")
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="eager")
    opt = _opt(model, "fp32")
    _train(model, opt, range(1))
    full = zeroshard.full_state_dict(model, rank0_only=False)
    with zeroshard.summon_full_params(model, writeback=False):
        want = {k: v.detach().clone() for k, v in model.named_parameters()}
    theirs = list(get_model_state_dict(model, options=None))
    checkpoint.save(base, model, opt, {"step": 1})
    plain = _model(3, "fp32")
    refused = ""
    try:
        checkpoint.load(base, plain, _opt(plain, "fp32"))
    except checkpoint.CheckpointError as exc:
        refused = str(exc)
    # The blocks' entries whole, as plain tensors (they came as DTensors: the wrapper's call of
    # its block taken for a call of the user's, of the plain kind).
    plain_whole = all(
        type(full[k.replace("_orig_mod.", "")]) is torch.Tensor
        and torch.equal(full[k.replace("_orig_mod.", "")], v)
        for k, v in want.items()
    )
    return {"names": list(full), "theirs": theirs, "refused": refused, "whole": plain_whole}


def test_blocks_compiled_inside_the_model_keep_the_model_s_names(workers2, tmp_path):
    for r in workers2.run(_compiled_blocks, str(tmp_path / "ckpt")):
        assert r["whole"], r["names"][:3]
        assert sorted(r["names"]) == sorted(r["theirs"]), (r["names"][:3], r["theirs"][:3])
        assert not [n for n in r["names"] if "_orig_mod" in n], r["names"][:3]
        assert "differ only by torch.compile's '_orig_mod.' level" in r["refused"], r["refused"]


def _disk_fills_up(base: str, where: str) -> bool:
    """ENOSPC in the middle of a save (after the space check passed), on rank 1 only: every rank
    raises one line, nothing is published, no temporary folder is left, and the previous
    checkpoint, even at the same path, stays whole and loadable. ``where``: in every stream,
    or EIO at the fsync of the files that DCP's writer threads write (they dropped the error:
    the save returned and published a checkpoint that could not be loaded)."""
    import contextlib
    import errno
    import threading

    from torch.distributed.checkpoint import filesystem

    model = _model(3, "fp32")
    opt = _opt(model, "fp32")
    folder = Path(base) / "ckpt"
    _train(model, opt, range(1))
    good = checkpoint.step_path(folder, 1)
    checkpoint.save(good, model, opt, {"step": 1})
    then = zeroshard.full_state_dict(model, rank0_only=False)
    _train(model, opt, range(1, 2))
    real = filesystem.FileSystem.create_stream

    class Full:  # writes 1 KiB, then the disk is full
        def __init__(self, stream):
            self.stream, self.left = stream, 1024

        def write(self, data):
            if len(data) > self.left:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.left -= len(data)
            return self.stream.write(data)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    @contextlib.contextmanager
    def full_disk(fs, path, mode):
        with real(fs, path, mode) as stream:
            yield Full(stream) if "w" in mode else stream

    def fsync(fd):  # in DCP's writer threads (not in the thread that started them)
        if getattr(threading.current_thread(), "_target", None) is writer_thread:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_fsync(fd)

    writer_thread = filesystem._write_files_from_queue

    real_fsync = os.fsync
    if where == "every_stream":
        patch = mock.patch.object(filesystem.FileSystem, "create_stream", full_disk)
    else:
        patch = mock.patch.object(filesystem.os, "fsync", fsync)
    said = "No space left" if where == "every_stream" else "Input/output error"
    on_rank_1 = patch if dist.get_rank() == 1 else contextlib.nullcontext()
    cases = [(checkpoint.step_path(folder, 2), False), (good, False), (good, True)]
    for target, async_save in cases:  # a new path; over the previous one; in the background
        with on_rank_1, pytest.raises(checkpoint.CheckpointError) as info:
            handle = checkpoint.save(target, model, opt, {"step": 2}, async_save=async_save)
            handle.wait() if async_save else None
        message = str(info.value)
        assert "rank 1: OSError" in message and said in message, message
        assert "intact" in message and "\n" not in message, message
        dist.barrier()
        assert sorted(p.name for p in folder.iterdir()) == ["step-000001"]
        assert checkpoint.verify(good) is None and checkpoint.latest(folder) == good
    fresh = _model(3, "fp32", seed=3)
    assert checkpoint.load(good, fresh, _opt(fresh, "fp32"))["step"] == 1
    for k, v in zeroshard.full_state_dict(fresh, rank0_only=False).items():
        assert torch.equal(v, then[k]), k
    return True


@pytest.mark.parametrize("where", ["every_stream", "writer_thread"])
def test_a_full_disk_leaves_the_previous_checkpoint_whole(workers2, tmp_path, where):
    assert all(workers2.run(_disk_fills_up, str(tmp_path), where))


# --------------------------------------------------------------------- bad input


def _bad_input(base: str) -> bool:
    rank = dist.get_rank()
    good = _path(base, "good")
    model = _model(3, "fp32")
    opt = _opt(model, "fp32")
    _train(model, opt, range(1))
    checkpoint.save(good, model, opt, {"step": 1})
    # Another model: wider (mis-shaped), and deeper (unexpected names when loading the smaller).
    torch.manual_seed(0)
    wide = zeroshard.shard(GPT(GPTConfig(n_layer=2, n_embd=48, n_head=2, block_size=64)), stage=3)
    with pytest.raises(checkpoint.CheckpointError, match=r"another model.*mis-shaped: wte.weight"):
        checkpoint.load(good, wide, _opt(wide, "fp32"))
    deep = zeroshard.shard(GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=64)), stage=3)
    with pytest.raises(checkpoint.CheckpointError, match=r"missing: blocks\.2\.") as info:
        checkpoint.load(good, deep, _opt(deep, "fp32"))
    assert "(+" in str(info.value) and "\n" not in str(info.value)
    # Missing path, and a save that stopped between its two renames.
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*nowhere"):
        checkpoint.load(_path(base, "nowhere"), model, opt)
    dist.barrier()
    if rank == 0:
        os.rename(good, good + ".old-abcd")
    dist.barrier()
    with pytest.raises(FileNotFoundError, match=r"good\.old-abcd .*rename it back"):
        checkpoint.load(good, model, opt)
    dist.barrier()
    if rank == 0:
        os.rename(good + ".old-abcd", good)
    dist.barrier()
    # Incomplete saves: a temporary folder, and a folder without zeroshard.json.
    with pytest.raises(checkpoint.CheckpointError, match=r"incomplete save"):
        checkpoint.load(good + ".tmp-1234", model, opt)
    assert not checkpoint.info(good).problem
    # A corrupted data file: named, with the tensor whose stored piece the byte is in (by the
    # chunks' checksums, DCP's chunk of it named as the model names it), by load and by verify.
    dist.barrier()
    data = Path(good) / "__1_0.distcp"
    storage = dcp.FileSystemReader(good).read_metadata().storage_data
    chunk = max(
        (v for v in storage.values() if v.relative_path == data.name), key=lambda v: v.length
    )
    hit = [k.fqn for k, v in storage.items() if v == chunk]
    if rank == 0:
        raw = bytearray(data.read_bytes())
        raw[chunk.offset + chunk.length // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    dist.barrier()
    damaged = (
        rf"__1_0\.distcp is corrupted \(its xxh3_64 .*; damaged: tensors? '{re.escape(hit[0])}'"
    )
    with pytest.raises(checkpoint.CheckpointError, match=damaged):
        checkpoint.load(good, model, opt)
    assert re.search(damaged, checkpoint.verify(good)), checkpoint.verify(good)
    # Its other files' bytes reached the tensors before the damage was found: the model says
    # so at its next use (it trained on a mix of two states before).
    # So do its exports (full_state_dict, save_pretrained) and summon_full_params: they gave
    # the half-loaded values without a word.
    x, y = batch("gpt", 0, 2)

    def summon():
        with zeroshard.summon_full_params(model):
            pass

    uses = [lambda: model(x), opt.step, lambda: checkpoint.save(good + "-2", model, opt)]
    for use in (*uses, lambda: zeroshard.full_state_dict(model), summon):
        with pytest.raises(RuntimeError, match=r"partly overwritten by zeroshard.checkpoint.load"):
            use()
    model.state_dict(), opt.state_dict()  # (templates that a load fills: not refused)
    dist.barrier()
    if rank == 0:
        os.remove(Path(good) / "zeroshard.json")
    dist.barrier()
    with pytest.raises(checkpoint.CheckpointError, match=r"has no zeroshard.json: a torch.dis"):
        checkpoint.load(good, model, opt)
    assert not checkpoint.info(good).complete
    with pytest.raises(ValueError, match="keep"):
        checkpoint.save(good, model, opt, keep=0)
    # A step that is not a count: a bare int() error before, and 2.7 recorded as step 2.
    for step in ("best", None, 2.7, -1, True):
        with pytest.raises(checkpoint.CheckpointError, match=r"extra\['step'\] is the step"):
            checkpoint.save(_path(base, "steps"), model, opt, {"step": step})
    return True


def test_bad_checkpoints_are_one_line_errors(workers2, tmp_path):
    assert all(workers2.run(_bad_input, str(tmp_path)))


def _damage(path: Path, name: str, how: str) -> None:
    """Rank 0 damages ``name`` of the checkpoint at ``path``: "flip" a byte, "cut" it short."""
    dist.barrier()  # every rank is done reading it
    if dist.get_rank() == 0:
        raw = bytearray((path / name).read_bytes())
        if how == "flip":
            raw[int(len(raw) * 0.6)] ^= 0xFF
        (path / name).write_bytes(bytes(raw if how == "flip" else raw[: len(raw) // 2]))
    dist.barrier()


def _loads_that_differ(base: str, stage: int) -> dict:
    """Ranks given different checkpoints, or asked to load them differently."""
    model = _model(stage, "fp32")
    opt = _opt(model, "fp32")
    paths = []
    for n in (1, 2):
        _train(model, opt, range(n - 1, n))
        paths.append(Path(base) / f"step-{n}")
        checkpoint.save(paths[-1], model, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rank = dist.get_rank()
    errors = []
    for mine in (
        lambda: checkpoint.load(paths[rank % 2], model, opt),  # each its own latest()
        lambda: checkpoint.load(paths[0], model, opt if rank else None, model_only=not rank),
    ):
        with pytest.raises(checkpoint.CheckpointError) as caught:
            mine()
        errors.append(str(caught.value))
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    checkpoint.load(paths[0], model, opt)  # (the group is not stuck afterwards)
    return {"errors": errors, "unchanged": unchanged}


@pytest.mark.parametrize("stage", [0, 3])
def test_ranks_load_one_checkpoint_one_way(workers2, tmp_path, stage):
    """Each rank loading its own path trained on a mix of two checkpoints at stages 1-3 (and
    on replicas apart at stage 0), without a word (explorer)."""
    for r in workers2.run(_loads_that_differ, str(tmp_path), stage):
        paths, counts = r["errors"]
        assert "the ranks passed different paths to zeroshard.checkpoint.load" in paths, r
        assert "step-1 on rank 0, " in paths and "step-2 on another" in paths, r
        assert "different numbers of optimizers" in counts, r
        assert r["unchanged"], r


def _edges(base: str) -> bool:
    """What a user's own folder, values and damaged metadata meet: refused in one line."""
    model = _model(3, "fp32")
    opt = _opt(model, "fp32")
    _train(model, opt, range(1))
    # A save never replaces a folder that is not a checkpoint (a run folder of the user's).
    own = Path(base) / "run"
    if dist.get_rank() == 0:
        own.mkdir()
        (own / "notes.txt").write_text("a week of notes")
    dist.barrier()
    with pytest.raises(checkpoint.CheckpointError, match=r"is not a zeroshard checkpoint"):
        checkpoint.save(own, model, opt)
    assert (own / "notes.txt").read_text() == "a week of notes"
    # Every rank passes the same path (a per-rank name would write half a checkpoint each).
    with pytest.raises(checkpoint.CheckpointError, match=r"the ranks passed different paths"):
        checkpoint.save(Path(base) / f"rank{dist.get_rank()}", model, opt)
    # An extra value that load could not read back is refused before anything is written.
    with pytest.raises(checkpoint.CheckpointError, match=r"extra\['where'\] \(a PosixPath\)"):
        checkpoint.save(own / "ckpt", model, opt, {"where": Path(base)})
    # One that cannot be pickled at all: named the same (a raw pickling AttributeError before).
    with pytest.raises(checkpoint.CheckpointError, match=r"extra\['fn'\] \(a function\) could not"):
        checkpoint.save(own / "ckpt", model, opt, {"fn": lambda step: step})
    assert not (own / "ckpt").exists()
    # A path under ~ is the home folder's; the metadata file is not the checkpoint.
    with mock.patch.dict(os.environ, {"HOME": str(Path(base) / "home")}):
        checkpoint.save(checkpoint.step_path("~", 3), model, opt, keep=None)
        assert checkpoint.latest("~") == Path(base) / "home" / "step-000003"
        checkpoint.load("~/step-000003", model, opt)
    # Loaded under inference_mode (an evaluation script's), the optimizer states were inference
    # tensors, and the next step's in-place update of them failed.
    with torch.inference_mode():
        checkpoint.load(Path(base) / "home" / "step-000003", model, opt)
    _train(model, opt, range(1))
    with torch.inference_mode():
        opt.load_state_dict(opt.state_dict())
    _train(model, opt, range(1))
    with pytest.raises(checkpoint.CheckpointError, match=r"zeroshard.json is a file; a che"):
        checkpoint.load(Path(base) / "home" / "step-000003" / "zeroshard.json", model, opt)
    for step in (3, 7):  # (step 7 does not exist: it made a checkpoint named zeroshard.json)
        where = Path(base) / "home" / f"step-00000{step}" / "zeroshard.json"
        with pytest.raises(checkpoint.CheckpointError, match=r"names one of a checkpoint's fi"):
            checkpoint.save(where, model, opt)
    assert not (Path(base) / "home" / "step-000007").exists()
    # The model and the optimizer swapped ("is not sharded" before).
    for call in (checkpoint.save, checkpoint.load):
        with pytest.raises(TypeError, match=r"the model comes first"):
            call(own / "ckpt", opt, model)
    # A damaged .metadata or zeroshard.json: named, before anything is unpickled.
    folder = Path(base) / "ckpt"
    for step in (1, 2):
        checkpoint.save(checkpoint.step_path(folder, step), model, opt, {"step": step})
    newest = checkpoint.step_path(folder, 2)
    for name, how, message in ((".metadata", "flip", "is corrupted"),
                               ("zeroshard.json", "cut", "is damaged"),
                               ("__1_0.distcp", "cut", "is corrupted"),
                               ("rank-00001.pt", "cut", "is corrupted"),  # torch.load: OSError
                               ("rank-00000.pt", "flip", "is corrupted")):  # fmt: skip
        _damage(newest, name, how)
        with pytest.raises(checkpoint.CheckpointError, match=re.escape(name) + " " + message):
            checkpoint.load(newest, model, opt)
        if how == "cut":  # incomplete: resume "auto" and restarts take the one before
            assert checkpoint.latest(folder) == checkpoint.step_path(folder, 1)
        if name.startswith("rank-") and how == "cut":  # unchecked, it is still named
            with pytest.raises(checkpoint.CheckpointError, match=name + " cannot be read"):
                checkpoint.load(newest, model, opt, verify=False)
        if name.endswith(".distcp"):  # read had begun: the model is refused until a good load
            with pytest.raises(RuntimeError, match="partly overwritten"):
                checkpoint.save(newest, model, opt, {"step": 2})
            checkpoint.load(checkpoint.step_path(folder, 1), model, opt)
        checkpoint.save(newest, model, opt, {"step": 2})  # a damaged checkpoint is replaced
        assert checkpoint.latest(folder) == newest
    return True


def test_a_write_cut_short_inside_torch_save_is_said():
    """torch.save's zip writer turns the OSError of a full disk met in the middle of a file
    into "unexpected pos": the message says what it means."""
    from types import SimpleNamespace

    cut = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    said = checkpoint_checks.first_failure(SimpleNamespace(failures={1: (cut, ""), 3: (cut, "")}))
    assert said.startswith("rank 1: RuntimeError: [enforce fail"), said
    assert said.endswith("(a write stopped short: the file system took no more, e.g. a full disk)")


def test_a_users_folder_values_and_damaged_metadata(workers2, tmp_path):
    assert all(workers2.run(_edges, str(tmp_path)))


# --------------------------------------------------------------------- asynchronous save


def _async_save(base: str) -> bool:
    import threading

    rank = dist.get_rank()
    folder = Path(base) / "ckpt"
    model = _model(3, "fp32")
    opt = _opt(model, "fp32")
    _train(model, opt, range(2))
    then = zeroshard.full_state_dict(model, rank0_only=False)
    go = threading.Event()
    write = checkpoint._write_bytes

    def held_back(path, data):  # the background thread writes only once training moved on
        assert go.wait(60)
        write(path, data)

    with mock.patch.object(checkpoint, "_write_bytes", held_back):
        handle = checkpoint.save(
            checkpoint.step_path(folder, 2), model, opt, {"step": 2}, async_save=True
        )
        assert not handle.done()
        draws_then = _draws()  # from the RNG states the save recorded
        _train(model, opt, range(2, 4))  # changes the parameters and optimizer state
        now = zeroshard.full_state_dict(model, rank0_only=False)
        assert any(not torch.equal(then[k], now[k]) for k in then)
        go.set()
        assert handle.wait() == folder / "step-000002" and handle.done()
    # Its collectives give up on a stuck peer after the job's timeout, not gloo's 30 minutes.
    ((_, background),) = checkpoint_async._BACKGROUND_GROUPS.values()  # (the job, the group)
    assert group_timeout_s(background) == group_timeout_s(None)
    # A second save waits for the first: both published, in order.
    first = checkpoint.save(
        checkpoint.step_path(folder, 4), model, opt, {"step": 4}, async_save=True
    )
    with mock.patch.object(checkpoint, "_write_bytes", held_back):
        second = checkpoint.save(
            checkpoint.step_path(folder, 5), model, opt, {"step": 5}, async_save=True
        )
        assert first.done() and checkpoint.info(folder / "step-000004").complete
    assert second.wait() == folder / "step-000005"
    assert checkpoint.latest(folder) == folder / "step-000005"
    fresh = _model(3, "fp32", seed=7)
    fresh_opt = _opt(fresh, "fp32")
    assert checkpoint.load(folder / "step-000002", fresh, fresh_opt) == {"step": 2}
    for k, v in zeroshard.full_state_dict(fresh, rank0_only=False).items():
        assert torch.equal(v, then[k]), k
    torch.manual_seed(123)
    checkpoint.load(folder / "step-000002", fresh, fresh_opt)
    assert _draws() == draws_then  # RNGs as at the call
    # Resuming from the async snapshot gives the same steps as the run that went on.
    assert _train(fresh, fresh_opt, range(2, 4)) == _train(*_rerun(), range(2, 4))

    # A failing background write raises at wait(), on every rank.
    def broken(path, data):
        if rank == 1:
            raise OSError(28, "No space left on device")
        write(path, data)

    with mock.patch.object(checkpoint, "_write_bytes", broken):
        handle = checkpoint.save(folder / "step-000009", model, opt, {"step": 9}, async_save=True)
        with pytest.raises(checkpoint.CheckpointError, match=r"No space left on device"):
            handle.wait()
    assert checkpoint.wait() is None  # nothing in flight any more
    assert not (folder / "step-000009").exists()
    return True


def _rerun():
    """A model and optimizer trained the first two steps, as _async_save's."""
    model = _model(3, "fp32")
    opt = _opt(model, "fp32")
    _train(model, opt, range(2))
    return model, opt


_EXITS_WHILE_SAVING = """
import sys, time, torch, zeroshard
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from zeroshard import checkpoint
write = checkpoint._write_and_publish
def slow(*args):
    time.sleep(0.5)  # still writing when the script ends
    if sys.argv[3] == "fails":
        raise OSError(28, "No space left on device")
    write(*args)
checkpoint._write_and_publish = slow
zeroshard.Mesh.from_env(backend="gloo", device="cpu")
model = zeroshard.shard(torch.nn.Linear(4, 4), stage=3)
opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
checkpoint.save(f"{sys.argv[1]}/step-1", model, opt, async_save=True)
if sys.argv[3] == "fails":
    time.sleep(1.0)  # it failed meanwhile, and no one waits for it
else:  # the second waits for the first
    checkpoint.save(f"{sys.argv[1]}/step-2", model, opt, async_save=True)
if sys.argv[2] == "destroy":
    dist.destroy_process_group()  # most scripts' last line
"""


_ENDINGS = [(ending, write) for ending in ("exit", "destroy") for write in ("writes", "fails")]


@pytest.fixture(scope="module")
def exits_while_saving(tmp_path_factory) -> dict:
    """(ending, write) -> (folder, exit status, stderr) of ``_EXITS_WHILE_SAVING`` run in its own
    folder, the four runs at once (each is mostly a process starting on one core)."""
    import subprocess
    import sys

    from zeroshard.testing import free_port

    runs = {}
    for ending, write in _ENDINGS:
        folder = tmp_path_factory.mktemp(f"{ending}-{write}")
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
        proc = subprocess.Popen(
            [sys.executable, "-c", _EXITS_WHILE_SAVING, str(folder), ending, write],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        runs[ending, write] = folder, proc
    ended = {}
    try:
        for key, (folder, proc) in runs.items():
            err = proc.communicate(timeout=120)[1]
            ended[key] = folder, proc.returncode, err
    finally:
        for _, proc in runs.values():
            proc.kill()
    return ended


def _said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("zeroshard:")]


@pytest.mark.parametrize("ending", ["exit", "destroy"])
def test_an_asynchronous_save_in_flight_at_exit_is_finished(exits_while_saving, ending):
    """As torch.distributed.checkpoint's async_save: the process exits once it is written (it
    was lost, with a warning per save made, and gloo aborted the process under it); also when
    the script ends with ``dist.destroy_process_group()``, which took the save's group from
    under it (the checkpoint lost, the script exiting 0)."""
    folder, status, err = exits_while_saving[ending, "writes"]
    assert status == 0, err[-3000:]
    said = _said(err)
    before = "exiting" if ending == "exit" else "destroying the process group"
    want = f"zeroshard: finishing the asynchronous save of {folder / 'step-2'} before {before}"
    assert len(said) == 1 and said[0].startswith(want), err[-3000:]
    for step in (1, 2):
        assert checkpoint.info(folder / f"step-{step}").complete


@pytest.mark.parametrize("ending", ["exit", "destroy"])
def test_an_asynchronous_save_that_failed_unwaited_is_said_at_exit(exits_while_saving, ending):
    """A save that failed in the background before the exit, and that no one waited for,
    was lost without a word (only one still running at exit was reported). Ending with
    ``dist.destroy_process_group()``, the script raises it there and exits 1 (it exited 0: a
    scheduler took the run whose checkpoint was lost as a success); at a plain exit the status
    stays the script's (forcing it would skip the interpreter's shutdown)."""
    folder, status, err = exits_while_saving[ending, "fails"]
    assert status == (1 if ending == "destroy" else 0), err[-3000:]
    said = _said(err)
    want = f"zeroshard: the asynchronous save of {folder / 'step-1'} failed: "
    assert len(said) == 1 and said[0].startswith(want) and "No space left" in said[0], err
    if ending == "destroy":
        assert "CheckpointError: the asynchronous save of" in err.splitlines()[-1], err
    assert checkpoint.latest(folder) is None


def test_async_save_snapshots_then_writes_in_the_background(workers2, tmp_path):
    assert all(workers2.run(_async_save, str(tmp_path)))


class _WithAux(torch.nn.Module):
    """A head (``aux``) no backward reaches until ``use_aux``: in the root unit beside
    parameters that step, or a unit of its own; declared first or last (the first parameter
    of a sub-group is the one without state)."""

    def __init__(self, aux_first: bool) -> None:
        super().__init__()
        if aux_first:
            self.aux = torch.nn.Linear(8, 4)
        self.body, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        if not aux_first:
            self.aux = torch.nn.Linear(8, 4)
        self.use_aux = False

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.head(h) + self.aux(h) if self.use_aux else self.head(h)


def _aux_run(base: str | None, how: tuple, steps: range, save_at: int = -1, load: bool = False):
    """AdamW steps of ``_WithAux`` (``how``: stage, wrap_aux, aux_first), aux used from step 2;
    saved after step ``save_at`` to ``base``, or loaded from it first."""
    stage, wrap_aux, aux_first = how
    torch.manual_seed(0)
    model = _WithAux(aux_first)
    policy = zeroshard.wrap.by_class(torch.nn.Linear) if wrap_aux else None
    model = zeroshard.shard(model, stage=stage, wrap=policy)
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-2)
    if load:
        checkpoint.load(base, model, opt)
    rank, losses = dist.get_rank(), []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        model.use_aux = step >= 2
        loss = torch.nn.functional.mse_loss(model(x[2 * rank : 2 * rank + 2]), y[2 * rank :][:2])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == save_at and not load:
            checkpoint.save(base, model, opt)
    with zeroshard.summon_full_params(model):
        return losses, [p.detach().clone() for p in model.parameters()]


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _never_stepped(base: str, stage: int, wrap_aux: bool) -> dict:
    out = {}
    for aux_first in (False, True):
        how = (stage, wrap_aux, aux_first)
        plain = _aux_run(None, how, range(5))
        for save_at in (0, 2):  # aux without state yet; aux stepped once, the rest 3 times
            path = f"{base}-{aux_first}-{save_at}"
            saved = _aux_run(path, how, range(5), save_at)
            resumed = _aux_run(path, how, range(save_at + 1, 5), load=True)
            out[f"aux_first={aux_first} saved after step {save_at}"] = {
                "save_changes_nothing": _same(saved, plain),
                "resumed": _same(resumed, (saved[0][save_at + 1 :], saved[1])),
            }
    return out


@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("wrap_aux", [False, True], ids=["aux_in_root", "aux_unit"])
def test_parameters_no_backward_reached_yet(workers2, tmp_path, stage, wrap_aux):
    """A checkpoint saved while some parameters have no optimizer state yet (an unused head,
    beside parameters that stepped, or a unit of its own) is written, does not change the
    training that goes on, and resumes exactly: those parameters come back without state, so
    their first step after the resume is Adam's first, as in the run that went on."""
    for r in workers2.run(_never_stepped, str(tmp_path / "ckpt"), stage, wrap_aux):
        assert all(v["save_changes_nothing"] and v["resumed"] for v in r.values()), r


class _WithNorm(torch.nn.Module):
    """BatchNorm between two layers: each rank's batches move its own running statistics;
    ``wrapped``: the norm inside torch's ``checkpoint_wrapper`` (a level that state-dict keys
    leave out)."""

    def __init__(self, wrapped: bool = False) -> None:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        super().__init__()
        self.inp, self.norm = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 4)
        if wrapped:
            self.norm = checkpoint_wrapper(self.norm)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x))))

    def norm_buffers(self) -> dict[str, torch.Tensor]:
        norm = getattr(self.norm, "_checkpoint_wrapped_module", self.norm)
        return {k: v.clone() for k, v in norm.named_buffers()}


def _norm_run(
    base: str, stage: int, steps: range, load: bool, wrapped: bool = False
) -> tuple[list, dict]:
    """Steps of ``_WithNorm``, saved after step 1 (or loaded from there); each rank's losses
    in eval mode and its buffers at the end."""
    torch.manual_seed(0)
    model = zeroshard.shard(_WithNorm(wrapped), stage=stage, wrap=zeroshard.wrap.by_class("Linear"))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-2)
    if load:
        checkpoint.load(base, model, opt)
    rank, losses = dist.get_rank(), []
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own rows
        x, y = torch.randn(4, 8, generator=g) * (1 + rank), torch.randn(4, 4, generator=g)
        model.train()
        opt.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            losses.append(torch.nn.functional.mse_loss(model(x), y).item())
        if not load and step == 1:
            checkpoint.save(base, model, opt)
    return losses, model.norm_buffers()


def _running_stats_resume(base: str, stage: int, wrapped: bool) -> torch.Tensor:
    path = _path(base, f"norm-{stage}")
    losses, buffers = _norm_run(path, stage, range(4), False, wrapped)
    resumed, resumed_buffers = _norm_run(path, stage, range(2, 4), True, wrapped)
    assert resumed == losses[2:], (losses, resumed)  # eval mode: the running statistics count
    for name, value in buffers.items():
        assert torch.equal(resumed_buffers[name], value), name
    return buffers["running_mean"]


def _saved_running_mean(base: str, stage: int, wrapped: bool) -> torch.Tensor:
    """The running mean of ``_norm_run``'s checkpoint loaded at this world size."""
    model = _WithNorm(wrapped)
    model = zeroshard.shard(model, stage=stage, wrap=zeroshard.wrap.by_class("Linear"))
    checkpoint.load(base, model, None, model_only=True)
    return model.norm_buffers()["running_mean"]


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "checkpoint_wrapper"])
@pytest.mark.parametrize("stage", [0, 3])
def test_per_rank_running_statistics_resume_exactly(workers1, workers2, tmp_path, stage, wrapped):
    """Buffers that each rank updates from its own batches (BatchNorm's running statistics,
    different on every rank) come back to the rank that had them: eval losses resume bit for
    bit on every rank. At another world size every rank gets rank 0's, as full_state_dict
    gives them (DCP's balancing wrote rank 1's; so it did under torch's checkpoint_wrapper
    until the buffers' names were taken as the keys have them)."""
    first, second = workers2.run(_running_stats_resume, str(tmp_path), stage, wrapped)
    assert not torch.equal(first, second)  # the ranks' statistics did differ
    base = str(tmp_path / "two-steps")  # saved after its last step: the buffers saved
    ranks = [
        buffers["running_mean"]
        for _, buffers in workers2.run(_norm_run, base, stage, range(2), False, wrapped)
    ]
    (alone,) = workers1.run(_saved_running_mean, base, stage, wrapped)
    assert torch.equal(alone, ranks[0]) and not torch.equal(alone, ranks[1])


def _another_optimizer(base: str) -> str:
    model = _model(1, "fp32")
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    _train(model, opt, range(1))
    checkpoint.save(base, model, opt)
    other = _model(1, "fp32")
    sgd = zeroshard.optimizer(other, torch.optim.SGD, lr=1e-3, momentum=0.9)
    _train(other, sgd, range(1))
    recorded = _refused(lambda: checkpoint.load(base, other, sgd))
    # A scheduler made before the load adds initial_lr to the groups, which were saved
    # without: loaded, the key kept (DCP's "Missing key ... initial_lr" before).
    adamw = zeroshard.optimizer(other, torch.optim.AdamW, lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5)
    assert _refused(lambda: checkpoint.load(base, other, adamw)) == "loaded"
    assert adamw.param_groups[0]["initial_lr"] == 1e-3
    dist.barrier()
    if dist.get_rank() == 0:
        meta = json.loads((Path(base) / "zeroshard.json").read_text())
        del meta["optimizers"]
        (Path(base) / "zeroshard.json").write_text(json.dumps(meta))
    dist.barrier()
    return recorded, _refused(lambda: checkpoint.load(base, other, sgd))


def _without_optimizer(base: str) -> dict:
    """A model no optimizer trains (a distillation teacher, an EMA copy) is checkpointed with
    ``None`` (or ``[]``) for the optimizer: saved at stage 3, loaded at stage 1 exactly (it was
    refused, "got NoneType"). Something that is not its optimizer is still a one-line error,
    and so is a checkpoint with optimizer states loaded without them (or the reverse)."""
    teacher = _model(3, "fp32")
    checkpoint.save(Path(base) / "teacher", teacher, None, {"step": 4})
    copy = _model(1, "fp32", seed=9)
    out = {"step": checkpoint.load(Path(base) / "teacher", copy, [])["step"]}
    assert checkpoint.verify(Path(base) / "teacher") is None
    assert checkpoint.info(Path(base) / "teacher").step == 4
    mine = zeroshard.full_state_dict(copy, rank0_only=False)
    theirs = zeroshard.full_state_dict(teacher, rank0_only=False)
    out["same"] = all(torch.equal(v, theirs[k]) for k, v in mine.items())
    try:
        checkpoint.save(Path(base) / "x", teacher, torch.optim.SGD(copy.parameters(), lr=0.1))
    except TypeError as exc:
        out["not its optimizer"] = str(exc)
    opt = _opt(copy, "fp32")
    try:
        checkpoint.load(Path(base) / "teacher", copy, opt)
    except checkpoint.CheckpointError as exc:
        out["states missing"] = str(exc)
    return out


def test_a_model_without_an_optimizer_is_checkpointed(workers2, tmp_path):
    for r in workers2.run(_without_optimizer, str(tmp_path)):
        assert r["step"] == 4 and r["same"], r
        assert "or None for a model no optimizer trains (got SGD)" in r["not its optimizer"], r
        assert "holds 0 optimizer(s), and 1 were passed" in r["states missing"], r


def test_a_checkpoint_of_another_optimizer_is_a_one_line_error(workers2, tmp_path):
    for recorded, unrecorded in workers2.run(_another_optimizer, str(tmp_path / "ckpt")):
        assert "saved with optimizer(s) AdamW, and SGD were given" in recorded, recorded
        # a checkpoint that does not record the classes (an earlier version's, FSDP2's)
        assert "does not fit this model and optimizer" in unrecorded, unrecorded
        assert "momentum_buffer" in unrecorded, unrecorded
        assert "\n" not in recorded + unrecorded


def _other_hyperparameters(base: str, stage: int, cls: type, saved: dict, given: dict) -> float:
    """Saved with one setting of an optimizer class, loaded into the same class built with
    another that keeps other states (amsgrad's ``max_exp_avg_sq``, SGD's momentum): the saved
    groups and states are taken whole, as torch's ``load_state_dict`` takes them, and training
    goes on as the run that was not interrupted, computed here by plain torch on every rank's
    rows (``checkpoint.load`` read only the states the given optimizer kept: momentum
    restarted at 0, 2e-1 off, or a KeyError at the next step). Returns the largest difference
    of the parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))

    def train(model, opt, steps: range) -> None:
        for step in steps:
            x = torch.randn(2 * world, 6, generator=torch.Generator().manual_seed(step))
            if isinstance(opt, zeroshard.ShardedOptimizer):
                opt.backward(model(x[2 * rank : 2 * rank + 2]).pow(2).mean())
            else:
                model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    ref = build()
    train(ref, cls(ref.parameters(), lr=0.05, **saved), range(6))
    model = zeroshard.shard(build(), stage=stage)
    opt = zeroshard.optimizer(model, cls, lr=0.05, **saved)
    train(model, opt, range(3))
    checkpoint.save(base, model, opt)
    model = zeroshard.shard(build(), stage=stage)
    opt = zeroshard.optimizer(model, cls, lr=0.05, **given)
    checkpoint.load(base, model, opt)
    train(model, opt, range(3, 6))
    with zeroshard.summon_full_params(model):
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize(
    "cls, saved, given",
    [
        (torch.optim.Adam, {"amsgrad": True}, {}),
        (torch.optim.Adam, {}, {"amsgrad": True}),
        (torch.optim.SGD, {"momentum": 0.9}, {}),
        (torch.optim.SGD, {}, {"momentum": 0.9}),
        (torch.optim.RMSprop, {"centered": True, "momentum": 0.5}, {}),
    ],
)
def test_a_checkpoint_loads_into_its_optimizer_class_built_otherwise(
    workers2, tmp_path, stage, cls, saved, given
):
    for diff in workers2.run(_other_hyperparameters, str(tmp_path), stage, cls, saved, given):
        assert diff < 1e-6, diff


def _initial_lr(base: str) -> dict:
    """A scheduler's ``initial_lr`` saved in the groups is loaded into an optimizer made
    without one (it was dropped: a scheduler resumed with ``last_epoch`` raised KeyError, one
    made fresh took the decayed lr as its base), as torch's ``load_state_dict`` gives it."""
    model = _model(3, "fp32")
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    for _ in range(3):
        _train(model, opt, range(1))
        sched.step()
    checkpoint.save(base, model, opt)
    other = _model(3, "fp32")
    fresh = zeroshard.optimizer(other, torch.optim.AdamW, lr=0.1)
    checkpoint.load(base, other, fresh)
    # torch: the same schedule on a plain optimizer, its state dict loaded into a fresh one
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    plain_sched = torch.optim.lr_scheduler.LambdaLR(plain, lambda s: 1 / (1 + s))
    for _ in range(3):
        plain.step()
        plain_sched.step()
    reloaded = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    reloaded.load_state_dict(plain.state_dict())
    out = {}
    for name, o in (("ours", fresh), ("torch", reloaded)):
        again = torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s), last_epoch=2)
        o.step()
        again.step()
        out[name] = (o.param_groups[0]["initial_lr"], o.param_groups[0]["lr"])
    return out


def test_a_schedulers_initial_lr_is_loaded(workers2, tmp_path):
    for r in workers2.run(_initial_lr, str(tmp_path)):
        assert r["ours"] == r["torch"] and r["ours"][0] == 0.1, r


def _two_optimizers(model) -> list:
    """AdamW over the first half of the parameters, SGD with momentum over the rest."""
    params = list(model.parameters())
    half = len(params) // 2
    return [
        zeroshard.optimizer(model, torch.optim.AdamW, params[:half], lr=3e-3),
        zeroshard.optimizer(model, torch.optim.SGD, params[half:], lr=0.1, momentum=0.9),
    ]


def _train_both(model, opts: list, steps: range) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank, losses = GLOBAL_BATCH // world, []
    for step in steps:
        x, y = batch("gpt", step, GLOBAL_BATCH)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = loss_of("gpt", model, x[mine], y[mine])
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


def _refused(load: Callable[[], Any]) -> str:
    try:
        load()
        return "loaded"
    except (checkpoint.CheckpointError, ValueError) as exc:
        return str(exc)


def _untied(stage: int, untie: bool):
    torch.manual_seed(0)
    model, policy = build("gpt")
    if untie:  # (the reference GPT ties its head to the token embedding)
        model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach() + 1.0)
    return zeroshard.shard(model, stage=stage, wrap=policy)


def _ties_across_a_load(base: str) -> dict[str, str]:
    """Saved from an untied model; loaded into the tied one, which is refused before any read,
    and into an untied one; and the other way round."""
    untied = _untied(2, untie=True)
    checkpoint.save(base + "/untied", untied, None)
    saved = zeroshard.full_state_dict(untied, rank0_only=False)
    tied = _untied(1, untie=False)
    before = zeroshard.full_state_dict(tied, rank0_only=False)
    out = {"into tied": _refused(lambda: checkpoint.load(base + "/untied", tied, None))}
    after = zeroshard.full_state_dict(tied, rank0_only=False)
    out["unchanged"] = str(all(torch.equal(v, after[k]) for k, v in before.items()))
    again = _untied(3, untie=True)
    out["into untied"] = _refused(lambda: checkpoint.load(base + "/untied", again, None))
    mine = zeroshard.full_state_dict(again, rank0_only=False)
    out["same"] = str(all(torch.equal(v, mine[k]) for k, v in saved.items()))
    checkpoint.save(base + "/tied", tied, None)
    out["tied into untied"] = _refused(lambda: checkpoint.load(base + "/tied", again, None))
    return out


def test_a_model_that_ties_what_the_checkpoint_saved_apart_is_refused(workers2, tmp_path):
    """An untied checkpoint read into a tied model wrote pieces of both saved tensors into its
    one (315 elements of 481 from one, 166 from the other, changing with the layout: an
    explorer's). Refused by name; the other way round the one saved tensor fills both."""
    for r in workers2.run(_ties_across_a_load, str(tmp_path)):
        said = r["into tied"]
        assert "holds 'wte.weight' and 'lm_head.weight' as two tensors" in said, said
        assert "Build the model untied" in said and r["unchanged"] == "True", r
        assert r["into untied"] == "loaded" and r["same"] == "True", r
        assert r["tied into untied"] == "loaded", r


def test_ties_recorded_under_torch_compile_s_prefix_are_the_model_s():
    """Builds that saved a compiled model under its prefix recorded its ties so: the model,
    tied as saved, was refused as if the checkpoint had held two tensors."""
    saved = {"_orig_mod.lm_head.weight": "_orig_mod.wte.weight"}
    checkpoint_checks.ties(Path("ckpt"), saved, {"lm_head.weight": "wte.weight"})
    with pytest.raises(checkpoint.CheckpointError, match="as two tensors"):
        checkpoint_checks.ties(Path("ckpt"), {}, {"lm_head.weight": "wte.weight"})


def _rank0_alone(base: str) -> str:
    """``if rank == 0: checkpoint.save(...)``, the DDP habit: a one-line error naming it, not
    a wait for the collective timeout; every rank's save after it works."""
    model = _model(3, "fp32")
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    _train(model, opt, range(1))
    said = ""
    if dist.get_rank() == 0:
        with impatient(), pytest.raises(CollectiveTimeout) as info:
            checkpoint.save(Path(base) / "alone", model, opt)
        said = str(info.value)
    dist.barrier()
    assert _refused(lambda: checkpoint.save(Path(base) / "all", model, opt)) == "loaded"
    assert _refused(lambda: checkpoint.load(Path(base) / "all", model, opt)) == "loaded"
    return said


def test_a_save_on_rank_0_alone_is_named(workers2, tmp_path):
    said = workers2.run(_rank0_alone, str(tmp_path))[0]
    assert said.startswith("save of checkpoint alone timed out after 0.5 s on rank 0: rank 1 did "
                           "not arrive"), said  # fmt: skip
    assert "(save is a collective: every rank calls it, not under `if rank == 0:`" in said
    assert not (tmp_path / "alone").exists()


def _several_optimizers(base: str, stage: int) -> dict[str, Any]:
    """Two optimizers saved and loaded as a list: the run goes on bit for bit (both optimizers'
    states restored); one optimizer for a checkpoint of two, none, the two in the other order,
    or one passed twice, is refused; ``model_only`` loads the weights alone."""
    model = _model(stage, "fp32")
    opts = _two_optimizers(model)
    _train_both(model, opts, range(2))
    checkpoint.save(base, model, opts, {"step": 2})
    saved = zeroshard.full_state_dict(model, rank0_only=False)
    straight = _train_both(model, opts, range(2, 4))
    fresh = _model(stage, "fp32", seed=5)
    again = _two_optimizers(fresh)
    out: dict[str, Any] = {
        "reversed": _refused(lambda: checkpoint.load(base, fresh, again[::-1])),
        "none": _refused(lambda: checkpoint.load(base, fresh, None)),
        "one": _refused(lambda: checkpoint.load(base, fresh, again[0])),
        "twice": _refused(lambda: checkpoint.save(base + "-twice", model, [opts[0], opts[0]])),
        "model_only with one": _refused(
            lambda: checkpoint.load(base, fresh, again, model_only=True)
        ),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert checkpoint.load(base, fresh, again)["step"] == 2
    out["warned"] = [str(w.message)[:120] for w in caught]
    out["same"] = _train_both(fresh, again, range(2, 4)) == straight
    weights = _model(1, "fp32", seed=7)  # fine-tuning from a training checkpoint
    assert checkpoint.load(base, weights, None, model_only=True)["step"] == 2
    mine = zeroshard.full_state_dict(weights, rank0_only=False)
    out["weights"] = all(torch.equal(v, saved[k]) for k, v in mine.items())
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_several_optimizers_resume_exactly(workers2, tmp_path, stage):
    # zeroshard.checkpoint took one optimizer: a second one's states were lost.
    for r in workers2.run(_several_optimizers, str(tmp_path / "ckpt"), stage):
        assert r["same"] and r["weights"], r
        # Each optimizer got the states of both: it said the other's were of frozen parameters.
        assert not r["warned"], r["warned"]
        assert "holds 2 optimizer(s), and 1 were passed" in r["one"], r
        assert "were passed" in r["none"] and "model_only=True" in r["none"], r
        assert "saved with optimizer(s) AdamW, SGD, and SGD, AdamW were given" in r["reversed"]
        assert "both hold" in r["twice"], r
        assert "pass None for the optimizer" in r["model_only with one"], r


def _another_group_layout(base: str) -> str:
    """Saved with two param groups (no decay on biases and norms), loaded into one: each group
    would take one saved group's hyperparameters for all its parameters, silently."""
    model = _model(1, "fp32")
    opt = zeroshard.optimizer(model, torch.optim.AdamW, param_groups(model, 0.1), lr=1e-3)
    _train(model, opt, range(1))
    checkpoint.save(base, model, opt)
    other = _model(1, "fp32")
    params = list(other.parameters())
    halves = [{"params": params[: len(params) // 2]}, {"params": params[len(params) // 2 :]}]
    said = []
    for groups in ([{"params": params}], halves):  # fewer groups; as many, cut elsewhere
        try:
            checkpoint.load(base, other, zeroshard.optimizer(other, torch.optim.AdamW, groups))
            said.append("loaded")
        except (checkpoint.CheckpointError, ValueError) as exc:
            said.append(str(exc))
    return said


def test_a_checkpoint_of_another_param_group_layout_is_a_one_line_error(workers2, tmp_path):
    for fewer, cut in workers2.run(_another_group_layout, str(tmp_path / "ckpt")):
        assert "saved with 2 optimizer param group(s), this optimizer has 1" in fewer, fewer
        assert "holds parameters of saved param groups 0, 1" in cut, cut
        assert "\n" not in fewer + cut


def _bf16_model_resume(base: str, stage: int) -> bool:
    """A model built in bf16 (``from_pretrained(torch_dtype=bf16)``) trains on FP32 masters;
    its checkpoint holds them, not their bf16 rounding, so the resume is exact."""

    def make():
        torch.manual_seed(0)
        model, policy = build("gpt")
        model = zeroshard.shard(model.to(torch.bfloat16), stage=stage, wrap=policy)
        return model, _opt(model, "bf16")

    model, opt = make()
    _train(model, opt, range(2))
    checkpoint.save(base, model, opt)
    _train(model, opt, range(2, 4))
    other, other_opt = make()
    checkpoint.load(base, other, other_opt)
    _train(other, other_opt, range(2, 4))
    mine = _local_masters(model)
    return all(torch.equal(a, b) for a, b in zip(mine, _local_masters(other)))


def _local_masters(model) -> list[torch.Tensor]:
    return [
        f.master.clone() for f in zeroshard.engine_of(model).flat_params if f.master is not None
    ]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_model_built_in_bf16_resumes_exactly(workers2, tmp_path, stage):
    assert all(workers2.run(_bf16_model_resume, str(tmp_path / "ckpt"), stage))


def _whole_values(model) -> dict[str, torch.Tensor]:
    """The model's state dict with every sharded entry gathered whole (a collective)."""
    return {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
        for k, v in model.state_dict().items()
    }


def _failed_load_then_a_good_one(base: str, how: str) -> bool:
    """A load that fails midway (a corrupted data file: its checksum is known once its last
    byte is read) leaves the model refusing to train or save, until the model and optimizer
    are loaded whole again: by ``checkpoint.load`` of a good checkpoint, or by both their
    ``load_state_dict`` (the state dicts still serve as templates meanwhile). Training on then
    equals a fresh model's from the good checkpoint, exactly."""
    folder = Path(base) / "ckpt"
    model = _model(3, "fp32")
    opt = _opt(model, "fp32")
    _train(model, opt, range(1))
    good, bad = checkpoint.step_path(folder, 1), checkpoint.step_path(folder, 2)
    checkpoint.save(good, model, opt, {"step": 1})
    _train(model, opt, range(1, 2))
    checkpoint.save(bad, model, opt, {"step": 2})
    # Cut short: refused before any read, the model untouched (it was partly overwritten).
    cut = checkpoint.step_path(folder, 3)
    checkpoint.save(cut, model, opt, {"step": 2})
    _damage(cut, "__1_0.distcp", "cut")
    before = _whole_values(model)
    with pytest.raises(checkpoint.CheckpointError, match=r"is corrupted \(it is [\d,]+ bytes, "):
        checkpoint.load(cut, model, opt, verify=False)
    after = _whole_values(model)  # (full_state_dict is refused until a good load)
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    _damage(bad, "__1_0.distcp", "flip")
    with pytest.raises(checkpoint.CheckpointError, match="is corrupted"):
        checkpoint.load(bad, model, opt)
    with pytest.raises(RuntimeError, match="partly overwritten"):
        _train(model, opt, range(2, 3))
    fresh = _model(3, "fp32", seed=5)
    fresh_opt = _opt(fresh, "fp32")
    checkpoint.load(good, fresh, fresh_opt)
    if how == "checkpoint":
        assert checkpoint.load(good, model, opt)["step"] == 1
    else:
        model.load_state_dict(fresh.state_dict())
        with pytest.raises(RuntimeError, match="each optimizer's load_state_dict"):
            opt.step()  # the optimizer's states are still the mix
        opt.load_state_dict(fresh_opt.state_dict())
    assert _train(model, opt, range(1, 3)) == _train(fresh, fresh_opt, range(1, 3))
    theirs = zeroshard.full_state_dict(fresh, rank0_only=False)
    return all(torch.equal(v, theirs[k]) for k, v in zeroshard.full_state_dict(model).items())


@pytest.mark.parametrize("how", ["checkpoint", "state dicts"])
def test_a_failed_load_is_refused_until_a_good_one(workers2, tmp_path, how):
    assert all(workers2.run(_failed_load_then_a_good_one, str(tmp_path / how), how))


def _unfrozen(base: str) -> dict:
    """Saved with the first layer frozen, loaded into the same model with it trainable (an
    embedding unfrozen after a warm-up): the weights all load, the optimizer states of the
    layers that trained, and the unfrozen layer starts without any, as a fresh optimizer's."""

    def built(frozen: bool):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8))
        net[0].requires_grad_(not frozen)
        net = zeroshard.shard(net, stage=3, wrap=zeroshard.wrap.by_class(torch.nn.Linear))
        return net, zeroshard.optimizer(net, torch.optim.AdamW, lr=1e-2)

    model, opt = built(frozen=True)
    for _ in range(2):
        opt.backward(model(torch.randn(2, 4)).pow(2).mean())
        opt.step()
        opt.zero_grad()
    checkpoint.save(Path(base) / "warm", model, opt, {"step": 2})
    again, again_opt = built(frozen=False)
    checkpoint.load(Path(base) / "warm", again, again_opt)
    saved = zeroshard.full_state_dict(model, rank0_only=False)
    loaded = zeroshard.full_state_dict(again, rank0_only=False)
    states = again_opt.state_dict()["state"]
    return {
        "weights": all(torch.equal(v, loaded[k]) for k, v in saved.items()),
        "states": sorted(states),
        "steps": sorted({int(st["step"]) for st in states.values()}),
    }


def test_a_layer_unfrozen_after_the_save_starts_without_state(workers2, tmp_path):
    for r in workers2.run(_unfrozen, str(tmp_path)):
        assert r == {"weights": True, "states": ["1.bias", "1.weight"], "steps": [2]}, r


def test_the_step_of_an_optimizer_without_a_step_state(lone_process, tmp_path):
    # SGD keeps no "step" in its states: a save without extra["step"] recorded step 0.
    model = _model(3, "fp32")
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    _train(model, opt, range(3))
    checkpoint.save(tmp_path / "a", model, opt)
    assert checkpoint.info(tmp_path / "a").step == 3
    fresh = _model(3, "fp32", seed=1)
    fresh_opt = zeroshard.optimizer(fresh, torch.optim.SGD, lr=0.1, momentum=0.9)
    checkpoint.load(tmp_path / "a", fresh, fresh_opt)
    _train(fresh, fresh_opt, range(3, 4))
    checkpoint.save(tmp_path / "b", fresh, fresh_opt)
    assert checkpoint.info(tmp_path / "b").step == 4


def _step_with_an_occasional_head(path: str) -> dict:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.aux, self.body, self.head = (torch.nn.Linear(4, 4) for _ in range(3))
            self.use_aux = False

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return self.head(h) + self.aux(h) if self.use_aux else self.head(h)

    torch.manual_seed(0)
    model = zeroshard.shard(Net(), stage=3, wrap=zeroshard.wrap.by_class(torch.nn.Linear))
    opt = zeroshard.optimizer(model, torch.optim.Adam, lr=0.01)
    for step in range(5):
        model.use_aux = step < 2  # Adam counts 2 steps for the auxiliary head, 5 for the rest
        opt.backward(model(torch.randn(2, 4)).square().mean())
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, model, opt)
    fresh = zeroshard.shard(Net(), stage=3, wrap=zeroshard.wrap.by_class(torch.nn.Linear))
    fresh_opt = zeroshard.optimizer(fresh, torch.optim.Adam, lr=0.01)
    checkpoint.load(path, fresh, fresh_opt)
    return {"recorded": checkpoint.info(path).step, "loaded": fresh_opt.steps_taken}


def test_the_step_recorded_is_the_optimizer_s_not_a_lagging_parameter_s(workers2, tmp_path):
    # The first piece's "step" was taken: a parameter out of the loss on some steps (an
    # auxiliary head) recorded 2 of 5 steps, a resume at step 2 replaying three batches.
    for r in workers2.run(_step_with_an_occasional_head, str(tmp_path / "ck")):
        assert r == {"recorded": 5, "loaded": 5}, r


def _sparse_buffer_save(path: str) -> list[str]:
    """A graph's adjacency kept as a sparse buffer: DCP cannot write it, and the save failed
    after its exchanges with "2 of 8 entries were not written ... free space or save
    elsewhere"; refused before any, naming the buffer and the fix. Non-persistent, it saves."""
    said = []
    for persistent in (True, False):
        model = torch.nn.Linear(3, 3)
        adjacency = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.ones(2), (3, 3))
        model.register_buffer("adjacency", adjacency, persistent=persistent)
        model = zeroshard.shard(model, stage=3)
        opt = zeroshard.optimizer(model, torch.optim.Adam, lr=1e-2)
        try:
            checkpoint.save(Path(path) / f"step-{int(persistent)}", model, opt, {"step": 1})
            said.append("saved")
        except checkpoint.CheckpointError as exc:
            said.append(str(exc))
    return said


def test_a_sparse_buffer_is_refused_before_any_write(workers2, tmp_path):
    for refused, saved in workers2.run(_sparse_buffer_save, str(tmp_path)):
        assert refused.startswith("buffer 'adjacency' is a sparse tensor"), refused
        assert "persistent=False" in refused and saved == "saved"
    assert [p.name for p in tmp_path.iterdir()] == ["step-0"]


def _quantization_aware(path: str) -> float:
    """A model prepared for quantization-aware training: its observers' scales are sized at the
    first forward (per channel), so a fresh model's are not the saved ones' shape, and the load
    refused "checkpoint ... is of another model (... mis-shaped ...fake_quant.scale (saved (8,),
    model (1,)))": they are read at the saved shape, and the module's own load resizes them, as
    torch's load_state_dict does. The largest difference from the saved model's evaluation."""
    import torch.ao.quantization as Q

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        model.qconfig = Q.get_default_qat_qconfig("x86")
        return zeroshard.shard(Q.prepare_qat(model), stage=3)

    model = make()
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    opt.backward(model(torch.randn(6, 4)).square().mean())
    opt.step()
    checkpoint.save(Path(path) / "step-1", model, opt, {"step": 1})
    fresh = make()
    checkpoint.load(
        Path(path) / "step-1", fresh, zeroshard.optimizer(fresh, torch.optim.SGD, lr=0.1)
    )
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (fresh.eval()(x) - model.eval()(x)).abs().max().item()


def test_observers_sized_at_the_first_forward_are_loaded(workers2, tmp_path):
    assert workers2.run(_quantization_aware, str(tmp_path)) == [0.0, 0.0]


def test_arguments_that_are_not_a_model_or_a_step(lone_process, tmp_path):
    """save(path, None, opt) was "'NoneType' object has no attribute ..."; step_path(f, -5)
    gave "step--00005"."""
    model = zeroshard.shard(torch.nn.Linear(2, 2), stage=1)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="take the sharded model, got None"):
        checkpoint.save(tmp_path / "c", None, opt)
    with pytest.raises(ValueError, match="an int >= 0; got -5"):
        checkpoint.step_path(tmp_path, -5)
    assert checkpoint.step_path(tmp_path, np.int64(7)).name == "step-000007"


def _hook_computing_on_entries(path: str) -> str:
    """A state_dict hook converting its entries (to BF16 for a smaller file) failed inside the
    save with "'FlatRange' object has no attribute 'to'"; one naming the hook and the fix."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    net[1].register_state_dict_post_hook(
        lambda m, sd, prefix, meta: sd.update({prefix + "weight": sd[prefix + "weight"].bfloat16()})
    )
    model = zeroshard.shard(net, stage=3, wrap=torch.nn.Linear)
    opt = zeroshard.optimizer(model, torch.optim.SGD, lr=0.1)
    try:
        checkpoint.save(Path(path) / "step-1", model, opt, {"step": 1})
    except TypeError as exc:
        return str(exc)
    return "saved"


def test_a_state_dict_hook_computing_on_entries_is_named(workers2, tmp_path):
    for said in workers2.run(_hook_computing_on_entries, str(tmp_path)):
        assert said.startswith("a state_dict hook of this model computes on its entries"), said
        assert "rename or drop keys only" in said


def _thread_error() -> None:
    raise ValueError("a data-loading thread failed")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_leaves_other_threads_errors_to_their_hook(lone_process, tmp_path, async_save):
    # The save collects its writer threads' errors through threading.excepthook: it collected
    # every thread's while it wrote (an async save's whole duration), and the user's hook, a
    # data-loading or logging thread's error, saw nothing (an explorer).
    import threading

    from torch import nn
    from torch.distributed.checkpoint import FileSystemWriter

    seen: list[BaseException] = []
    real = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        other = threading.Thread(target=_thread_error)  # (another thread of the process)
        other.start()
        other.join()
        return real(self, plan, planner)

    torch.manual_seed(0)
    model = zeroshard.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), stage=3)
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    opt.backward(model(torch.ones(2, 4)).sum())
    opt.step()
    with (
        mock.patch.object(threading, "excepthook", lambda args: seen.append(args.exc_value)),
        mock.patch.object(FileSystemWriter, "write_data", write_data),
    ):
        handle = checkpoint.save(tmp_path / "ckpt", model, opt, async_save=async_save)
        if async_save:
            handle.wait()
    assert [type(e) for e in seen] == [ValueError], seen
