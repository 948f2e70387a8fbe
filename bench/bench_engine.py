"""zeroshard against torch's own data parallelism: step time and peak per-rank memory.

The same GPT (one unit per Block, 2 gloo ranks, one compute thread each, seeded init, the same
random tokens) is trained by

    zeroshard stage 3        vs  FSDP2 ``fully_shard`` on each Block then the root (fp32, and bf16:
                                 param bf16 / reduce fp32 on both sides)
    zeroshard stages 0, 1, 2 vs  ``DistributedDataParallel`` (gradient_as_bucket_view=True)
    zeroshard stage 3        vs  the no-communication floor: each rank training the plain model
                                 alone on its own batch (what sharding cannot beat)
    zeroshard stage 3 with   vs  FSDP2 (each unit steps as soon as its gradient shard is reduced:
    step_in_backward             ``zeroshard.model_states.backward_step``; the peak target 0.9)

Sizes: ``--presets tiny,100m`` (the default, what ``make bench`` runs) measures each preset in a
job of its own, with batch x seq per rank from ``SIZES`` unless --batch / --seq say otherwise:
on ``tiny`` Python overhead dominates, ``100m`` (86M parameters) shows copies, temporaries and
communication.

Every contender uses the same AdamW implementation (--optimizer; fused by default, zeroshard's
default where the device has it).

Timing: after --warmup steps each, the contenders alternate in blocks of --steps steps for
--rounds rounds (the starting contender rotates every round); a step is forward + backward +
optimizer step + zero_grad, its time the slowest rank's. Step times are medians over all steps;
the ratio is paired: per round, our block's median over the baseline's (which ran moments apart,
under the same background load), then the median and quartiles of those over the rounds ("met"
judges this median). The CPU-time ratio (median process CPU time per step, all threads) is a
second opinion that other jobs' load on the machine does not inflate.
Forward, backward and optimizer-step times are kept apart too (CPU work is synchronous).

Memory: a separate short pass per contender (--mem-steps steps inside
``torch.distributed._tools.mem_tracker.MemTracker``, or ``FSDPMemTracker`` for FSDP2). For
zeroshard the engine's flat tensors (full, master, full_grad, shard_grad) are tracked as well.
"model state" is the tracker's total right after the optimizer step (parameters, gradients and
optimizer states; nothing else is alive then), compared with the ZeRO formula for N ranks and Psi
parameters: stage 0 16 Psi, stage 1 8 Psi + 8 Psi/N, stage 2 4 Psi + 12 Psi/N, stage 3 16 Psi/N.

    python bench/bench_engine.py                          # tiny and 100m, ~12 min
    python bench/bench_engine.py --presets small --precision fp32 --rounds 3 --json out.json

It relaunches itself under ``torch.distributed.run`` (2 processes); ``--worker`` marks the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run standalone from a checkout

import zeroshard  # noqa: E402
from zeroshard.models.gpt import GPT, PRESETS, Block  # noqa: E402

NPROC = 2
MiB = 1 << 20
LR = 3e-4
SIZES: dict[str, tuple[int, int]] = {
    "nano": (8, 64), "tiny": (8, 128), "small": (4, 128), "100m": (2, 64), "1b": (1, 64)
}  # fmt: skip
"""Default (batch, seq) per rank for each preset: what fits this 24 GiB, 2-core machine."""


# --------------------------------------------------------------------------------- contenders
@dataclass
class Contender:
    """One way of training the GPT; ``phases`` are its per-step (forward, backward, opt) times."""

    name: str
    model: nn.Module
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    opt_step: Callable[[], None]
    zero_grad: Callable[[], None]
    tracker: Callable[[], object]
    """A fresh memory tracker with this contender's persistent tensors registered."""
    phases: list[tuple[float, float, float]] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    """Process CPU seconds (all threads) per timed step."""
    loss: torch.Tensor | None = None
    """Loss of the last timed step: every contender saw the same batches, so these agree."""


