"""Scale check: a GPT preset far larger than the tiny ones, trained at stage 3 on this machine.

    python bench/bench_scale.py                        # 1b (1.2B parameters), 2 ranks, 3 steps
    python bench/bench_scale.py --step-in-backward --fsdp2

Each of ``--nproc`` gloo ranks (one compute thread) builds the preset on the meta device, shards
it one unit per ``Block`` at stage 3 (materialized one unit at a time, ``param_init_fn``), and
trains ``--steps`` steps of FP32 fused AdamW on batch x seq random tokens. Reported per rank:
peak RSS (``ru_maxrss``) minus the RSS before building (torch's own footprint), against the
planner's predicted peak for the same configuration (``zeroshard.planner.calibrate.predict``:
the tensors alive at the largest moment, no allocator slack); and the seconds per step.
``--fsdp2`` then runs FSDP2 (``fully_shard`` per Block and the root, built on meta,
``to_empty`` and initialized) in fresh processes, the same way, when it fits.

The ranks are processes of ``zeroshard.testing.Workers`` (spawned, gloo), so that each run starts
from an empty process and ``ru_maxrss`` is its own.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run standalone from a checkout

import zeroshard  # noqa: E402
from zeroshard.models.gpt import GPT, Block, preset  # noqa: E402
from zeroshard.planner import calibrate  # noqa: E402
from zeroshard.testing import Workers  # noqa: E402

GB = 1e9


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _batches(vocab: int, batch: int, seq: int, steps: int) -> list[tuple]:
    gen = torch.Generator().manual_seed(1000 + torch.distributed.get_rank())
    out = []
    for _ in range(steps):
        tok = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        out.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
    return out


def _zeroshard(name: str, batch: int, seq: int, steps: int, sib: bool) -> dict:
    from zeroshard import model_states, sharding  # noqa: F401  (imported before the baseline)

    torch.set_num_threads(1)
    base = _rss_bytes()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(preset(name))
    model = zeroshard.shard(
        model, stage=3, wrap=zeroshard.wrap.by_class(Block), param_init_fn=model.init_module
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-4, step_in_backward=sib)

    def step(x, y):
        loss = model(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss

    return _train(step, base, preset(name).vocab_size, batch, seq, steps)


def _fsdp2(name: str, batch: int, seq: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    base = _rss_bytes()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(preset(name))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            model.init_module(module)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return _train(step, base, preset(name).vocab_size, batch, seq, steps)


def _train(step, base: int, vocab: int, batch: int, seq: int, steps: int) -> dict:
    built = _peak_bytes() - base
    times, losses = [], []
    for x, y in _batches(vocab, batch, seq, steps):
        t0 = time.perf_counter()
        losses.append(step(x, y).item())
        times.append(time.perf_counter() - t0)
    return {
        "built_bytes": built,
        "peak_above_base": _peak_bytes() - base,
        "step_s": times,
        "losses": losses,
    }


def _report(title: str, results: list[dict], predicted: int | None) -> None:
    print(f"\n{title}")
    print("| rank | peak RSS above start | predicted peak | ratio | after build | s per step |")
    print("|---|---|---|---|---|---|")
    for rank, r in enumerate(results):
        pred = f"{predicted / GB:.2f} GB" if predicted else "-"
        ratio = f"{r['peak_above_base'] / predicted:.2f}" if predicted else "-"
        steps = ", ".join(f"{s:.1f}" for s in r["step_s"])
        print(
            f"| {rank} | {r['peak_above_base'] / GB:.2f} GB | {pred} | {ratio} "
            f"| {r['built_bytes'] / GB:.2f} GB | {steps} |"
        )
    print(f"losses (rank 0): {', '.join(f'{v:.4f}' for v in results[0]['losses'])}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="1b")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step-in-backward", action="store_true")
    p.add_argument("--fsdp2", action="store_true", help="also run FSDP2 the same way")
    args = p.parse_args()
    cfg = preset(args.preset)
    case = calibrate.Case(
        preset=args.preset,
        stage=3,
        micro_batch_size=args.batch,
        seq_len=args.seq,
        step_in_backward=args.step_in_backward,
    )
    predicted = calibrate.predict(case, args.nproc)["peak_bytes"]
    print(
        f"{args.preset}: {cfg.num_params():,} parameters ({4 * cfg.num_params() / GB:.2f} GB in "
        f"FP32, {16 * cfg.num_params() / GB:.1f} GB of FP32 AdamW model states), stage 3 on "
        f"{args.nproc} gloo ranks, batch {args.batch} x seq {args.seq}, {args.steps} steps"
    )
    with Workers(args.nproc, timeout_s=3600) as workers:
        results = workers.run(
            _zeroshard, args.preset, args.batch, args.seq, args.steps, args.step_in_backward
        )
    name = "zeroshard stage 3" + (" (step_in_backward)" if args.step_in_backward else "")
    _report(name, results, predicted)
    if args.fsdp2:
        with Workers(args.nproc, timeout_s=3600) as workers:
            results = workers.run(_fsdp2, args.preset, args.batch, args.seq, args.steps)
        _report("FSDP2", results, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
