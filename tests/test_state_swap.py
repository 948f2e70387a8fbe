"""Optimizer states on the CPU and NVMe tiers (``zeroshard.Offload``) against no offload.

Each multi-rank test trains the same model twice in the same process, with and without the
placement, and compares the parameters bit for bit. The model is the nano GPT wrapped per
``nn.Linear`` with one bucket per unit: 9 sub-groups, so the ring of 3 slots must stream.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from parity_models import batch, build, loss_of, param_groups
from swap_faults import flip_byte, refused_steps

import zeroshard
import zeroshard.testing
from zeroshard.offload import Offload, OffloadError, SwapSpaceError
from zeroshard.offload.folder import pid_lock
from zeroshard.stages import STAGES

PER_RANK_BATCH = 2


def _files(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*"))


def _make(
    stage: int,
    offload: Offload | None,
    mixed_precision: str | None = None,
    kind: str = "gpt",
    **config,
):
    torch.manual_seed(0)
    model, _ = build(kind)
    model = zeroshard.shard(
        model,
        stage=stage,
        wrap=zeroshard.wrap.by_class(torch.nn.Linear),
        config=zeroshard.ShardConfig(bucket_bytes=0, **config),
        mixed_precision=mixed_precision,
        offload=offload,
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, param_groups(model, 0.1), lr=1e-3)
    return model, opt


def _train(model, opt, steps: range, accum: int = 1, kind: str = "gpt") -> list[float]:
    """Train on the same global batches; a small max_norm keeps clipping active."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = []
    for step in steps:
        x, y = batch(kind, step, PER_RANK_BATCH * world)
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        for i, (xm, ym) in enumerate(zip(x[mine].chunk(accum), y[mine].chunk(accum))):
            loss = loss_of(kind, model, xm, ym) / accum
            opt.backward(loss, sync=i == accum - 1)
        opt.clip_grad_norm(0.1)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _params(model) -> list[torch.Tensor]:
    with zeroshard.summon_full_params(model, writeback=False):
        return [p.detach().float().clone() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() if x.numel() else 0.0 for x, y in zip(a, b))


PLACEMENTS = {
    "cpu": dict(optimizer="cpu", gradients="cpu"),
    "nvme": dict(optimizer="nvme"),
    "nvme+grads": dict(optimizer="nvme", gradients="nvme"),
}


def _parity(
    stage: int,
    placement: str,
    folder: str,
    mixed_precision: str | None,
    accum: int = 1,
    kind: str = "gpt",
    **config,
) -> dict:
    where = dict(PLACEMENTS[placement])
    if not STAGES[stage].gradients:
        where.pop("gradients", None)
    offload = Offload(**where, folder=folder if "nvme" in placement else None)
    ref_model, ref_opt = _make(stage, None, mixed_precision, kind, **config)
    ref_losses = _train(ref_model, ref_opt, range(4), accum, kind)
    model, opt = _make(stage, offload, mixed_precision, kind, **config)
    losses = _train(model, opt, range(4), accum, kind)
    stats = opt.offload_stats()
    state_bytes = opt._swap.need_bytes if opt._swap is not None else 0
    out = {
        "losses_equal": losses == ref_losses,
        "param_diff": _max_diff(_params(model), _params(ref_model)),
        "read_bytes": stats.get("read_bytes", 0),
        "grad_bytes": stats.get("grad_read_bytes", 0),
        "num_slots": stats.get("num_slots", 0),
        "slot_bytes": stats.get("slot_bytes", 0),
        "state_bytes": state_bytes,
    }
    torch.distributed.barrier()
    del model, opt
    gc.collect()  # the optimizer owns the store: freeing it deletes the swap files
    torch.distributed.barrier()  # every rank's files are gone before any lists them
    out["files"] = _files(folder)
    return out


@pytest.mark.parametrize(
    "stage,placement",
    [(s, p) for s in (1, 2, 3) for p in ("cpu", "nvme")] + [(2, "nvme+grads"), (3, "nvme+grads")],
)
def test_offloaded_training_equals_no_offload_bit_for_bit(workers2, tmp_path, stage, placement):
    for r in workers2.run(_parity, stage, placement, str(tmp_path), None):
        assert r["losses_equal"] and r["param_diff"] == 0.0, r
        assert r["files"] == [], r
        if "nvme" in placement:  # the states really went through the disk, 3 slots at most
            assert r["read_bytes"] > 0 and r["num_slots"] == 3, r
            assert 0 < r["slot_bytes"] < r["state_bytes"], r  # less memory than all states
        assert (r["grad_bytes"] > 0) == (placement == "nvme+grads"), r