def _seeded_gpt(preset: str) -> GPT:
    torch.manual_seed(0)
    return GPT(PRESETS[preset])


OPTIM: dict = {}
"""The AdamW implementation every contender uses (set from --optimizer)."""


def zeroshard_contender(
    preset: str, stage: int, bf16: bool, step_in_backward: bool = False, **config
) -> Contender:
    from torch.distributed._tools.mem_tracker import MemTracker

    mp = zeroshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = zeroshard.shard(
        _seeded_gpt(preset),
        stage=stage,
        wrap=zeroshard.wrap.by_class(Block),
        mixed_precision=mp if bf16 else None,
        config=zeroshard.ShardConfig(**config),
    )
    opt = zeroshard.optimizer(
        model, torch.optim.AdamW, lr=LR, step_in_backward=step_in_backward, **OPTIM
    )

    def tracker() -> MemTracker:
        t = MemTracker()
        engine = zeroshard.engine_of(model)
        extra = [t for f in engine.flat_params for t in (f.full, f.master)]
        extra += [t for b in engine.buckets for t in (b.full_grad, b.shard_grad)]
        extra += [t for pool in engine.buffer_pools() for t in pool.tensors()]  # free ones count
        # Engine tensors first, then the model (re-tags parameter storage as Parameter).
        t.track_external(*[x for x in extra if x is not None], model, opt.optimizer)
        return t

    return Contender(
        name=f"zeroshard-{stage}{'-sib' if step_in_backward else ''}{'-bf16' if bf16 else ''}",
        model=model,
        forward=lambda x, y: model(x, y),
        backward=opt.backward,
        opt_step=opt.step,
        zero_grad=opt.zero_grad,
        tracker=tracker,
    )


def fsdp2_contender(preset: str, bf16: bool) -> Contender:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    model = _seeded_gpt(preset)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **OPTIM)
    return Contender(
        name="fsdp2" + ("-bf16" if bf16 else ""),
        model=model,
        forward=lambda x, y: model(x, y),
        backward=lambda loss: loss.backward(),
        opt_step=opt.step,
        zero_grad=opt.zero_grad,
        tracker=lambda: FSDPMemTracker(model, opt),
    )


def _plain_contender(name: str, model: nn.Module) -> Contender:
    """``model`` (plain, or wrapped by DDP) trained with torch's AdamW and ``loss.backward()``."""
    from torch.distributed._tools.mem_tracker import MemTracker

    opt = torch.optim.AdamW(model.parameters(), lr=LR, **OPTIM)

    def tracker() -> MemTracker:
        t = MemTracker()
        t.track_external(model, opt)
        return t

    return Contender(
        name=name,
        model=model,
        forward=lambda x, y: model(x, y),
        backward=lambda loss: loss.backward(),
        opt_step=opt.step,
        zero_grad=opt.zero_grad,
        tracker=tracker,
    )


def ddp_contender(preset: str) -> Contender:
    from torch.nn.parallel import DistributedDataParallel as DDP

    # Bucket views: gradients live in the communication buckets (no second copy), so the
    # baseline holds 16 Psi like stage 0 rather than DDP's default 20 Psi.
    return _plain_contender("ddp", DDP(_seeded_gpt(preset), gradient_as_bucket_view=True))


def floor_contender(preset: str) -> Contender:
    """The plain model on one rank's batch, no communication at all."""
    return _plain_contender("alone", _seeded_gpt(preset))


