"""What gloo's collectives cost per byte here: all-reduce, reduce-scatter, all-gather.

    python bench/bench_collectives.py --mib 25

Two ranks x one thread (torchrun), one buffer of --mib MiB: the all-reduce DDP issues per
bucket, and the reduce-scatter plus all-gather that ZeRO-1/2 issue for the same bucket (out of
place and in place). Median milliseconds over --iters calls, rank 0's view.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def _time(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def worker(mib: int, iters: int) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    n = mib * 2**20 // 4
    n -= n % world
    full, shard, out = torch.randn(n), torch.randn(n // world), torch.empty(n)
    mine = full[rank * (n // world) : (rank + 1) * (n // world)]
    results = {
        "all_reduce (DDP)": _time(lambda: dist.all_reduce(full), iters),
        "reduce_scatter": _time(lambda: dist.reduce_scatter_tensor(shard, full), iters),
        "reduce_scatter in place": _time(lambda: dist.reduce_scatter_tensor(mine, full), iters),
        "all_gather": _time(lambda: dist.all_gather_into_tensor(out, shard), iters),
        "all_gather in place": _time(lambda: dist.all_gather_into_tensor(full, mine), iters),
    }
    if rank == 0:
        print(f"{mib} MiB FP32 buffer, {world} gloo ranks x 1 thread, median of {iters} calls")
        print("| collective | ms |")
        print("|---|---|")
        for name, ms in results.items():
            print(f"| {name} | {ms:.1f} |")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=25)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.mib, args.iters)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [__file__, "--worker", "--mib", str(args.mib), "--iters", str(args.iters)]
    return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))


if __name__ == "__main__":
    sys.exit(main())
