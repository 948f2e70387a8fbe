"""The advisor: hand-timed steps, ranking, reasons for what does not fit, and only what the
engine runs offered."""

import contextlib

import pytest
import torch

import zeroshard
from zeroshard.models.gpt import GPT, Block, GPTConfig
from zeroshard.planner import describe as d
from zeroshard.planner.advise import Cluster, Workload, advise, engine_problem
from zeroshard.planner.memory import OFFLOADS, MemoryConfig, Placement, Tier, at_stage

MODEL = d.from_params(10**9)


def _cluster(**kw):
    base = dict(
        num_devices=4,
        device_memory_bytes=10**12,
        peak_flops=1e15,
        net_bandwidth_bytes_per_s=100e9,
        cpu_bandwidth_bytes_per_s=10e9,
        nvme_bandwidth_bytes_per_s=1e9,
        device_type="cpu",  # the engine offloads model states only when training on the CPU
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


def test_accumulation_holds_the_shards_of_a_step_in_backward():
    # Stepping in backward holds no gradient shard within one micro-batch; between several,
    # each waits for the last one's backward (the row said "accum 4" and counted none).
    memory = MemoryConfig(stage=3, step_in_backward=True)
    for batch, shards in ((4, 0), (16, 10**9)):  # 4 devices, fp16 gradients: 2 Psi / 4
        w = _workload(global_batch_size=batch, stages=(3,), offloads=("none",), memory=memory)
        (c,) = advise(MODEL, _cluster(), w).feasible
        assert c.memory.device["grads"] == shards / 2, (batch, c.num_micro_batches)


def test_offload_traffic_by_hand():
    w = _workload(stages=(3,), offloads=("nvme-all",), memory=MemoryConfig(stage=0))
    (c,) = advise(MODEL, _cluster(), w).feasible
    shard = 10**9 // 4  # elements per rank
    # The gradient shard goes to the CPU tier: on a CPU device that is its own memory, so
    # nothing moves there.
    # Parameters read in forward, backward and for the step, and written back after it (they
    # were read 3 times, not written: the advisor's NVMe traffic was 0.79-0.86x the engine's,
    # explorer); the optimizer states read and written.
    nvme = 4 * 2 * shard + 2 * 12 * shard
    assert c.time_seconds["offload"] == pytest.approx(nvme / 1e9)


def test_offloaded_gradients_with_accumulation_by_hand():
    """Gradient shards on NVMe go down at each reduction and are read back (by the next
    reduction adding to them, or the step): every micro-batch at stage 3, once when
    accumulated unreduced at stage 2."""
    shard = 10**9 // 4
    for stage, reductions in ((3, 4), (2, 1)):
        w = _workload(
            global_batch_size=16,
            stages=(stage,),
            offloads=("nvme-states",),
            memory=MemoryConfig(stage=0, accumulate_unreduced=stage == 2),
        )
        (c,) = advise(MODEL, _cluster(), w).feasible
        # + the optimizer states read and written, and the updated parameters back
        nvme = 2 * reductions * 2 * shard + 2 * 12 * shard + 2 * shard
        assert c.num_micro_batches == 4
        assert c.time_seconds["offload"] == pytest.approx(nvme / 1e9), stage


def test_on_a_cpu_device_the_cpu_tier_is_device_memory():
    """Training on the CPU, "offloading" to the CPU frees no memory: the advisor counts the
    CPU tier against the device's memory and charges no copy time for it."""
    w = _workload(stages=(2,), offloads=("cpu-optimizer",))
    (c,) = advise(MODEL, _cluster(), w).feasible
    assert c.time_seconds["offload"] == 0.0
    device, cpu = c.memory.total_bytes(Tier.DEVICE), c.memory.total_bytes(Tier.CPU)
    assert cpu > 0
    (rejected,) = advise(MODEL, _cluster(device_memory_bytes=device + cpu - 1), w).rejected
    assert rejected.problem.startswith("needs"), rejected.problem
    assert len(advise(MODEL, _cluster(device_memory_bytes=device + cpu), w).feasible) == 1


def test_memory_limit_rejects_with_reason():
    small = _cluster(device_memory_bytes=7 * 10**9)  # stage 2: (2 + 14 / 4) GB + 10% fits
    advice = advise(MODEL, small, _workload(offloads=("none",)))
    assert {c.stage for c in advice.feasible} == {2, 3}
    why = advice.why_not()
    # 16 GB of model states + 2 x 25 MiB buckets, + 10% fragmentation allowance.
    assert why[(0, "none")].startswith("needs 17.7 GB per device, has 7 GB")
    assert "needs" in why[(1, "none")]


def test_cpu_capacity_is_per_node():
    """Training on the CPU, the node's memory holds every device's whole need (its device and
    CPU tiers): checked per node of ``num_devices_per_node`` (the CPU tier alone was checked,
    and 4 devices' worth of memory passed a node that holds one's)."""
    w = _workload(stages=(2,), offloads=("cpu-optimizer",))
    (c,) = advise(MODEL, _cluster(), w).feasible
    assert c.device_bytes == c.memory.peak_bytes() + c.memory.total_bytes(Tier.CPU)
    ok = advise(MODEL, _cluster(cpu_memory_bytes=4 * c.device_bytes), w)
    assert len(ok.feasible) == 1
    tight = advise(MODEL, _cluster(cpu_memory_bytes=4 * c.device_bytes - 1), w)
    assert not tight.feasible
    assert "of cpu per node" in tight.rejected[0].problem
    two_nodes = advise(
        MODEL, _cluster(cpu_memory_bytes=2 * c.device_bytes, num_devices_per_node=2), w
    )
    assert len(two_nodes.feasible) == 1


def test_not_offered_and_not_divisible():
    advice = advise(MODEL, _cluster(), _workload(global_batch_size=6, micro_batch_sizes=(1, 2)))
    problems = {(c.stage, c.offload, c.micro_batch_size): c.problem for c in advice.rejected}
    assert "gradients leave the device only when partitioned" in problems[(1, "nvme-states", 1)]
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
        (lambda: _cluster(device_type=""), "device_type"),
        (lambda: _workload(global_batch_size=0), "global_batch_size"),
        (lambda: _workload(micro_batch_sizes=()), "micro_batch_sizes"),
        (lambda: _workload(offloads=("tape",)), "unknown offload"),
    ],
)
def test_config_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---- only what the engine runs -------------------------------------------------------------


