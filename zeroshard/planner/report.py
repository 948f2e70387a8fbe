"""What ``zeroshard plan`` reports: the plan (memory, communication and efficiency per stage and
offload placement) and the advisor's ranking, as JSON-ready dicts whose keys the README
documents, and the tables that print them.

The builders take numbers (bytes, bytes/s, FLOP/s) and planner objects; reading flags and their
units happens in ``zeroshard.cli.plan``. All sizes are bytes and all times seconds.
"""

from __future__ import annotations

import math
from dataclasses import replace

from zeroshard.planner import bandwidth, comm, flops, memory, saved, timeline, units
from zeroshard.planner.advise import Candidate, Cluster, Workload, advise
from zeroshard.planner.describe import ModelDescription
from zeroshard.planner.memory import OFFLOADS, MemoryConfig, Tier


def model_report(model: ModelDescription) -> dict:
    """``model`` in the report: its count, shape and units (parameters per unit)."""
    return {
        "name": model.name,
        "num_params": model.num_params,
        "shape": None if model.shape is None else vars(model.shape),
        "wrap_policy": model.wrap_policy,
        "activations_measured": model.activations is not None,
        "inputs": _inputs(getattr(model.activations, "inputs", None)),
        "root_unit_numel": model.root_numel,
        "largest_unit_numel": model.block_unit_numel,
        "num_units": None if model.block_unit_numels is None else 1 + len(model.block_unit_numels),
    }


def _flops_report(total: int, counted) -> dict:
    """FLOPs of one micro-batch in the report: ``counted`` on the built model (a
    ``flops.Flops``: forward, backward, recomputed under activation checkpointing), else the
    paper's 8 * Psi * bsz * seq."""
    out = {"per_iteration": total, "counted": counted is not None}
    if counted is not None:
        out.update(forward=counted.forward, backward=counted.backward)
        out["recomputed"] = total - counted.forward - counted.backward
    return out


def _inputs(inputs) -> str | None:
    """One sample's inputs (``Inputs``, ``3x224x224``), for a model that takes no token ids."""
    return None if inputs is None else str(inputs)


