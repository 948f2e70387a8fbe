"""ZeRO-Infinity at ~3B parameters on this machine, against the disk-bound limit of its step.

    python bench/bench_infinity.py [--config examples/infinity.toml] [--nproc 1 2] [--preset 3b]

For each rank count, ``zeroshard train --config CONFIG --nproc N`` runs as its own process tree
(the `3b` preset built on the meta device; FP32 masters, Adam states and gradient shards in swap
files under the config's offload_folder). From its ``summary.json`` and ``metrics.jsonl``:

* peak RSS per rank (``ru_maxrss``; target: under 20 GiB) and the most bytes the swap folder held
  (sampled every second: allocated blocks of its files), each beside the planner's figure (see
  ``planned``; the RSS also holds torch itself, ~0.3 GiB, which the planner does not count);
* step time: the median gap between consecutive training records (one per step, evaluation
  excluded; the first step, which also creates the Adam states, is left out);
* disk bytes read and written per step, every rank together, as the swappers count them;
* the loss of each step and the validation loss before and after.

Then ``dd`` with O_DIRECT and 4 MiB blocks writes and reads ``--dd-gib`` GiB in the same folder.
A step's disk-bound limit is read bytes / dd's read rate + written bytes / dd's write rate (the
step cannot be faster while the disk works one request stream at a time); the target is a step at
or below 2x that limit (at least 50% of the disk's bandwidth used over the step).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_offload import dd_pass

from zeroshard.cli.train import load_config
from zeroshard.models.gpt import preset
from zeroshard.planner import memory
from zeroshard.planner.describe import from_gpt
from zeroshard.tokens import BYTE_VOCAB_SIZE

ROOT = Path(__file__).resolve().parent.parent
GB, GiB = 1e9, 1 << 30
TARGET_LIMIT_RATIO = 2.0
RSS_LIMIT = 20 * GiB


def folder_bytes(folder: Path) -> int:
    """Bytes allocated on the disk by the files under ``folder`` (0 when it is gone)."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # deleted while walking
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
    return total


class FolderPeak(threading.Thread):
    """The most bytes ``folder`` holds while the thread runs, sampled every ``every_s``."""

    def __init__(self, folder: Path, every_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.folder, self.every_s, self.peak = folder, every_s, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            self.peak = max(self.peak, folder_bytes(self.folder))


def train(config: Path, cfg, nproc: int, overrides: list[str]) -> dict:
    """One ``zeroshard train`` run of ``config`` (``cfg`` once loaded, ``overrides`` applied);
    its summary, records and the swap folder's peak bytes."""
    out = Path(cfg.out_dir) / f"nproc{nproc}"
    swap = Path(cfg.offload_folder)
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "train", "--config", str(config),
           "--nproc", str(nproc), "--out-dir", str(out), *overrides]  # fmt: skip
    watch = FolderPeak(swap)
    watch.start()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    watch.done.set()
    watch.join()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((ROOT / out / "summary.json").read_text())
    records = [json.loads(line) for line in (ROOT / out / "metrics.jsonl").open()]
    return {"summary": summary, "records": records, "swap_peak": watch.peak, "wall_s": wall,
            "left_behind": folder_bytes(swap)}  # fmt: skip


def planned(cfg, nproc: int) -> tuple[int, int]:
    """(host bytes per rank, NVMe bytes of every rank) that the planner gives this run: the
    engine's timeline peak (gathered units, activations; no activation checkpointing, FP32) plus
    the CPU tier (offload staging), and the NVMe tier, as ``zeroshard plan --stage 3 --offload
    nvme-everything --bytes-per-param 4,4,8`` does (the table shows them beside the measures)."""
    gpt = dataclasses.replace(preset(cfg.preset), vocab_size=BYTE_VOCAB_SIZE)
    config = memory.MemoryConfig(
        stage=3, num_dp_ranks=nproc,
        bytes_per_param=memory.BytesPerParam(params=4, grads=4, optimizer_states=8),
        placement=memory.OFFLOADS["nvme-everything"],
        micro_batch_size=cfg.batch_size // nproc, seq_len=cfg.seq_len,
        activation_checkpointing=cfg.checkpoint_every > 0, activation_bytes=4,
        fragmentation_fraction=0.0,
    )  # fmt: skip
    plan = memory.plan_memory(from_gpt(gpt), config)
    return plan.peak_bytes() + plan.total_bytes("cpu"), nproc * plan.total_bytes("nvme")


