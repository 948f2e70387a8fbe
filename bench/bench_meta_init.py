"""Peak memory of sharding a model built on the meta device, against building it in full.

    python bench/bench_meta_init.py --preset 1b --nproc 2

Each of ``--nproc`` gloo ranks builds the GPT preset under ``torch.device("meta")`` and shards it
at stage 3 (``param_init_fn=model.init_module``: one unit materialized at a time). Reported per
rank: peak RSS (``ru_maxrss``) minus the RSS before building (torch's own footprint), against the
model's FP32 size and against the expected shards (FP32 master, 1/N of the model) plus the
largest unit. ``--eager`` also builds the model in full first, the way without meta init.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

import zeroshard
from zeroshard.models.gpt import GPT, Block, preset
from zeroshard.testing import Workers


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _shard(name: str, eager: bool) -> dict:
    base = _rss_bytes()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    if eager:
        model = GPT(preset(name))
    else:
        with torch.device("meta"):
            model = GPT(preset(name))
    numel = sum(p.numel() for p in model.parameters())
    model = zeroshard.shard(
        model, stage=3, wrap=zeroshard.wrap.by_class(Block), param_init_fn=model.init_module
    )
    engine = zeroshard.engine_of(model)
    largest_unit = max(sum(f.padded_numel for f in u.flat_params) for u in engine.units)
    return {
        "numel": numel,
        "seconds": time.perf_counter() - t0,
        "peak_above_base": _peak_bytes() - base,
        "largest_unit_bytes": 4 * largest_unit,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="build in full first (no meta)")
    args = parser.parse_args()
    with Workers(args.nproc, timeout_s=1800) as workers:
        results = workers.run(_shard, args.preset, args.eager)
    numel = results[0]["numel"]
    full = 4 * numel
    shards = full / args.nproc
    print(f"{args.preset}: {numel:,} parameters, {full / 1e9:.2f} GB in FP32; {args.nproc} ranks")
    print("| rank | peak RSS above start | / full model | / (shard + largest unit) | seconds |")
    print("|---|---|---|---|---|")
    for rank, r in enumerate(results):
        bound = shards + r["largest_unit_bytes"]
        print(
            f"| {rank} | {r['peak_above_base'] / 1e9:.2f} GB | {r['peak_above_base'] / full:.2f} "
            f"| {r['peak_above_base'] / bound:.2f} | {r['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()
