"""ZeRO-R's residual memory on this machine: buffer reuse, allocations per step, RSS, fragmentation.

Four sections (issue 13, items 4 and 5):

a. buffer reuse: filling an existing ``--buffer-mb`` float32 buffer against allocating and
   touching a fresh one (median of ``--repeats``), in this process.
b. allocations per step: zeroshard stages 0-3 on 2 gloo ranks (the GPT, one unit per ``Block``,
   ``checkpoint_every`` 1), every allocation recorded by ``torch.profiler`` (``profile_memory``,
   read from its raw event tree, so that allocations inside ops and on gloo's threads count
   too) and assigned to the step that began last before it (each step waits for the parameter
   all-gathers its optimizer step started, so that they fall inside it); per stage: the
   allocations of at least ``--min-mib`` per step over steps 2..N (count, bytes), whether their
   sizes are the same multiset on every one of those steps, and the ops that make them.
c. RSS: ``--steps`` (500) steps of ``--rss-preset`` at ``--rss-stage`` (3) on 2 fresh ranks,
   each rank's RSS sampled after every step; from step ``--rss-warmup`` on it must not exceed
   its value then by more than 5% (reported against the whole RSS, and against the training
   footprint above the RSS before the model was built, which is stricter). With
   ``--mmap-threshold 131072``, run again with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed (its
   default threshold is dynamic), which tells allocator fragmentation from a leak.
d. CUDA (only where ``torch.cuda.is_available()``): reserved minus allocated over a one-rank run,
   with and without ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (a process each).

    python bench/bench_residual.py                       # all sections, ~2-4 min on 2 cores
    python bench/bench_residual.py --sections c --mmap-threshold 131072
    python bench/bench_residual.py --sections b --alloc-presets small --alloc-steps 12
    python bench/bench_residual.py --sections c --steps 2000 --json rss.json

Sections b and c run in jobs of their own under ``torch.distributed.run`` (2 processes;
``--worker`` marks the ranks), which write their results to a temporary file; this process
prints the tables. The profiler's own start/stop lines on stderr are not part of the results.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run standalone from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks' helpers

from bench_engine import LR, NPROC, SIZES, MiB  # noqa: E402
from bench_scale import _batches, _rss_bytes  # noqa: E402

import zeroshard  # noqa: E402
from zeroshard.mesh import tear_down  # noqa: E402
from zeroshard.models.gpt import GPT, Block, preset  # noqa: E402

TOP_SOURCES = 8
RSS_LIMIT = 0.05
"""Section c: RSS after warm-up never exceeds its value at warm-up by more than this fraction
(shrinking is not growth: it is reported, as "max dev", but passes)."""


def rss_bytes() -> int:
    """This process's resident set (psutil where installed, else /proc/self/statm)."""
    try:
        import psutil
    except ImportError:
        return _rss_bytes()
    return psutil.Process().memory_info().rss


NO_TRIM = "ZEROSHARD_BENCH_NO_TRIM"
"""Set to 1 in a worker's environment: ``ShardConfig(trim_host_memory=0)`` (never trim)."""


# --------------------------------------------------------------------------------- a: reuse
def buffer_reuse(mb: int, repeats: int) -> dict:
    """Milliseconds to fill an existing ``mb`` MB float32 buffer vs allocate + fill a fresh one."""
    numel = mb * 10**6 // 4
    buf = torch.empty(numel)
    buf.fill_(0.0)  # touched once: its pages exist
    reuse, fresh = [], []
    for i in range(repeats):  # alternated, so that both see the same background load
        t0 = time.perf_counter()
        buf.fill_(float(i))
        t1 = time.perf_counter()
        new = torch.empty(numel)
        new.fill_(float(i))
        t2 = time.perf_counter()
        del new
        reuse.append(1e3 * (t1 - t0))
        fresh.append(1e3 * (t2 - t1))
    r, f = statistics.median(reuse), statistics.median(fresh)
    return {
        "mb": mb, "repeats": repeats, "threads": torch.get_num_threads(),
        "reuse_ms": r, "fresh_ms": f, "ratio": f / r, "reuse_all_ms": reuse, "fresh_all_ms": fresh,
    }  # fmt: skip


