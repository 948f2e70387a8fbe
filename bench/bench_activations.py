"""ZeRO-R's activation levers on a 2-D mesh, measured against the planner.

    python bench/bench_activations.py                       # tiny and 100m, 4 ranks (dp 2 x tp 2)
    python bench/bench_activations.py --presets 100m --seq 256 --steps 5

Each GPT preset is split 2-way tensor-parallel (``zeroshard.tensor_parallel``) and sharded at
stage 3 over the 2 data-parallel ranks, checkpointing every block (``checkpoint_every=1``), and
trained ``--steps`` steps of FP32 AdamW on random tokens, once per variant:

    checkpoints   each span's input kept whole on the device
    Pa            kept 1/tp per tensor-parallel rank, all-gathered before its recomputation
    Pa+cpu        those pieces in the tensor store's CPU tier, read back ahead of use
    SP            sequence parallelism (Megatron's successor to Pa): the residual stream split
                  along the sequence between the attention and MLP pairs, so each span's input
                  is 1/tp per rank as it is, with no gather before the recomputation
    SP+cpu        those inputs in the CPU tier

Reported per variant (rank 0; every rank holds the same amounts): the peak bytes of checkpoints
per tier as the keeper holds them (real tensors: ``CheckpointKeeper.bytes``), the planner's
``activation_checkpoints`` for the same configuration (``zeroshard plan --mp 2 --ci 1
--partition-activations | --sequence-parallel [--offload-activations] --activation-bytes 4``)
and their ratio, the
all-gather bytes Pa adds per step (the ledger's scope ``tensor``), and the median seconds per
step. On this CPU-only machine the "device" is host memory too: Pa+cpu moves the pieces into the
store, it does not shrink the process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run standalone from a checkout

import zeroshard  # noqa: E402
from zeroshard import collectives as C  # noqa: E402
from zeroshard import tensor_parallel  # noqa: E402
from zeroshard.models.gpt import GPT, Block, preset  # noqa: E402
from zeroshard.planner.describe import from_gpt  # noqa: E402
from zeroshard.planner.memory import MemoryConfig, plan_memory  # noqa: E402
from zeroshard.testing import Workers  # noqa: E402

VARIANTS = {  # (Pa, where checkpoints go, sequence parallelism)
    "checkpoints": (False, None, False),
    "Pa": (True, None, False),
    "Pa+cpu": (True, "cpu", False),
    "SP": (False, None, True),
    "SP+cpu": (False, "cpu", True),
}
MIB = 2**20


def _run(name: str, partition: bool, where: str | None, sp: bool, batch: int, seq: int, steps: int):
    torch.set_num_threads(1)
    cfg = preset(name)
    device_mesh, mesh = tensor_parallel.mesh_2d(2)
    torch.manual_seed(0)
    model = GPT(cfg)
    tensor_parallel.parallelize(model, device_mesh, sequence_parallel=sp)
    model = zeroshard.shard(
        model,
        stage=3,
        mesh=mesh,
        wrap=zeroshard.wrap.by_class(Block),
        config=zeroshard.ShardConfig(checkpoint_every=1, partition_activations=partition),
        offload=zeroshard.Offload(activations=where) if where else None,
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-4)
    gen = torch.Generator().manual_seed(1000 + mesh.rank)  # the same rows on a tp group
    engine = zeroshard.engine_of(model)
    seconds = []
    for step in range(steps + 1):  # the first step warms up
        tok = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
        start = time.perf_counter()
        opt.backward(model(tok[:, :-1], tok[:, 1:]))
        opt.step()
        opt.zero_grad()
        if step:
            seconds.append(time.perf_counter() - start)
    key = (C.TENSOR, "all_gather", "activations")
    last = engine.ledger.scoped_steps[-1] if engine.ledger.scoped_steps else {}
    keeper = engine.checkpointing.keeper
    return {
        "peak": dict(keeper.bytes.peak),
        "gather_bytes": last[key].bytes if key in last else 0,
        "seconds": statistics.median(seconds),
    }


def _planned(name: str, partition: bool, offload: bool, sp: bool, batch: int, seq: int) -> int:
    config = MemoryConfig(
        stage=3,
        num_dp_ranks=2,
        num_mp_ranks=2,
        micro_batch_size=batch,
        seq_len=seq,
        num_layers_per_checkpoint=1,
        partition_activations=partition,
        offload_activations=offload,
        sequence_parallel=sp,
        activation_bytes=4,
    )
    memory = plan_memory(from_gpt(preset(name)), config)
    tier = memory.cpu if offload else memory.device
    return tier["activation_checkpoints"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="tiny,100m")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    print(
        f"4 gloo ranks (dp 2 x tp 2), stage 3, checkpoint every block, batch {args.batch} x seq "
        f"{args.seq} per data-parallel rank, FP32, median of {args.steps} steps after 1"
    )
    with Workers(4, timeout_s=3600) as workers:
        for name in args.presets.split(","):
            seq = min(args.seq, preset(name).block_size)
            print(f"\n{name} ({preset(name).num_params():,} parameters), seq {seq}\n")
            print(
                "| variant | device MiB | cpu MiB | planner MiB (tier) | measured / planner "
                "| Pa all-gather MiB/step | s/step |"
            )
            print("|---|---|---|---|---|---|---|")
            for variant, (partition, where, sp) in VARIANTS.items():
                r = workers.run(_run, name, partition, where, sp, args.batch, seq, args.steps)[0]
                tier = "cpu" if where else "device"
                planned = _planned(name, partition, bool(where), sp, args.batch, seq)
                print(
                    f"| {variant} | {r['peak']['device'] / MIB:.2f} | {r['peak']['cpu'] / MIB:.2f} "
                    f"| {planned / MIB:.2f} ({tier}) | {r['peak'][tier] / planned:.3f} "
                    f"| {r['gather_bytes'] / MIB:.2f} | {r['seconds']:.3f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
