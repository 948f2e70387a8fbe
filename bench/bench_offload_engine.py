"""Optimizer states offloaded by the engine (ZeRO-Offload / ZeRO-Infinity) against none.

The same GPT (one unit per Block, 2 gloo ranks, one compute thread each, seeded init, the same
random tokens, fused AdamW) is trained at ``--stage`` by three contenders:

    none   ``zeroshard.shard(..., offload=None)``: states in memory (fused AdamW on in-memory
           shards: the reference for the optimizer step alone)
    cpu    ``Offload(optimizer="cpu", gradients="cpu")``: the CPU tier (training on the CPU, the
           states already live there: this measures the placement's overhead, expected none)
    nvme   ``Offload(optimizer="nvme", folder=--folder)``: states in swap files, streamed through
           3 host slots (read i+1 while i steps and i-1 is written; sub-group 0, and as many as
           the store's 64 MiB pool holds, read during the next forward and backward)
    nvme+grads  the same, and the reduced gradient shards written to NVMe as each reduction
           finishes, read back at the step (stage 2-3 only)

Timing: after --warmup steps each, the contenders alternate in blocks of --steps steps for
--rounds rounds (the starting contender rotates every round). A step is forward + backward +
optimizer step + zero_grad; its time is the slowest rank's. Reported: the median step and
optimizer-step time, and per round the paired ratio against ``none`` (median and range over the
rounds). For nvme: bytes moved per step, seconds any swap was in flight (``io_s``), seconds the
step blocked on one (``wait_s``), and the fraction of I/O hidden behind compute,
``1 - wait_s / io_s`` (the rank with the least hidden).

    python bench/bench_offload_engine.py --preset small --rounds 1   # a check, ~1 min
    python bench/bench_offload_engine.py --preset small --preset 100m --rounds 5 --json out.json

It relaunches itself under ``torch.distributed.run`` (2 processes); ``--worker`` marks the ranks.
Targets (issue 12): nvme <= 1.5x none on 100m, cpu <= 1.10x.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run standalone from a checkout

import zeroshard  # noqa: E402
from zeroshard.models.gpt import GPT, PRESETS, Block  # noqa: E402

NPROC = 2
LR = 3e-4
TARGETS = {"cpu": 1.10, "nvme": 1.5}


def _contender(preset: str, stage: int, placement: str, folder: str):
    torch.manual_seed(0)
    offload = {
        "none": None,
        "cpu": zeroshard.Offload(optimizer="cpu", gradients="cpu" if stage >= 2 else None),
        # one folder per optimizer: a store locks its folder
        "nvme": zeroshard.Offload(optimizer="nvme", folder=f"{folder}/nvme"),
        "nvme+grads": zeroshard.Offload(
            optimizer="nvme", gradients="nvme", folder=f"{folder}/nvme+grads"
        ),
    }[placement]
    model = zeroshard.shard(
        GPT(PRESETS[preset]), stage=stage, wrap=zeroshard.wrap.by_class(Block), offload=offload
    )
    return model, zeroshard.optimizer(model, torch.optim.AdamW, lr=LR, fused=True)


def _step(model, opt, x, y) -> tuple[float, float]:
    """(step seconds, optimizer-step seconds) on this rank."""
    t0 = time.perf_counter()
    opt.backward(model(x, y))
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    results = {}
    for preset in args.preset:
        cfg = PRESETS[preset]
        gen = torch.Generator().manual_seed(1000 + rank)
        batches = []
        for _ in range(4):
            tok = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
            batches.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
        names = ["none", "cpu", "nvme"] + (["nvme+grads"] if args.stage >= 2 else [])
        runs = {n: _contender(preset, args.stage, n, args.folder) for n in names}
        times: dict[str, list[list[tuple[float, float]]]] = {n: [] for n in names}
        io: dict[str, list[dict]] = {n: [] for n in names if "nvme" in n}
        for n in names:
            for i in range(args.warmup):
                _step(*runs[n], *batches[i % len(batches)])
        for r in range(args.rounds):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                model, opt = runs[n]
                opt.offload_stats()  # from here on
                block = []
                for i in range(args.steps):
                    dist.barrier()
                    block.append(_step(model, opt, *batches[i % len(batches)]))
                times[n].append(block)
                if n in io:
                    io[n].append(dict(opt.offload_stats(), steps=args.steps))
            if rank == 0:
                print(f"{preset}: round {r + 1}/{args.rounds} done", flush=True)
        slots = runs["nvme"][1].offload_stats()["slot_bytes"]
        results[preset] = {"times": times, "io": io, "slots": slots, "names": names}
        del runs
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        report(args, gathered)
    dist.barrier()
    dist.destroy_process_group()


def _slowest(gathered: list[dict], preset: str, name: str) -> list[list[tuple[float, float]]]:
    """Per round, per step: (step, opt) seconds of the slowest rank."""
    per_rank = [g[preset]["times"][name] for g in gathered]
    return [
        [
            (max(r[b][s][0] for r in per_rank), max(r[b][s][1] for r in per_rank))
            for s in range(len(per_rank[0][b]))
        ]
        for b in range(len(per_rank[0]))
    ]


def io_names(gathered: list[dict], preset: str) -> list[str]:
    return list(gathered[0][preset]["io"])


def report(args: argparse.Namespace, gathered: list[dict]) -> None:
    out = {"args": vars(args), "rows": []}
    for preset in args.preset:
        base = _slowest(gathered, preset, "none")
        print(f"\n{preset} ({PRESETS[preset].num_params() / 1e6:.1f}M parameters), stage "
              f"{args.stage}, {NPROC} ranks, batch {args.batch} x {args.seq}, "
              f"{args.rounds} rounds x {args.steps} steps")  # fmt: skip
        print("| placement | step ms | opt step ms | step / none (range) | opt / none | target |")
        print("|---|---:|---:|---:|---:|---:|")
        for name in gathered[0][preset]["names"]:
            mine = _slowest(gathered, preset, name)
            step = statistics.median(t for b in mine for t, _ in b)
            opt = statistics.median(o for b in mine for _, o in b)
            ratios = [
                statistics.median(t for t, _ in m) / statistics.median(t for t, _ in b)
                for m, b in zip(mine, base)
            ]
            opt_ratio = opt / statistics.median(o for b in base for _, o in b)
            target = TARGETS.get(name)
            print(
                f"| {name} | {step * 1e3:.0f} | {opt * 1e3:.0f} | {statistics.median(ratios):.3f} "
                f"({min(ratios):.3f}-{max(ratios):.3f}) | {opt_ratio:.2f} | "
                f"{f'<= {target:.2f}' if target else '-'} |"
            )
            out["rows"].append(
                {
                    "preset": preset,
                    "placement": name,
                    "step_s": step,
                    "opt_s": opt,
                    "ratio": statistics.median(ratios),
                    "ratio_range": [min(ratios), max(ratios)],
                    "opt_ratio": opt_ratio,
                }  # fmt: skip
            )
        for name in io_names(gathered, preset):
            hidden, moved, busy, waited = [], [], [], []
            for g in gathered:
                for st in g[preset]["io"][name]:
                    hidden.append(1 - st["wait_s"] / st["io_s"] if st["io_s"] > 0 else 1.0)
                    total = st["read_bytes"] + st["write_bytes"]
                    total += st.get("grad_read_bytes", 0) + st.get("grad_write_bytes", 0)
                    moved.append(total / st["steps"])
                    busy.append(st["io_s"] / st["steps"])
                    waited.append(st["wait_s"] / st["steps"])
            busy_ms, waited_ms = statistics.median(busy) * 1e3, statistics.median(waited) * 1e3
            print(
                f"{name}, per rank and step: {statistics.median(moved) / 2**20:.1f} MiB moved, "
                f"I/O in flight {busy_ms:.0f} ms, blocked {waited_ms:.0f} ms; I/O hidden behind "
                f"compute: median {statistics.median(hidden):.0%}, least {min(hidden):.0%}; host "
                f"slots {gathered[0][preset]['slots'] / 2**20:.1f} MiB"
            )
            out["rows"].append(
                {"preset": preset, "placement": f"{name}-io", "hidden": statistics.median(hidden),
                 "hidden_min": min(hidden), "bytes_per_step": statistics.median(moved),
                 "io_s_per_step": statistics.median(busy),
                 "wait_s_per_step": statistics.median(waited)}
            )  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", action="append", choices=list(PRESETS), help="repeatable")
    p.add_argument(
        "--stage", type=int, default=3, choices=[1, 2, 3],
        help="3: one sub-group per Block; at 1-2 sub-groups are 25 MiB buckets (one on small)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=3, help="steps per contender per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender first")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--folder", default=None, help="swap folder (default: a new one under /tmp)")
    p.add_argument("--json", default=None, help="also write the results to this path")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.preset = args.preset or ["small", "100m"]
    if args.json:
        args.json = str(Path(args.json).resolve())
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    made = args.folder is None
    folder = args.folder or tempfile.mkdtemp(prefix="zeroshard-offload-bench-")
    argv = sys.argv[1:] + ([] if args.folder else ["--folder", folder])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(NPROC), __file__, "--worker", *argv]
    try:
        return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        if made:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