# --------------------------------------------------------------------------------- training
def build(cfg, stage: int, checkpoint_every: int):
    """The seeded GPT sharded one unit per Block, and its AdamW."""
    torch.manual_seed(0)
    model = zeroshard.shard(
        GPT(cfg),
        stage=stage,
        wrap=zeroshard.wrap.by_class(Block),
        config=zeroshard.ShardConfig(
            checkpoint_every=checkpoint_every,
            **({"trim_host_memory": 0} if os.environ.get(NO_TRIM) == "1" else {}),
        ),
    )
    return model, zeroshard.optimizer(model, torch.optim.AdamW, lr=LR)


def train_step(model, opt, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step (the parameter all-gathers a step starts at stages 1-2 end inside it)."""
    loss = model(x, y)
    opt.backward(loss)
    opt.step()
    opt.zero_grad()


# --------------------------------------------------------------------------------- b: allocations
def _walk(events):
    for e in events:
        yield e
        yield from _walk(e.children)


def _source(e) -> str:
    """``outermost op > innermost op`` above an allocation (below the step's annotation)."""
    ops = []
    p = e.parent
    while p is not None and not p.name.startswith("residual_step_"):
        ops.append(p.name.replace("autograd::engine::evaluate_function: ", "backward: "))
        p = p.parent
    if not ops:
        return "(outside any op)"
    return ops[-1] if len(ops) == 1 else f"{ops[-1]} > {ops[0]}"


def step_allocations(prof, steps: int, min_bytes: int) -> list[dict]:
    """Per step (annotated ``residual_step_<i>``): sizes and sources of allocations of at least
    ``min_bytes``, frees of at least that, and the net bytes of all allocations. An allocation
    belongs to the step that began last before it, whatever its thread (gloo allocates on its
    own)."""
    from torch._C._profiler import _EventType

    events = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    starts = sorted(
        (e.start_time_ns, int(e.name.rsplit("_", 1)[1]))
        for e in events
        if e.tag == _EventType.TorchOp and e.name.startswith("residual_step_")
    )
    assert [i for _, i in starts] == list(range(steps)), starts
    out = [{"sizes": [], "sources": [], "frees": 0, "net": 0} for _ in range(steps)]
    for e in events:
        if e.tag != _EventType.Allocation or e.extra_fields.device.type != "cpu":
            continue
        i = bisect.bisect_right(starts, (e.start_time_ns, steps)) - 1
        if i < 0:
            continue
        rec, size = out[i], e.extra_fields.alloc_size
        rec["net"] += size
        if size >= min_bytes:
            rec["sizes"].append(size)
            rec["sources"].append(_source(e))
        elif -size >= min_bytes:
            rec["frees"] += 1
    for rec in out:
        rec["sizes"].sort()
    return out


def allocations(preset_name: str, stage: int, steps: int, min_bytes: int, ce: int) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    cfg = preset(preset_name)
    batch, seq = SIZES[preset_name]
    model, opt = build(cfg, stage, ce)
    batches = _batches(cfg.vocab_size, batch, seq, 4)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i in range(steps):
            with record_function(f"residual_step_{i}"):
                train_step(model, opt, *batches[i % len(batches)])
    per_step = step_allocations(prof, steps, min_bytes)
    later = per_step[1:]
    first = later[0]["sizes"]
    new_sizes = sorted({s for r in later for s in r["sizes"]} - set(first))
    return {
        "preset": preset_name, "stage": stage, "steps": steps, "batch": batch, "seq": seq,
        "params": cfg.num_params(), "step1": per_step[0], "later": later,
        "constant": all(r["sizes"] == first for r in later),
        "counts": [len(r["sizes"]) for r in later],
        "bytes": [sum(r["sizes"]) for r in later],
        "new_sizes": new_sizes,
        "sources": collections.Counter(s for r in later for s in r["sources"]).most_common(),
    }  # fmt: skip


# --------------------------------------------------------------------------------- c: RSS
def rss_run(preset_name: str, stage: int, steps: int, ce: int) -> dict:
    cfg = preset(preset_name)
    batch, seq = SIZES[preset_name]
    start = rss_bytes()
    model, opt = build(cfg, stage, ce)
    batches = _batches(cfg.vocab_size, batch, seq, 4)
    samples = []
    t0 = time.perf_counter()
    for i in range(steps):
        train_step(model, opt, *batches[i % len(batches)])
        samples.append(rss_bytes())
    return {"start": start, "samples": samples, "seconds": time.perf_counter() - t0}


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    local: dict = {"alloc": [], "rss": None}
    if args.job == "b":
        for name in args.alloc_presets:
            for stage in args.stages:
                t0 = time.perf_counter()
                r = allocations(name, stage, args.alloc_steps, int(args.min_mib * MiB), args.ce)
                r["seconds"] = time.perf_counter() - t0
                local["alloc"].append(r)
                if rank == 0:
                    print(f"b: {name} stage {stage} ({r['seconds']:.0f} s)", flush=True)
    if args.job == "c":
        local["rss"] = rss_run(args.rss_preset, args.rss_stage, args.steps, args.ce)
        if rank == 0:
            print(f"c: {args.steps} steps ({local['rss']['seconds']:.0f} s)", flush=True)
    gathered: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, local)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    tear_down(clean=True)  # the model's groups before the default one, gloo's threads stopped


def rss_summary(r: dict, warmup: int) -> dict:
    s = r["samples"]
    w = min(warmup, len(s)) - 1
    at, end, after = s[w], s[-1], s[w:]
    dev = max(abs(v - at) for v in after)
    footprint = at - r["start"]
    return {
        "at_warmup": at, "end": end, "max": max(after), "min": min(after),
        "growth": (end - at) / at, "max_dev": dev / at,
        "footprint": footprint, "growth_footprint": (end - at) / footprint if footprint else None,
        "max_dev_footprint": dev / footprint if footprint else None,
        "passed": (max(after) - at) / at <= RSS_LIMIT, "seconds": r["seconds"],
    }  # fmt: skip


# --------------------------------------------------------------------------------- d: CUDA
def cuda_worker(args: argparse.Namespace) -> None:
    """One rank on the GPU (zeroshard's one-rank world), reserved - allocated after each step."""
    cfg = preset(args.cuda_preset)
    batch, seq = SIZES[args.cuda_preset]
    model, opt = build(cfg, 3, args.ce)
    gen = torch.Generator().manual_seed(1000)
    gaps, reserved = [], []
    for _ in range(args.cuda_steps):
        tok = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen).cuda()
        train_step(model, opt, tok[:, :-1], tok[:, 1:])
        torch.cuda.synchronize()
        r, a = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        gaps.append(r - a)
        reserved.append(r)
    Path(args.out).write_text(
        json.dumps(
            {
                "gaps": gaps,
                "reserved": reserved,
                "max_reserved": torch.cuda.max_memory_reserved(),
                "max_allocated": torch.cuda.max_memory_allocated(),
            }
        )
    )


