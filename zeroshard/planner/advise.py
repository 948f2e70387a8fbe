"""The advisor: given a model, a cluster and a workload, try every stage, offload placement,
checkpoint span and micro-batch size, keep those that fit, rank them by estimated step time and
say why the others do not fit.

Step time is the sum, without overlap (the same assumption as §8's efficiency), of
- compute: the FLOPs of a micro-batch / Nm at the device's peak: counted on the built model
  (``flops``: forward, backward, and the units' recomputation under activation checkpointing),
  else 8 * Psi * bsz * seq (2 * 4 * 12 * bsz * seq * nl * hd^2 for a transformer shape);
- data-parallel collectives (``comm.dp_communication``) at the network bandwidth, every
  micro-batch where gradients are sharded or parameters gathered, else once per step; with hybrid
  sharding (``MemoryConfig.shard_group_size``) those inside a shard group at that bandwidth and
  the all-reduce across groups at the inter-node bandwidth (``inter_group``), added: the engine
  runs it after each reduce-scatter, not overlapped;
- offload traffic at the CPU or NVMe bandwidth, from the per-device bytes the memory breakdown
  puts on that tier: streamed FP32 masters go up in each micro-batch's forward and backward and,
  from NVMe, are read for the step and written back after it; offloaded gradient shards go down
  once per reduction (every micro-batch, or once when accumulated unreduced), and from NVMe are
  read back too; updated parameters come back once per step; optimizer states on NVMe are read
  and written once per step (a CPU optimizer step is not timed); CPU activation checkpoints are
  written and read once per micro-batch.

Only configurations zeroshard's engine accepts are feasible (``engine_problem``): the others are
rejected with the engine's own reason and fix.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace

from zeroshard.planner.comm import (
    REPLICATE,
    SHARD,
    dp_communication,
    gathered_again,
    scope_ranks,
    scope_seconds,
)
from zeroshard.planner.describe import ModelDescription
from zeroshard.planner.flops import of_config
from zeroshard.planner.memory import (
    OFFLOADS,
    MemoryBreakdown,
    MemoryConfig,
    Placement,
    Tier,
    at_stage,
    placement_problem,
    plan_memory,
)
from zeroshard.planner.staging import MASTER_BYTES
from zeroshard.planner.timeline import as_engine_buckets
from zeroshard.planner.units import format_bytes
from zeroshard.stages import partition


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The machines: device count, memory per tier and bandwidths."""

    num_devices: int
    """Accelerators in total (Nd * Nm)."""
    device_memory_bytes: int
    """Memory of one accelerator."""
    peak_flops: float
    """Achievable FLOP/s of one accelerator (the papers use 70e12 for a V100)."""
    net_bandwidth_bytes_per_s: float
    """Bandwidth of data-parallel collectives per device (inside a node: a shard group's)."""
    inter_node_bandwidth_bytes_per_s: float | None = None
    """Bandwidth per device across nodes, for hybrid sharding's all-reduce across shard groups
    (and stage 0's all-reduce over every rank when shard groups are given); None: the network
    bandwidth."""
    cpu_bandwidth_bytes_per_s: float | None = None
    """CPU memory to one device (ZeRO-Infinity's bw); None: CPU offload is not considered."""
    nvme_bandwidth_bytes_per_s: float | None = None
    """NVMe to one device, effective; None: NVMe offload is not considered."""
    num_devices_per_node: int | None = None
    """Devices sharing one node's CPU memory and NVMe; default: all (one node)."""
    cpu_memory_bytes: int | None = None
    """CPU memory of one node; None: not checked."""
    nvme_bytes: int | None = None
    """NVMe capacity of one node; None: not checked."""
    device_type: str = "cuda"
    """The devices' torch device type: "cuda" (or another accelerator) or "cpu". zeroshard's
    engine offloads model states only when training on the CPU (``Offload.check``), so on an
    accelerator every offloaded placement is rejected."""

    def __post_init__(self) -> None:
        for name in ("num_devices", "device_memory_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster.{name} must be a positive int, got {value!r}")
        for name in ("peak_flops", "net_bandwidth_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Cluster.{name} must be positive, got {getattr(self, name)!r}")
        for name in (
            "inter_node_bandwidth_bytes_per_s",
            "cpu_bandwidth_bytes_per_s",
            "nvme_bandwidth_bytes_per_s",
            "num_devices_per_node",
            "cpu_memory_bytes",
            "nvme_bytes",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"Cluster.{name} must be positive or None, got {value!r}")
        if not isinstance(self.device_type, str) or not self.device_type:
            raise ValueError(
                f"Cluster.device_type must be a torch device type such as 'cuda' or 'cpu', got "
                f"{self.device_type!r}"
            )

    @property
    def devices_per_node(self) -> int:
        return min(self.num_devices_per_node or self.num_devices, self.num_devices)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What to train and which choices the advisor may make."""

    seq_len: int
    """Tokens per sample."""
    global_batch_size: int
    """Samples per optimizer step, over all data-parallel ranks."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Samples per device per forward to try."""
    checkpoint_spans: tuple[int, ...] = (1,)
    """ci values to try (blocks per activation checkpoint)."""
    stages: tuple[int, ...] = (0, 1, 2, 3)
    """Stages to try."""
    offloads: tuple[str, ...] = tuple(OFFLOADS)
    """Names of ``memory.OFFLOADS`` placements to try."""
    memory: MemoryConfig = field(default_factory=lambda: MemoryConfig(stage=0))
    """Everything else (Nm, bytes per parameter, prefetch, buckets, fragmentation, activation
    partitioning and offload); its stage, Nd, micro-batch, seq and ci are set per candidate."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "global_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{name} must be a positive int, got {value!r}")
        for name in ("micro_batch_sizes", "checkpoint_spans", "stages", "offloads"):
            values = getattr(self, name)
            if isinstance(values, (str, int)):  # ("none" read letter by letter)
                raise TypeError(f"Workload.{name} is a tuple of values, got {values!r}")
            if not values:
                raise ValueError(f"Workload.{name} is empty; give at least one value")
        for name in ("micro_batch_sizes", "checkpoint_spans"):
            bad = [v for v in getattr(self, name) if isinstance(v, bool) or not isinstance(v, int)]
            bad += [v for v in getattr(self, name) if isinstance(v, int) and v < 1]
            if bad:
                raise ValueError(f"Workload.{name} holds positive ints, got {bad[0]!r}")
        unknown = [o for o in self.offloads if o not in OFFLOADS]
        if unknown:
            raise ValueError(f"unknown offload {unknown[0]!r}; choose from {', '.join(OFFLOADS)}")


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One configuration the advisor tried."""

    stage: int
    offload: str
    num_layers_per_checkpoint: int
    micro_batch_size: int
    num_micro_batches: int
    """Gradient-accumulation steps per optimizer step (0 when the batch does not divide)."""
    memory: MemoryBreakdown | None
    step_seconds: float | None
    """Estimated time per optimizer step (None when it does not fit)."""
    time_seconds: dict[str, float]
    """``step_seconds`` split into compute, collectives (inside shard groups), inter_group
    (across shard groups: hybrid sharding; 0 otherwise) and offload."""
    problem: str | None
    """Why it does not fit (None when it does)."""
    device_bytes: int | None = None
    """The device's peak, as ``zeroshard plan`` reports it (the engine's timeline where the
    workload follows it), plus the CPU tier where the CPU is the device; None when the memory
    was not planned."""
    accumulate_unreduced: bool = False
    """Micro-batches accumulated unreduced (the workload asks it, and the engine takes it here:
    partitioned gradients, two or more micro-batches)."""