def plan_report(
    model: ModelDescription,
    base: MemoryConfig,
    *,
    stages: tuple[int, ...],
    offloads: tuple[str, ...],
    bandwidth_bytes_per_s: float | None = None,
    net_bandwidth_bytes_per_s: float | None = None,
    inter_node_bandwidth_bytes_per_s: float | None = None,
    peak_flops: float | None = None,
    device_memory_bytes: int | None = None,
    cpu_memory_bytes: int | None = None,
    nvme_bytes: int | None = None,
    devices_per_node: int | None = None,
    target_efficiency: float | None = None,
) -> dict:
    """Everything ``zeroshard plan`` prints for ``model`` trained as ``base`` (its stage and
    placement replaced by each of ``stages`` x ``offloads`` that is offered), as a dict.
    With hybrid sharding (``base.shard_group_size``) communication is split into intra-group
    bytes (at ``net_bandwidth_bytes_per_s``) and inter-group bytes (at
    ``inter_node_bandwidth_bytes_per_s``, default the network bandwidth); their times add."""
    bw, net_bw, peak = bandwidth_bytes_per_s, net_bandwidth_bytes_per_s, peak_flops
    num_groups = comm.num_shard_groups(base.num_dp_ranks, base.num_shard_ranks)
    if inter_node_bandwidth_bytes_per_s is not None and num_groups == 1:
        raise ValueError(
            "an inter-node bandwidth prices the traffic across shard groups; give a shard group "
            f"size smaller than Nd = {base.num_dp_ranks} (hybrid sharding) or drop it"
        )
    links = (net_bw, inter_node_bandwidth_bytes_per_s)
    out: dict = {
        "model": model_report(model),
        "num_dp_ranks": base.num_dp_ranks,
        "shard_group_size": base.num_shard_ranks,
        "num_shard_groups": num_groups,
        "net_bandwidth_bytes_per_s": net_bw,
        "inter_node_bandwidth_bytes_per_s": inter_node_bandwidth_bytes_per_s,
        "num_mp_ranks": base.num_mp_ranks,
        "bytes_per_param": vars(base.bytes_per_param),
        "micro_batch_size": base.micro_batch_size,
        "seq_len": base.seq_len,
        "num_layers_per_checkpoint": base.num_layers_per_checkpoint,
        "accumulate_unreduced": base.accumulate_unreduced and base.grad_accum > 1,
        "device_memory_bytes": device_memory_bytes,
        "cpu_memory_bytes": cpu_memory_bytes,
        "nvme_bytes": nvme_bytes,
    }
    # What each tier holds, for the fits column: the device per device; the CPU and NVMe per
    # node, shared by its devices (all Nd x Nm of them unless told).
    devices = base.num_dp_ranks * base.num_mp_ranks
    per_node = min(devices_per_node or devices, devices)
    have = {
        "device": (device_memory_bytes, 1),
        "cpu": (cpu_memory_bytes, per_node),
        "nvme": (nvme_bytes, per_node),
    }
    shape = model.shape
    out["timeline"] = base.engine_timeline or not base.activation_checkpointing
    if not base.activation_checkpointing:
        out["num_layers_per_checkpoint"] = 0  # none: each row's device is its largest moment
    elif shape is not None:
        ci = min(base.num_layers_per_checkpoint, shape.num_layers)
        common = dict(micro_batch_size=base.micro_batch_size, seq_len=base.seq_len)
        out["activation_checkpoint_bytes"] = memory.activation_checkpoint_bytes(
            **common,
            hidden_size=shape.hidden_size,
            num_layers=shape.num_layers,
            num_layers_per_checkpoint=ci,
            num_mp_ranks=base.num_mp_ranks,
            partitioned=base.splits_checkpoints,
            activation_bytes=base.activation_bytes,
        )
        out["activation_working_bytes"] = memory.activation_working_bytes(
            **common,
            hidden_size=shape.hidden_size,
            num_heads=shape.num_heads,
            num_layers_per_checkpoint=ci,
            activation_bytes=base.activation_bytes,
        )
        out["model_state_working_bytes"] = memory.model_state_working_bytes(
            hidden_size=shape.hidden_size
        )
    measured = base.activation_checkpointing and saved.at_config(model, base) is not None
    if measured:
        # Measured on the built model (zeroshard.planner.saved), not the GPT-shaped formulas.
        allowance = memory.plan_memory(model, replace(base, activation_checkpointing=True))
        out["activation_checkpoint_bytes"] = sum(
            allowance.on(t)["activation_checkpoints"] for t in Tier
        )
        out["activation_working_bytes"] = allowance.device["activation_working"]
    total, counted = flops.of_config(model, base)
    out["flops"] = _flops_report(total, counted)
    # (a rank's checkpoints, against its 1/Nm of the FLOPs)
    checkpoints = out["activation_checkpoint_bytes"] * base.num_mp_ranks if measured else None
    ait = bandwidth.intensity(
        micro_batch_size=base.micro_batch_size,
        seq_len=base.seq_len,
        shape=shape if base.activation_checkpointing else None,
        num_layers_per_checkpoint=base.num_layers_per_checkpoint,
        counted_flops=None if counted is None else total,
        num_params=model.num_params,
        checkpoint_bytes=checkpoints,
    )
    out["intensity"] = ait.as_dict()
    if bw is not None and peak is not None:
        out["efficiency"] = ait.efficiencies(bw, peak)
    if target_efficiency is not None:
        if peak is None:
            raise ValueError("--target-efficiency needs --peak-flops, e.g. --peak-flops 70TFLOP/s")
        out["target_efficiency"] = target_efficiency
        out["required_bandwidth_bytes_per_s"] = ait.required_bandwidths(peak, target_efficiency)
    rows, skipped = [], {}
    for stage in stages:
        for offload in offloads:
            placement = memory.at_stage(OFFLOADS[offload], stage)
            why = memory.placement_problem(stage, placement, step_in_backward=base.step_in_backward)
            if why:
                skipped.setdefault(why, []).append(f"stage {stage} {offload}")
                continue
            config = replace(base, stage=stage, placement=placement)
            config = timeline.as_engine_buckets(model, config)
            rows.append(_row(model, config, offload, ait, bw, links, peak, have))
    reasons = [f"{', '.join(which)}: {why}" for why, which in skipped.items()]
    if not rows:
        raise ValueError(
            f"no stage in --stage {','.join(map(str, stages))} supports --offload "
            f"{','.join(offloads)}; " + "; ".join(reasons)
        )
    out["stages"] = rows
    out["not_planned"] = [f"not planned: {r}" for r in reasons]
    return out


