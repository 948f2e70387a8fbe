"""AdamW implementations on one rank's shard: the for-loop path, foreach and fused.

    python bench/bench_optimizer.py --numel 43000000 --tensors 30 --steps 10

One thread (as each rank has under ``zeroshard train``); FP32 master pieces of ``--numel``
elements in total, split into ``--tensors`` tensors (a shard's pieces). Reports the median step
time, the bytes each step touches (parameter, gradient, two states read and written: 28 bytes
per element) per second, and each implementation against the for-loop path. zeroshard turns on
``fused=True`` for Adam/AdamW by default where the device has fused kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def step_times(impl: str, numel: int, num_tensors: int, steps: int) -> list[float]:
    sizes = [numel // num_tensors] * num_tensors
    params = [torch.randn(n, requires_grad=True) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    flags = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    opt = torch.optim.AdamW(params, lr=1e-3, **flags[impl])
    opt.step()  # states exist from here on
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=43_000_000, help="elements (100m / 2 ranks)")
    parser.add_argument("--tensors", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {
        impl: statistics.median(step_times(impl, args.numel, args.tensors, args.steps))
        for impl in ("forloop", "foreach", "fused")
    }
    print(f"AdamW on {args.numel:,} FP32 elements in {args.tensors} tensors, 1 thread")
    print("| implementation | ms per step | GB/s (28 B per element) | speed-up over for-loop |")
    print("|---|---|---|---|")
    for impl, t in results.items():
        print(
            f"| {impl} | {1e3 * t:.1f} | {28 * args.numel / t / 1e9:.1f} "
            f"| {results['forloop'] / t:.2f}x |"
        )


if __name__ == "__main__":
    main()
