"""Calibration: run a configuration for real and hold the planner's prediction against it.

On the current process group, ``calibrate(case)`` builds a zeroshard GPT preset, shards it one
unit per ``Block`` at the case's stage, trains it a couple of steps with FP32 AdamW and measures
on this rank (DESIGN.md "Measuring"):

- model states right after ``opt.step()`` (before ``zero_grad``): MemTracker's live bytes (the
  model's buffers with them, predicted as the plan's ``buffers``; stage 3's free constant
  buffers apart, ``constant_buffers_bytes``, predicted as the plan's ``gathered_units``), and per
  category from the engine's own storages (parameters: ``full`` and a separate ``master``;
  gradients: ``full_grad`` and ``shard_grad``; optimizer states: the inner optimizer's state);
- the per-rank peak over one whole step (forward, backward, step, ``zero_grad``), MemTracker;
- the elements each collective moved in that step (the ledger: all-gather / reduce-scatter n,
  all-reduce 2n).

The prediction comes from ``plan_memory`` and ``dp_communication`` with the engine's real
settings (``engine_config``): 4 + 4 + 8 bytes per parameter (FP32 AdamW whose master is the
parameter itself), the engine's prefetch depth and in-flight reductions, per-unit gradient
reduction, no activation checkpointing, FP32 activations, fused attention, no fragmentation (the
tracker counts live tensor bytes, not an allocator's reservations). ``Case.step_in_backward``
builds the optimizer stepping in backward and predicts with ``MemoryConfig.step_in_backward``;
``Case.precision`` bf16 / fp16 shards with that mixed precision and predicts with
``memory.ENGINE_MIXED`` and 2-byte activations.

``HFCase`` does the same for a Hugging Face model built from a config dict (``measure_hf``),
wrapped as ``describe.from_hf_config`` finds its units; ``measure_module`` is the shared run.

``run_grid`` launches the grid through torchrun, one job per rank count, and ``render``
(``zeroshard.planner.calibration_table``) prints the Markdown table; ``zeroshard plan --measure``
and ``bench/bench_calibration.py`` call them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass, replace

from zeroshard.planner import comm, describe, timeline
from zeroshard.planner.calibration_table import MODEL_STATES_TOLERANCE as MODEL_STATES_TOLERANCE
from zeroshard.planner.calibration_table import PEAK_TOLERANCE as PEAK_TOLERANCE
from zeroshard.planner.calibration_table import error as error
from zeroshard.planner.calibration_table import render as render
from zeroshard.planner.calibration_table import summarize as summarize
from zeroshard.planner.calibration_table import within_tolerance as within_tolerance
from zeroshard.planner.memory import FP32_ADAMW as FP32_ADAMW  # (re-exported)
from zeroshard.planner.memory import MODEL_STATES, PRECISION_BYTES, MemoryConfig, plan_memory
from zeroshard.stages import partition


@dataclass(frozen=True, kw_only=True)
class Case:
    """One configuration of the grid (the rank count is the process group's)."""

    preset: str = "nano"
    """A zeroshard GPT preset (``zeroshard.models.gpt.PRESETS``)."""
    stage: int = 3
    """ZeRO-DP stage, 0-3."""
    micro_batch_size: int = 4
    """Samples per rank per step."""
    seq_len: int | None = None
    """Tokens per sample; default the preset's ``block_size``."""
    num_steps: int = 2
    """Steps in all; the last one is measured (the first creates the optimizer states)."""
    step_in_backward: bool = False
    """Build the optimizer with ``step_in_backward=True`` (stages 2-3): each unit's sub-group
    steps as its reduction finishes."""
    tp: int = 1
    """Tensor-parallel degree Nm (``zeroshard.tensor_parallel``); ZeRO shards over the rest."""
    checkpoint_every: int = 0
    """Activation checkpointing every this many units (``ShardConfig.checkpoint_every``)."""
    precision: str = "fp32"
    """fp32, or a mixed-precision preset of ``zeroshard.shard`` (bf16, fp16)."""
    grad_accum: int = 1
    """Micro-batches per step: backward with ``sync=False`` before the last at stages 0-1 (and
    at stages 2-3 with ``accumulate_unreduced``), else each one reduced."""
    accumulate_unreduced: bool = False


def _accumulation(case: Case | HFCase) -> tuple[int, bool]:
    """``grad_accum`` and ``accumulate_unreduced`` (an ``HFCase`` runs one micro-batch)."""
    return getattr(case, "grad_accum", 1), getattr(case, "accumulate_unreduced", False)


def _gpt_config(case: Case):
    from zeroshard.models.gpt import preset

    return preset(case.preset)


@dataclass(frozen=True, kw_only=True)
class HFCase:
    """One Hugging Face model, built from a config dict (no download) and wrapped as
    ``zeroshard.planner.describe.from_hf_config`` finds its units."""

    config: dict
    """A config dict with ``model_type`` (what a ``config.json`` holds)."""
    wrap: tuple[str, ...] = ()
    """Classes to wrap (``--wrap``); empty: ``_no_split_modules``."""
    stage: int = 3
    """ZeRO-DP stage, 0-3."""
    micro_batch_size: int = 2
    """Samples per rank per step."""
    seq_len: int = 16
    """Tokens per sample (encoder and decoder alike)."""
    tp: int = 1
    """Tensor-parallel degree Nm, by the config's ``base_model_tp_plan``."""
    num_steps: int = 2
    """Steps in all; the last one is measured."""
    precision: str = "fp32"
    """fp32, or a mixed-precision preset of ``zeroshard.shard`` (bf16, fp16)."""
    checkpoint_every: int = 0
    """Activation checkpointing every this many units (``ShardConfig.checkpoint_every``)."""


def _seq_len(case: Case | HFCase) -> int:
    return case.seq_len or _gpt_config(case).block_size


def engine_config(case: Case | HFCase, num_ranks: int) -> MemoryConfig:
    """The planner's inputs that describe what the engine does for ``case`` on ``num_ranks``."""
    from zeroshard.engine import ShardConfig

    engine = ShardConfig()
    model = describe_case(case)
    ci = case.checkpoint_every
    bytes_per_param, activation_bytes = PRECISION_BYTES[case.precision]
    return MemoryConfig(
        stage=case.stage,
        num_dp_ranks=num_ranks // case.tp,
        num_mp_ranks=case.tp,
        bytes_per_param=bytes_per_param,
        micro_batch_size=case.micro_batch_size,
        seq_len=_seq_len(case),
        # Prefetch depth. Stage 3 reduces unit by unit, up to max_inflight_reductions in flight
        # (counting the one being started); with replicated parameters consecutive units share
        # one gradient bucket of up to bucket_bytes, allocated at its first unit's backward and
        # reduced after its last (a unit larger than that alone in its bucket: per unit again).
        num_units_prefetch=engine.num_prefetch,
        constant_buffers=engine.constant_buffers,
        gradients_in_gather_buffers=True,  # (the measured runs are on the CPU, where it does)
        point_to_point_reductions=True,  # (and on gloo)
        bucket_per_unit=timeline.bucket_per_unit(model, case.stage, engine.bucket_bytes),
        bucket_bytes=engine.bucket_bytes,
        num_buckets=engine.max_inflight_reductions,
        step_in_backward=getattr(case, "step_in_backward", False),
        grad_accum=_accumulation(case)[0],
        accumulate_unreduced=_accumulation(case)[1],
        # Checkpointing as the case asks, counted along the engine timeline; FP32 compute; the
        # fused attention kernel saves a log-sum-exp per head, not the probabilities (CPU too).
        activation_checkpointing=bool(ci),
        num_layers_per_checkpoint=max(1, ci),
        engine_timeline=True,
        activation_bytes=activation_bytes,
        flash_attention=True,
        # On gloo zeroshard's reduce-scatter is sends and receives into its output
        # (zeroshard.collectives): no staging copy of the input while it is waited for.
        reduce_stages_input=False,
        fragmentation_fraction=0.0,
    )


def describe_case(case: Case | HFCase) -> describe.ModelDescription:
    """The planner's description of the model ``case`` trains."""
    if isinstance(case, HFCase):
        return describe.from_hf_config(case.config, wrap=case.wrap or None)
    return describe.from_gpt(case.preset)


def predict(case: Case | HFCase, num_ranks: int) -> dict:
    """Model states per category, the peak and the step's communication, from the planner."""
    from zeroshard.engine import ShardConfig

    model = describe_case(case)
    config = engine_config(case, num_ranks)
    plan = plan_memory(model, config)
    kept = 0 if ShardConfig().reshard_root_after_forward else model.kept_gathered_numel
    # Kept between steps: the most gathered at once (the gradients' borrowed buffers are given
    # back beyond as many per size as were lent).
    at_rest = plan_memory(model, replace(config, gradients_in_gather_buffers=False))
    pooled = at_rest.device["gathered_units"] if config.constant_buffers else 0
    collectives = comm.dp_communication(
        model.num_params,
        stage=case.stage,
        num_mp_ranks=case.tp,
        num_params_replicated=model.replicated_numel,
        param_dtype_bytes=4,
        reduce_dtype_bytes=4,
        num_params_kept_gathered=kept,
        reduce_every_micro_batch=not _accumulation(case)[1],
        num_params_gathered_again=comm.gathered_again(model, config),
    )
    comm_numel: dict[str, int] = {}
    for c in collectives:
        key = f"{c.op}/{c.label}"
        comm_numel[key] = comm_numel.get(key, 0) + comm.total_numel((c,), _accumulation(case)[0])
    at_rest_states = {c: plan.device[c] for c in MODEL_STATES}
    if plan.grads_at_rest is not None:  # (as measured: after the step)
        at_rest_states["grads"] = plan.grads_at_rest
    return {
        "model_states": at_rest_states,
        # What is alive after the step: MemTracker counts the model's buffers too. (The
        # constant buffers stage 3's gathers borrow stay too, apart.)
        "model_states_bytes": plan.model_states_at_rest_bytes() + plan.device["buffers"],
        "constant_buffers_bytes": pooled,
        "peak_bytes": plan.peak_bytes(),
        "peak": plan.peak,
        "peak_moment": plan.peak_moment,
        "comm_numel": comm_numel,
    }


def measure(case: Case) -> dict:
    """Run ``case`` on the current process group; this rank's measurements (see the module)."""
    import torch

    import zeroshard
    from zeroshard.models.gpt import GPT, Block

    cfg, seq_len = _gpt_config(case), _seq_len(case)
    shape = (case.micro_batch_size, seq_len)

    def loss(model, gen):
        x = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        y = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        return model(x, y)

    return measure_module(
        lambda: GPT(cfg),
        loss,
        stage=case.stage,
        wrap=zeroshard.wrap.by_class(Block),
        num_steps=case.num_steps,
        step_in_backward=case.step_in_backward,
        tp=case.tp,
        checkpoint_every=case.checkpoint_every,
        mixed_precision=case.precision,
        grad_accum=case.grad_accum,
        accumulate_unreduced=case.accumulate_unreduced,
    )


def measure_hf(case: HFCase) -> dict:
    """Run a Hugging Face ``case`` on the current process group (random token ids as inputs and
    labels; the model's own loss); this rank's measurements."""
    import torch

    from zeroshard.planner import hf

    vocab, shape = case.config["vocab_size"], (case.micro_batch_size, case.seq_len)

    def build():
        model = hf.build(case.config, device="cpu")
        return model.train()

    def loss(model, gen):
        x = torch.randint(0, vocab, shape, generator=gen)
        y = torch.randint(0, vocab, shape, generator=gen)
        return model(input_ids=x, labels=y).loss

    meta = hf.build(case.config)
    policy, _ = describe.wrap_policy(meta, case.wrap or None)
    return measure_module(
        build, loss, stage=case.stage, wrap=policy, num_steps=case.num_steps, tp=case.tp,
        mixed_precision=case.precision, checkpoint_every=case.checkpoint_every,
    )  # fmt: skip


class _NoHook:
    """A hook handle with nothing to remove."""

    def remove(self) -> None:
        pass


def measure_module(
    build,
    loss,
    *,
    stage: int,
    wrap,
    num_steps: int,
    step_in_backward: bool = False,
    tp: int = 1,
    checkpoint_every: int = 0,
    mixed_precision: str | None = None,
    grad_accum: int = 1,
    accumulate_unreduced: bool = False,
) -> dict:
    """Shard ``build()`` at ``stage`` with ``wrap``, train it ``num_steps`` steps of AdamW (FP32,
    or ``mixed_precision``'s policy)
    (stepping in backward with ``step_in_backward``) on the current process group
    (``loss(model, generator)`` gives each micro-batch's loss, ``grad_accum`` per step, as
    ``Case.grad_accum`` runs them) and measure the last step on this rank
    (see the module): model states in bytes, peak bytes, elements moved per collective. With
    ``tp`` > 1 the model is split tensor-parallel first (its plan, ``tensor_parallel.plan_for``)
    and sharded over the data-parallel ranks; a tensor-parallel group draws the same batches.
    ``checkpoint_every``: activation checkpointing every this many units."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    import zeroshard
    from zeroshard import tensor_parallel

    torch.manual_seed(0)
    model, mesh = build(), None
    if tp > 1:
        device_mesh, mesh = tensor_parallel.mesh_2d(tp)
        tensor_parallel.parallelize(model, device_mesh)
    # As ``zeroshard train`` runs accumulation: each micro-batch's backward reduces at stages
    # 2-3 unless ``accumulate_unreduced``; only the last is synchronized (stepping in backward
    # refuses a synchronized one before it).
    config = zeroshard.ShardConfig(
        checkpoint_every=checkpoint_every,
        reduce_every_micro_step=partition(stage).gradients and not accumulate_unreduced,
    )
    model = zeroshard.shard(
        model, stage=stage, wrap=wrap, mesh=mesh, config=config, mixed_precision=mixed_precision
    )
    opt = zeroshard.optimizer(model, torch.optim.AdamW, lr=1e-3, step_in_backward=step_in_backward)
    engine = zeroshard.engine_of(model)
    gen = torch.Generator().manual_seed(1000 + (mesh.rank if mesh else dist.get_rank()))

    def forward_backward(tracker=None) -> None:
        # Inside a function: the batch and the loss are gone before model states are measured.
        for i in range(grad_accum):
            last = i == grad_accum - 1
            opt.backward(loss(model, gen) / grad_accum, sync=last)
            if tracker is not None and not last:  # (it refuses a module's second forward)
                tracker.reset_mod_stats()

    for _ in range(num_steps - 1):
        forward_backward()
        opt.step()
        opt.zero_grad()
    flat = [t for f in engine.flat_params for t in (f.full, f.master)]
    flat = [t for t in flat + [b.full_grad for b in engine.buckets] if t is not None]
    # Stage 3's constant buffers: the free ones hold memory too (``BufferPool.tensors``).
    flat += [t for pool in engine.buffer_pools() for t in pool.tensors()]
    tracker = MemTracker()
    tracker.track_external(model, opt.optimizer, *flat)
    for p in model.parameters():  # (torch's tracker hooks every one: refused on a frozen one)
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    with tracker:
        forward_backward(tracker)
        opt.step()
        after_step = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
        states = _model_state_storages(engine, opt.optimizer)
        pooled = sum(pool.free_bytes for pool in engine.buffer_pools())  # all free by now
        opt.zero_grad()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    last = engine.ledger.steps[-1]
    comm_numel: dict[str, int] = {}
    for (op, label), entry in last.items():
        if label in ("params", "grads"):
            comm_numel[f"{op}/{label}"] = comm_numel.get(f"{op}/{label}", 0) + entry.numel
    return {
        "model_states": states,
        "model_states_bytes": after_step - pooled,  # (residual states, apart)
        "constant_buffers_bytes": pooled,
        "peak_bytes": peak,
        "comm_numel": comm_numel,
    }


def _model_state_storages(engine, optimizer) -> dict[str, int]:
    """Bytes of the distinct storages behind each model state (aliases counted once)."""
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    flats = engine.flat_params
    return {
        "params": size(t for f in flats for t in (f.full, f.master)),
        "grads": size(t for b in engine.buckets for t in (b.full_grad, b.shard_grad)),
        "optimizer_states": size(
            t for state in optimizer.state.values() for t in state.values() if hasattr(t, "shape")
        ),
    }


def calibrate(case: Case | HFCase) -> dict:
    """Measure ``case`` on this rank and predict it; one row (this rank's)."""
    import torch.distributed as dist

    num_ranks = dist.get_world_size()
    row = asdict(case) | {"seq_len": _seq_len(case)}
    if isinstance(case, HFCase):
        row["preset"] = str(case.config.get("model_type", "HF model"))  # the table's model column
    measured = measure_hf(case) if isinstance(case, HFCase) else measure(case)
    # The plan depends on the case and the number of ranks alone: one rank makes it (its meta
    # forward and backward cost seconds) and gives it to the others.
    predicted: list = [None]
    failed = None
    if dist.get_rank() == 0:
        try:
            predicted[0] = predict(case, num_ranks)
        except Exception as exc:  # raised on every rank, none left waiting for the plan (as
            failed = exc  # text: an exception may not pickle)
            predicted[0] = f"rank 0 could not plan the case: {type(exc).__name__}: {exc}"
    dist.broadcast_object_list(predicted, src=0)
    if failed is not None:
        raise failed
    if isinstance(predicted[0], str):
        raise RuntimeError(predicted[0])
    return {
        "case": row,
        "num_ranks": num_ranks,
        "rank": dist.get_rank(),
        "measured": measured,
        "predicted": predicted[0],
    }


# ---- the grid through torchrun -------------------------------------------------------------------


def _worker(argv: list[str]) -> int:
    """A torchrun rank: calibrate every case, rank 0 writes every rank's rows to ``--out``."""
    import argparse

    import torch
    import torch.distributed as dist

    from zeroshard.mesh import Mesh

    p = argparse.ArgumentParser(prog="python -m zeroshard.planner.calibrate")
    p.add_argument("--presets", default="nano,tiny")
    p.add_argument("--stages", default="0,1,2,3", help="3s: stage 3 stepping in backward")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=0, help="tokens per sample (0: block_size)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ci", type=int, default=0, help="checkpoint every this many units")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--accumulate-unreduced", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    Mesh.from_env(backend="gloo", device="cpu")
    torch.set_num_threads(1)  # ranks share the machine's cores
    rows = []
    # Stages given as "3s" (or "2s") step in backward.
    stages = [(int(s.rstrip("s")), s.endswith("s")) for s in args.stages.split(",")]
    for name in args.presets.split(","):
        for stage, in_backward in stages:
            case = Case(
                preset=name,
                stage=stage,
                micro_batch_size=args.batch,
                seq_len=args.seq or None,
                num_steps=args.steps,
                step_in_backward=in_backward,
                tp=args.tp,
                checkpoint_every=args.ci,
                precision=args.precision,
                grad_accum=args.grad_accum,
                accumulate_unreduced=args.accumulate_unreduced,
            )
            mine = calibrate(case)
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            rows.extend(everyone)
    if dist.get_rank() == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f)
    dist.barrier()  # nobody tears gloo down while a peer is still in a collective
    dist.destroy_process_group()
    return 0