@pytest.mark.parametrize("kind", ["odd", "tiny_units"])
def test_odd_sizes_and_units_smaller_than_the_world(workers2, tmp_path, kind):
    # prime sizes, a zero-element parameter, a one-element unit that one rank holds none of
    for r in workers2.run(_parity, 3, "nvme+grads", str(tmp_path), None, kind=kind):
        assert r["losses_equal"] and r["param_diff"] == 0.0 and r["files"] == [], r


def test_gradients_on_nvme_accumulate_over_reductions(workers2, tmp_path):
    # Reducing every micro-step: the second reduction reads the stored shard back and adds.
    results = workers2.run(
        _parity, 2, "nvme+grads", str(tmp_path), None, accum=2, reduce_every_micro_step=True
    )
    for r in results:
        assert r["losses_equal"] and r["param_diff"] == 0.0 and r["grad_bytes"] > 0, r


def test_offloaded_training_in_bf16(workers2, tmp_path):
    for r in workers2.run(_parity, 3, "nvme+grads", str(tmp_path), "bf16"):
        assert r["param_diff"] <= 1e-6, r


def _corrupt(folder: str, grads: bool = False) -> list[str]:
    # Read-ahead into the store's pool is a hint, turned off here: a block read (and verified)
    # before the byte flips would be used, rightly, and the flip never seen.
    with mock.patch("zeroshard.offload.store.TensorStore.prefetch", return_value=[]):
        return _corrupt_and_step(folder, grads)


def _corrupt_and_step(folder: str, grads: bool = False) -> list[str]:
    model, opt = _make(
        2, Offload(optimizer="nvme", gradients="nvme" if grads else None, folder=folder)
    )
    _train(model, opt, range(2))
    rank = torch.distributed.get_rank()
    # Sub-group 4 was written back and its slot reused during the step (not in flight).
    (victim,) = Path(folder, f"rank{rank:05d}").glob("optimizer_states_4_*.swp")
    flip_byte(victim, 100)
    steps = (2, 3, 4) if grads else (2, 3)
    messages = refused_steps(
        lambda step, m=model, o=opt: _train(m, o, range(step, step + 1)), steps
    )
    torch.distributed.barrier()
    del model, opt
    gc.collect()
    torch.distributed.barrier()  # every rank's files are gone before any lists them
    return [*messages, *_files(folder)]


@pytest.mark.parametrize("grads", [False, True])
def test_a_corrupted_swap_file_stops_training_naming_the_tensor(workers2, tmp_path, grads):
    # With the gradients in the same store, the next backward read its stored gradient back
    # from the store the failure had closed: "the store is closed", the cause lost.
    for first, *later in workers2.run(_corrupt, str(tmp_path), grads):
        assert "optimizer_states[4]:blocks.0.mlp.proj" in first
        assert "checksum" in first.lower() or "corrupt" in first.lower(), first
        assert "Restart the run from the last checkpoint" in first
        files = later[2 if grads else 1 :]
        assert later[: len(later) - len(files)] == [first] * (2 if grads else 1), later
        assert files == []


def _optimizer_states(opt) -> dict[str, torch.Tensor]:
    """Every state tensor of ``opt.state_dict()``, this rank's part, by "name.key"."""
    out = {}
    for name, st in opt.state_dict()["state"].items():
        for key, v in st.items():
            out[f"{name}.{key}"] = v.to_local() if hasattr(v, "to_local") else v
    return out


def _checkpoint(folder: str, ckpt: str, in_memory: bool) -> dict:
    nvme = Offload(optimizer="nvme", folder=folder)
    ref_model, ref_opt = _make(2, None)
    _train(ref_model, ref_opt, range(6))
    ref_params, ref_states = _params(ref_model), _optimizer_states(ref_opt)

    def load(model, opt) -> None:
        if in_memory:
            with opt.states_in_memory():
                zeroshard.checkpoint.load(ckpt, model, opt)
            assert {s.where.value for s in opt._swap._swaps} == {"stored"}  # streamed out
        else:
            zeroshard.checkpoint.load(ckpt, model, opt)

    model, opt = _make(2, nvme)
    _train(model, opt, range(3))
    zeroshard.checkpoint.save(ckpt, model, opt)
    _train(model, opt, range(3, 6))
    diffs = [_max_diff(_params(model), ref_params)]
    load(model, opt)  # back into an optimizer whose states are on disk
    _train(model, opt, range(3, 6))
    diffs.append(_max_diff(_params(model), ref_params))
    states = _optimizer_states(opt)
    same_states = states.keys() == ref_states.keys() and all(
        torch.equal(states[k], ref_states[k]) for k in states
    )
    del model, opt
    gc.collect()
    model, opt = _make(2, nvme)  # and into a fresh one
    load(model, opt)
    _train(model, opt, range(3, 6))
    diffs.append(_max_diff(_params(model), ref_params))
    torch.distributed.barrier()
    del model, opt
    gc.collect()
    torch.distributed.barrier()  # every rank's files are gone before any lists them
    return {"diffs": diffs, "same_states": same_states, "files": _files(folder)}