# --------------------------------------------------------------------------------- measuring
def train_step(c: Contender, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    loss = c.forward(x, y)
    t1 = time.perf_counter()
    c.backward(loss)
    t2 = time.perf_counter()
    c.opt_step()
    c.zero_grad()
    t3 = time.perf_counter()
    c.loss = loss.detach()
    return t1 - t0, t2 - t1, t3 - t2


def _phase_peaks(tracker, model: nn.Module) -> dict[str, int]:
    """The model's peak in forward and in backward (MemTracker's per-module snapshots)."""
    from torch.distributed._tools.mem_tracker import _ModState

    stats = tracker.memory_tracking.get(model)
    out = {}
    for phase, state in (("forward", _ModState.PEAK_FW), ("backward", _ModState.PEAK_BW)):
        snaps = stats.snapshots.get(state) if stats is not None else None
        if snaps:
            out[phase] = max(sum(s["Total"] for s in snap.values()) for snap in snaps)
    return out


def measure_memory(c: Contender, batches, num_steps: int) -> dict:
    """Peak total and per-category bytes, the model-state bytes right after the step, and the
    peaks of forward and backward."""
    x, y = batches[0]
    c.backward(c.forward(x, y))  # every persistent tensor exists before tracking starts
    c.opt_step()
    tracker = c.tracker()
    after_step = []
    phases: dict[str, int] = {}
    with tracker:
        c.zero_grad()
        for i in range(num_steps):
            x, y = batches[i % len(batches)]
            loss = c.forward(x, y)
            c.backward(loss)
            del loss
            c.opt_step()
            snap = tracker.get_tracker_snapshot("current")
            after_step.append(sum(s["Total"] for s in snap.values()))
            for phase, peak_bytes in _phase_peaks(tracker, c.model).items():
                phases[phase] = max(phases.get(phase, 0), peak_bytes)
            c.zero_grad()
            tracker.reset_mod_stats()  # it refuses a module's second forward otherwise
    peak = tracker.get_tracker_snapshot("peak")
    by_category: dict[str, int] = {}
    for dev_snap in peak.values():
        for k, v in dev_snap.items():
            key = str(getattr(k, "value", k))
            by_category[key] = by_category.get(key, 0) + v
    return {
        "peak_bytes": sum(s["Total"] for s in peak.values()),
        "peak_by_category": by_category,
        "model_state_bytes": max(after_step),
        "phase_peak_bytes": phases,
    }


def formula_bytes(stage: int, psi: int, n: int) -> int:
    """Per-rank model-state bytes of ZeRO stage ``stage`` (4 B params, 4 B grads, 8 B Adam)."""
    part = zeroshard.STAGES[stage]
    params = 4 * psi // n if part.parameters else 4 * psi
    grads = 4 * psi // n if part.gradients else 4 * psi
    adam = 8 * psi // n if part.optimizer_states else 8 * psi
    return params + grads + adam


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = PRESETS[args.preset]
    OPTIM.update({"fused": {"fused": True}, "foreach": {"foreach": True}}.get(args.optimizer, {}))
    if args.optimizer == "forloop":
        OPTIM.update(foreach=False, fused=False)
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    contenders: list[Contender] = []
    if "fp32" in precisions:
        contenders += [
            zeroshard_contender(args.preset, 3, False),
            fsdp2_contender(args.preset, False),
            zeroshard_contender(args.preset, 3, False, step_in_backward=True),
        ]
        # DDP between stages 1 and 2, so that each pair of contenders runs back to back.
        contenders += [zeroshard_contender(args.preset, 1, False), ddp_contender(args.preset)]
        contenders += [zeroshard_contender(args.preset, s, False) for s in (2, 0)]
        contenders += [floor_contender(args.preset)]
    if "bf16" in precisions:
        contenders += [
            zeroshard_contender(args.preset, 3, True),
            fsdp2_contender(args.preset, True),
        ]

    gen = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(4):
        tok = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
        batches.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    log(f"warm-up: {args.warmup} steps x {len(contenders)} contenders")
    for c in contenders:
        for i in range(args.warmup):
            train_step(c, *batches[i % len(batches)])
    begin = time.perf_counter()
    for r in range(args.rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            dist.barrier()
            for i in range(args.steps):
                cpu0 = time.process_time()
                c.phases.append(train_step(c, *batches[i % len(batches)]))
                c.cpu.append(time.process_time() - cpu0)
        log(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - begin:.0f} s)")

    memory = {}
    for c in contenders:
        dist.barrier()
        memory[c.name] = measure_memory(c, batches, args.mem_steps)
    log("memory pass done")

    local = {
        c.name: {"phases": c.phases, "cpu": c.cpu, "memory": memory[c.name], "loss": float(c.loss)}
        for c in contenders
    }
    gathered: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, local)
    if rank == 0:
        report(args, cfg.num_params(), world, [c.name for c in contenders], gathered)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------- reporting