def _communication(model, config, net_bw, inter_bw) -> dict:
    """A row's collectives, in total and per scope: ``intra_group`` (inside a shard group: every
    rank without hybrid sharding) and ``inter_group`` (across shard groups), with their seconds
    (None without a network bandwidth)."""
    k, nd, micro = config.shard_group_size, config.num_dp_ranks, config.grad_accum
    collectives = comm.dp_communication(
        model.num_params,
        stage=config.stage,
        num_mp_ranks=config.num_mp_ranks,
        param_dtype_bytes=config.bytes_per_param.params or 2,
        reduce_dtype_bytes=config.bytes_per_param.grads or 2,
        num_dp_ranks=None if k is None else nd,
        shard_group_size=k,
        num_params_kept_gathered=model.kept_gathered_numel,
        num_params_replicated=model.replicated_numel,
        reduce_every_micro_batch=not config.accumulate_unreduced,
        num_params_trainable=model.num_trainable_params,
        num_params_gathered_again=comm.gathered_again(model, config),
    )
    notes = []
    if config.stage == 0 and k is not None and k < nd:
        # The engine ignores shard groups at stage 0 (with a warning): one all-reduce over every
        # rank, whose ring crosses nodes, so the inter-node link bounds it.
        notes.append(
            "stage 0 shards nothing: the shard group size is ignored and the gradient all-reduce "
            "spans every rank (timed at the inter-node bandwidth)"
        )
        net_bw = inter_bw or net_bw
    if k == 1 and config.stage > 0:
        notes.append(
            "shard groups of one rank: the intra-group column is the papers' count (as the "
            "engine's ledger keeps it), but nothing crosses there: timed as 0 s"
        )
    seconds = None
    if net_bw is not None:
        seconds = comm.scope_seconds(
            collectives,
            intra_bandwidth_bytes_per_s=net_bw,
            inter_bandwidth_bytes_per_s=inter_bw,
            num_micro_batches=micro,
            group_ranks=comm.scope_ranks(config.stage, nd, k),
        )
    out = {  # per optimizer step: what runs every micro-batch repeats (it was counted once)
        "numel": comm.total_numel(collectives, micro),
        "bytes": comm.total_bytes(collectives, micro),
        "seconds": None if seconds is None else sum(seconds.values()),
    }
    for key, (scope, group) in zip(
        ("intra_group", "inter_group"), comm.by_scope(collectives).items()
    ):
        out[key] = {
            "numel": comm.total_numel(group, micro),
            "bytes": comm.total_bytes(group, micro),
            "seconds": None if seconds is None else seconds[scope],
        }
    return out | {"collectives": [vars(c) for c in collectives], "notes": notes}


def _row(model, config, offload, ait, bw, links, peak, have) -> dict:
    mem = memory.plan_memory(model, config)
    # The streams this placement waits on, for its efficiency after ZeRO-Infinity.
    streams = []
    if config.placement.params is not Tier.DEVICE:
        streams.append(ait.params_grads)
    if config.placement.optimizer_states is not Tier.DEVICE:
        streams.append(ait.optimizer_states)
    if config.offload_activations and ait.activation_checkpoints is not None:
        streams.append(ait.activation_checkpoints)
    eff = None
    if streams and bw is not None and peak is not None:
        eff = bandwidth.combined_efficiency(streams, [bw] * len(streams), peak)
    device_bytes = mem.peak_bytes()  # along the engine's timeline: its largest moment
    model_states = mem.model_states_bytes(Tier.DEVICE)
    if mem.peak is not None:
        model_states = sum(mem.peak[c] for c in memory.MODEL_STATES)
    out = {
        "stage": config.stage,
        "offload": offload,
        "model_states_bytes": model_states,
        "model_states_at_rest_bytes": mem.model_states_at_rest_bytes(),
        "residual_states_bytes": device_bytes - model_states,
        "device_bytes": device_bytes,
        "cpu_bytes": mem.total_bytes(Tier.CPU),
        "nvme_bytes": mem.total_bytes(Tier.NVME),
        "memory": mem.to_dict(),
        "communication": _communication(model, config, *links),
        "efficiency": eff,
    }
    short = [
        tier
        for tier, (capacity, sharing) in have.items()
        if capacity is not None and out[f"{tier}_bytes"] * sharing > capacity
    ]
    given = any(capacity is not None for capacity, _ in have.values())
    return out | {"fits": not short if given else None, "short": short}


