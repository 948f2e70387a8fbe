"""``zeroshard plan``: will a model fit, and how fast can it go, per stage and offload placement.

    zeroshard plan --params 7.5B --dp 64                     # the ZeRO paper's Table 1
    zeroshard plan --preset 1b --dp 8 --seq 2048 --batch 4 --ci 1 --memory 80GB --offload all
    zeroshard plan --layers 96 --hidden 8192 --heads 64 --seq 1024 --batch 2 \\
        --bandwidth 70GB/s --peak-flops 70TFLOP/s --target-efficiency 0.9 --json
    zeroshard plan --preset 1b --advise --devices 8 --memory 16GB --global-batch 256 \\
        --peak-flops 70TFLOP/s --net-bandwidth 100GB/s --bandwidth 25GB/s --batch 1,2,4,8
    zeroshard plan --preset nano --advise --device-type cpu --memory 8GB --global-batch 8 \\
        --peak-flops 1TFLOP/s --net-bandwidth 10GB/s --bandwidth 10GB/s --offload all
    zeroshard plan --preset 1b --dp 32 --shard-group-size 8 \\
        --net-bandwidth 300GB/s --inter-node-bandwidth 25GB/s   # hybrid: 4 nodes of 8
    zeroshard plan --measure                  # calibration: nano and tiny, stages 0-3, 1/2/4 ranks

Sizes take units: "80GB" is 80e9 bytes, "80GiB" 80 * 2**30; rates "70GB/s"; counts "7.5B".
All arithmetic lives in ``zeroshard.planner`` (the report and its tables in
``zeroshard.planner.report``; the flags read into its inputs in ``zeroshard.cli.plan_inputs``);
this file only parses the flags, calls and prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from zeroshard import planner
from zeroshard.cli import plan_flags as flags
from zeroshard.cli.plan_inputs import check_counts, describe_model, fit_to_model, memory_config
from zeroshard.planner import report, units
from zeroshard.planner.advise import layout_problem
from zeroshard.planner.memory import OFFLOADS


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
    m.add_argument(
        "--hf",
        metavar="PATH_OR_NAME",
        help="a Hugging Face config.json (or a hub name in the local cache): built on the meta "
        "device and counted exactly when transformers is installed, else the GPT-shaped formula",
    )
    m.add_argument(
        "--module",
        metavar="PKG.MOD:FACTORY",
        help="a callable building an nn.Module (built on the meta device)",
    )
    m.add_argument(
        "--wrap",
        metavar="CLASS[,CLASS]",
        help="with --module or --hf: the module classes the engine wraps as units (default: the "
        "model's _no_split_modules, else its repeated block, with a warning)",
    )
    m.add_argument(
        "--input-shape",
        action="append",
        metavar="SHAPE",
        help="with --module or --hf, for a model that takes no token ids (images, audio): one "
        "sample's input, e.g. 3x224x224, or NAME=3x224x224 for a keyword argument; repeat it "
        "for several inputs. Its activations are then measured (a transformers vision model's "
        "pixels are found in its config). Keywords ending in _ids or _positions, and "
        "labels, are integers: an encoder-decoder's input_features=80x3000 "
        "decoder_input_ids=448",
    )
    m.add_argument("--layers", "--nl", type=int, help="transformer blocks (nl)")
    m.add_argument("--hidden", "--hd", type=int, help="hidden size (hd)")
    m.add_argument("--heads", type=int, help="attention heads (must divide hd)")
    m.add_argument("--vocab", type=int, default=50257, help="vocabulary size (with a shape)")

    t = p.add_argument_group("training")
    t.add_argument("--dp", type=int, default=1, help="data-parallel degree Nd")
    t.add_argument(
        "--mp", "--tp", type=int, default=1, help="model-parallel degree Nm (train's --tp)"
    )
    t.add_argument(
        "--shard-group-size",
        type=int,
        metavar="K",
        help="hybrid sharding: shard stages 1-3 inside groups of K ranks (a node), replicate "
        "across groups; must divide the data-parallel ranks (default, or 0: all of them, no "
        "hybrid)",
    )
    t.add_argument(
        "--stage", default=None, help="stages to show, e.g. 3 or 2,3 (default 0,1,2,3; 2,3 with "
        "--step-in-backward)"
    )  # fmt: skip
    t.add_argument(
        "--offload",
        default="none",
        help="placements to show: all, or some of " + ", ".join(OFFLOADS),
    )
    t.add_argument(
        "--bytes-per-param",
        default=None,
        help="zero (2,2,12; the default), infinity (2,2,16) or PARAMS,GRADS,K",
    )
    t.add_argument(
        "--precision",
        choices=tuple(flags.PRECISION_BYTES),
        default=None,
        help="the run's precision, as zeroshard train --precision: the bytes per parameter and "
        "activation the engine keeps (fp32, tf32: 4,4,8, the parameter is its own master, and "
        "4-byte activations; bf16, fp16: 2,2,12 + a 4-byte FP32 gradient, and 2)",
    )
    t.add_argument(
        "--seq",
        "--seq-len",
        dest="seq",
        type=int,
        default=None,
        help="tokens per sample (default: 1024, or fewer when the model's positions end sooner)",
    )
    t.add_argument("--batch", default="1", help="micro-batch per device (a list with --advise)")
    t.add_argument(
        "--ci",
        "--checkpoint-every",
        dest="ci",
        default=None,
        help="blocks per activation checkpoint (list w/ --advise; default 1, with --measure "
        "0); 0: none, as "
        "zeroshard train's default (--checkpoint-every 0): the device is then counted along the "
        "engine's timeline, its largest moment",
    )
    t.add_argument(
        "--partition-activations",
        action="store_true",
        help="split activation checkpoints 1/Nm (ZeRO-R Pa)",
    )
    t.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="sequence parallelism: activation checkpoints 1/Nm as they are (no Pa gather)",
    )
    t.add_argument(
        "--offload-activations",
        nargs="?",
        const="cpu",
        default=False,
        choices=("cpu", "nvme"),
        help="keep activation checkpoints off the device: cpu (the default when given: Pa+cpu) "
        "or nvme (swap files, as zeroshard train --offload-activations nvme)",
    )
    t.add_argument(
        "--activation-bytes",
        type=int,
        choices=(2, 4),
        default=None,
        help="bytes per activation element: 2 for fp16/bf16 compute (the papers'; the default), "
        "4 for fp32",
    )
    t.add_argument("--prefetch", type=int, default=1, help="stage 3: units gathered ahead")
    t.add_argument(
        "--param-prefetch",
        type=int,
        default=1,
        help="stage 3 with parameters on NVMe: units whose masters are read beyond the gathers "
        "ahead (Offload(param_prefetch))",
    )
    t.add_argument(
        "--timeline",
        action="store_true",
        help="with --ci 1 or more, count the device along zeroshard's engine timeline (spans "
        "recomputed one at a time) instead of the papers' sum of every term; always so with "
        "--ci 0",
    )
    t.add_argument(
        "--step-in-backward",
        action="store_true",
        help="stages 2-3: the optimizer steps each unit as its gradient is reduced "
        "(zeroshard.optimizer(..., step_in_backward=True)), so gradient shards never accumulate "
        "(grads 0); stages 2 and 3 only",
    )
    t.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches per optimizer step (with --step-in-backward the gradient shards "
        "wait between them)",
    )
    t.add_argument(
        "--accumulate-unreduced",
        action="store_true",
        help="stages 2-3 with gradient accumulation: micro-batches keep their local gradients "
        "whole and reduce once per step (zeroshard train --accumulate-unreduced, no_sync): the "
        "whole gradient is on the device instead of the shards",
    )
    t.add_argument("--bucket", default="25MiB", help="communication bucket size")
    t.add_argument(
        "--fragmentation",
        type=float,
        default=0.1,
        help="fragmentation allowance, a fraction of the rest of device memory",
    )

    h = p.add_argument_group("hardware")
    h.add_argument("--memory", help="memory per device, e.g. 80GB or 80GiB (adds a fits column)")
    h.add_argument("--cpu-memory", help="CPU memory per node, e.g. 1TB (fits column)")
    h.add_argument("--nvme", help="NVMe capacity per node, e.g. 28TB (fits column)")
    h.add_argument("--devices-per-node", type=int, help="devices sharing a node's CPU and NVMe")
    h.add_argument("--bandwidth", help="slow memory (CPU/NVMe) to each device, e.g. 70GB/s")
    h.add_argument(
        "--nvme-bandwidth", help="NVMe to each device for --advise (default --bandwidth)"
    )
    h.add_argument(
        "--net-bandwidth",
        help="data-parallel collectives per device, e.g. 100GB/s (inside a node / shard group)",
    )
    h.add_argument(
        "--inter-node-bandwidth",
        help="with --shard-group-size: the all-reduce across shard groups per device, e.g. "
        "25GB/s (default --net-bandwidth)",
    )
    h.add_argument("--peak-flops", help="achievable FLOP/s of one device, e.g. 70TFLOP/s")
    h.add_argument(
        "--device-type",
        choices=("cuda", "cpu"),
        default="cuda",
        help="what the devices are (default cuda: a GPU cluster): for --advise, zeroshard "
        "offloads model states to CPU/NVMe only when training on the CPU, so with cuda every "
        "offloaded placement is rejected; for the engine timeline (--ci 0, --timeline), on the "
        "CPU each unit's gradient is collected into the gather buffer its parameters freed",
    )
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
    p.set_defaults(_flags={a.dest: (a.option_strings[0], a.default) for a in p._actions[1:]})
    return p


MEASURE_FLAGS = {"measure", "measure_presets", "measure_ranks", "measure_batch", "measure_steps",
                 "stage", "step_in_backward", "json", "unit", "seq", "ci", "mp", "precision",
                 "grad_accum", "accumulate_unreduced"}  # fmt: skip
"""What ``--measure`` reads: its own grid of GPT presets, run as these training flags say; it
would ignore the rest."""


ADVISE_FLAGS = {"devices", "global_batch", "top", "nvme_bandwidth"}
"""What only ``--advise`` reads (its cluster and workload)."""


def _given(args, dests, *, among: bool) -> list[str]:
    """The flags given (not at their defaults) whose destination is in ``dests`` (``among``)
    or is not (``not among``)."""
    return [
        flag
        for dest, (flag, default) in args._flags.items()
        if (dest in dests) == among and getattr(args, dest, default) != default
    ]


def _check_advise_flags(args) -> None:
    """A plan without ``--advise`` would ignore the advisor's flags (``--devices 64`` planned
    for Nd = 1 without a word: 132 GB per device instead of 2.12)."""
    given = _given(args, ADVISE_FLAGS, among=True)
    if given:
        raise ValueError(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --advise, and a plan "
            f"without it would ignore {'it' if len(given) == 1 else 'them'}; add --advise, or "
            "drop them (--dp and --mp set the ranks of a plan)"
        )


def _check_measure_flags(args) -> None:
    ignored = _given(args, MEASURE_FLAGS, among=False)
    if ignored:
        raise ValueError(
            f"--measure runs its own grid (--measure-presets, --measure-ranks, --measure-batch, "
            f"--measure-steps, --stage; --seq, --ci, --mp, --precision, --grad-accum, "
            f"--accumulate-unreduced, --step-in-backward) and would ignore {', '.join(ignored)}; "
            "drop them, or plan without --measure"
        )


def _gpt_presets() -> list[str]:
    from zeroshard.models.gpt import PRESETS

    return list(PRESETS)


def plan(args) -> dict:
    """Everything ``zeroshard plan`` prints, as the JSON-ready dict (``planner.report``)."""
    _check_advise_flags(args)
    fit_to_model(args)
    model = describe_model(args)
    check_counts(args)
    for flag in ("prefetch", "param_prefetch"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    batches, cis = flags.ints("--batch", args.batch), flags.ints("--ci", args.ci or "1", low=0)
    if len(batches) > 1 or len(cis) > 1:
        raise ValueError("--batch and --ci take one value each unless --advise is given")
    flags.check_accumulate_unreduced(args, flags.stages(args.stage, args.step_in_backward))
    config = memory_config(args, micro_batch_size=batches[0], num_layers_per_checkpoint=cis[0])
    problem = layout_problem(model, config)  # what the engine would refuse (as --advise does)
    if problem is not None:
        raise ValueError(problem)
    return report.plan_report(
        model,
        config,
        stages=flags.stages(args.stage, args.step_in_backward),
        offloads=flags.offloads(args.offload),
        bandwidth_bytes_per_s=flags.opt(units.parse_bandwidth, args, "bandwidth"),
        net_bandwidth_bytes_per_s=flags.opt(units.parse_bandwidth, args, "net_bandwidth"),
        inter_node_bandwidth_bytes_per_s=flags.opt(
            units.parse_bandwidth, args, "inter_node_bandwidth"
        ),
        peak_flops=flags.opt(units.parse_flops, args, "peak_flops"),
        device_memory_bytes=flags.opt(units.parse_bytes, args, "memory"),
        cpu_memory_bytes=flags.opt(units.parse_bytes, args, "cpu_memory"),
        nvme_bytes=flags.opt(units.parse_bytes, args, "nvme"),
        devices_per_node=args.devices_per_node,
        target_efficiency=args.target_efficiency,
    )


def advice(args) -> dict:
    """The advisor's ranking, as the JSON-ready dict (``planner.report``)."""
    fit_to_model(args)
    model = describe_model(args)
    needed = ("memory", "peak_flops", "net_bandwidth", "global_batch")
    missing = ["--" + f.replace("_", "-") for f in needed if getattr(args, f) is None]
    if missing:
        raise ValueError(f"--advise needs {', '.join(missing)} too")
    for flag in ("dp", "mp", "seq", "devices", "global_batch", "top", "devices_per_node"):
        flags.check_positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.grad_accum != 1:
        raise ValueError(
            f"--advise derives the accumulation steps from --global-batch / (Nd x micro-batch) "
            f"for each candidate and would ignore --grad-accum {args.grad_accum}; drop "
            "--grad-accum (--global-batch sets the batch)"
        )
    if args.devices and args.dp != 1 and args.dp * args.mp != args.devices:
        raise ValueError(
            f"--dp {args.dp} x --mp {args.mp} is not --devices {args.devices}: --advise trains "
            f"on every device (Nd = devices / Nm = {args.devices // args.mp}); drop --dp, or "
            "make them agree"
        )
    bw = flags.opt(units.parse_bandwidth, args, "bandwidth")
    num_devices = args.devices or args.dp * args.mp
    if num_devices % args.mp:
        raise ValueError(
            f"--devices {num_devices} is not a multiple of --mp {args.mp}; pick an --mp that "
            "divides the device count"
        )
    cluster = planner.Cluster(
        num_devices=num_devices,
        device_memory_bytes=flags.opt(units.parse_bytes, args, "memory"),
        peak_flops=flags.opt(units.parse_flops, args, "peak_flops"),
        net_bandwidth_bytes_per_s=flags.opt(units.parse_bandwidth, args, "net_bandwidth"),
        inter_node_bandwidth_bytes_per_s=flags.opt(
            units.parse_bandwidth, args, "inter_node_bandwidth"
        ),
        cpu_bandwidth_bytes_per_s=bw,
        nvme_bandwidth_bytes_per_s=flags.opt(units.parse_bandwidth, args, "nvme_bandwidth") or bw,
        num_devices_per_node=args.devices_per_node,
        cpu_memory_bytes=flags.opt(units.parse_bytes, args, "cpu_memory"),
        nvme_bytes=flags.opt(units.parse_bytes, args, "nvme"),
        device_type=args.device_type,
    )
    workload = planner.Workload(
        seq_len=args.seq,
        global_batch_size=args.global_batch,
        micro_batch_sizes=flags.ints("--batch", args.batch),
        checkpoint_spans=_advised_spans(args.ci or "1"),
        stages=flags.stages(args.stage, args.step_in_backward),
        offloads=flags.offloads(args.offload),
        # The advisor sets stage, bsz, seq and ci per candidate; Nd is the devices over Nm.
        memory=memory_config(args, num_dp=num_devices // args.mp),
    )
    return report.advice_report(model, cluster, workload)


def _advised_spans(text: str) -> tuple[int, ...]:
    spans = flags.ints("--ci", text, low=0)
    if 0 in spans:
        raise ValueError(
            "--advise ranks activation checkpoint spans of 1 block or more; --ci 0 (no "
            "checkpointing) is for a plan without --advise"
        )
    return spans


def measure(args) -> tuple[list[dict], str]:
    """The calibration grid's rows (one per configuration and rank) and its Markdown table."""
    from zeroshard.models.gpt import PRESETS
    from zeroshard.planner import calibrate

    presets = tuple(p.strip() for p in args.measure_presets.split(","))
    known = _gpt_presets()
    for name in presets:
        if name not in known:
            raise ValueError(f"unknown --measure-presets {name!r}; choose from {', '.join(known)}")
        limit = PRESETS[name].block_size  # (before launch: else every rank of the grid fails)
        if args.seq is not None and args.seq > limit:
            raise ValueError(
                f"--seq {args.seq} exceeds the {limit} positions of preset {name!r}; pass "
                f"--seq {limit} or less"
            )
    flags.check_positive("--measure-batch", args.measure_batch)
    if args.measure_steps < 2:
        raise ValueError("--measure-steps must be >= 2: the first step creates optimizer states")
    stages = flags.stages(args.stage, args.step_in_backward)
    flags.check_step_in_backward(args)
    ranks = flags.ints("--measure-ranks", args.measure_ranks)
    check_counts(args)
    cis = flags.ints("--ci", args.ci or "0", low=0)
    if len(cis) != 1:
        raise ValueError(f"--measure takes one --ci, got {args.ci!r}")
    odd = [n for n in ranks if n % args.mp]
    if odd:
        raise ValueError(
            f"--measure-ranks {','.join(map(str, odd))} is not a multiple of --mp {args.mp}: "
            "each job splits its ranks into tensor-parallel groups of --mp; pick rank counts "
            "that --mp divides"
        )
    flags.check_accumulate_unreduced(args, stages)
    rows = calibrate.run_grid(
        presets=presets,
        stages=tuple(f"{s}s" for s in stages) if args.step_in_backward else stages,
        ranks=ranks,
        micro_batch_size=args.measure_batch,
        seq_len=args.seq,
        num_steps=args.measure_steps,
        tp=args.mp,
        checkpoint_every=cis[0],
        precision=args.precision or "fp32",
        grad_accum=args.grad_accum,
        accumulate_unreduced=args.accumulate_unreduced,
    )
    return rows, calibrate.render(rows)


def run(args) -> int:
    units.format_bytes(1, args.unit)  # a bad --unit fails before any work
    if args.measure:
        from zeroshard.planner.calibrate import within_tolerance

        _check_measure_flags(args)
        rows, text = measure(args)
        print(json.dumps(rows, indent=2) if args.json else text)
        return 0 if all(within_tolerance(r) for r in rows) else 1
    # The planner warns when it estimates instead of counting (no transformers, a guessed wrap
    # policy): one line each on stderr, so that --json output stays parseable.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = advice(args) if args.advise else plan(args)
    for w in caught:
        print(f"zeroshard plan: warning: {w.message}", file=sys.stderr)
    if args.json:
        text = json.dumps(report.finite(out), indent=2)
    elif args.advise:
        text = report.render_advice(out, args.unit, args.top)
    else:
        text = report.render_plan(out, args.unit)
    print(text)
    return 0