@pytest.mark.parametrize("in_memory", [False, True])
def test_checkpoint_of_offloaded_states_resumes_exactly(workers2, tmp_path, in_memory):
    folder, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    for r in workers2.run(_checkpoint, str(folder), str(ckpt), in_memory):
        assert r["diffs"] == [0.0, 0.0, 0.0] and r["same_states"], r
        assert r["files"] == [], r


def _preflight(folder: str) -> list[str]:
    torch.manual_seed(0)
    errors = []
    with mock.patch("zeroshard.model_states.swap_space.free_bytes", return_value=1000):
        with pytest.raises(SwapSpaceError) as err:
            _make(1, Offload(optimizer="nvme", folder=folder))
        errors.append(str(err.value))
    with pytest.raises(OffloadError) as err:
        _make(1, Offload(optimizer="nvme", folder="/proc/zeroshard-not-writable"))
    errors.append(str(err.value))
    where = "zeroshard.model_states.swap_space.memory_available_bytes"
    with mock.patch(where, return_value=1000), pytest.raises(OffloadError) as err:
        _make(1, Offload(optimizer="nvme", folder=folder))
    errors.append(str(err.value))
    # One rank short: every rank raises (the other would wait for it in its next collective)
    rank0 = torch.distributed.get_rank() == 0
    alone = mock.patch("zeroshard.model_states.swap_space.free_bytes", return_value=1000)
    with alone if rank0 else contextlib.nullcontext(), pytest.raises(SwapSpaceError) as err:
        _make(1, Offload(optimizer="nvme", folder=folder))
    errors.append(str(err.value))
    gc.collect()
    torch.distributed.barrier()  # every rank's files are gone before any lists them
    return [*errors, *_files(folder)]


def test_space_and_folder_are_checked_before_the_first_step(workers2, tmp_path):
    said = workers2.run(_preflight, str(tmp_path))
    assert "1000 bytes free on this node" in said[0][3], said[0][3]
    assert "1000 bytes free on rank 0's node" in said[1][3], said[1][3]
    for space, unusable, memory, _, *files in said:
        need = int(memory.split(" needs ")[1].split(" bytes")[0])  # slots + the store's pool
        assert need > 64 << 20 and f"short by {need - 1000} bytes" in memory, memory
        assert "smaller units" in memory, memory
        # nano GPT, stage 1 on 2 ranks: each rank needs 2 states x 4 bytes x its padded pieces
        need = int(space.split(" need ")[1].split(":")[0])
        assert need > 0 and f"short by {need - 1000} bytes" in space, space
        assert "not usable" in unusable and "folder=" in unusable, unusable
        assert files == []


_CRASH = textwrap.dedent(
    """
    import os, sys, torch, zeroshard
    sys.path.insert(0, {tests!r})
    from parity_models import batch, build
    torch.manual_seed(0)
    model, _ = build("gpt")
    model = zeroshard.shard(model, stage=1, wrap=zeroshard.wrap.by_class(torch.nn.Linear),
                            offload=zeroshard.Offload(optimizer="nvme", folder={folder!r}))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    x, y = batch("gpt", 0, 2)
    opt.backward(model(x, y)); opt.step()
    opt._swap.synchronize()
    os._exit(3)  # a crash: no cleanup runs
    """
)


def _restart(folder: str) -> dict:
    nvme = Offload(optimizer="nvme", activations="nvme", folder=folder)
    model, opt = _make(1, nvme, checkpoint_every=1)
    losses = _train(model, opt, range(2))
    torch.distributed.barrier()
    del model, opt
    gc.collect()
    torch.distributed.barrier()  # every rank's files are gone before any lists them
    return {"losses": losses, "files": _files(folder)}