def _problems(advice):
    return {(c.stage, c.offload): c.problem for c in advice.rejected}


def test_accelerators_get_no_model_state_offload():
    w = _workload(stages=(3,))
    advice = advise(MODEL, _cluster(device_type="cuda"), w)
    assert {c.offload for c in advice.feasible} == {"none"}
    for name in ("cpu-optimizer", "nvme-optimizer", "cpu-all", "nvme-all"):
        problem = _problems(advice)[(3, name)]
        assert "on a cuda device is not implemented yet" in problem and "offload none" in problem
    assert {c.offload for c in advise(MODEL, _cluster(), w).feasible} == set(OFFLOADS)


def test_an_offloaded_optimizer_below_stage_2_leaves_the_gradients_on_the_device():
    # The engine partitions gradients from stage 2: at stage 1 they stay on the device and the
    # optimizer on the CPU takes its rank's slice at the step, as zeroshard train runs it.
    advice = advise(MODEL, _cluster(), _workload(stages=(1, 2), offloads=("cpu-optimizer",)))
    by_stage = {c.stage: c for c in advice.feasible}
    assert sorted(by_stage) == [1, 2]
    assert by_stage[1].memory.cpu["grads"] == 0 and by_stage[1].memory.device["grads"] > 0
    assert by_stage[2].memory.cpu["grads"] > 0 and by_stage[2].memory.device["grads"] == 0


@pytest.mark.parametrize(
    "stage, placement, match",
    [
        (2, Placement(params=Tier.CPU, grads=Tier.CPU, optimizer_states=Tier.CPU), "stage 3"),
        (0, Placement(grads=Tier.CPU, optimizer_states=Tier.CPU), "partitioned gradients"),
        (3, Placement(grads=Tier.NVME, optimizer_states=Tier.CPU), "needs optimizer='nvme'"),
    ],
)
def test_engine_placement_rules(stage, placement, match):
    problem = engine_problem(MODEL, _cluster(), MemoryConfig(stage=0), stage, placement)
    assert match in problem


