"""FSDP2-format state dicts at stage 3 against FSDP2's own, in the same run.

On 2 gloo ranks x 1 thread, each model is sharded at stage 3 (zeroshard, one unit per block)
and with ``fully_shard`` (FSDP2, the same blocks), takes one AdamW step so that optimizer states
exist, then each contender times, alternating over --rounds rounds (the slowest rank's time
between barriers, the median over rounds):

    save    ``model.state_dict()``                  (FSDP2: its DTensors as held)
    load    ``model.load_state_dict(sd)`` of that dict
    osave   ``opt.state_dict()``                    (FSDP2: ``get_optimizer_state_dict``)
    oload   ``opt.load_state_dict(osd)``            (FSDP2: ``set_optimizer_state_dict``)

Models (--models): ``many``, 400 units of ``Linear(16, 16)`` + ``LayerNorm(16)`` (Python per
unit and per entry decides), and the GPT presets (``tiny``, ``100m``: the bytes decide).
zeroshard's entries are row chunks cut from its flat shards, which must be gathered (FSDP2's
shards are row chunks already): its ratio is above 1 by construction; what this measures is how
far.

    python bench/bench_state_dict.py                      # many and 100m, 3 rounds
    python bench/bench_state_dict.py --models many --rounds 5

It relaunches itself under ``torch.distributed.run`` (2 processes); ``--worker`` marks the ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run standalone from a checkout

import zeroshard  # noqa: E402
from zeroshard.models.gpt import GPT, PRESETS, Block  # noqa: E402

NPROC = 2
OPS = ("save", "load", "osave", "oload")


class Pair(nn.Sequential):
    """One small unit of the ``many`` model."""


def _model(name: str) -> tuple[nn.Module, type[nn.Module]]:
    torch.manual_seed(0)
    if name == "many":
        return nn.Sequential(*[Pair(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(400)]), Pair
    return GPT(PRESETS[name]), Block


def _loss(name: str, model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(dist.get_rank())
    if name == "many":
        return model(torch.randn(4, 16, generator=g)).square().mean()
    x = torch.randint(0, PRESETS[name].vocab_size, (2, 64), generator=g)
    return model(x, x)


def _ours(name: str) -> dict[str, Callable[[], object]]:
    net, unit = _model(name)
    model = zeroshard.shard(net, stage=3, wrap=zeroshard.wrap.by_class(unit))
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3)
    opt.backward(_loss(name, model))
    opt.step()
    opt.zero_grad()
    sd, osd = model.state_dict(), opt.state_dict()
    return {
        "save": model.state_dict,
        "load": lambda: model.load_state_dict(sd),
        "osave": opt.state_dict,
        "oload": lambda: opt.load_state_dict(osd),
    }


def _fsdp2(name: str) -> dict[str, Callable[[], object]]:
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, unit = _model(name)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in model.modules():
        if isinstance(m, unit):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _loss(name, model).backward()
    opt.step()
    opt.zero_grad()
    sd, osd = model.state_dict(), get_optimizer_state_dict(model, opt)
    return {
        "save": model.state_dict,
        "load": lambda: model.load_state_dict(sd),
        "osave": lambda: get_optimizer_state_dict(model, opt),
        "oload": lambda: set_optimizer_state_dict(model, opt, osd),
    }


def _timed(op: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    op()
    dist.barrier()
    mine = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.item()


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    for name in args.models.split(","):
        contenders = {"zeroshard": _ours(name), "fsdp2": _fsdp2(name)}
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            order = list(contenders)[r % 2 :] + list(contenders)[: r % 2]
            for who in order:
                for op in OPS:
                    times.setdefault((who, op), []).append(_timed(contenders[who][op]))
        for op in OPS:
            ours = statistics.median(times[("zeroshard", op)])
            base = statistics.median(times[("fsdp2", op)])
            rows.append((name, op, ours, base))
        del contenders
    if dist.get_rank() == 0:
        print("| model | operation | zeroshard ms | FSDP2 ms | ratio |")
        print("|---|---|---|---|---|")
        for name, op, ours, base in rows:
            print(f"| `{name}` | {op} | {ours * 1e3:.1f} | {base * 1e3:.1f} | {ours / base:.2f} |")
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="many,100m", help="many and/or GPT presets, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    argv = [a for a in sys.argv[1:] if a != "--worker"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(NPROC), __file__, "--worker", *argv]
    return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))


if __name__ == "__main__":
    sys.exit(main())