def cuda_section(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "torch.cuda.is_available() is False (no CUDA device or a CPU build "
                           f"of torch {torch.__version__})"}  # fmt: skip
    out = {}
    for label, conf in (("default", None), ("expandable_segments", "expandable_segments:True")):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
            env.pop(k, None)  # a one-rank world of its own
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/cuda.json"
            cmd = [sys.executable, __file__, "--cuda-worker", "--out", path]
            cmd += ["--cuda-preset", args.cuda_preset, "--cuda-steps", str(args.cuda_steps)]
            cmd += ["--checkpoint-every", str(args.ce)]
            if rc := subprocess.call(cmd, env=env):
                out[label] = {"error": f"exit status {rc}"}
                continue
            r = json.loads(Path(path).read_text())
        gaps = r["gaps"][1:] or r["gaps"]
        out[label] = dict(r, gap_median=statistics.median(gaps), gap_max=max(gaps))
    return out


# --------------------------------------------------------------------------------- reporting
def _mib(b: float) -> str:
    return f"{b / MiB:.2f}"


def report(args: argparse.Namespace, res: dict) -> None:
    if "a" in res:
        a = res["a"]
        print(
            f"\n### a. buffer reuse: {a['mb']} MB float32, median of {a['repeats']}, "
            f"{a['threads']} thread(s)\n"
        )
        print("| fill existing (ms) | allocate + fill fresh (ms) | fresh / reuse |")
        print("|---|---|---|")
        print(f"| {a['reuse_ms']:.1f} | {a['fresh_ms']:.1f} | {a['ratio']:.1f}x |")
    if res.get("b"):
        print(
            f"\n### b. allocations >= {args.min_mib:g} MiB per step, steps 2..{args.alloc_steps}"
            f" (rank 0; {NPROC} gloo ranks, checkpoint_every {args.ce})\n"
        )
        print(
            "| preset | stage | step 1: count / MiB | steps 2..N: count per step | MiB per step "
            "| same sizes every step | new sizes after step 2 | net MiB per step (all sizes) "
            "| ranks agree |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r, peers in res["b"]:
            counts = sorted(set(r["counts"]))
            mibs = sorted({round(b / MiB, 2) for b in r["bytes"]})
            net = [x["net"] / MiB for x in r["later"]]
            print(
                f"| {r['preset']} | {r['stage']} | {len(r['step1']['sizes'])} / "
                f"{_mib(sum(r['step1']['sizes']))} | {', '.join(map(str, counts))} "
                f"| {', '.join(f'{m:.2f}' for m in mibs)} | {'yes' if r['constant'] else 'NO'} "
                f"| {', '.join(_mib(s) for s in r['new_sizes']) or '-'} "
                f"| {min(net):+.2f} .. {max(net):+.2f} | {'yes' if peers else 'NO'} |"
            )
        print(
            "\nwhere they come from (steps 2..N, rank 0: outermost op > innermost op x "
            f"allocations; the {TOP_SOURCES} largest counts, all in --json):\n"
        )
        print("| preset | stage | sources |")
        print("|---|---|---|")
        for r, _ in res["b"]:
            src = "; ".join(f"{s} x{n}" for s, n in r["sources"][:TOP_SOURCES]) or "-"
            print(f"| {r['preset']} | {r['stage']} | {src} |")
    if res.get("c"):
        print(
            f"\n### c. RSS: {args.rss_preset} at stage {args.rss_stage}, {args.steps} steps, "
            f"{NPROC} gloo ranks, checkpoint_every {args.ce}; flat = no sample from step "
            f"{args.rss_warmup} on more than {RSS_LIMIT:.0%} above it\n"
        )
        print(
            "| malloc | rank | RSS at step w (MiB) | at the end | min .. max after w | growth "
            "| max dev | footprint at w (MiB) | growth / footprint | max dev / footprint | flat |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for label, rank, s in [(k, i, s) for k, v in res["c"].items() for i, s in enumerate(v)]:
            gf = s["growth_footprint"]
            df = s["max_dev_footprint"]
            print(
                f"| {label} | {rank} | {_mib(s['at_warmup'])} | {_mib(s['end'])} "
                f"| {_mib(s['min'])} .. {_mib(s['max'])} | {s['growth']:+.2%} "
                f"| {s['max_dev']:.2%} | {_mib(s['footprint'])} "
                f"| {'-' if gf is None else f'{gf:+.1%}'} | {'-' if df is None else f'{df:.1%}'} "
                f"| {'yes' if s['passed'] else 'NO'} |"
            )
    if "d" in res:
        d = res["d"]
        print("\n### d. CUDA fragmentation: reserved - allocated after each step\n")
        if "skipped" in d:
            print(f"skipped: {d['skipped']}")
        else:
            print("| allocator | median (MiB) | max (MiB) | max reserved | max allocated |")
            print("|---|---|---|---|---|")
            for label, r in d.items():
                if "error" in r:
                    print(f"| {label} | {r['error']} | | | |")
                    continue
                print(
                    f"| {label} | {_mib(r['gap_median'])} | {_mib(r['gap_max'])} "
                    f"| {_mib(r['max_reserved'])} | {_mib(r['max_allocated'])} |"
                )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="abcd", help="any of a, b, c, d (default: abcd)")
    p.add_argument("--buffer-mb", type=int, default=400, help="a: buffer size (MB)")
    p.add_argument("--repeats", type=int, default=7, help="a: repeats (median)")
    p.add_argument("--alloc-presets", default="tiny,small", help="b: comma-separated presets")
    p.add_argument("--stages", default="0,1,2,3", help="b: comma-separated ZeRO stages")
    p.add_argument("--alloc-steps", type=int, default=6, help="b: steps N profiled")
    p.add_argument("--min-mib", type=float, default=1.0, help="b: smallest allocation counted")
    p.add_argument("--steps", type=int, default=500, help="c: training steps")
    p.add_argument("--rss-preset", default="tiny", help="c: GPT preset")
    p.add_argument("--rss-stage", type=int, default=3, help="c: ZeRO stage")
    p.add_argument(
        "--mmap-threshold", type=int, default=0,
        help="c: also run with glibc's MALLOC_MMAP_THRESHOLD_ fixed at this many bytes, e.g. "
        "131072 (default 0: no second run)",
    )  # fmt: skip
    p.add_argument("--rss-warmup", type=int, default=50, help="c: warm-up steps")
    p.add_argument("--cuda-preset", default="small", help="d: GPT preset")
    p.add_argument("--cuda-steps", type=int, default=50, help="d: steps per allocator setting")
    p.add_argument(
        "--checkpoint-every", dest="ce", type=int, default=1, help="ShardConfig.checkpoint_every"
    )
    p.add_argument("--json", default=None, help="also write the results to this path")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cuda-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)  # where a worker job writes its results
    p.add_argument("--job", choices=["b", "c"], help=argparse.SUPPRESS)  # a worker job's section
    args = p.parse_args(argv)
    if set(args.sections) - set("abcd"):
        p.error(f"--sections takes letters of abcd, got {args.sections!r}")
    args.alloc_presets = [x.strip() for x in args.alloc_presets.split(",") if x.strip()]
    args.stages = [int(x) for x in args.stages.split(",") if x.strip()]
    for name in [*args.alloc_presets, args.rss_preset, args.cuda_preset]:
        if name not in SIZES:
            p.error(f"unknown preset {name!r}; choose from {', '.join(SIZES)}")
    if args.alloc_steps < 3:
        p.error("--alloc-steps must be >= 3 (steps 2..N are compared)")
    if not 0 < args.rss_warmup <= args.steps:
        p.error("--rss-warmup must be in 1..--steps")
    return args