@dataclass(frozen=True, kw_only=True)
class Advice:
    feasible: tuple[Candidate, ...]
    """Configurations that fit, fastest first."""
    rejected: tuple[Candidate, ...]
    """The rest, each with its ``problem``."""
    notes: tuple[str, ...] = ()
    """What the advisor could not check (also issued as warnings)."""

    def why_not(self) -> dict[tuple[int, str], str]:
        """For each (stage, offload) with nothing feasible, why its smallest candidate fails."""
        fits = {(c.stage, c.offload) for c in self.feasible}
        out: dict[tuple[int, str], str] = {}
        for c in sorted(
            self.rejected, key=lambda c: (c.micro_batch_size, -c.num_layers_per_checkpoint)
        ):
            key = (c.stage, c.offload)
            if key not in fits and key not in out:
                out[key] = c.problem or ""
        return out


def advise(model: ModelDescription, cluster: Cluster, workload: Workload) -> Advice:
    """Every candidate of ``workload`` on ``cluster``, feasible ones ranked by step time."""
    num_mp = workload.memory.num_mp_ranks
    if cluster.num_devices % num_mp:
        raise ValueError(
            f"{cluster.num_devices} devices cannot be split into model-parallel groups of "
            f"{num_mp}; pick a model-parallel degree that divides the device count"
        )
    num_dp = cluster.num_devices // num_mp
    notes = []
    if num_mp > 1:
        notes.append(
            f"Nm = {num_mp}: zeroshard's tensor parallelism splits models that have a plan "
            "(tensor_parallel.plan_for: the built-in GPT, Hugging Face configs declaring "
            "base_model_tp_plan, models with a tp_plan attribute); the advisor cannot tell from "
            "the description whether this model has one"
        )
    for note in notes:
        warnings.warn(note, stacklevel=2)
    feasible, rejected = [], []
    for stage in workload.stages:
        for offload in workload.offloads:
            for ci in workload.checkpoint_spans:
                for mb in workload.micro_batch_sizes:
                    c = _try(model, cluster, workload, stage, offload, ci, mb, num_dp)
                    (rejected if c.problem else feasible).append(c)
    # Fastest first; on a tie (to 6 digits) the larger micro-batch, which uses a device better
    # than this model counts, then the smaller footprint.
    feasible.sort(
        key=lambda c: (float(f"{c.step_seconds:.6g}"), -c.micro_batch_size, c.device_bytes)
    )
    return Advice(feasible=tuple(feasible), rejected=tuple(rejected), notes=tuple(notes))