def test_step_in_backward_refusals():
    sib = MemoryConfig(stage=3, step_in_backward=True)
    advice = advise(MODEL, _cluster(), _workload(memory=sib))  # every stage and offload
    problems = _problems(advice)
    for stage in (0, 1):
        assert (
            "step_in_backward needs partitioned gradients (stage 2 or 3)"
            in problems[(stage, "none")]
        )
    assert "NVMe" in problems[(3, "nvme-all")] and "NVMe" in problems[(3, "nvme-optimizer")]
    assert {(c.stage, c.offload) for c in advice.feasible} == {
        (2, "none"),
        (2, "cpu-optimizer"),
        (3, "none"),
        (3, "cpu-optimizer"),
        (3, "cpu-all"),
    }
    params_on_nvme = Placement(params=Tier.NVME, grads=Tier.CPU, optimizer_states=Tier.CPU)
    problem = engine_problem(MODEL, _cluster(), sib, 3, params_on_nvme)
    assert "cannot stream parameters on NVMe" in problem and "drop step_in_backward" in problem


@pytest.mark.parametrize(
    "memory, match",
    [
        (MemoryConfig(stage=0, partition_activations=True), "tensor-parallel ranks"),
        (MemoryConfig(stage=0, sequence_parallel=True), "sequence_parallel splits sequences"),
        (
            MemoryConfig(
                stage=0, num_mp_ranks=2, sequence_parallel=True, partition_activations=True
            ),
            "so does Pa; drop one",
        ),
        (
            MemoryConfig(
                stage=0, num_mp_ranks=2, partition_activations=True, activation_checkpointing=False
            ),
            "partition_activations places activation checkpoints, and there are none",
        ),
        (
            MemoryConfig(stage=0, offload_activations=True, activation_checkpointing=False),
            "offload_activations places activation checkpoints, and there are none",
        ),
    ],
)
def test_activation_and_mesh_refusals(memory, match):
    tensor_parallel = memory.num_mp_ranks > 1  # warns: the plan is unknown (next test)
    with pytest.warns(UserWarning) if tensor_parallel else contextlib.nullcontext():
        advice = advise(MODEL, _cluster(), _workload(offloads=("none",), memory=memory))
    assert not advice.feasible
    assert all(match in c.problem for c in advice.rejected)


def test_tensor_parallel_heads_and_the_unknown_plan():
    three_heads = d.from_transformer(num_layers=2, hidden_size=96, num_heads=3, vocab_size=100)
    w = _workload(
        global_batch_size=2, offloads=("none",), memory=MemoryConfig(stage=0, num_mp_ranks=2)
    )
    with pytest.warns(UserWarning, match="splits models that have a plan"):
        advice = advise(three_heads, _cluster(), w)
    assert not advice.feasible
    assert "3 heads do not split in Nm = 2; use an Nm that divides 3" in advice.rejected[0].problem
    gpt = d.from_gpt(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    with pytest.warns(UserWarning, match="cannot tell"):
        advice = advise(gpt, _cluster(), w)
    assert advice.feasible and "plan_for" in advice.notes[0]
    assert not advise(MODEL, _cluster(), _workload(offloads=("none",))).notes


# ---- end to end: every feasible candidate runs on the engine -------------------------------

SMALL = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)
_ENGINE_TIER = {Tier.DEVICE: None, Tier.CPU: "cpu", Tier.NVME: "nvme"}


def _small_advice(device_type):
    cluster = _cluster(
        num_devices=1,
        device_memory_bytes=10**10,
        cpu_memory_bytes=10**10,
        nvme_bytes=10**10,
        device_type=device_type,
    )
    workload = Workload(
        seq_len=SMALL.block_size,
        global_batch_size=2,
        micro_batch_sizes=(2,),
        checkpoint_spans=(1, 2),
        stages=(0, 1, 2, 3),
        offloads=tuple(OFFLOADS),
    )
    return advise(d.from_gpt(SMALL), cluster, workload)


def _build(stage, offload, ci, folder):
    p = at_stage(OFFLOADS[offload], stage)
    place = {
        "optimizer": _ENGINE_TIER[p.optimizer_states],
        "gradients": _ENGINE_TIER[p.grads],
        "parameters": _ENGINE_TIER[p.params],
    }
    on_nvme = "nvme" in place.values()
    if on_nvme:
        folder.mkdir()
    torch.manual_seed(0)
    return zeroshard.shard(
        GPT(SMALL),
        stage=stage,
        wrap=zeroshard.wrap.by_class(Block),
        config=zeroshard.ShardConfig(checkpoint_every=ci),
        offload=zeroshard.Offload(**place, folder=folder if on_nvme else None),
    )