def advice_report(model: ModelDescription, cluster: Cluster, workload: Workload) -> dict:
    """The advisor's ranking of every configuration of ``workload`` on ``cluster``, as a dict."""
    result = advise(model, cluster, workload)

    def candidate(c: Candidate) -> dict:
        return {
            "stage": c.stage,
            "offload": c.offload,
            "ci": c.num_layers_per_checkpoint,
            "micro_batch_size": c.micro_batch_size,
            "num_micro_batches": c.num_micro_batches,
            # (where the engine takes it: zeroshard train --accumulate-unreduced true)
            "accumulate_unreduced": c.accumulate_unreduced,
            "device_bytes": c.device_bytes,
            "memory": None if c.memory is None else c.memory.to_dict(),
            "step_seconds": c.step_seconds,
            "time_seconds": c.time_seconds,
            "problem": c.problem,
        }

    return {
        "model": model_report(model),
        "num_devices": cluster.num_devices,
        "feasible": [candidate(c) for c in result.feasible],
        "rejected": [candidate(c) for c in result.rejected],
        "why_not": [
            {"stage": s, "offload": o, "problem": why} for (s, o), why in result.why_not().items()
        ],
    }


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _count(n: int) -> str:
    """7500000000 -> "7.5e9"; small counts as they are."""
    if n < 10**6:
        return f"{n:,}"
    exp = int(math.floor(math.log10(n)))
    return f"{n / 10**exp:.4g}e{exp}"


def _size(num_bytes: float | None, unit: str) -> str:
    return "-" if not num_bytes else units.format_bytes(num_bytes, unit)


def _units_line(m: dict) -> str:
    """How the model was cut into units, as the engine would cut it."""
    largest = m["largest_unit_numel"]
    others = "" if largest is None else f", largest other unit {_count(largest)}"
    return (
        f"units ({m['wrap_policy']}): {m['num_units']}; root unit {_count(m['root_unit_numel'])} "
        f"parameters{others}"
    )


def _mixed(bpp: dict) -> bool:
    """Whether the bytes per parameter are the article's 16-bit mixed precision (2 + 2 + 12)."""
    return (bpp["params"], bpp["grads"], bpp["optimizer_states"]) == (2, 2, 12) and not bpp.get(
        "working_copies"
    )