_OFFLOAD_FIELDS = {"optimizer_states": "optimizer", "grads": "gradients", "params": "parameters"}
"""``Placement`` fields and the ``zeroshard.Offload`` fields that place the same state."""


def engine_problem(
    model: ModelDescription,
    cluster: Cluster,
    config: MemoryConfig,
    stage: int,
    placement: Placement,
) -> str | None:
    """Why zeroshard's engine refuses to run ``placement`` at ``stage`` with ``config``'s
    activation, hybrid and tensor-parallel settings on ``cluster`` (None when it runs it): the
    refusals of ``Offload``, ``train_config`` / ``backward_step`` (step_in_backward),
    ``residual_states.partitioned`` and ``sharding`` (activation checkpoints), and
    ``tensor_parallel.gpt_plan``, each naming the fix."""
    part = partition(stage)
    off = {
        name: placement.tier(field).value
        for field, name in _OFFLOAD_FIELDS.items()
        if placement.tier(field) is not Tier.DEVICE
    }
    if config.step_in_backward:
        if not part.gradients:
            return (
                f"step_in_backward needs partitioned gradients (stage 2 or 3), got stage {stage}; "
                "use stage 2 or 3, or drop step_in_backward"
            )
        on_nvme = [n for n, t in off.items() if t == Tier.NVME.value]
        if on_nvme:
            return (
                f"step_in_backward cannot stream {on_nvme[0]} on NVMe in step order; keep them "
                "in memory or drop step_in_backward"
            )
    if "parameters" in off and not part.parameters:
        return (
            f"parameters={off['parameters']!r} at stage {stage} needs partitioned parameters; "
            "use stage 3 or keep the parameters on the device"
        )
    if "gradients" in off and not part.gradients:
        return (
            f"gradients={off['gradients']!r} at stage {stage} needs partitioned gradients; use "
            "stage 2 or 3, or keep the gradients on the device"
        )
    if off.get("gradients") == "nvme" and off.get("optimizer") != "nvme":
        return "gradients='nvme' needs optimizer='nvme'; set both, or gradients='cpu'"
    if off and cluster.device_type != "cpu":
        name = next(iter(off))
        return (
            f"{name}={off[name]!r} on a {cluster.device_type} device is not implemented yet "
            "(the engine offloads model states only when training on the CPU); use offload "
            "none there"
        )
    return layout_problem(model, config)


