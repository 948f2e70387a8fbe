"""Swap bandwidth of the NVMe tier against ``dd`` with O_DIRECT on the same disk.

For tensors of 1, 4, 16 and 64 MiB (--size-gib of them in all, 1 GiB by default) it times
TensorStore.swap_out and swap_in against ``dd`` writing and reading one file with O_DIRECT in
blocks of the same size (min(tensor, block_bytes)): one thread, one buffer, the disk's plain
sequential bandwidth (see dd_pass). Targets, for tensors of 4 MiB and more: swap_in at 80% of dd
or better, swap_out (plain, not page-aligned tensors) at 90% or better.

Fairness. The disk of a shared VM drifts from second to second, so each of the --repeats (7)
rounds times a dd pass and a store pass back to back, writes then reads, and the ratio of the
two is taken within the round. Who goes first alternates between rounds (a pass right after a
1 GiB write may meet the host still flushing it, so neither side always follows the writes). The
table shows the median bandwidth of the passes and the median ratio of the rounds with its range:
the median is what to expect, the range how much the machine moved. CPU time is the process's
(all threads) during the store's passes, per GiB moved, median of the rounds.

    python bench/bench_offload.py                   # 1 GiB, folder in a temp dir under /tmp
    python bench/bench_offload.py --aligned         # tensors from store.empty_host: no copy
    python bench/bench_offload.py --size-gib 4 --folder /nvme/tmp
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run standalone from a checkout

from bench_checkpoint import _dd  # noqa: E402

from zeroshard.offload import OffloadConfig, TensorStore, Tier  # noqa: E402
from zeroshard.offload.nvme import filesystem_type  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


def new_tensor(store: TensorStore, numel: int, aligned: bool) -> torch.Tensor:
    """A 1D fp32 host tensor: page-aligned from the store, or plain torch (64-byte aligned)."""
    return store.empty_host((numel,), torch.float32) if aligned else torch.empty(numel)


def dd_pass(path: Path, total_bytes: int, request_bytes: int, write: bool) -> float:
    """Seconds for ``dd`` to write (``oflag=direct``, in place: ``conv=notrunc``) or read
    (``iflag=direct``) ``total_bytes`` of ``path`` in ``request_bytes`` blocks: one thread, one
    reused buffer, sequential O_DIRECT requests, the disk at its plain best (the process start,
    ~2 ms, is counted)."""
    block = f"bs={request_bytes // 1024}K"
    count = f"count={total_bytes // request_bytes}"
    if write:
        args = ["if=/dev/zero", f"of={path}", block, count, "oflag=direct", "conv=notrunc"]
    else:
        args = [f"if={path}", "of=/dev/null", block, count, "iflag=direct"]
    begin = time.perf_counter()
    _dd(args)
    return time.perf_counter() - begin


def disk_counters(folder: Path) -> list[int] | None:
    """(reads, sectors read, writes, sectors written) of the folder's block device, if Linux."""
    dev = os.stat(folder).st_dev
    try:
        fields = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
    except OSError:
        return None
    return [int(fields[k]) for k in (0, 2, 4, 6)]