def summarize(name: str, gathered: list[dict], steps_per_round: int) -> dict:
    """Median step and phase times (slowest rank per step) and the largest rank's memory."""
    per_rank = [g[name]["phases"] for g in gathered]
    steps = [max(sum(r[i]) for r in per_rank) for i in range(len(per_rank[0]))]
    phases = [
        statistics.median(max(r[i][p] for r in per_rank) for i in range(len(per_rank[0])))
        for p in range(3)
    ]
    mems = [g[name]["memory"] for g in gathered]
    losses = [g[name]["loss"] for g in gathered]
    return {
        "step_ms": 1e3 * statistics.median(steps),
        "cpu_ms": 1e3 * statistics.median(max(r) for r in zip(*(g[name]["cpu"] for g in gathered))),
        "round_ms": [
            1e3 * statistics.median(steps[i : i + steps_per_round])
            for i in range(0, len(steps), steps_per_round)
        ],
        "forward_ms": 1e3 * phases[0],
        "backward_ms": 1e3 * phases[1],
        "opt_ms": 1e3 * phases[2],
        "num_steps": len(steps),
        "loss_rank0": losses[0],
        "peak_bytes": max(m["peak_bytes"] for m in mems),
        "model_state_bytes": max(m["model_state_bytes"] for m in mems),
        "per_rank_memory": mems,
    }


