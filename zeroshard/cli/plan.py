"""``zeroshard plan``: will a model fit, and how fast can it go, per stage and offload placement.

    zeroshard plan --params 7.5B --dp 64                     # the ZeRO paper's Table 1
    zeroshard plan --preset 1b --dp 8 --seq 2048 --batch 4 --ci 1 --memory 80GB --offload all
    zeroshard plan --layers 96 --hidden 8192 --heads 64 --seq 1024 --batch 2 \\
        --bandwidth 70GB/s --peak-flops 70TFLOP/s --target-efficiency 0.9 --json
    zeroshard plan --preset 1b --advise --devices 8 --memory 16GB --global-batch 256 \\
        --peak-flops 70TFLOP/s --net-bandwidth 100GB/s --bandwidth 25GB/s --batch 1,2,4,8
    zeroshard plan --measure                  # calibration: nano and tiny, stages 0-3, 1/2/4 ranks

Sizes take units: "80GB" is 80e9 bytes, "80GiB" 80 * 2**30; rates "70GB/s"; counts "7.5B".
All arithmetic lives in ``zeroshard.planner``; this file only parses, calls and prints.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
from dataclasses import replace

from zeroshard import planner
from zeroshard.planner import bandwidth, comm, memory, units
from zeroshard.planner.memory import OFFLOADS, Tier


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="memory, communication and efficiency per ZeRO stage and offload placement",
        description="Will a model fit, and how fast can it go, per ZeRO stage and offload "
        "placement. Sizes: 80GB = 80e9 bytes, 80GiB = 80 * 2**30 bytes; rates like 70GB/s; counts "
        "like 7.5B. GB in the output are 1e9 bytes unless --unit says otherwise.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model (one of --params, --preset, --hf, --module, or a shape)")
    m.add_argument("--params", help="parameter count Psi, e.g. 7.5B or 7.5e9 (overrides a shape's)")
    m.add_argument("--preset", help="a zeroshard GPT preset: " + ", ".join(_gpt_presets()))
    m.add_argument("--hf", metavar="PATH_OR_NAME", help="a Hugging Face config.json or hub name")
    m.add_argument(
        "--module",
        metavar="PKG.MOD:FACTORY",
        help="a callable building an nn.Module (built on the meta device)",
    )
    m.add_argument("--layers", "--nl", type=int, help="transformer blocks (nl)")
    m.add_argument("--hidden", "--hd", type=int, help="hidden size (hd)")
    m.add_argument("--heads", type=int, help="attention heads (must divide hd)")
    m.add_argument("--vocab", type=int, default=50257, help="vocabulary size (with a shape)")

    t = p.add_argument_group("training")
    t.add_argument("--dp", type=int, default=1, help="data-parallel degree Nd")
    t.add_argument("--mp", type=int, default=1, help="model-parallel degree Nm")
    t.add_argument("--stage", default="0,1,2,3", help="stages to show, e.g. 3 or 2,3")
    t.add_argument(
        "--offload",
        default="none",
        help="placements to show: all, or some of " + ", ".join(OFFLOADS),
    )
    t.add_argument(
        "--bytes-per-param",
        default="zero",
        help="zero (2,2,12), infinity (2,2,16) or PARAMS,GRADS,K",
    )
    t.add_argument("--seq", type=int, default=1024, help="tokens per sample")
    t.add_argument("--batch", default="1", help="micro-batch per device (a list with --advise)")
    t.add_argument("--ci", default="1", help="blocks per activation checkpoint (list w/ --advise)")
    t.add_argument(
        "--partition-activations",
        action="store_true",
        help="split activation checkpoints 1/Nm (ZeRO-R Pa)",
    )
    t.add_argument(
        "--offload-activations",
        action="store_true",
        help="keep activation checkpoints in CPU memory (Pa+cpu)",
    )
    t.add_argument("--prefetch", type=int, default=1, help="stage 3: units gathered ahead")
    t.add_argument("--bucket", default="25MiB", help="communication bucket size")
    t.add_argument(
        "--fragmentation",
        type=float,
        default=0.1,
        help="fragmentation allowance, a fraction of the rest of device memory",
    )

    h = p.add_argument_group("hardware")
    h.add_argument("--memory", help="memory per device, e.g. 80GB or 80GiB (adds a fits column)")
    h.add_argument("--cpu-memory", help="CPU memory per node, e.g. 1TB")
    h.add_argument("--nvme", help="NVMe capacity per node, e.g. 28TB")
    h.add_argument("--devices-per-node", type=int, help="devices sharing a node's CPU and NVMe")
    h.add_argument("--bandwidth", help="slow memory (CPU/NVMe) to each device, e.g. 70GB/s")
    h.add_argument(
        "--nvme-bandwidth", help="NVMe to each device for --advise (default --bandwidth)"
    )
    h.add_argument("--net-bandwidth", help="data-parallel collectives per device, e.g. 100GB/s")
    h.add_argument("--peak-flops", help="achievable FLOP/s of one device, e.g. 70TFLOP/s")
    h.add_argument(
        "--target-efficiency",
        type=float,
        help="also print the bandwidth each stream needs for it, e.g. 0.9",
    )

    a = p.add_argument_group("advisor")
    a.add_argument(
        "--advise",
        action="store_true",
        help="rank every feasible stage/offload/ci/micro-batch by step time",
    )
    a.add_argument("--devices", type=int, help="devices in the cluster (default dp * mp)")
    a.add_argument("--global-batch", type=int, help="samples per optimizer step (--advise)")
    a.add_argument("--top", type=int, default=10, help="feasible configurations to list")

    c = p.add_argument_group("calibration (run it for real on this machine)")
    c.add_argument(
        "--measure",
        action="store_true",
        help="train GPT presets for a few steps through torchrun (gloo, CPU) per stage and rank "
        "count; print predicted against measured model states, per-rank peak (MemTracker) and "
        "communication (the ledger); exit 1 if a tolerance is missed",
    )
    c.add_argument("--measure-presets", default="nano,tiny", help="GPT presets to measure")
    c.add_argument("--measure-ranks", default="1,2,4", help="rank counts, one torchrun job each")
    c.add_argument("--measure-batch", type=int, default=4, help="micro-batch per rank")
    c.add_argument("--measure-steps", type=int, default=2, help="steps; the last is measured")

    p.add_argument("--unit", default="GB", help="unit of the table: GB (1e9 bytes), GiB, MB...")
    p.add_argument("--json", action="store_true", help="print JSON for machines instead")
    return p


def _gpt_presets() -> list[str]:
    from zeroshard.models.gpt import PRESETS

    return list(PRESETS)


# ---- reading the arguments -----------------------------------------------------------------


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


def _ints(flag: str, text: str, *, positive: bool = True) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} takes integers separated by commas, got {text!r}") from None
    for v in values:
        if positive:
            _positive(flag, v)
    return values


def _model(args) -> planner.ModelDescription:
    shape_flags = (args.layers, args.hidden, args.heads)
    sources = [s for s in ("preset", "hf", "module") if getattr(args, s)]
    if any(v is not None for v in shape_flags):
        sources.append("shape")
    if len(sources) > 1:
        raise ValueError(f"describe the model once; got {' and '.join(sources)}")
    num_params = units.parse_count(args.params) if args.params else None
    if not sources:
        if num_params is None:
            raise ValueError(
                "no model given; pass --params 7.5B, --preset NAME, --hf PATH, --module "
                "PKG.MOD:FACTORY, or a shape --layers/--hidden/--heads"
            )
        return planner.from_params(num_params)
    if num_params is not None and sources != ["shape"]:
        raise ValueError(f"--params overrides a shape's count only; drop it or --{sources[0]}")
    if sources == ["shape"]:
        missing = [f for f, v in zip(("--layers", "--hidden", "--heads"), shape_flags) if v is None]
        if missing:
            raise ValueError(f"a transformer shape needs {', '.join(missing)} too")
        for flag, v in zip(
            ("--layers", "--hidden", "--heads", "--vocab"), (*shape_flags, args.vocab)
        ):
            _positive(flag, v)
        return planner.from_transformer(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_heads=args.heads,
            vocab_size=args.vocab,
            max_seq_len=args.seq,
            num_params=num_params,
        )
    if args.preset:
        return planner.from_gpt(args.preset)
    if args.hf:
        return planner.from_hf_config(args.hf)
    return planner.from_module(_import_factory(args.module))


def _import_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--module takes PKG.MOD:FACTORY, got {spec!r}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--module {spec!r}: {exc}; check the module path and name") from None


def _bytes_per_param(text: str) -> memory.BytesPerParam:
    if text in memory.BYTES_PER_PARAM_PRESETS:
        return memory.BYTES_PER_PARAM_PRESETS[text]
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(
            f"--bytes-per-param takes zero, infinity or PARAMS,GRADS,K such as 2,2,12; got {text!r}"
        )
    p, g, k = (int(v) for v in parts)
    return memory.BytesPerParam(params=p, grads=g, optimizer_states=k)


def _offloads(text: str) -> tuple[str, ...]:
    names = tuple(OFFLOADS) if text == "all" else tuple(n.strip() for n in text.split(","))
    for n in names:
        if n not in OFFLOADS:
            raise ValueError(f"unknown --offload {n!r}; choose all or from {', '.join(OFFLOADS)}")
    return names


def _stages(text: str) -> tuple[int, ...]:
    stages = _ints("--stage", text, positive=False)
    for s in stages:
        if s not in (0, 1, 2, 3):
            raise ValueError(f"--stage takes 0, 1, 2 or 3 (or a list such as 2,3), got {s}")
    return stages


def _opt(parse, text):
    return None if text is None else parse(text)


# ---- the plan ------------------------------------------------------------------------------


def plan(args) -> dict:
    """Everything ``zeroshard plan`` prints, as the JSON-ready dict."""
    model = _model(args)
    for flag in ("dp", "mp", "seq", "devices_per_node"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.prefetch < 0:
        raise ValueError(f"--prefetch must be >= 0, got {args.prefetch}")
    batches, cis = _ints("--batch", args.batch), _ints("--ci", args.ci)
    if len(batches) > 1 or len(cis) > 1:
        raise ValueError("--batch and --ci take one value each unless --advise is given")
    device_memory = _opt(units.parse_bytes, args.memory)
    bw = _opt(units.parse_bandwidth, args.bandwidth)
    net_bw = _opt(units.parse_bandwidth, args.net_bandwidth)
    peak = _opt(units.parse_flops, args.peak_flops)
    base = memory.MemoryConfig(
        stage=0,
        num_dp_ranks=args.dp,
        num_mp_ranks=args.mp,
        bytes_per_param=_bytes_per_param(args.bytes_per_param),
        micro_batch_size=batches[0],
        seq_len=args.seq,
        num_layers_per_checkpoint=cis[0],
        partition_activations=args.partition_activations,
        offload_activations=args.offload_activations,
        num_units_prefetch=args.prefetch,
        bucket_bytes=units.parse_bytes(args.bucket),
        fragmentation_fraction=args.fragmentation,
    )
    out: dict = {
        "model": {
            "name": model.name,
            "num_params": model.num_params,
            "shape": None if model.shape is None else vars(model.shape),
        },
        "num_dp_ranks": args.dp,
        "num_mp_ranks": args.mp,
        "bytes_per_param": vars(base.bytes_per_param),
        "micro_batch_size": base.micro_batch_size,
        "seq_len": base.seq_len,
        "num_layers_per_checkpoint": base.num_layers_per_checkpoint,
        "device_memory_bytes": device_memory,
    }
    shape = model.shape
    if shape is not None:
        ci = min(base.num_layers_per_checkpoint, shape.num_layers)
        common = dict(micro_batch_size=base.micro_batch_size, seq_len=base.seq_len)
        out["activation_checkpoint_bytes"] = memory.activation_checkpoint_bytes(
            **common,
            hidden_size=shape.hidden_size,
            num_layers=shape.num_layers,
            num_layers_per_checkpoint=ci,
            num_mp_ranks=base.num_mp_ranks,
            partitioned=base.partition_activations,
        )
        out["activation_working_bytes"] = memory.activation_working_bytes(
            **common,
            hidden_size=shape.hidden_size,
            num_heads=shape.num_heads,
            num_layers_per_checkpoint=ci,
        )
        out["model_state_working_bytes"] = memory.model_state_working_bytes(
            hidden_size=shape.hidden_size
        )
    ait = bandwidth.intensity(
        micro_batch_size=base.micro_batch_size,
        seq_len=base.seq_len,
        shape=shape,
        num_layers_per_checkpoint=base.num_layers_per_checkpoint,
    )
    out["intensity"] = ait.as_dict()
    if bw is not None and peak is not None:
        out["efficiency"] = ait.efficiencies(bw, peak)
    if args.target_efficiency is not None:
        if peak is None:
            raise ValueError("--target-efficiency needs --peak-flops, e.g. --peak-flops 70TFLOP/s")
        out["target_efficiency"] = args.target_efficiency
        out["required_bandwidth_bytes_per_s"] = ait.required_bandwidths(
            peak, args.target_efficiency
        )
    rows = []
    for stage in _stages(args.stage):
        for offload in _offloads(args.offload):
            placement = OFFLOADS[offload]
            if memory.placement_problem(stage, placement):
                continue
            config = replace(base, stage=stage, placement=placement)
            rows.append(_row(model, config, offload, ait, bw, net_bw, peak, device_memory))
    if not rows:
        raise ValueError(
            f"no stage in --stage {args.stage} supports --offload {args.offload}; offloading "
            "needs stage >= 1, and parameters or NVMe need stage 3"
        )
    out["stages"] = rows
    return out


def _row(model, config, offload, ait, bw, net_bw, peak, device_memory) -> dict:
    mem = memory.plan_memory(model, config)
    collectives = comm.dp_communication(
        model.num_params,
        stage=config.stage,
        num_mp_ranks=config.num_mp_ranks,
        param_dtype_bytes=config.bytes_per_param.params or 2,
        reduce_dtype_bytes=config.bytes_per_param.grads or 2,
    )
    comm_bytes = comm.total_bytes(collectives)
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
    device_bytes = mem.total_bytes(Tier.DEVICE)
    return {
        "stage": config.stage,
        "offload": offload,
        "model_states_bytes": mem.model_states_bytes(Tier.DEVICE),
        "residual_states_bytes": mem.residual_states_bytes(Tier.DEVICE),
        "device_bytes": device_bytes,
        "cpu_bytes": mem.total_bytes(Tier.CPU),
        "nvme_bytes": mem.total_bytes(Tier.NVME),
        "memory": mem.to_dict(),
        "communication": {
            "numel": comm.total_numel(collectives),
            "bytes": comm_bytes,
            "seconds": None if net_bw is None else comm.comm_seconds(comm_bytes, net_bw),
            "collectives": [vars(c) for c in collectives],
        },
        "efficiency": eff,
        "fits": None if device_memory is None else device_bytes <= device_memory,
    }


def advice(args) -> dict:
    """The advisor's ranking, as the JSON-ready dict."""
    model = _model(args)
    missing = [
        f
        for f, v in (
            ("--memory", args.memory),
            ("--peak-flops", args.peak_flops),
            ("--net-bandwidth", args.net_bandwidth),
            ("--global-batch", args.global_batch),
        )
        if v is None
    ]
    if missing:
        raise ValueError(f"--advise needs {', '.join(missing)} too")
    for flag in ("dp", "mp", "seq", "devices", "global_batch", "top", "devices_per_node"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    bw = _opt(units.parse_bandwidth, args.bandwidth)
    cluster = planner.Cluster(
        num_devices=args.devices or args.dp * args.mp,
        device_memory_bytes=units.parse_bytes(args.memory),
        peak_flops=units.parse_flops(args.peak_flops),
        net_bandwidth_bytes_per_s=units.parse_bandwidth(args.net_bandwidth),
        cpu_bandwidth_bytes_per_s=bw,
        nvme_bandwidth_bytes_per_s=_opt(units.parse_bandwidth, args.nvme_bandwidth) or bw,
        num_devices_per_node=args.devices_per_node,
        cpu_memory_bytes=_opt(units.parse_bytes, args.cpu_memory),
        nvme_bytes=_opt(units.parse_bytes, args.nvme),
    )
    workload = planner.Workload(
        seq_len=args.seq,
        global_batch_size=args.global_batch,
        micro_batch_sizes=_ints("--batch", args.batch),
        checkpoint_spans=_ints("--ci", args.ci),
        stages=_stages(args.stage),
        offloads=_offloads(args.offload),
        memory=memory.MemoryConfig(
            stage=0,
            num_mp_ranks=args.mp,
            bytes_per_param=_bytes_per_param(args.bytes_per_param),
            partition_activations=args.partition_activations,
            offload_activations=args.offload_activations,
            num_units_prefetch=args.prefetch,
            bucket_bytes=units.parse_bytes(args.bucket),
            fragmentation_fraction=args.fragmentation,
        ),
    )
    result = planner.advise(model, cluster, workload)

    def candidate(c: planner.Candidate) -> dict:
        return {
            "stage": c.stage,
            "offload": c.offload,
            "ci": c.num_layers_per_checkpoint,
            "micro_batch_size": c.micro_batch_size,
            "num_micro_batches": c.num_micro_batches,
            "device_bytes": None if c.memory is None else c.memory.total_bytes(Tier.DEVICE),
            "memory": None if c.memory is None else c.memory.to_dict(),
            "step_seconds": c.step_seconds,
            "time_seconds": c.time_seconds,
            "problem": c.problem,
        }

    return {
        "model": {"name": model.name, "num_params": model.num_params},
        "num_devices": cluster.num_devices,
        "feasible": [candidate(c) for c in result.feasible],
        "rejected": [candidate(c) for c in result.rejected],
        "why_not": [
            {"stage": s, "offload": o, "problem": why} for (s, o), why in result.why_not().items()
        ],
    }


# ---- printing ------------------------------------------------------------------------------


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


def render_plan(out: dict, unit: str = "GB") -> str:
    m, bpp = out["model"], out["bytes_per_param"]
    total = sum(bpp.values())
    scale = units.parse_bytes("1" + unit)
    lines = [
        f"{m['name']}: Psi = {_count(m['num_params'])} parameters, Nd = {out['num_dp_ranks']}, "
        f"Nm = {out['num_mp_ranks']}, {bpp['params']} + {bpp['grads']} + "
        f"{bpp['optimizer_states']} = {total} bytes per parameter",
        f"memory per device; {unit} = {scale:,} bytes",
        "",
    ]
    rows = out["stages"]
    show_time = any(r["communication"]["seconds"] is not None for r in rows)
    show_eff = any(r["efficiency"] is not None for r in rows)
    show_fits = out["device_memory_bytes"] is not None
    header = ["stage", "offload", "model states", "residual", "device", "cpu", "nvme", "comm/step"]
    header += ["comm time"] * show_time + ["efficiency"] * show_eff + ["fits"] * show_fits
    body = []
    for r in rows:
        c = r["communication"]
        psi = c["numel"] / m["num_params"]
        line = [
            str(r["stage"]),
            r["offload"],
            _size(r["model_states_bytes"], unit),
            _size(r["residual_states_bytes"], unit),
            _size(r["device_bytes"], unit),
            _size(r["cpu_bytes"], unit),
            _size(r["nvme_bytes"], unit),
            f"{psi:.3g} Psi = {_size(c['bytes'], unit)}",
        ]
        if show_time:
            line.append("-" if c["seconds"] is None else f"{c['seconds']:.3g} s")
        if show_eff:
            line.append("-" if r["efficiency"] is None else f"{r['efficiency']:.3f}")
        if show_fits:
            line.append("yes" if r["fits"] else "NO")
        body.append(line)
    lines.append(_table(header, body))
    notes = sorted({n for r in rows for n in r["memory"]["notes"]})
    lines += [f"note: {n}" for n in notes]
    if "activation_checkpoint_bytes" in out:
        terms = [
            ("activation checkpoints", "2*bsz*seq*hd*nl/ci", "activation_checkpoint_bytes"),
            ("activation working", "bsz*seq*ci*(16*hd+2*heads*seq)", "activation_working_bytes"),
            ("model-state working", "4*hd*4hd", "model_state_working_bytes"),
        ]
        lines += [
            "",
            f"residual states (bsz = {out['micro_batch_size']}, seq = {out['seq_len']}, "
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
    lines += ["", "arithmetic intensity (FLOPs per byte moved, ZeRO-Infinity):"]
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


def render_advice(out: dict, unit: str = "GB", top: int = 10) -> str:
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
    body = []
    for i, c in enumerate(out["feasible"][:top], 1):
        t = c["time_seconds"]
        body.append(
            [
                str(i),
                str(c["stage"]),
                c["offload"],
                str(c["ci"]),
                str(c["micro_batch_size"]),
                str(c["num_micro_batches"]),
                _size(c["device_bytes"], unit),
                f"{c['step_seconds']:.3g} s",
                f"{t['compute']:.3g} s",
                f"{t['collectives']:.3g} s",
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


def _finite(obj):
    """JSON cannot say inf or nan; None says 'not computed'."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def measure(args) -> tuple[list[dict], str]:
    """The calibration grid's rows (one per configuration and rank) and its Markdown table."""
    from zeroshard.planner import calibrate

    presets = tuple(p.strip() for p in args.measure_presets.split(","))
    known = _gpt_presets()
    for name in presets:
        if name not in known:
            raise ValueError(f"unknown --measure-presets {name!r}; choose from {', '.join(known)}")
    _positive("--measure-batch", args.measure_batch)
    if args.measure_steps < 2:
        raise ValueError("--measure-steps must be >= 2: the first step creates optimizer states")
    rows = calibrate.run_grid(
        presets=presets,
        stages=_stages(args.stage),
        ranks=_ints("--measure-ranks", args.measure_ranks),
        micro_batch_size=args.measure_batch,
        num_steps=args.measure_steps,
    )
    return rows, calibrate.render(rows)


def run(args) -> int:
    units.format_bytes(1, args.unit)  # a bad --unit fails before any work
    if args.measure:
        from zeroshard.planner.calibrate import within_tolerance

        rows, text = measure(args)
        print(json.dumps(rows, indent=2) if args.json else text)
        return 0 if all(within_tolerance(r) for r in rows) else 1
    if args.advise:
        out = advice(args)
        text = render_advice(out, args.unit, args.top)
    else:
        out = plan(args)
        text = render_plan(out, args.unit)
    print(json.dumps(_finite(out), indent=2) if args.json else text)
    return 0
