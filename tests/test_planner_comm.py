"""Data-parallel communication per step: 2 Psi, 2 Psi, 2 Psi, 3 Psi elements (§4)."""

import pytest

from zeroshard.planner.comm import comm_seconds, dp_communication, total_bytes, total_numel


@pytest.mark.parametrize("stage, psi_multiple", [(0, 2), (1, 2), (2, 2), (3, 3)])
def test_volume_per_stage(stage, psi_multiple):
    collectives = dp_communication(1000, stage=stage)
    assert total_numel(collectives) == psi_multiple * 1000
    assert total_bytes(collectives) == psi_multiple * 1000 * 2  # fp16


def test_stage3_is_one_and_a_half_times_data_parallel():
    psi = 7_500_000_000
    assert total_bytes(dp_communication(psi, stage=3)) == 1.5 * total_bytes(
        dp_communication(psi, stage=0)
    )


def test_which_collectives_and_when():
    names = [c.name for c in dp_communication(10, stage=3)]
    assert names == [
        "all_gather params (forward)",
        "all_gather params (backward)",
        "reduce_scatter grads (backward)",
    ]
    # The ledger's (op, label) keys in zeroshard.collectives.
    assert [(c.op, c.label) for c in dp_communication(10, stage=1)] == [
        ("reduce_scatter", "grads"),
        ("all_gather", "params"),
    ]
    assert all(c.every_micro_batch for c in dp_communication(10, stage=3))
    (all_reduce,) = dp_communication(10, stage=0)
    assert all_reduce.name == "all_reduce grads (backward)" and not all_reduce.every_micro_batch
    rs1, ag1 = dp_communication(10, stage=1)
    assert not rs1.every_micro_batch and not ag1.every_micro_batch  # reduced once per step
    rs2, ag2 = dp_communication(10, stage=2)
    assert rs2.every_micro_batch and not ag2.every_micro_batch  # sharded grads each backward


def test_dtypes_priced_separately():
    # fp32 gradient reduction, bf16 parameters: Psi * 4 + Psi * 2 at stage 2.
    collectives = dp_communication(100, stage=2, reduce_dtype_bytes=4, param_dtype_bytes=2)
    assert [c.num_bytes for c in collectives] == [400, 200]


def test_model_parallel_splits_volume():
    assert total_numel(dp_communication(1000, stage=0, num_mp_ranks=4)) == 500


def test_time_at_bandwidth():
    # 2 Psi fp16 for 7.5B parameters = 30 GB; at 100 GB/s: 0.3 s.
    assert comm_seconds(total_bytes(dp_communication(7_500_000_000, stage=0)), 100e9) == 0.3
    with pytest.raises(ValueError):
        comm_seconds(1, 0)


def test_errors():
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        dp_communication(100, stage=5)
    with pytest.raises(ValueError, match="num_params"):
        dp_communication(0, stage=0)
    with pytest.raises(ValueError, match="reduce_dtype_bytes"):
        dp_communication(10, stage=0, reduce_dtype_bytes=3)


def test_stage3_root_kept_gathered_is_not_gathered_again():
    collectives = dp_communication(1000, stage=3, num_params_kept_gathered=100)
    assert [c.numel for c in collectives] == [1000, 900, 1000]
    assert total_numel(collectives) == 3 * 1000 - 100
    with pytest.raises(ValueError, match="num_params_kept_gathered"):
        dp_communication(1000, stage=3, num_params_kept_gathered=1001)


def test_unreduced_accumulation_reduces_once_per_step():
    for stage in (2, 3):
        every = dp_communication(1000, stage=stage)
        once = dp_communication(1000, stage=stage, reduce_every_micro_batch=False)
        grads = [c for c in every if c.label == "grads"]
        assert grads and all(c.every_micro_batch for c in grads)
        assert all(not c.every_micro_batch for c in once if c.label == "grads")
        assert [c.num_bytes for c in once] == [c.num_bytes for c in every]


def _frozen_ledger(stage: int) -> dict[str, int]:
    """Elements per collective of one step of a model whose first Linear is frozen."""
    import torch

    import zeroshard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))
    model[0].requires_grad_(False)
    model = zeroshard.shard(model, stage=stage, wrap=zeroshard.wrap.by_class(torch.nn.Linear))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    for _ in range(2):
        opt.backward(model(torch.randn(4, 16)).square().mean())
        opt.step()
        opt.zero_grad()
    last = zeroshard.engine_of(model).ledger.steps[-1]
    return {f"{op}/{label}": e.numel for (op, label), e in last.items() if label != "found_inf"}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_parameters_move_no_gradient_and_are_not_gathered_after_a_step(workers2, stage):
    # A third of the model frozen: the plan counted its gradient reduction (+50% at stage 0),
    # and stages 1-2 gathered it again after every step, though the step leaves it unchanged.
    measured = workers2.run(_frozen_ledger, stage)[0]
    whole, trainable = 3 * (16 * 16 + 16), 2 * (16 * 16 + 16)
    predicted: dict[str, int] = {}
    for c in dp_communication(whole, stage=stage, num_params_trainable=trainable):
        key = f"{c.op}/{c.label}"
        predicted[key] = predicted.get(key, 0) + c.numel
    assert measured == predicted
    if stage in (1, 2):
        assert measured["all_gather/params"] == trainable
