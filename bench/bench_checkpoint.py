"""zeroshard.checkpoint save/load throughput against plain DCP and the disk itself (``dd``).

On 2 gloo ranks the GPT preset (--preset, ``100m`` by default) is sharded at stage 3 and takes
one AdamW step, so that optimizer states exist (``100m``: about 1.4 GB of model and optimizer
states in all). Then, in the same run, alternating (the starting contender rotates every
round) for --rounds rounds:

    ours      ``zeroshard.checkpoint.save`` / ``load`` (fsync, checksums, atomic publish,
              checksum verification on load, loading into the model and optimizer)
    dcp       ``dcp.save`` / ``dcp.load`` with the default ``FileSystemWriter`` (sync_files=True)
              / ``FileSystemReader``, on the same state in FSDP2's layout
    dd        rank 0: ``dd if=/dev/zero of=FILE bs=4M count=N oflag=direct conv=fsync`` of the
              bytes of our checkpoint folder, then read back with ``iflag=direct``

in --folder (default: a temporary folder under the current directory; /tmp is avoided when it
is a tmpfs). Before every load the files are dropped from the page cache
(``posix_fadvise(DONTNEED)``; --warm keeps them), so that loads read the disk as ``dd`` does.
A time is the slowest rank's, between barriers; GB/s is the checkpoint's bytes (of our folder,
of the DCP folder; ``dd``: ours) over the median time. Ours is timed end to end (its state dicts
are views of each rank's own ranges: nothing gathered). DCP's is timed on FSDP2-layout state
dicts (``model.state_dict()``, ``opt.state_dict()``: DTensor row chunks) built before the clock
starts, and its load ends when ``dcp.load`` returns (no ``load_state_dict``): what FSDP2, whose
state dicts cost nothing, pays.

    python bench/bench_checkpoint.py                 # 100m, 3 rounds, a few minutes on 2 cores
    python bench/bench_checkpoint.py --preset tiny --rounds 1

It relaunches itself under ``torch.distributed.run`` (2 processes); ``--worker`` marks the ranks.
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
from zeroshard import checkpoint  # noqa: E402
from zeroshard.models.gpt import GPT, PRESETS, Block  # noqa: E402

NPROC = 2
GB = 1e9
TARGET_DD = 0.5  # ours >= this fraction of dd
TARGET_DCP = 2.0  # ours >= this many times DCP's default
OPS = ("save", "load")


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _drop_cache(path: Path) -> None:
    """Evict ``path``'s files from the page cache (they are clean: written and fsynced)."""
    for p in path.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(fn) -> float:
    """Seconds of ``fn`` on the slowest rank."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _dd(args: list[str]) -> None:
    subprocess.run(["dd", *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = PRESETS[args.preset]
    torch.manual_seed(0)
    model = zeroshard.shard(GPT(cfg), stage=3, wrap=zeroshard.wrap.by_class(Block))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=3e-4)
    gen = torch.Generator().manual_seed(1000 + rank)
    tok = torch.randint(0, cfg.vocab_size, (1, 33), generator=gen)
    opt.backward(model(tok[:, :-1], tok[:, 1:]))
    opt.step()
    opt.zero_grad()

    base = Path(args.folder)
    ours, plain, ddfile = base / "ours", base / "dcp", base / "dd.bin"

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    def clear(path: Path) -> None:
        dist.barrier()
        if rank == 0:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        dist.barrier()

    def before_load(path: Path) -> None:
        dist.barrier()
        if rank == 0 and not args.warm:
            _drop_cache(path)

    def dcp_state() -> dict:
        """FSDP2-layout state dicts (DTensor row chunks), built outside the timings: FSDP2's
        own cost nothing, ours take an all-gather per flat buffer (that ours avoids)."""
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    nbytes: dict[str, int] = {}

    def run_ours() -> tuple[float, float]:
        clear(ours)
        s = _timed(lambda: checkpoint.save(ours, model, opt, {"step": 1}, keep=None))
        nbytes["ours"] = _folder_bytes(ours)
        before_load(ours)
        return s, _timed(lambda: checkpoint.load(ours, model, opt))

    def run_dcp() -> tuple[float, float]:
        clear(plain)
        state = dcp_state()
        s = _timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(plain)))
        nbytes["dcp"] = _folder_bytes(plain)
        before_load(plain)
        state = dcp_state()
        return s, _timed(lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(plain)))

    def run_dd() -> tuple[float, float]:
        clear(ddfile)
        count = -(-nbytes["ours"] // (4 << 20))
        out, inp = f"of={ddfile}", f"if={ddfile}"

        def write() -> None:
            if rank == 0:
                _dd(["if=/dev/zero", out, "bs=4M", f"count={count}", "oflag=direct", "conv=fsync"])

        def read() -> None:
            if rank == 0:
                _dd([inp, "of=/dev/null", "bs=4M", "iflag=direct"])

        return _timed(write), _timed(read)

    runners = {"ours": run_ours, "dcp": run_dcp, "dd": run_dd}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runners}
    run_ours()  # warm-up (and the byte count dd needs)
    order = list(runners)
    for r in range(args.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            times[name].append(runners[name]())
        log(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} save {v[-1][0]:.2f} s load {v[-1][1]:.2f} s" for k, v in times.items()
        ))  # fmt: skip
    for p in (ours, plain, ddfile):
        clear(p)
    if rank != 0:
        return
    nbytes["dd"] = -(-nbytes["ours"] // (4 << 20)) * (4 << 20)
    med = {
        (k, op): statistics.median(t[i] for t in times[k])
        for k in runners
        for i, op in enumerate(("save", "load"))
    }
    rate = {(k, op): nbytes[k] / med[k, op] / GB for k in ("ours", "dcp", "dd") for op in OPS}
    cache = "warm" if args.warm else "cold"
    sizes = f"ours {nbytes['ours'] / GB:.2f} GB, dcp {nbytes['dcp'] / GB:.2f} GB"
    print(f"\n{args.preset}: {sizes}, median of {args.rounds} rounds, {cache} page cache for "
          f"loads, folder {base}\n")  # fmt: skip
    print("| op | ours GB/s | DCP default GB/s | dd GB/s | ours/dd | ours/DCP | target | met |")
    print("|---|---|---|---|---|---|---|---|")
    result = {}
    for op in OPS:
        o, d, x = rate["ours", op], rate["dcp", op], rate["dd", op]
        met = o / x >= TARGET_DD and o / d >= TARGET_DCP
        print(
            f"| {op} | {o:.2f} | {d:.2f} | {x:.2f} | {o / x:.2f} | {o / d:.2f} "
            f"| >= {TARGET_DD} dd, >= {TARGET_DCP:g}x DCP | {'yes' if met else 'NO'} |"
        )
        result[op] = {"ours": o, "dcp": d, "dd": x, "met": met}
    if args.json:
        Path(args.json).write_text(json.dumps({"rates_GBps": result, "times_s": times}, indent=2))


def _default_folder() -> str:
    """A temporary folder under the current directory (never a tmpfs /tmp)."""
    return tempfile.mkdtemp(prefix="bench-ckpt-", dir=os.getcwd())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="100m", choices=sorted(PRESETS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--folder", default=None, help="where to write (default: a temp dir here)")
    p.add_argument("--warm", action="store_true", help="keep the files in the page cache")
    p.add_argument("--json", default=None, help="also write the results to this path")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    made = args.folder is None
    folder = Path(args.folder or _default_folder()).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    kind = subprocess.run(
        ["stat", "-f", "-c", "%T", str(folder)], capture_output=True, text=True
    ).stdout.strip()
    if kind == "tmpfs":
        print(f"warning: {folder} is on a tmpfs (memory), not a disk", file=sys.stderr)
    argv = [*sys.argv[1:], "--folder", str(folder)]  # the last of a repeated flag wins
    if args.json:
        argv += ["--json", str(Path(args.json).resolve())]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(NPROC), __file__, "--worker", *argv]
    try:
        return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        if made:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