def _launch(job: str, env: dict[str, str | None] | None = None) -> list[dict]:
    """Section ``job`` (b or c) on NPROC fresh ranks, with ``env`` changed (None: unset);
    each rank's results."""
    environ = dict(os.environ, OMP_NUM_THREADS="1")
    for k, v in (env or {}).items():
        if v is None:
            environ.pop(k, None)
        else:
            environ[k] = v
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/ranks.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(NPROC), __file__, "--worker", "--job", job, "--out", out]
        cmd += [a for a in sys.argv[1:] if a not in ("--worker", "--cuda-worker")]
        if rc := subprocess.call(cmd, env=environ):
            raise SystemExit(f"section {job}: the worker job exited with status {rc}")
        return json.loads(Path(out).read_text())


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.cuda_worker:
        cuda_worker(args)
        return 0
    begin = time.perf_counter()
    res: dict = {}
    if "a" in args.sections:
        res["a"] = buffer_reuse(args.buffer_mb, args.repeats)
    if "b" in args.sections:
        ranks = _launch("b")
        # Rank 0's table; "ranks agree" whether every rank saw the same large sizes.
        res["b"] = [
            (r, all(_same_sizes(g["alloc"][i], r) for g in ranks))
            for i, r in enumerate(ranks[0]["alloc"])
        ]
    if "c" in args.sections:  # fresh ranks: the RSS before building is torch's alone
        res["c"], res["c_samples"] = {}, {}
        # The engine's default (malloc_trim after each step), then without it.
        settings = {"glibc default, trim on 3% growth": (None, None)}
        settings["glibc default, no trim"] = (None, "1")
        if args.mmap_threshold:
            label = f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}, no trim"
            settings[label] = (str(args.mmap_threshold), "1")
        for label, (threshold, no_trim) in settings.items():
            ranks = _launch("c", {"MALLOC_MMAP_THRESHOLD_": threshold, NO_TRIM: no_trim})
            res["c"][label] = [rss_summary(g["rss"], args.rss_warmup) for g in ranks]
            res["c_samples"][label] = [g["rss"]["samples"] for g in ranks]
    if "d" in args.sections:
        res["d"] = cuda_section(args)
    report(args, res)
    print(f"\ntotal {time.perf_counter() - begin:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **res}, indent=2))
        print(f"wrote {args.json}")
    return 0


def _same_sizes(a: dict, b: dict) -> bool:
    return [x["sizes"] for x in a["later"]] == [x["sizes"] for x in b["later"]]


if __name__ == "__main__":
    sys.exit(main())