def test_a_crashed_runs_swap_files_are_discarded_at_restart(workers2, tmp_path):
    tests = os.path.dirname(__file__)
    env = dict(os.environ, MASTER_PORT=str(zeroshard.testing.free_port()))
    code = _CRASH.format(tests=tests, folder=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    assert any(f.endswith(".swp") for f in _files(tmp_path))  # what the crash left behind
    # Its activation stores' too: one with files (the restart failed), one with its lock alone
    # (left behind, empty).
    shutil.copytree(tmp_path / "rank00000", tmp_path / "rank00000-activations")
    (tmp_path / "rank00001-activations").mkdir()
    (tmp_path / "rank00001-activations" / "LOCK").write_text("1")
    # As if the crashed run had 4 ranks, restarted at 2: ranks 2 and 3 are nobody's now.
    shutil.copytree(tmp_path / "rank00000", tmp_path / "rank00002")
    shutil.copytree(tmp_path / "rank00000", tmp_path / "rank00003-params")
    # Not this job's: another job's live store (its lock held), and a folder of no store.
    shutil.copytree(tmp_path / "rank00000", tmp_path / "rank00005")
    (tmp_path / "rank00004").mkdir()
    (tmp_path / "rank00004" / "notes.txt").write_text("mine")
    live = pid_lock(tmp_path / "rank00005" / "LOCK")
    try:
        for r in workers2.run(_restart, str(tmp_path)):
            kept = [f for f in r["files"] if not f.startswith("rank00005")]
            assert kept == ["rank00004", "rank00004/notes.txt"], r
            assert any(f.endswith(".swp") for f in r["files"] if f.startswith("rank00005/"))
    finally:
        os.close(live)


def test_placements_a_stage_cannot_have_are_refused_with_the_fix():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="use stage=3"):
        Offload(parameters="cpu").check(STAGES[2], cpu)
    with pytest.raises(ValueError, match="use stage=2 or 3"):
        Offload(gradients="cpu").check(STAGES[1], cpu)
    with pytest.raises(ValueError, match="needs folder="):
        Offload(optimizer="nvme")
    with pytest.raises(ValueError, match="needs folder=.*got ''"):  # not the working directory
        Offload(optimizer="nvme", folder="")
    with pytest.raises(ValueError, match="only used by 'nvme'"):
        Offload(optimizer="cpu", folder="/tmp")
    with pytest.raises(ValueError, match="must be None"):
        Offload(optimizer="disk")
    with pytest.raises(TypeError, match=r"folder=123 must be a path \(a str or os.PathLike\)"):
        Offload(optimizer="nvme", folder=123)
    with pytest.raises(ValueError, match="not implemented yet"):
        Offload(optimizer="cpu").check(STAGES[1], torch.device("cuda"))
    Offload(optimizer="nvme", gradients="cpu", parameters="cpu", folder="/tmp").check(
        STAGES[3], cpu
    )


def _unusual_gradient_uses(folder: str | None) -> dict:
    """Uses of a gradient outside backward -> clip -> step -> zero_grad, each as torch keeps
    ``.grad`` until ``zero_grad``: clip twice (the second norm is the clipped one), step, read
    the norm after the step, a second step on the same gradients, then a backward without
    ``zero_grad`` (it adds), clip and step. With gradients on NVMe the step used them up, norms
    were the unclipped ones and a clip before another backward scaled the new gradient too."""
    offload = None if folder is None else Offload(optimizer="nvme", gradients="nvme", folder=folder)
    model, opt = _make(2, offload)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    norms = []
    for step in range(2):
        x, y = batch("gpt", step, PER_RANK_BATCH * world)
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        opt.backward(loss_of("gpt", model, x[mine], y[mine]))
        norms += [opt.clip_grad_norm(0.5).item(), opt.clip_grad_norm(0.2).item()]
        opt.step()
        norms.append(opt.clip_grad_norm(float("inf")).item())
        opt.step()  # again, on the same gradients
    opt.zero_grad()
    return {"norms": norms, "params": _params(model)}


def test_gradients_on_nvme_stay_until_zero_grad(workers2, tmp_path):
    plain = workers2.run(_unusual_gradient_uses, None)
    swapped = workers2.run(_unusual_gradient_uses, str(tmp_path / "swap"))
    for a, b in zip(plain, swapped):
        assert a["norms"] == b["norms"]
        assert _max_diff(a["params"], b["params"]) == 0.0


class _Late(torch.nn.Module):
    """A unit whose second Linear trains only from step 2 (a branch, an expert not routed at
    first): its optimizer states are made by a later step than the unit's first."""

    def __init__(self) -> None:
        super().__init__()
        self.late = torch.nn.Linear(17, 7)  # on both sides of the one trained from the start
        self.early, self.late2 = torch.nn.Linear(17, 7), torch.nn.Linear(17, 7)
        self.use_late = False

    def forward(self, x):
        return self.early(x) + (self.late(x) + self.late2(x) if self.use_late else 0)