def layout_problem(model: ModelDescription, config: MemoryConfig) -> str | None:
    """Why the engine refuses ``config``'s activation and tensor-parallel settings, whatever the
    stage and placement (None when it runs them); ``zeroshard plan`` checks its table's too."""
    num_mp = config.num_mp_ranks
    if config.partition_activations and num_mp < 2:
        return (
            "partition_activations splits checkpoints over tensor-parallel ranks, and there are "
            "none (Nm = 1); use Nm >= 2, or drop partition_activations"
        )
    if config.sequence_parallel and (num_mp < 2 or config.partition_activations):
        why = "there are none (Nm = 1); use Nm >= 2" if num_mp < 2 else "so does Pa; drop one"
        return f"sequence_parallel splits sequences over tensor-parallel ranks, and {why}"
    if config.sequence_parallel and config.seq_len % num_mp:
        return (
            f"sequence_parallel splits each sequence evenly: seq {config.seq_len} does not split "
            f"in Nm = {num_mp}; use a multiple of {num_mp}"
        )
    for name in ("partition_activations", "offload_activations"):
        if getattr(config, name) and not config.activation_checkpointing:
            return (
                f"{name} places activation checkpoints, and there are none; checkpoint "
                f"activations (checkpoint_every >= 1), or drop {name}"
            )
    heads = None if model.shape is None else model.shape.num_heads
    if num_mp > 1 and heads is not None and heads % num_mp:
        return (
            f"tensor parallelism splits attention by heads: {heads} heads do not split in "
            f"Nm = {num_mp}; use an Nm that divides {heads}"
        )
    return None


def _try(model, cluster, workload, stage, offload, ci, mb, num_dp) -> Candidate:
    def unreduced(num_micro: int) -> bool:
        """Where the engine takes ``accumulate_unreduced`` (zeroshard train refuses it
        elsewhere): partitioned gradients, two or more micro-batches."""
        asked = workload.memory.accumulate_unreduced
        return asked and partition(stage).gradients and num_micro > 1

    def candidate(memory=None, num_micro=0, times=None, problem=None) -> Candidate:
        return Candidate(
            accumulate_unreduced=unreduced(num_micro),
            device_bytes=None if memory is None else _device_need(memory, cluster),
            stage=stage,
            offload=offload,
            num_layers_per_checkpoint=ci,
            micro_batch_size=mb,
            num_micro_batches=num_micro,
            memory=memory,
            step_seconds=None if times is None else sum(times.values()),
            time_seconds=times or {},
            problem=problem,
        )

    def reject(problem: str, memory=None, num_micro=0) -> Candidate:
        return candidate(memory, num_micro, problem=problem)

    placement = at_stage(OFFLOADS[offload], stage)
    problem = placement_problem(
        stage, placement, step_in_backward=workload.memory.step_in_backward
    ) or engine_problem(model, cluster, workload.memory, stage, placement)
    if problem:
        return reject(problem)
    tiers = {placement.params, placement.grads, placement.optimizer_states}
    for tier, bw in (
        (Tier.CPU, cluster.cpu_bandwidth_bytes_per_s),
        (Tier.NVME, cluster.nvme_bandwidth_bytes_per_s),
    ):
        if tier in tiers and bw is None and not (tier is Tier.CPU and _cpu_is_device(cluster)):
            return reject(f"no {tier.value} bandwidth given for the cluster")
    if workload.global_batch_size % (num_dp * mb):
        return reject(
            f"global batch {workload.global_batch_size} is not a multiple of "
            f"Nd * micro-batch = {num_dp} * {mb}"
        )
    num_micro = workload.global_batch_size // (num_dp * mb)
    config = replace(
        workload.memory,
        stage=stage,
        num_dp_ranks=num_dp,
        placement=placement,
        micro_batch_size=mb,
        seq_len=workload.seq_len,
        num_layers_per_checkpoint=ci,
        grad_accum=num_micro,
        accumulate_unreduced=unreduced(num_micro),
    )
    memory = plan_memory(model, as_engine_buckets(model, config))
    need, have = _device_need(memory, cluster), cluster.device_memory_bytes
    if need > have:
        return reject(
            f"needs {format_bytes(need)} per device, has {format_bytes(have)}", memory, num_micro
        )
    per_node = cluster.devices_per_node
    for tier, have in ((Tier.CPU, cluster.cpu_memory_bytes), (Tier.NVME, cluster.nvme_bytes)):
        need = memory.total_bytes(tier) * per_node
        if tier is Tier.CPU and _cpu_is_device(cluster):  # every device is in the node's RAM
            need = _device_need(memory, cluster) * per_node
        if have is not None and need > have:
            return reject(
                f"needs {format_bytes(need)} of {tier.value} per node, has {format_bytes(have)}",
                memory,
                num_micro,
            )
    times = _step_times(model, cluster, config, memory, num_micro)
    return candidate(memory, num_micro, times)


def _device_need(memory: MemoryBreakdown, cluster: Cluster) -> int:
    """Bytes per device: its peak (along the engine's timeline where the plan follows it, as
    ``zeroshard plan`` reports it), and the CPU tier too where the CPU is the device."""
    return memory.peak_bytes() + (memory.total_bytes(Tier.CPU) if _cpu_is_device(cluster) else 0)