def step_seconds(records: list[dict]) -> float:
    """Median seconds between consecutive per-step training records, the first step left out."""
    train = [r for r in records if r["kind"] == "train"]
    gaps = [b["time"] - a["time"] for a, b in zip(train, train[1:]) if b["step"] == a["step"] + 1]
    if not gaps:
        sys.exit("need log_every = 1 and 3 or more steps to time a step")
    return statistics.median(gaps)


def dd_rates(folder: Path, gib: float) -> tuple[float, float]:
    """(write, read) bytes/s of dd with O_DIRECT and 4 MiB blocks on a file in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path, nbytes = folder / "dd.bin", max(1, int(gib * 256)) * (4 << 20)
    try:
        write_s = dd_pass(path, nbytes, 4 << 20, write=True)
        read_s = dd_pass(path, nbytes, 4 << 20, write=False)
    finally:
        path.unlink(missing_ok=True)
    return nbytes / write_s, nbytes / read_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "infinity.toml")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--preset", help="override the config's preset (e.g. 1b, for a quick run)")
    parser.add_argument("--dd-gib", type=float, default=8.0, help="GiB dd writes and reads")
    args = parser.parse_args()
    overrides = ["--preset", args.preset] if args.preset else []
    cfg = load_config(args.config, {"preset": args.preset} if args.preset else {})
    runs = {n: train(args.config, cfg, n, overrides) for n in args.nproc}
    swap = ROOT / cfg.offload_folder
    write_bps, read_bps = dd_rates(swap, args.dd_gib)
    print(f"dd O_DIRECT 4 MiB blocks on {swap}: write {write_bps / GB:.2f} GB/s, read "
          f"{read_bps / GB:.2f} GB/s ({args.dd_gib:g} GiB)")  # fmt: skip
    print("| ranks | params | peak RSS per rank / planned (GiB) | swap folder peak / planned "
          "(GB) | disk read / written per step (GB) | step (s) | disk-bound limit (s) | "
          "step / limit | train loss by step | val loss first -> last |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, run in runs.items():
        s, records = run["summary"], run["records"]
        step = step_seconds(records)
        limit = s["disk_read_gb_per_step"] * GB / read_bps
        limit += s["disk_write_gb_per_step"] * GB / write_bps
        rss = [m * 2**20 for m in s["peak_rss_mib"]]
        host, nvme = planned(cfg, n)
        losses = ", ".join(f"{r['loss']:.3f}" for r in records if r["kind"] == "train")
        print(
            f"| {n} | {s['num_params'] / 1e9:.2f}B | "
            f"{' / '.join(f'{b / GiB:.1f}' for b in rss)} / {host / GiB:.1f} | "
            f"{run['swap_peak'] / GB:.1f} / {nvme / GB:.1f} | "
            f"{s['disk_read_gb_per_step']:.1f} / {s['disk_write_gb_per_step']:.1f} | "
            f"{step:.1f} | {limit:.1f} | {step / limit:.2f} | {losses} | "
            f"{s['val_loss_first']:.3f} -> {s['val_loss_last']:.3f} |"
        )
        if max(rss) > RSS_LIMIT or step > TARGET_LIMIT_RATIO * limit or run["left_behind"]:
            print(f"  nproc {n}: target missed (RSS < 20 GiB, step <= {TARGET_LIMIT_RATIO}x "
                  f"limit, no swap files left: {run['left_behind']} bytes left)")  # fmt: skip


if __name__ == "__main__":
    main()