def _late_states(folder: str) -> dict:
    torch.manual_seed(0)
    unit = _Late()
    model = zeroshard.shard(
        torch.nn.Sequential(torch.nn.Linear(13, 17), torch.nn.Tanh(), unit),
        stage=3,
        wrap=zeroshard.wrap.by_class(_Late),
        offload=Offload(optimizer="nvme", folder=folder),
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in range(5):
        unit.use_late = step >= 2
        opt.backward(model(torch.randn(2, 13)).square().mean())
        opt.step()
        opt.zero_grad()
    opt._swap.synchronize()
    resident = 0  # element-wise states in tensors of their own, outside any step
    for s in opt._swap._swaps:
        for p in s.params:
            for v in dict.get(s.optimizer.state, p, {}).values():
                if torch.is_tensor(v) and v.ndim >= 1:
                    resident += v.numel() * v.element_size()
    return {"resident": resident, "where": [s.where.name for s in opt._swap._swaps]}


def test_states_made_by_a_later_step_are_offloaded_too(workers2, tmp_path):
    for r in workers2.run(_late_states, str(tmp_path)):
        assert r["resident"] == 0 and set(r["where"]) == {"STORED"}, r


class _Rebinding(torch.optim.Optimizer):
    """Heavy-ball SGD written as many optimizers of one's own are: each step replaces its state
    with a new tensor (``state["buf"] = buf * m + g``) rather than updating it in place."""

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.9) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    st = self.state[p]
                    buf = st.get("buf")
                    st["buf"] = p.grad.clone() if buf is None else buf * group["momentum"] + p.grad
                    p.add_(st["buf"], alpha=-group["lr"])


def _rebinding_optimizer(folder: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])  # > 3 slots
    offload = Offload(optimizer="nvme", folder=folder) if folder else None
    model = zeroshard.shard(model, stage=3, wrap={torch.nn.Linear}, offload=offload)
    opt = zeroshard.optimizer(model, _Rebinding, lr=0.01, elementwise=True)
    for step in range(5):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        opt.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
    return _params(model)


def test_an_optimizer_replacing_its_states_is_offloaded_exactly(workers2, tmp_path):
    # The slot, written back, kept the old values: the updates were lost (2e-3 after 5 steps).
    for a, b in zip(
        workers2.run(_rebinding_optimizer, None), workers2.run(_rebinding_optimizer, str(tmp_path))
    ):
        assert _max_diff(a, b) == 0.0


def _one_rank_cannot(folder: str, which: str) -> str:
    """Rank 1's swap folder is taken by a file: every rank must say so, none wait for it."""
    from zeroshard.offload import OffloadSetupError

    if torch.distributed.get_rank() == 0:
        Path(folder, which).write_text("not a folder")
    torch.distributed.barrier()
    try:
        _make(3, Offload(optimizer="nvme", parameters="nvme", folder=folder))
    except OffloadSetupError as exc:
        return str(exc)
    return "built"


@pytest.mark.parametrize("which", ["rank00001", "rank00001-params"])
def test_a_rank_that_cannot_offload_stops_every_rank(workers2, tmp_path, which):
    said = workers2.run(_one_rank_cannot, str(tmp_path), which)
    assert said[1].startswith(f"swap folder {tmp_path / which} is not usable"), said
    assert said[0].startswith(f"rank 1 cannot offload: swap folder {tmp_path / which}"), said


def _two_optimizers(stage: int, folder: str | None, gradients: str | None = None):
    """A model sharded with its optimizer states on NVMe (``folder``; None: in memory), and two
    optimizers over its two halves (AdamW, SGD with momentum)."""
    torch.manual_seed(0)
    model, _ = build("gpt")
    offload = (
        None if folder is None else Offload(optimizer="nvme", gradients=gradients, folder=folder)
    )
    model = zeroshard.shard(
        model, stage=stage, wrap=zeroshard.wrap.by_class(torch.nn.Linear), offload=offload,
        config=zeroshard.ShardConfig(bucket_bytes=0),
    )  # fmt: skip
    params = list(model.parameters())
    half = len(params) // 2
    first = zeroshard.optimizer(model, torch.optim.AdamW, params[:half], lr=1e-3)
    second = zeroshard.optimizer(model, torch.optim.SGD, params[half:], lr=0.1, momentum=0.9)
    return model, [first, second]


def _two_optimizers_on_nvme(stage: int, folder: str) -> tuple[float, list[str], str]:
    """Both optimizers' states on NVMe (a store each) against both in memory, after 3 steps of
    each; and the refusal of two optimizers when gradients are on NVMe too."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    runs = []
    for where in (None, folder):
        model, opts = _two_optimizers(stage, where)
        for step in range(3):
            x, y = batch("gpt", step, PER_RANK_BATCH * world)
            mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
            loss_of("gpt", model, x[mine], y[mine]).backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
        runs.append(_params(model))
        stores = sorted(p.name for p in Path(folder).iterdir()) if where else []
    try:
        _two_optimizers(stage, folder + "-grads", gradients="nvme")
        refused = "built"
    except ValueError as exc:
        refused = str(exc)
    return _max_diff(*runs), stores, refused


@pytest.mark.parametrize("stage", [1, 3])
def test_several_optimizers_each_have_a_store(workers2, tmp_path, stage):
    # The second optimizer's store was refused: "in use by a live store".
    grads_stage = STAGES[stage].gradients
    for diff, stores, refused in workers2.run(_two_optimizers_on_nvme, stage, str(tmp_path / "s")):
        assert diff == 0.0, diff
        assert stores == ["rank00000", "rank00000-states1", "rank00001", "rank00001-states1"]
        if grads_stage:
            assert "gradients are on NVMe" in refused, refused


def test_a_relative_folder_stays_where_it_was_after_a_chdir(tmp_path, monkeypatch):
    """The swap files' folder is fixed when the placement is made: an ``os.chdir`` later in the
    run moved a relative one (every read back failed, "swap file ... is missing")."""
    monkeypatch.chdir(tmp_path)
    offload = Offload(optimizer="nvme", parameters="nvme", folder="swap")
    monkeypatch.chdir("/")
    assert offload.store_config(0).folder == tmp_path / "swap" / "rank00000"
    assert offload.param_store_config(0).folder == tmp_path / "swap" / "rank00000-params"
    home = Offload(optimizer="nvme", folder="~/swap").store_config(3).folder
    assert home == Path.home() / "swap" / "rank00003"


def _space_of(folder: str, cls: type, settings: dict, where: str) -> dict:
    """The bytes the check before step 1 counts for one optimizer whose ``settings`` are in
    its defaults (``where`` "defaults") or in its only param group ("group"), and the swap files'
    bytes after a step."""
    torch.manual_seed(0)
    model, _ = build("gpt")
    offload = Offload(optimizer="nvme", gradients="nvme", folder=folder)
    model = zeroshard.shard(
        model, stage=2, wrap=zeroshard.wrap.by_class(torch.nn.Linear), offload=offload,
        config=zeroshard.ShardConfig(bucket_bytes=0),
    )  # fmt: skip
    params = list(model.parameters())
    if where == "group":
        opt = zeroshard.optimizer(model, cls, [{"params": params, **settings}], lr=1e-3)
    else:
        opt = zeroshard.optimizer(model, cls, params, lr=1e-3, **settings)
    _train(model, opt, range(1))
    opt._swap.synchronize()
    swap_files = Path(opt._swap.store.config.folder).glob("*.swp")
    out = {
        "need": opt._swap.need_bytes,
        "record": opt._swap.max_record_bytes,
        "written": sum(f.stat().st_size for f in swap_files),
    }
    del model, opt
    gc.collect()
    return out


@pytest.mark.parametrize(
    "cls, settings", [(torch.optim.Adam, {"amsgrad": True}), (torch.optim.SGD, {"momentum": 0.9})]
)
def test_space_counts_the_states_a_param_group_adds(workers2, tmp_path, cls, settings):
    # Measured on the defaults only: SGD's momentum in its group was counted as 0 bytes, and
    # the disk filled in the first step instead of being refused before it.
    folder = str(tmp_path / "s")
    plain, in_group, in_defaults = (
        workers2.run(_space_of, folder, cls, s, w)
        for s, w in (({}, "defaults"), (settings, "group"), (settings, "defaults"))
    )
    for p, g, d in zip(plain, in_group, in_defaults):
        assert g == d, (g, d)
        assert g["need"] > p["need"] and g["record"] > p["record"], (g, p)
        assert 0 < g["written"] <= g["need"], g


def _two_stores_on_one_disk(folder: str) -> str:
    """Two optimizers' stores on one disk with room for either alone, not for both."""
    _, opts = _two_optimizers(1, folder)
    needs = torch.tensor([opts[0]._swap.need_bytes, sum(o._swap.need_bytes for o in opts)])
    torch.distributed.all_reduce(needs, torch.distributed.ReduceOp.MAX)
    del opts
    gc.collect()
    local = torch.distributed.get_world_size()  # one node: its ranks share the disk
    free = local * int(needs[1]) - 1
    assert local * int(needs[0]) <= free
    with mock.patch("zeroshard.model_states.swap_space.free_bytes", return_value=free):
        try:
            _two_optimizers(1, folder)
        except SwapSpaceError as exc:
            return str(exc)
    return "built"


def test_stores_sharing_a_disk_count_each_others_unwritten_bytes(workers2, tmp_path):
    # Each store checked the free space alone, before any had written: both passed, and the
    # second optimizer's first step failed for space.
    for said in workers2.run(_two_stores_on_one_disk, str(tmp_path / "s")):
        assert "short by 1 bytes" in said, said
        assert "other offload stores on that disk, not yet written" in said, said


def _disk_full_at_the_step(folder: str, gradients: str | None) -> list[str]:
    from zeroshard.offload import nvme

    stage = 1 if gradients is None else 2
    model, opt = _make(stage, Offload(optimizer="nvme", gradients=gradients, folder=folder))
    with mock.patch.object(nvme, "free_bytes", return_value=0):  # filled since the check
        return refused_steps(lambda step: _train(model, opt, range(step, step + 1)), (0, 1))


@pytest.mark.parametrize("gradients", [None, "nvme"])
def test_a_disk_filled_after_the_check_stops_training(workers2, tmp_path, gradients):
    # The refusal came out of step() as a SwapSpaceError after the update was applied (a
    # retried step applied it twice), or out of backward with the gradient summed in memory.
    for first, second in workers2.run(_disk_full_at_the_step, str(tmp_path), gradients):
        assert "could not be written (SwapSpaceError" in first, first
        assert "training stopped" in first and second == first, (first, second)


def _disk_full_at_different_units(folder: str) -> list[str]:
    """Stage 3, gradients on NVMe: each rank's disk fills at its own unit of the first backward
    (rank r's (r + 1)-th gradient write is refused), then two more steps."""
    from zeroshard.offload import nvme

    model, opt = _make(3, Offload(optimizer="nvme", gradients="nvme", folder=folder))
    rank, real, calls = dist.get_rank(), nvme.free_bytes, []

    def free(path):
        calls.append(path)
        return 0 if len(calls) > rank else real(path)

    with mock.patch.object(nvme, "free_bytes", side_effect=free):
        return refused_steps(lambda step: _train(model, opt, range(step, step + 1)), (0, 1, 2))


def test_a_disk_full_at_each_ranks_own_unit_stops_every_rank_cleanly(workers2, tmp_path):
    # Each rank raised at its own unit, mid-backward: the other waited in a reduction this one
    # never started (a collective timeout), and the next forward's gathers paired with that
    # backward's leftovers (gloo aborted the process: "Received data size doesn't match").
    said = workers2.run(_disk_full_at_different_units, str(tmp_path))
    for first, *later in said:
        assert "could not be written (SwapSpaceError" in first, first
        assert "training stopped" in first and later == [first, first], (first, later)
    assert said[0][0] != said[1][0]  # (the ranks' failures are at different units)


def _reset_between_steps(folder: str | None, how: str) -> list[torch.Tensor]:
    """Two steps, the states reset (sub-group 0 being read ahead then), two more steps."""
    from collections import defaultdict

    model, opt = _make(1, None if folder is None else Offload(optimizer="nvme", folder=folder))
    assert len(opt._subgroups) > 3  # more than the slots: sub-group 0 is read ahead
    _train(model, opt, range(2))
    if how == "clear":
        opt.state.clear()
    else:
        opt.state = defaultdict(dict)
    _train(model, opt, range(2, 4))
    return _params(model)


@pytest.mark.parametrize("how", ["clear", "assign"])
def test_states_reset_while_read_ahead(workers2, tmp_path, how):
    # The read ahead of sub-group 0 finished into the new dict: its old moments came back
    # without their step count, and Adam failed with KeyError 'step'.
    ref = workers2.run(_reset_between_steps, None, how)
    for a, b in zip(ref, workers2.run(_reset_between_steps, str(tmp_path), how)):
        assert _max_diff(a, b) == 0.0


def _interrupted_step(stage: int, folder: str) -> dict:
    """A step that raised in a middle sub-group (a Ctrl-C in its step): with states on NVMe,
    every later step failed ("every slot held by a resident sub-group": the sub-group it
    raised in and the one read ahead kept their slots). Training goes on as without offload,
    interrupted alike: the sub-groups before it stepped, the rest did not."""

    def ctrl_c(*args):
        raise KeyboardInterrupt

    results = []
    for offload in (None, Offload(optimizer="nvme", folder=folder)):
        model, opt = _make(stage, offload)
        middle = len(opt.sub_optimizers) // 2
        _train(model, opt, range(1))
        handle = opt.sub_optimizers[middle].register_step_pre_hook(ctrl_c)
        with contextlib.suppress(KeyboardInterrupt):
            _train(model, opt, range(1, 2))
        handle.remove()
        opt.zero_grad()
        losses = _train(model, opt, range(2, 5))
        results.append((losses, _params(model)))
        del model, opt
        gc.collect()
    (losses, params), (swapped_losses, swapped) = results
    return {"losses_equal": losses == swapped_losses, "param_diff": _max_diff(params, swapped),
            "middle": middle}  # fmt: skip


@pytest.mark.parametrize("stage", [1, 3])
def test_a_step_interrupted_partway_with_states_on_nvme_goes_on(workers2, tmp_path, stage):
    for r in workers2.run(_interrupted_step, stage, str(tmp_path / "swap")):
        assert r["middle"] > 0 and r["losses_equal"] and r["param_diff"] == 0, r


def _files_after_collection(stage: int, folder: str, params: bool) -> list[str]:
    """This rank's swap files right after ``del model, opt; gc.collect()``, the reads ahead of
    the next step (issued as the last step ended) slowed down so that they are in flight."""
    from zeroshard.offload.nvme import NvmeBackend

    where = dict(optimizer="nvme", gradients="nvme" if stage >= 2 else None, folder=folder)
    model, opt = _make(stage, Offload(**where, parameters="nvme" if params else None))
    _train(model, opt, range(1))
    pread = NvmeBackend._pread

    def slow(self, *args):
        time.sleep(0.05)
        return pread(self, *args)

    with mock.patch.object(NvmeBackend, "_pread", slow):
        _train(model, opt, range(1, 2))
        del model, opt
        gc.collect()
        rank = torch.distributed.get_rank()
        return sorted(str(p) for p in Path(folder).glob(f"rank{rank:05d}*/*"))


@pytest.mark.parametrize("stage,params", [(1, False), (2, False), (3, True)])
def test_swap_files_are_gone_once_the_model_and_optimizer_are_collected(
    workers2, tmp_path, stage, params
):
    # The reads ahead of the next step kept the store alive until they finished, on an I/O
    # thread, which then deleted the files: a test listing them right after gc saw them
    # (the flaky CI failure of test_offloaded_training_equals_no_offload_bit_for_bit).
    for left in workers2.run(_files_after_collection, stage, str(tmp_path), params):
        assert left == [], left


def _small_offloaded(offload: Offload, cls) -> tuple:
    """A 2-Linear model at stage 3 with ``offload``, its optimizer (lr 1e-2) and a batch."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    model = zeroshard.shard(
        model, stage=3, wrap=zeroshard.wrap.by_class(nn.Linear), offload=offload
    )
    opt = zeroshard.optimizer(model, cls, lr=1e-2)
    return model, opt, torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


def test_a_signal_in_a_written_sub_group_s_bookkeeping_leaves_the_step_usable(
    lone_process, tmp_path
):
    # A Ctrl-C landing as a written sub-group left the write queue, before it was marked back
    # in its slot: every later step raised "0 is not in deque" (an explorer). It lands once
    # the bookkeeping is done.
    import signal
    from collections import deque

    class Interrupting(deque):
        def remove(self, value) -> None:
            super().remove(value)
            if armed:
                armed.clear()
                signal.raise_signal(signal.SIGINT)  # (Python's handler: a KeyboardInterrupt)

    def run(interrupt: bool) -> list[float]:
        offload = Offload(optimizer="nvme", folder=tmp_path / str(interrupt))
        model, opt, x = _small_offloaded(offload, torch.optim.Adam)
        losses = []
        for step in range(4):
            if step == 1:
                swap = opt._swap
                swap._writing = Interrupting(swap._writing)
                armed.extend([True] if interrupt else [])
            loss = model(x).sum()
            opt.backward(loss)
            try:
                opt.step()
            except KeyboardInterrupt:
                interrupted.append(step)
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    armed: list[bool] = []
    interrupted: list[int] = []
    reference = run(False)
    losses = run(True)
    assert interrupted == [1], interrupted
    # The interrupted step left the weights as they were (Adam's states written back whole),
    # and training went on from there, as the reference would without that step.
    assert losses[:2] == reference[:2] and losses[2:] == reference[1:3], (losses, reference)


def test_a_signal_as_a_master_is_marked_resident_leaves_it_read(lone_process, tmp_path):
    # Parameters' masters on NVMe: a Ctrl-C in a forward landing after a master was marked
    # resident and before its read was issued left it resident, unread: every later step
    # computed with uninitialized memory (losses 5.8, 0.0, -8.2e14: an explorer). It lands
    # once the read is issued; the interrupted forward is dropped, training goes on.
    import signal

    from zeroshard.model_states.param_swap import ParamSwapper

    real = ParamSwapper._grow

    def run(interrupt: bool) -> list[float]:
        offload = Offload(parameters="nvme", folder=tmp_path / str(interrupt))
        model, opt, x = _small_offloaded(offload, torch.optim.SGD)
        losses, armed = [], [interrupt]

        def grow(swapper, nbytes):
            real(swapper, nbytes)
            if armed.pop() if armed else False:
                signal.raise_signal(signal.SIGINT)  # (Python's handler: a KeyboardInterrupt)

        for step in range(4):
            if step == 1:
                patch = mock.patch.object(ParamSwapper, "_grow", grow)
                with patch, contextlib.suppress(KeyboardInterrupt):
                    model(x)  # (interrupted or not: its output dropped)
                opt.zero_grad()
            loss = model(x).sum()
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    assert run(True) == run(False)