def _cpu_is_device(cluster: Cluster) -> bool:
    """Whether the CPU tier is the device's own memory (training on the CPU): what is placed
    there counts against ``device_memory_bytes`` and moves in no time."""
    return cluster.device_type == "cpu"


READ_BACK = {Tier.CPU: 0, Tier.NVME: 1}
"""Per offload tier, whether a state placed there is read back into memory to be used and
written again after the step: the CPU steps states where they are; from NVMe they come into
host memory and go back (ZeRO-Infinity), as the engine's swappers do."""


def _step_times(model, cluster, config, memory, num_micro) -> dict[str, float]:
    """Seconds per optimizer step for compute, collectives and offload (see the module doc)."""
    num_mp = config.num_mp_ranks
    flops, _ = of_config(model, config)
    compute = num_micro * flops / num_mp / cluster.peak_flops

    k = config.shard_group_size
    collectives = dp_communication(
        model.num_params,
        stage=config.stage,
        num_mp_ranks=num_mp,
        param_dtype_bytes=config.bytes_per_param.params or 2,
        reduce_dtype_bytes=config.bytes_per_param.grads or 2,
        num_dp_ranks=None if k is None else config.num_dp_ranks,
        shard_group_size=k,
        num_params_kept_gathered=model.kept_gathered_numel,
        num_params_replicated=model.replicated_numel,
        reduce_every_micro_batch=not config.accumulate_unreduced,
        num_params_trainable=model.num_trainable_params,
        num_params_gathered_again=gathered_again(model, config),
    )
    net, inter = cluster.net_bandwidth_bytes_per_s, cluster.inter_node_bandwidth_bytes_per_s
    if config.stage == 0 and k is not None and k < config.num_dp_ranks:
        net = inter or net  # stage 0 ignores shard groups: its all-reduce spans every node
    seconds = scope_seconds(
        collectives,
        intra_bandwidth_bytes_per_s=net,
        inter_bandwidth_bytes_per_s=inter,
        num_micro_batches=num_micro,
        group_ranks=scope_ranks(config.stage, config.num_dp_ranks, k),
    )

    bandwidth = {
        Tier.CPU: cluster.cpu_bandwidth_bytes_per_s,
        Tier.NVME: cluster.nvme_bandwidth_bytes_per_s,
    }
    p = config.placement
    traffic: dict[Tier, float] = {Tier.CPU: 0.0, Tier.NVME: 0.0}
    shard_params_bytes = math.ceil(
        config.bytes_per_param.params * model.num_params / (num_mp * config.num_shard_ranks)
    )
    if p.params is not Tier.DEVICE:
        streamed = memory.on(p.params)["params"]
        if config.bytes_per_param.working_copies:  # none at rest: the FP32 masters stream
            streamed = math.ceil(
                MASTER_BYTES * model.num_params / (num_mp * config.num_shard_ranks)
            )
        # Up to the device in each micro-batch's forward and backward (a recomputation finds the
        # unit gathered), and through the step where it reads them back (``READ_BACK``).
        at_step = 2 * READ_BACK[p.params]
        traffic[p.params] += (2 * num_micro + at_step) * streamed
    if p.grads is not Tier.DEVICE:
        reductions = 1 if config.accumulate_unreduced else num_micro
        # Each reduction's shard goes down, and is read back where it does not stay in reach
        # (by the next reduction adding to it, or by the step).
        trips = 1 + READ_BACK[p.grads]
        traffic[p.grads] += trips * reductions * memory.on(p.grads)["grads"]
        if p.params is Tier.DEVICE:
            traffic[p.grads] += shard_params_bytes  # updated parameters come back
    if p.optimizer_states is not Tier.DEVICE:
        states = memory.on(p.optimizer_states)["optimizer_states"]
        traffic[p.optimizer_states] += 2 * READ_BACK[p.optimizer_states] * states
    for tier in (Tier.CPU, Tier.NVME):  # checkpoints go down in forward, come back in backward
        traffic[tier] += num_micro * 2 * memory.on(tier)["activation_checkpoints"]
    if _cpu_is_device(cluster):
        traffic[Tier.CPU] = 0.0  # nothing is copied
    offload = sum(b / bandwidth[t] for t, b in traffic.items() if b)
    return {
        "compute": compute,
        "collectives": seconds[SHARD],
        "inter_group": seconds[REPLICATE],
        "offload": offload,
    }