def report(args, psi: int, n: int, names: list[str], gathered: list[dict]) -> None:
    s = {name: summarize(name, gathered, args.steps) for name in names}
    rows = []
    pairs = [
        ("zeroshard-3", "fsdp2", 3, "fp32", 0.9, 1.0),
        ("zeroshard-3-sib", "fsdp2", 3, "fp32", 0.9, 0.9),
        ("zeroshard-3-bf16", "fsdp2-bf16", 3, "bf16", 0.9, 1.0),
        ("zeroshard-3", "alone", 3, "fp32", 1.10, None),
        ("zeroshard-0", "ddp", 0, "fp32", 1.05, None),
        ("zeroshard-1", "ddp", 1, "fp32", 1.00, None),
        ("zeroshard-2", "ddp", 2, "fp32", 1.00, None),
    ]
    for ours, base, stage, prec, time_target, mem_target in pairs:
        if ours not in s:
            continue
        a, b = s[ours], s[base]
        # Paired: per round, our block's median over the baseline's (run moments apart, so they
        # share the machine's load at the time); the median and quartiles over rounds.
        per_round = [x / y for x, y in zip(a["round_ms"], b["round_ms"])]
        q1, t_ratio, q3 = (
            statistics.quantiles(per_round, n=4) if len(per_round) > 1 else [per_round[0]] * 3
        )
        m_ratio = a["peak_bytes"] / b["peak_bytes"]
        if base == "alone":
            mem_target = None  # the floor holds the whole model: memory is compared elsewhere
        formula = formula_bytes(stage, psi, n)
        ms_ratio = a["model_state_bytes"] / formula
        rows.append(
            {
                "comparison": f"{ours} vs {base}",
                "stage": stage,
                "precision": prec,
                "ours_ms": a["step_ms"],
                "base_ms": b["step_ms"],
                "time_ratio": t_ratio,
                "time_ratio_quartiles": [q1, q3],
                # CPU time of the rank's process (all its threads, gloo's included): what the step
                # costs in work, unlike wall time blind to other jobs' load on the machine.
                "cpu_ratio": a["cpu_ms"] / b["cpu_ms"],
                "time_target": time_target,
                "time_met": t_ratio <= time_target,
                "ours_peak_bytes": a["peak_bytes"],
                "base_peak_bytes": b["peak_bytes"],
                "peak_ratio": m_ratio,
                "peak_target": mem_target,
                # Stages 0-2: the target is the model state the formula predicts (within 5%,
                # the padding and the tiny scalars aside).
                "memory_met": m_ratio <= mem_target if mem_target else abs(ms_ratio - 1) <= 0.05,
                "runs": 1,
                "ours_model_state_bytes": a["model_state_bytes"],
                "base_model_state_bytes": b["model_state_bytes"],
                "formula_bytes": formula,
            }
        )
    print()
    print(
        f"preset {args.preset} (Psi = {psi:,} parameters), {n} gloo ranks x 1 thread, batch "
        f"{args.batch} x seq {args.seq} per rank, AdamW ({args.optimizer}); {args.rounds} rounds "
        f"x {args.steps} "
        f"steps after {args.warmup} warm-up, median of the slowest rank; memory: peak per rank "
        f"(MiB) over {args.mem_steps} tracked steps"
    )
    print()
    print(
        "| comparison | ours ms | base ms | ratio [quartiles] | CPU-time ratio | target | met "
        "| ours peak | base peak | ratio | target | met | model state ours / base / formula |"
    )
    print("|" + "---|" * 13)
    for r in rows:
        mem_target = f"<= {r['peak_target']:.2f}" if r["peak_target"] else "formula +-5%"
        print(
            f"| {r['comparison']} ({r['precision']}) | {r['ours_ms']:.1f} | {r['base_ms']:.1f} "
            f"| {r['time_ratio']:.3f} [{r['time_ratio_quartiles'][0]:.2f}-"
            f"{r['time_ratio_quartiles'][1]:.2f}] | {r['cpu_ratio']:.3f} "
            f"| <= {r['time_target']:.2f} "
            f"| {'yes' if r['time_met'] else 'NO'} "
            f"| {r['ours_peak_bytes'] / MiB:.2f} | {r['base_peak_bytes'] / MiB:.2f} "
            f"| {r['peak_ratio']:.3f} | {mem_target} | {'yes' if r['memory_met'] else 'NO'} "
            f"| {r['ours_model_state_bytes'] / MiB:.2f} / {r['base_model_state_bytes'] / MiB:.2f}"
            f" / {r['formula_bytes'] / MiB:.2f} |"
        )
    met = sum(r["time_met"] for r in rows) + sum(r["memory_met"] for r in rows)
    print(f"\ntargets met: {met} of {2 * len(rows)}")
    print()
    print(
        "| contender | step ms | CPU ms | forward ms | backward ms | opt step + zero_grad ms "
        "| loss after timing (rank 0) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in names:
        c = s[name]
        print(
            f"| {name} | {c['step_ms']:.1f} | {c['cpu_ms']:.1f} | {c['forward_ms']:.1f} "
            f"| {c['backward_ms']:.1f} | {c['opt_ms']:.1f} | {c['loss_rank0']:.5f} |"
        )
    print()
    print(
        "| contender | peak - model states (MiB) | forward / backward peak - model states "
        "| at the peak, by category (MiB) |"
    )
    print("|---|---|---|---|")
    for name in names:
        mem = s[name]["per_rank_memory"][0]  # rank 0
        states = mem["model_state_bytes"]
        phases = " / ".join(
            f"{(mem['phase_peak_bytes'][p] - states) / MiB:.1f}" if p in mem["phase_peak_bytes"]
            else "-"
            for p in ("forward", "backward")
        )  # fmt: skip
        cats = ", ".join(
            f"{k} {v / MiB:.1f}" for k, v in mem["peak_by_category"].items() if v and k != "Total"
        )
        print(f"| {name} | {(mem['peak_bytes'] - states) / MiB:.1f} | {phases} | {cats} |")
    if args.json:
        out = {"args": vars(args), "psi": psi, "world_size": n, "rows": rows, "contenders": s}
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"\nwrote {args.json}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="tiny,100m", help="comma-separated GPT presets")
    p.add_argument("--preset", help=argparse.SUPPRESS)  # one job's preset (set by main)
    p.add_argument("--steps", type=int, default=4, help="steps per contender per round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per contender first")
    p.add_argument("--mem-steps", type=int, default=2, help="steps inside the memory tracker")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: SIZES)")
    p.add_argument("--batch", type=int, help="sequences per rank (default: SIZES)")
    p.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    p.add_argument("--json", default=None, help="also write the results to this path")
    p.add_argument(
        "--optimizer", choices=["fused", "foreach", "forloop"], default="fused",
        help="AdamW implementation, the same for every contender",
    )  # fmt: skip
    p.add_argument("--runs", type=int, default=1, help="whole runs; >1 adds a median/range table")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.presets = [x.strip() for x in args.presets.split(",") if x.strip()]
    for name in args.presets:
        if name not in PRESETS:
            p.error(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        seq = args.seq or SIZES[name][1]
        if seq > PRESETS[name].block_size:
            p.error(f"--seq {seq} exceeds {name}'s block_size {PRESETS[name].block_size}")
    if args.preset is not None:  # a worker: one preset, its sizes resolved
        args.batch = args.batch or SIZES[args.preset][0]
        args.seq = args.seq or SIZES[args.preset][1]
    if args.json:
        args.json = str(Path(args.json).resolve())
    return args


def _launch(argv: list[str]) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(NPROC), __file__, "--worker", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.call(cmd, env=env)


def _across_runs(paths: list[str]) -> None:
    """Median and range over whole runs of each comparison's paired time ratio and peak ratio."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    print(f"\nacross {len(runs)} runs (median [min-max] of each run's paired median ratio)")
    print("| comparison | time ratio | target | met (median) | peak ratio |")
    print("|---|---|---|---|---|")
    for i, row in enumerate(runs[0]["rows"]):
        t = [r["rows"][i]["time_ratio"] for r in runs]
        m = [r["rows"][i]["peak_ratio"] for r in runs]
        med = statistics.median(t)
        print(
            f"| {row['comparison']} ({row['precision']}) | {med:.3f} [{min(t):.3f}-{max(t):.3f}] "
            f"| <= {row['time_target']:.2f} | {'yes' if med <= row['time_target'] else 'NO'} "
            f"| {statistics.median(m):.3f} [{min(m):.3f}-{max(m):.3f}] |"
        )


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` less ``flags`` and their values."""
    out, skip = [], False
    for a in argv:
        if skip or a.startswith(flags):
            skip = not skip and "=" not in a
            continue
        out.append(a)
    return out


def _run_preset(preset: str, args: argparse.Namespace) -> int:
    """One preset: one job, or ``--runs`` jobs and the table across them."""
    argv = [*_without(sys.argv[1:], ("--presets", "--json", "--runs")), "--preset", preset]
    if args.runs <= 1:
        json_path = [] if not args.json else ["--json", _per_preset(args.json, preset, args)]
        return _launch([*argv, *json_path])
    import tempfile

    paths = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            path = f"{tmp}/run{i}.json"
            print(f"== {preset}: run {i + 1}/{args.runs}", flush=True)
            if rc := _launch([*argv, "--json", path]):
                return rc
            paths.append(path)
        _across_runs(paths)
    return 0


def _per_preset(path: str, preset: str, args: argparse.Namespace) -> str:
    """``--json out.json`` names ``out.json`` for one preset, ``out.<preset>.json`` for several."""
    if len(args.presets) == 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{preset}{p.suffix}"))


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    for preset in args.presets:
        print(f"== preset {preset}", flush=True)
        if rc := _run_preset(preset, args):
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
