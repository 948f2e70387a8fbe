"""The advisor: hand-timed steps, ranking, and reasons for what does not fit."""

import pytest

from zeroshard.planner import describe as d
from zeroshard.planner.advise import Cluster, Workload, advise
from zeroshard.planner.memory import MemoryConfig

MODEL = d.from_params(10**9)


def _cluster(**kw):
    base = dict(
        num_devices=4,
        device_memory_bytes=10**12,
        peak_flops=1e15,
        net_bandwidth_bytes_per_s=100e9,
        cpu_bandwidth_bytes_per_s=10e9,
        nvme_bandwidth_bytes_per_s=1e9,
    )
    return Cluster(**base | kw)


def _workload(**kw):
    base = dict(seq_len=1000, global_batch_size=4, micro_batch_sizes=(1,))
    return Workload(**base | kw)


def test_step_time_by_hand():
    advice = advise(MODEL, _cluster(), _workload(stages=(0,), offloads=("none",)))
    (c,) = advice.feasible
    assert c.num_micro_batches == 1
    # compute 8 * Psi * bsz * seq / peak; all-reduce 2 Psi fp16 over 100 GB/s.
    assert c.time_seconds["compute"] == pytest.approx(8e9 * 1000 / 1e15)
    assert c.time_seconds["collectives"] == pytest.approx(4e9 / 100e9)
    assert c.time_seconds["offload"] == 0
    assert c.step_seconds == pytest.approx(0.008 + 0.04)


def test_accumulation_repeats_sharded_collectives_only():
    w = _workload(global_batch_size=16, offloads=("none",))
    by_stage = {c.stage: c for c in advise(MODEL, _cluster(), w).feasible}
    assert by_stage[0].num_micro_batches == 4
    assert by_stage[0].time_seconds["collectives"] == pytest.approx(4e9 / 100e9)  # once
    # Stage 2: reduce-scatter Psi every micro-batch, all-gather Psi once.
    assert by_stage[2].time_seconds["collectives"] == pytest.approx((4 + 1) * 2e9 / 100e9)
    # Stage 3: 3 Psi every micro-batch.
    assert by_stage[3].time_seconds["collectives"] == pytest.approx(4 * 6e9 / 100e9)
    ranked = [c.stage for c in advise(MODEL, _cluster(), w).feasible]
    assert ranked.index(0) < ranked.index(2) < ranked.index(3)


def test_offload_traffic_by_hand():
    w = _workload(stages=(3,), offloads=("nvme-all",), memory=MemoryConfig(stage=0))
    (c,) = advise(MODEL, _cluster(), w).feasible
    shard = 10**9 // 4  # elements per rank
    cpu = 2 * shard  # fp16 gradient shard written once
    nvme = 3 * 2 * shard + 2 * 12 * shard  # params read 3 times; optimizer read + written
    assert c.time_seconds["offload"] == pytest.approx(cpu / 10e9 + nvme / 1e9)


def test_memory_limit_rejects_with_reason():
    small = _cluster(device_memory_bytes=7 * 10**9)  # stage 2: (2 + 14 / 4) GB + 10% fits
    advice = advise(MODEL, small, _workload(offloads=("none",)))
    assert {c.stage for c in advice.feasible} == {2, 3}
    why = advice.why_not()
    # 16 GB of model states + 2 x 25 MiB buckets, + 10% fragmentation allowance.
    assert why[(0, "none")].startswith("needs 17.7 GB per device, has 7 GB")
    assert "needs" in why[(1, "none")]


def test_cpu_capacity_is_per_node():
    w = _workload(stages=(2,), offloads=("cpu-optimizer",))
    # 14 bytes per parameter over 4 ranks go to the CPU: 3.5 GB a rank, 14 GB a node of 4.
    ok = advise(MODEL, _cluster(cpu_memory_bytes=14 * 10**9), w)
    assert len(ok.feasible) == 1
    tight = advise(MODEL, _cluster(cpu_memory_bytes=13 * 10**9), w)
    assert not tight.feasible
    assert "of cpu per node" in tight.rejected[0].problem
    two_nodes = advise(MODEL, _cluster(cpu_memory_bytes=13 * 10**9, num_devices_per_node=2), w)
    assert len(two_nodes.feasible) == 1


def test_not_offered_and_not_divisible():
    advice = advise(MODEL, _cluster(), _workload(global_batch_size=6, micro_batch_sizes=(1, 2)))
    problems = {(c.stage, c.offload, c.micro_batch_size): c.problem for c in advice.rejected}
    assert "stage >= 1" in problems[(0, "cpu-optimizer", 1)]
    assert "stage 3" in problems[(2, "cpu-all", 1)]
    assert "not a multiple" in problems[(0, "none", 1)]  # 6 samples over 4 ranks
    assert not advice.feasible


def test_missing_tier_bandwidth():
    advice = advise(MODEL, _cluster(nvme_bandwidth_bytes_per_s=None), _workload(stages=(3,)))
    offered = {c.offload for c in advice.feasible}
    assert offered == {"none", "cpu-optimizer", "cpu-all"}
    assert "no nvme bandwidth" in advice.why_not()[(3, "nvme-all")]


def test_model_parallel_must_divide_devices():
    w = _workload(memory=MemoryConfig(stage=0, num_mp_ranks=3))
    with pytest.raises(ValueError, match="model-parallel"):
        advise(MODEL, _cluster(), w)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: _cluster(num_devices=0), "num_devices"),
        (lambda: _cluster(device_memory_bytes=-1), "device_memory_bytes"),
        (lambda: _cluster(peak_flops=0), "peak_flops"),
        (lambda: _cluster(cpu_memory_bytes=0), "cpu_memory_bytes"),
        (lambda: _workload(global_batch_size=0), "global_batch_size"),
        (lambda: _workload(micro_batch_sizes=()), "micro_batch_sizes"),
        (lambda: _workload(offloads=("tape",)), "unknown offload"),
    ],
)
def test_config_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()