def store_pass(
    store: TensorStore, tensors: dict[str, torch.Tensor], outs: dict[str, torch.Tensor], write: bool
) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) to swap every tensor out, or in."""
    cpu, begin = time.process_time(), time.perf_counter()
    if write:
        handles = [store.swap_out(name, t) for name, t in tensors.items()]
    else:
        handles = [store.swap_in(name, into=outs[name]) for name in tensors]
    for h in handles:
        h.wait()
    return time.perf_counter() - begin, time.process_time() - cpu


def measure(
    store: TensorStore,
    tensors: dict[str, torch.Tensor],
    outs: dict[str, torch.Tensor],
    raw_file: Path,
    request_bytes: int,
    repeats: int,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds of each round's raw and store passes (and the store's CPU seconds), per direction,
    and the mean request size in KiB the disk saw in each kind of pass (empty if unknown)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    times: dict[str, list[float]] = {k: [] for k in ("raw_w", "w", "cpu_w", "raw_r", "r", "cpu_r")}
    counts = {k: [0, 0] for k in ("raw_w", "w", "raw_r", "r")}  # requests, sectors
    for round_ in range(repeats):
        for write, suffix in ((True, "w"), (False, "r")):
            raw_first = round_ % 2 == 0
            for raw in (raw_first, not raw_first):
                key = f"raw_{suffix}" if raw else suffix
                before = disk_counters(raw_file.parent)
                if raw:
                    times[key].append(dd_pass(raw_file, nbytes, request_bytes, write))
                else:
                    wall, cpu = store_pass(store, tensors, outs, write)
                    times[key].append(wall)
                    times[f"cpu_{suffix}"].append(cpu)
                after = disk_counters(raw_file.parent)
                if before and after:
                    first = 2 if write else 0
                    for k in (0, 1):
                        counts[key][k] += after[first + k] - before[first + k]
    kib = {k: sectors / 2 / requests for k, (requests, sectors) in counts.items() if requests}
    return times, kib


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="bytes moved per pass, GiB")
    parser.add_argument("--folder", type=Path, default=None, help="a directory on the disk")
    parser.add_argument("--tensor-mib", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument(
        "--aligned", action="store_true", help="tensors from store.empty_host (no staging copy)"
    )
    parser.add_argument("--repeats", type=int, default=7, help="rounds of dd and store passes")
    defaults = OffloadConfig(folder="unused")
    parser.add_argument("--block-mib", type=int, default=defaults.block_bytes // MiB)
    parser.add_argument("--num-buffers", type=int, default=defaults.num_buffers)
    parser.add_argument("--num-io-threads", type=int, default=defaults.num_io_threads)
    args = parser.parse_args()

    torch.set_num_threads(1)  # copies are spread over the store's threads, not OpenMP's
    total = int(args.size_gib * GiB)
    parent = Path(tempfile.mkdtemp(prefix="zeroshard-bench-", dir=args.folder))
    block_bytes = args.block_mib * MiB
    load_before = os.getloadavg()[0]
    print(
        f"folder {parent} ({filesystem_type(parent)}), {total / GiB:.2f} GiB per pass, "
        f"block {args.block_mib} MiB, {args.num_buffers} buffers, "
        f"{args.num_io_threads} I/O threads, {args.repeats} rounds, "
        f"{'page-aligned tensors (store.empty_host)' if args.aligned else 'plain torch tensors'}"
    )
    rows = []
    try:
        for tensor_mib in args.tensor_mib:
            n = max(total // (tensor_mib * MiB), 1)
            request = min(tensor_mib * MiB, block_bytes)
            config = OffloadConfig(
                tier=Tier.NVME,
                folder=parent / f"store-{tensor_mib}",
                block_bytes=block_bytes,
                num_buffers=args.num_buffers,
                num_io_threads=args.num_io_threads,
            )
            store = TensorStore(config)
            # 1D fp32 tensors of tensor_mib MiB: n * tensor_mib MiB in all, ~= --size-gib. Plain
            # torch tensors are staged through the pool; --aligned ones are swapped in place.
            numel = tensor_mib * MiB // 4
            tensors = {f"t{i}": new_tensor(store, numel, args.aligned).uniform_() for i in range(n)}
            outs = {
                k: new_tensor(store, numel, args.aligned).zero_() for k in tensors
            }  # touched: no page faults in the timing
            raw_file = parent / "raw.bin"
            nbytes = n * tensor_mib * MiB
            with store:
                store_pass(store, tensors, outs, write=True)  # create the files (and the pool)
                dd_pass(raw_file, nbytes, request, True)  # create the file; passes rewrite it
                times, kib = measure(store, tensors, outs, raw_file, request, args.repeats)
                for k in tensors:
                    if not torch.equal(outs[k], tensors[k]):
                        raise SystemExit(f"round trip of {k} is not exact")
                direct = store.stats()["direct_io"]
            raw_file.unlink()
            rows.append((tensor_mib, n, nbytes / GiB, times, kib, direct))
            del tensors, outs
    finally:
        shutil.rmtree(parent, ignore_errors=True)

    print(
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on "
        f"{os.cpu_count()} CPUs: the store needs CPU for hashing and copying, dd not"
    )
    print()
    print(
        "| tensor | count | dd write GiB/s | swap_out GiB/s | out/dd (range) "
        "| dd read GiB/s | swap_in GiB/s | in/dd (range) | CPU s/GiB out, in "
        "| KiB/request dd, store: w; r |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    TARGETS = {"w": 0.9, "r": 0.8}  # of dd, for tensors of 4 MiB and more
    worst = {"w": 1e9, "r": 1e9}
    for mib, n, gib, t, kib, direct in rows:
        cells = []
        for d in ("w", "r"):
            ratios = [dd / store for dd, store in zip(t[f"raw_{d}"], t[d], strict=True)]
            cells.append(
                f"{gib / median(t[f'raw_{d}']):.2f} | {gib / median(t[d]):.2f} "
                f"| {median(ratios):.0%} ({min(ratios):.0%}-{max(ratios):.0%})"
            )
            if mib >= 4:
                worst[d] = min(worst[d], median(ratios))
        cpu = f"{median(t['cpu_w']) / gib:.2f}, {median(t['cpu_r']) / gib:.2f}"
        sizes = "; ".join(
            ", ".join(f"{kib[k]:.0f}" if k in kib else "?" for k in (f"raw_{d}", d)) for d in "wr"
        )
        print(f"| {mib} MiB | {n} | {cells[0]} | {cells[1]} | {cpu} | {sizes} |")
        if not direct:
            print("  (the store fell back to buffered I/O: no O_DIRECT on this filesystem)")
    for d, what in (("w", "swap_out"), ("r", "swap_in")):
        if worst[d] < 1e9:
            verdict = "meets" if worst[d] >= TARGETS[d] else "MISSES"
            print(f"worst median {what}/dd for tensors >= 4 MiB: {worst[d]:.0%} ({verdict} the "
                  f"{TARGETS[d]:.0%} target)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