def render_plan(out: dict, unit: str = "GB") -> str:
    """The plan's table and its notes, residual-state terms and intensities, for people."""
    m, bpp = out["model"], out["bytes_per_param"]
    total = bpp["params"] + bpp["grads"] + bpp["optimizer_states"] + bpp.get("grad_master", 0)
    fp32_grad = f" + {bpp['grad_master']} (FP32 gradient)" if bpp.get("grad_master") else ""
    num_groups = out.get("num_shard_groups", 1)
    hybrid = ""
    if num_groups > 1:
        hybrid = f"sharded in {num_groups} groups of k = {out['shard_group_size']} (hybrid), "
    scale = units.parse_bytes("1" + unit)
    lines = [
        f"{m['name']}: Psi = {_count(m['num_params'])} parameters, Nd = {out['num_dp_ranks']}, "
        f"{hybrid}Nm = {out['num_mp_ranks']}, {bpp['params']} + {bpp['grads']} + "
        f"{bpp['optimizer_states']}{fp32_grad} = {total} bytes per parameter"
        + (
            " (2-byte copies kept whole only where the stage replicates them)"
            if bpp.get("working_copies")
            else ""
        ),
        f"memory per device; {unit} = {scale:,} bytes"
        + (
            "; 16-bit mixed precision (--precision fp32 for train's default)" if _mixed(bpp) else ""
        ),
        "",
    ]
    if m["wrap_policy"] is not None:
        lines.insert(1, _units_line(m))
    rows = out["stages"]
    show_time = any(r["communication"]["seconds"] is not None for r in rows)
    show_eff = any(r["efficiency"] is not None for r in rows)
    show_fits = any(r["fits"] is not None for r in rows)
    header = ["stage", "offload", "model states", "residual", "device", "cpu", "nvme"]
    header += ["intra-group/step", "inter-group/step"] if num_groups > 1 else ["comm/step"]
    header += ["comm time"] * show_time + ["efficiency"] * show_eff + ["fits"] * show_fits
    body = []
    for r in rows:
        c = r["communication"]
        line = [
            str(r["stage"]),
            r["offload"],
            _size(r["model_states_bytes"], unit),
            _size(r["residual_states_bytes"], unit),
            _size(r["device_bytes"], unit),
            _size(r["cpu_bytes"], unit),
            _size(r["nvme_bytes"], unit),
        ]
        for part in (c["intra_group"], c["inter_group"]) if num_groups > 1 else (c,):
            psi = part["numel"] / m["num_params"]
            line.append(f"{psi:.3g} Psi = {_size(part['bytes'], unit)}" if psi else "-")
        if show_time:
            line.append("-" if c["seconds"] is None else f"{c['seconds']:.3g} s")
        if show_eff:
            line.append("-" if r["efficiency"] is None else f"{r['efficiency']:.3f}")
        if show_fits:
            line.append("yes" if r["fits"] else f"NO ({', '.join(r['short'])})")
        body.append(line)
    lines.append(_table(header, body))
    notes = sorted({n for r in rows for n in r["memory"]["notes"] + r["communication"]["notes"]})
    lines += [f"note: {n}" for n in notes + out.get("not_planned", [])]
    if out.get("timeline"):
        moments = ", ".join(
            f"stage {r['stage']}: {r['memory']['peak_moment']}"
            for r in rows
            if "peak_moment" in r["memory"]
        )
        how = (
            "no activation checkpoints (--ci 0, zeroshard train's default)"
            if out["num_layers_per_checkpoint"] == 0
            else f"checkpoints every {out['num_layers_per_checkpoint']} unit(s), one span "
            "recomputed at a time (--timeline)"
        )
        lines.append(
            f"{how}: device is the largest moment of the engine's step "
            f"({moments or 'no timeline for this model'})"
        )
        fewer = [r for r in rows if r["model_states_at_rest_bytes"] != r["model_states_bytes"]]
        if fewer:  # (gradient shards not reduced yet, or the local gradient accumulated)
            at_rest = ", ".join(
                f"stage {r['stage']} {_size(r['model_states_at_rest_bytes'], unit)}" for r in fewer
            )
            why = (
                "with the whole local gradient held between micro-batches"
                if out.get("accumulate_unreduced")
                else "before every gradient exists"
            )
            lines.append(
                f"model states are those alive at that moment, {why}; at rest after the step "
                f"they are {at_rest}"
            )
    if "activation_checkpoint_bytes" in out:
        terms = [
            ("activation checkpoints", "2*bsz*seq*hd*nl/ci", "activation_checkpoint_bytes"),
            ("activation working", "bsz*seq*ci*(16*hd+2*heads*seq)", "activation_working_bytes"),
            ("model-state working", "4*hd*4hd", "model_state_working_bytes"),
        ]
        if out["model"]["activations_measured"]:
            terms[:2] = [
                ("activation checkpoints", "measured: span inputs", terms[0][2]),
                ("activation working", "measured: a span or the forward", terms[1][2]),
            ]
        terms = [t for t in terms if t[2] in out]
        inputs = out["model"].get("inputs")
        sample = f"inputs {inputs}" if inputs else f"seq = {out['seq_len']}"
        lines += [
            "",
            f"residual states (bsz = {out['micro_batch_size']}, {sample}, "
            f"ci = {out['num_layers_per_checkpoint']}):",
        ]
        lines += [
            f"  {name:<24}{formula:<33}{_size(out[key], unit)}" for name, formula, key in terms
        ]
    names = {
        "params_grads": "params and grads",
        "optimizer_states": "optimizer states",
        "activation_checkpoints": "activation checkpoints",
    }
    lines += ["", "arithmetic intensity (FLOPs per byte moved, ZeRO-Infinity):", _flops_line(out)]
    eff, need = out.get("efficiency"), out.get("required_bandwidth_bytes_per_s")
    for key, name in names.items():
        a = out["intensity"][key]
        if a is None:
            continue
        text = f"  {name:<24}ait = {a:<10.4g}"
        if eff is not None:
            text += f"efficiency {eff[key]:.3f}"
        if need is not None:
            target = f"efficiency {out['target_efficiency']:g}"
            text += f"   needs {units.format_rate(need[key])} for {target}"
        lines.append(text.rstrip())
    return "\n".join(lines)