def test_every_feasible_candidate_runs_on_the_engine(lone_process, tmp_path):
    advice = _small_advice("cpu")
    ran = set()
    for c in advice.feasible:
        key = (c.stage, c.offload, c.num_layers_per_checkpoint)
        model = _build(*key, tmp_path / "-".join(map(str, key)))
        opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
        x = torch.randint(0, SMALL.vocab_size, (c.micro_batch_size, SMALL.block_size))
        loss = model(x, x)
        loss.backward()
        opt.step()
        assert torch.isfinite(loss), key
        ran.add((c.stage, c.offload))
        del model, opt
    # Everything the planner does not reject, the engine runs (gradients left on the device
    # below stage 2, optimizer states on NVMe from stage 1).
    rejected = set(_problems(advice))
    assert ran == {(s, o) for s in range(4) for o in OFFLOADS} - rejected
    assert (1, "nvme-optimizer") in ran and (1, "cpu-all") in rejected
    # What the advisor rejects with an engine reason, the engine refuses with the same one.
    problem = engine_problem(
        d.from_gpt(SMALL), _cluster(), MemoryConfig(stage=1), 1, OFFLOADS["cpu-optimizer"]
    )
    with pytest.raises(ValueError, match="needs partitioned gradients") as refused:
        zeroshard.shard(
            GPT(SMALL), stage=1, offload=zeroshard.Offload(optimizer="cpu", gradients="cpu")
        )
    assert "gradients='cpu' at stage 1" in problem and "gradients='cpu' at stage 1" in str(
        refused.value
    )


def test_no_offloaded_candidate_on_accelerators():
    advice = _small_advice("cuda")
    assert {c.offload for c in advice.feasible} == {"none"}
    assert {c.stage for c in advice.feasible} == {0, 1, 2, 3}


def test_streamed_parameters_of_mixed_precision_are_the_fp32_masters():
    # The engine's BF16 keeps no 2-byte parameter at rest at stage 3: what streams from the
    # CPU or NVMe is the FP32 master shard, up in forward and backward (it was counted as free).
    import sys

    from zeroshard.planner import describe
    from zeroshard.planner.memory import ENGINE_MIXED, ZERO, plan_memory

    module = sys.modules["zeroshard.planner.advise"]
    model = describe.from_gpt("1b")
    cluster = module.Cluster(
        num_devices=8, device_memory_bytes=16 * 2**30, peak_flops=1e14,
        net_bandwidth_bytes_per_s=1e10, cpu_bandwidth_bytes_per_s=1e10,
        nvme_bandwidth_bytes_per_s=1e9,
    )  # fmt: skip
    offload = {}
    for bpp in (ZERO, ENGINE_MIXED):
        cfg = MemoryConfig(
            stage=3, num_dp_ranks=8, bytes_per_param=bpp, micro_batch_size=1, seq_len=1024,
            placement=OFFLOADS["cpu-all"],
        )  # fmt: skip
        plan = plan_memory(model, cfg)
        offload[bpp] = module._step_times(model, cluster, cfg, plan, 1)["offload"]
    # 4 bytes instead of 2 for each of the two parameter transfers and the gradient's
    more = (2 * (4 - 2) + (4 - 2)) * model.num_params / 8 / 1e10
    assert offload[ENGINE_MIXED] == pytest.approx(offload[ZERO] + more, rel=1e-3)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"micro_batch_sizes": (0,)}, ValueError, "positive ints, got 0"),  # ZeroDivisionError
        ({"micro_batch_sizes": "12"}, TypeError, "a tuple of values"),  # a raw TypeError
        ({"offloads": "none"}, TypeError, "a tuple of values"),  # "unknown offload 'n'"
        ({"checkpoint_spans": (1.5,)}, ValueError, "positive ints, got 1.5"),
    ],
)
def test_a_workload_s_choices_are_checked(kw, error, match):
    with pytest.raises(error, match=match):
        _workload(**kw)


def test_activation_checkpoints_on_nvme_cost_disk_time():
    """Each micro-batch writes its checkpoints in forward and reads them back in backward:
    on NVMe that is disk time (it was counted as CPU copies, free on a CPU device)."""
    model = d.from_gpt("nano")
    times = {}
    for where in ("cpu", "nvme"):
        memory = MemoryConfig(stage=0, offload_activations=where)
        w = _workload(global_batch_size=8, stages=(3,), offloads=("none",), memory=memory)
        (c,) = advise(model, _cluster(), w).feasible
        times[where] = c.time_seconds["offload"], c.num_micro_batches
        checkpoints = c.memory.on(where)["activation_checkpoints"]
        assert checkpoints > 0
    assert times["cpu"][0] == 0.0  # a CPU device copies nothing
    seconds, num_micro = times["nvme"]
    assert seconds == pytest.approx(num_micro * 2 * checkpoints / 1e9)