def run_grid(
    *,
    presets: tuple[str, ...] = ("nano", "tiny"),
    stages: tuple[int | str, ...] = (0, 1, 2, 3),
    ranks: tuple[int, ...] = (1, 2, 4),
    micro_batch_size: int = 4,
    seq_len: int | None = None,
    num_steps: int = 2,
    tp: int = 1,
    checkpoint_every: int = 0,
    precision: str = "fp32",
    grad_accum: int = 1,
    accumulate_unreduced: bool = False,
    timeout_s: float = 600.0,
) -> list[dict]:
    """Every (preset, stage) on every rank count, each rank count one torchrun job on this
    machine (gloo, one thread per rank). One row per configuration and rank. A stage written
    ``"3s"`` (or ``"2s"``) builds the optimizer with ``step_in_backward``; the other settings
    are ``Case``'s, the same for every case."""
    rows: list[dict] = []
    for n in ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                "-m",
                "zeroshard.planner.calibrate",
                f"--presets={','.join(presets)}",
                f"--stages={','.join(map(str, stages))}",
                f"--batch={micro_batch_size}",
                f"--seq={seq_len or 0}",
                f"--steps={num_steps}",
                f"--tp={tp}",
                f"--ci={checkpoint_every}",
                f"--precision={precision}",
                f"--grad-accum={grad_accum}",
                *(["--accumulate-unreduced"] if accumulate_unreduced else []),
                f"--out={out}",
            ]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode != 0 and os.path.exists(out):
                # Every case finished (rank 0 writes the rows last); a rank died tearing down.
                warnings.warn(
                    f"calibration on {n} ranks exited {done.returncode} after writing its rows: "
                    + done.stderr.strip().splitlines()[0],
                    stacklevel=2,
                )
            elif done.returncode != 0:
                raise RuntimeError(
                    f"calibration on {n} ranks failed (exit {done.returncode}):\n"
                    + done.stderr[-4000:]
                )
            with open(out, encoding="utf-8") as f:
                rows.extend(json.load(f))
    return rows


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