def _flops_line(out: dict) -> str:
    """How many FLOPs a micro-batch computes, and where the count comes from."""
    f = out["flops"]
    if not f["counted"]:
        return (
            f"  {'FLOPs per micro-batch':<24}{f['per_iteration']:.4g} (the paper's 8*Psi*bsz*seq)"
        )
    parts = f"forward {f['forward']:.4g} + backward {f['backward']:.4g}"
    if f["recomputed"]:
        parts += f" + recomputed {f['recomputed']:.4g}"
    return f"  {'FLOPs per micro-batch':<24}{f['per_iteration']:.4g} counted: {parts}"


def render_advice(out: dict, unit: str = "GB", top: int = 10) -> str:
    """The ``top`` feasible configurations, fastest first, and why the others are out."""
    m = out["model"]
    lines = [f"{m['name']}: Psi = {_count(m['num_params'])} on {out['num_devices']} devices", ""]
    header = [
        "rank",
        "stage",
        "offload",
        "ci",
        "micro-batch",
        "accum",
        "device",
        "step time",
        "compute",
        "collectives",
        "offload time",
    ]
    shown = out["feasible"][:top]
    inter = any(c["time_seconds"].get("inter_group") for c in shown)
    if inter:  # hybrid sharding: the all-reduce across shard groups, at the inter-node bandwidth
        header[-2:-1] = ["intra-group", "inter-group"]
    body = []
    for i, c in enumerate(shown, 1):
        t = c["time_seconds"]
        body.append(
            [
                str(i),
                str(c["stage"]),
                c["offload"],
                str(c["ci"]),
                str(c["micro_batch_size"]),
                f"{c['num_micro_batches']}{' unreduced' if c['accumulate_unreduced'] else ''}",
                _size(c["device_bytes"], unit),
                f"{c['step_seconds']:.3g} s",
                f"{t['compute']:.3g} s",
                f"{t['collectives']:.3g} s",
                *([f"{t['inter_group']:.3g} s"] if inter else []),
                f"{t['offload']:.3g} s",
            ]
        )
    if body:
        lines.append(_table(header, body))
        more = len(out["feasible"]) - len(body)
        if more > 0:
            lines.append(f"... and {more} more that fit (--top N to list them)")
    else:
        lines.append("nothing fits")
    offered = {(c["stage"], c["offload"]) for c in out["feasible"] + out["rejected"] if c["memory"]}
    unfit = [w for w in out["why_not"] if (w["stage"], w["offload"]) in offered]
    if unfit:
        lines += ["", "does not fit (smallest micro-batch tried):"]
        lines += [f"  stage {w['stage']} {w['offload']}: {w['problem']}" for w in unfit]
    not_offered: dict[tuple[int, str], list[str]] = {}
    for w in out["why_not"]:
        if (w["stage"], w["offload"]) not in offered:
            not_offered.setdefault((w["stage"], w["problem"]), []).append(w["offload"])
    if not_offered:
        lines += ["", "not offered:"]
        lines += [f"  stage {s} {', '.join(o)}: {why}" for (s, why), o in not_offered.items()]
    return "\n".join(lines)


def finite(obj):
    """JSON cannot say inf or nan; None says 'not computed'."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj
