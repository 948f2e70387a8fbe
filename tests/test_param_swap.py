"""Stage-3 parameter masters on NVMe (``Offload(parameters="nvme")``) against no offload.

Mirrors ``zeroshard.model_states.param_swap``. Each multi-rank test trains the same model twice
in the same process, with and without the placement, and compares losses and parameters bit for
bit (fp32, stage 3, 2 ranks); the helpers are ``test_state_swap``'s (nano GPT wrapped per
``nn.Linear``: many small units, so the read-ahead window must stream).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from parity_models import batch, loss_of
from swap_faults import flip_byte, refused_steps
from test_state_swap import _files, _make, _max_diff, _params, _train

import zeroshard
from zeroshard.offload import Offload
from zeroshard.stages import STAGES

PLACEMENTS = {
    "params": dict(parameters="nvme"),
    "params+optimizer": dict(parameters="nvme", optimizer="nvme"),
    "everything": dict(parameters="nvme", optimizer="nvme", gradients="nvme"),
}


def _master_bytes(model) -> int:
    """Bytes of FP32 master storage this rank holds in memory now."""
    engine = zeroshard.engine.engine_of(model)
    return sum(
        f.master_view.untyped_storage().nbytes()
        for f in engine.flat_params
        if f.master_view is not None
    )


def _window_bound(model) -> int:
    """The most master bytes the read-ahead may hold: the window's units, the unit being
    gathered and the root, taken as the largest masters."""
    swap = zeroshard.engine.engine_of(model).param_swap
    sizes = sorted((m.nbytes for m in swap._masters.values()), reverse=True)
    return sum(sizes[: swap.window + 2])


def _parity(placement: str, folder: str, mixed_precision: str | None = None) -> dict:
    offload = Offload(**PLACEMENTS[placement], folder=folder)
    ref_model, ref_opt = _make(3, None, mixed_precision)
    ref_losses = _train(ref_model, ref_opt, range(4))
    ref_resident = _master_bytes(ref_model)
    model, opt = _make(3, offload, mixed_precision)
    losses = _train(model, opt, range(4))
    stats = opt.offload_stats()
    out = {
        "window_bound": _window_bound(model),
        "losses_equal": losses == ref_losses,
        "param_diff": _max_diff(_params(model), _params(ref_model)),
        "ref_resident_bytes": ref_resident,
        "resident_bytes_now": _master_bytes(model),
        **{k: v for k, v in stats.items() if k.startswith("param_")},
    }
    torch.distributed.barrier()
    del model, opt
    gc.collect()  # the model owns the parameter store: freeing it deletes the swap files
    torch.distributed.barrier()  # every rank's files are gone before any rank lists them
    out["files"] = _files(folder)
    return out


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_parameters_on_nvme_train_bit_for_bit_as_no_offload(workers2, tmp_path, placement):
    for r in workers2.run(_parity, placement, str(tmp_path)):
        assert r["losses_equal"] and r["param_diff"] == 0.0, r
        assert r["files"] == [], r
        total = r["param_total_bytes"]
        assert total == r["ref_resident_bytes"] > 0, r  # every master, in memory without offload
        assert r["param_read_bytes"] > 0 and r["param_write_bytes"] > 0, r
        # outside the step only the read-ahead window is in memory, never every master
        assert 0 < r["param_max_resident_bytes"] <= r["window_bound"] < total, r
        assert r["resident_bytes_now"] <= r["window_bound"], r


def test_parameters_on_nvme_in_bf16(workers2, tmp_path):
    for r in workers2.run(_parity, "params+optimizer", str(tmp_path), "bf16"):
        assert r["param_diff"] <= 1e-6 and r["files"] == [], r


def _corrupt(folder: str) -> list[str]:
    model, opt = _make(3, Offload(parameters="nvme", folder=folder))
    _train(model, opt, range(2))
    rank = torch.distributed.get_rank()
    # master 6 is beyond the read-ahead window of the next forward: read after the flip
    (victim,) = Path(folder, f"rank{rank:05d}-params").glob("master_6_*.swp")
    flip_byte(victim, 8)
    messages = refused_steps(
        lambda step, m=model, o=opt: _train(m, o, range(step, step + 1)), (2, 3)
    )
    torch.distributed.barrier()
    del model, opt
    gc.collect()
    torch.distributed.barrier()
    return [*messages, *_files(folder)]


def test_a_corrupted_master_stops_training_naming_the_tensor(workers2, tmp_path):
    for first, second, *files in workers2.run(_corrupt, str(tmp_path)):
        assert "master[6]:" in first, first
        assert "checksum" in first.lower() or "corrupt" in first.lower(), first
        assert "Restart the run from the last checkpoint" in first
        assert second == first
        assert files == []


def _checkpoint(folder: str, ckpt: str) -> dict:
    offload = Offload(parameters="nvme", optimizer="nvme", folder=folder)
    ref_model, ref_opt = _make(3, None)
    _train(ref_model, ref_opt, range(6))
    ref_params = _params(ref_model)
    model, opt = _make(3, offload)
    _train(model, opt, range(3))
    zeroshard.checkpoint.save(ckpt, model, opt)
    resident_after_save = _master_bytes(model)
    _train(model, opt, range(3, 6))
    diffs = [_max_diff(_params(model), ref_params)]
    zeroshard.checkpoint.load(ckpt, model, opt)  # back into a model whose masters are on disk
    resident_after_load = _master_bytes(model)
    _train(model, opt, range(3, 6))
    diffs.append(_max_diff(_params(model), ref_params))
    del model, opt
    gc.collect()
    model, opt = _make(3, offload)  # and into a fresh one
    zeroshard.checkpoint.load(ckpt, model, opt)
    _train(model, opt, range(3, 6))
    diffs.append(_max_diff(_params(model), ref_params))
    total = zeroshard.engine.engine_of(model).param_swap.total_bytes
    torch.distributed.barrier()
    del model, opt
    gc.collect()
    torch.distributed.barrier()
    return {
        "diffs": diffs,
        "resident": [resident_after_save, resident_after_load],
        "total": total,
        "files": _files(folder),
    }


def test_checkpoint_of_a_model_with_masters_on_nvme_resumes_exactly(workers2, tmp_path):
    folder, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    for r in workers2.run(_checkpoint, str(folder), str(ckpt)):
        assert r["diffs"] == [0.0, 0.0, 0.0], r
        assert all(b < r["total"] for b in r["resident"]), r  # streamed back out after both
        assert r["files"] == [], r


def test_parameters_off_the_device_below_stage_3_are_refused_naming_stage_and_fix(tmp_path):
    cpu = torch.device("cpu")
    for stage in (0, 1, 2):
        for where in ("cpu", "nvme"):
            folder = str(tmp_path) if where == "nvme" else None
            with pytest.raises(ValueError, match=f"at stage {stage} .*use stage=3"):
                Offload(parameters=where, folder=folder).check(STAGES[stage], cpu)
    Offload(parameters="nvme", folder=str(tmp_path)).check(STAGES[3], cpu)
    for bad in (-1, True, 2.0):  # (True passed as 1)
        with pytest.raises(ValueError, match=f"param_prefetch={bad!r} must be an int >= 0"):
            Offload(parameters="nvme", folder=str(tmp_path), param_prefetch=bad)
    for where in (None, "cpu"):  # ignored without a word before
        with pytest.raises(ValueError, match="param_prefetch is only used by parameters='nvme'"):
            Offload(parameters=where, param_prefetch=3)


def _refused_at_shard(folder: str) -> str:
    with pytest.raises(ValueError) as err:
        _make(2, Offload(parameters="nvme", folder=folder))
    return str(err.value)


def test_shard_refuses_parameters_on_nvme_at_stage_2(workers2, tmp_path):
    for message in workers2.run(_refused_at_shard, str(tmp_path)):
        assert "stage 2" in message and "stage=3" in message, message


def _around(offload: Offload | None, between, first=None) -> list[torch.Tensor]:
    """``first(model, opt)`` on the fresh model, train 2 steps, ``between(model, opt)``, train 2
    more: the parameters at the end."""
    model, opt = _make(3, offload)
    if first is not None:
        first(model, opt)
    _train(model, opt, range(2))
    between(model, opt)
    _train(model, opt, range(2, 4))
    out = _params(model)
    torch.distributed.barrier()
    del model, opt
    gc.collect()
    return out


def _edit(model, opt) -> None:
    with zeroshard.summon_full_params(model):
        first = next(model.parameters())
        with torch.no_grad():
            first.mul_(0.5)


def _edit_inside_summon(folder: str | None) -> list[torch.Tensor]:
    """A parameter written inside summon_full_params must reach the master (written back to the
    store) and the next steps."""
    return _around(Offload(parameters="nvme", folder=folder) if folder else None, _edit)


def _summon_parity(folder: str) -> float:
    return _max_diff(_edit_inside_summon(folder), _edit_inside_summon(None))


def _interrupted_read(model, opt) -> None:
    """A Ctrl-C while a unit's master is read back from NVMe in forward (where a forward with
    parameters on NVMe waits), the step abandoned: the next steps must run as without it."""
    from unittest import mock

    from zeroshard.offload import tiers

    def interrupted(self, timeout=None):
        raise KeyboardInterrupt

    with mock.patch.object(tiers.SwapHandle, "wait", interrupted), pytest.raises(KeyboardInterrupt):
        _train(model, opt, range(2, 3))
    opt.zero_grad()


def _interrupt_parity(folder: str) -> float:
    return _max_diff(
        _around(Offload(parameters="nvme", folder=folder), _interrupted_read),
        _around(None, lambda model, opt: None),
    )


def test_a_ctrl_c_during_a_masters_read_leaves_the_model_usable(workers2, tmp_path):
    for diff in workers2.run(_interrupt_parity, str(tmp_path)):
        assert diff == 0.0, diff


def _infer(model, opt) -> None:
    """A forward under ``torch.inference_mode()``: the masters it reads back are read again by
    training, outside inference mode."""
    x, y = batch("gpt", 99, 2)
    with torch.inference_mode():
        loss_of("gpt", model, x, y)


def _inference_parity(folder: str) -> float:
    return _max_diff(
        _around(Offload(parameters="nvme", folder=folder), _infer, first=_infer),
        _around(None, _infer, first=_infer),
    )


def test_inference_mode_forwards_leave_offloaded_masters_trainable(workers2, tmp_path):
    # the masters read back under inference_mode were views torch refuses to write outside it:
    # every later read of them failed, and training stopped
    for diff in workers2.run(_inference_parity, str(tmp_path)):
        assert diff == 0.0


def test_writes_inside_summon_full_params_reach_offloaded_masters(workers2, tmp_path):
    for diff in workers2.run(_summon_parity, str(tmp_path)):
        assert diff == 0.0


def _cpu_placement_logs() -> list[str]:
    import logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep(logging.INFO)
    logger = logging.getLogger("zeroshard")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        model, opt = _make(3, Offload(parameters="cpu"))
        _train(model, opt, range(1))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return seen


def test_parameters_on_the_cpu_tier_of_a_cpu_run_say_nothing_moves(workers2):
    for messages in workers2.run(_cpu_placement_logs):
        assert any("parameters on the CPU tier" in m and "nothing moves" in m for m in messages)


def _state_dicts(model, opt) -> None:
    opt.state_dict()
    model.load_state_dict(model.state_dict())  # reads every master, then writes them


def _state_dicts_then_train(folder: str | None) -> list[torch.Tensor]:
    """State dicts of a fresh model and optimizer (the optimizer's is a template made by a
    zero step on every master), then training with state dicts taken and loaded midway."""
    offload = Offload(parameters="nvme", optimizer="nvme", folder=folder) if folder else None
    return _around(offload, _state_dicts, first=_state_dicts)


def _state_dict_parity(folder: str) -> float:
    return _max_diff(_state_dicts_then_train(folder), _state_dicts_then_train(None))


def test_state_dicts_outside_a_checkpoint_read_offloaded_masters(workers2, tmp_path):
    for diff in workers2.run(_state_dict_parity, str(tmp_path)):
        assert diff == 0.0


def _no_space(folder: str) -> list[str]:
    from unittest import mock

    from zeroshard.model_states.param_swap import ParamSwapper
    from zeroshard.offload import SwapSpaceError

    space = mock.patch("zeroshard.model_states.swap_space.free_bytes", return_value=1000)
    written = mock.patch.object(ParamSwapper, "_write", side_effect=AssertionError("written"))
    with space, written, pytest.raises(SwapSpaceError) as err:
        _make(3, Offload(parameters="nvme", folder=folder))
    message = str(err.value)
    del err
    gc.collect()
    torch.distributed.barrier()
    return [message, *_files(folder)]


def test_a_folder_too_small_for_the_masters_fails_at_shard(workers2, tmp_path):
    """Before the first master is written (it was checked after all were: a model that fit was
    refused, its own masters taking the free space, and one that did not fill the disk)."""
    for message, *files in workers2.run(_no_space, str(tmp_path)):
        assert "short by" in message and "bytes" in message, message
        assert files == [], files


def _needed_and_written(folder: str, kind: str, mixed_precision: str | None) -> tuple[int, int]:
    """The bytes checked before any master is written, and the swap files' bytes after."""
    from unittest import mock

    from zeroshard.model_states import param_swap
    from zeroshard.offload.folder import padded_bytes

    checked = []
    real = param_swap.check_space
    with mock.patch.object(
        param_swap, "check_space", lambda f, need, mesh: (checked.append(need), real(f, need, mesh))
    ):
        model, _ = _make(3, Offload(parameters="nvme", folder=folder), mixed_precision, kind)
    swap = zeroshard.engine_of(model).param_swap
    written = sum(padded_bytes(m.nbytes) for m in swap._masters.values())
    swap.close()
    return checked[0], written


@pytest.mark.parametrize(
    "kind, mixed_precision",
    [("gpt", None), ("gpt", "bf16"), ("frozen_mlp", None), ("odd", None), ("tiny_units", None)],
)
def test_the_space_checked_is_what_the_masters_take(workers2, tmp_path, kind, mixed_precision):
    for needed, written in workers2.run(_needed_and_written, str(tmp_path), kind, mixed_precision):
        assert needed == written > 0, (needed, written)
